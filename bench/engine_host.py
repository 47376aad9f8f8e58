"""The rollout engine's host time per engine step, without the device: what the GPU waits for between steps.

    python bench/engine_host.py [--batches 1 16 64 256] [--decode-steps 8] [--new-tokens 512] [--stop]

On the GPU a multi-step engine step replays `decode_steps` CUDA graphs, reads the sampled tokens back, and then the
host records them (stop checks), schedules the next step and builds its inputs while the GPU idles. Here the
forward is taken out: after a real prefill of a tiny model on the CPU, `runner.decode` builds its real inputs
(`decode_inputs`) and returns fixed tokens, so the timing is the engine's own Python per step (scheduling,
recording, stop checks, input building), not graph replays or copies. --stop adds stop strings (a character
tokenizer), which the engine checks on the decoded text of every new token. Runs anywhere; the host of the GPU
machine is faster or slower than this one.
"""

from __future__ import annotations

import argparse
import time

import torch

from orbit_lightning import load_model
from orbit_lightning.data.tokenizer import CharTokenizer
from orbit_lightning.rollout import RolloutEngine, SamplingParams


def host_ms_per_step(batch: int, decode_steps: int, new_tokens: int, stop: bool) -> tuple[float, int]:
    tok = CharTokenizer()
    model = load_model("tiny-qwen3", quant="int4", dtype=torch.float32, num_hidden_layers=1,
                       vocab_size=tok.vocab_size)  # fmt: skip
    prompt_len = 64
    engine = RolloutEngine(model, tok if stop else None, kv_budget_bytes=1 << 30, max_batch_size=batch,
                           max_model_len=prompt_len + new_tokens + 1, decode_steps=decode_steps,
                           max_prefill_tokens=batch * prompt_len)  # fmt: skip
    # "q" never appears in the fixed tokens below, so the stop strings are checked on every token and never hit.
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, stop=["qq", "q+q"] if stop else None)
    for i in range(batch):
        engine.add_request([5 + (i + j) % 20 for j in range(prompt_len)], params)
    engine.step(stream=False)  # every prefill
    assert engine.stats()["waiting"] == 0 and engine.stats()["running"] == batch

    def decode(tokens, positions, tables, graph_key, sampling, num_steps=1):
        engine.runner.decode_inputs(tokens, positions, tables, sampling)
        out = torch.empty(num_steps, 2, len(tokens))
        out[:, 0] = torch.arange(num_steps)[:, None] % 10 + 5  # digits: ids 5.. in the character set
        out[:, 1] = -1.0
        return out

    engine.runner.decode = decode
    steps, start = 0, time.perf_counter()
    while engine.has_unfinished():
        engine.step(stream=False)
        steps += 1
    return 1e3 * (time.perf_counter() - start) / steps, steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--stop", action="store_true", help="stop strings (checked on the text of every new token)")
    args = ap.parse_args()
    print(f"engine host time per step, decode_steps {args.decode_steps}, {args.new_tokens} new tokens"
          f"{', stop strings' if args.stop else ''}")  # fmt: skip
    for batch in args.batches:
        ms, steps = host_ms_per_step(batch, args.decode_steps, args.new_tokens, args.stop)
        print(f"batch {batch:4d}: {steps:4d} engine steps, {ms:8.3f} ms per engine step, "
              f"{1e3 * ms / args.decode_steps:8.1f} us per token step", flush=True)


if __name__ == "__main__":
    main()
