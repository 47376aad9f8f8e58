"""Full RL steps on a GPU with a random-weight model of a named shape (INT4 base, LoRA r=32 on all linears).

Workload (issue 5): P prompts of 128 random tokens, G generations each of exactly L tokens (EOS ignored),
KL to the reference with beta=0.04, one update per step. Prints the median step time, the per-phase breakdown
and peak memory; writes JSON under $OUT when set.

    python bench/rl_step.py --shape qwen3-1.7b --prompts 8 --gens 8 --new-tokens 256 --steps 5
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import statistics
import time

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("moe_switches", os.path.join(_HERE, "moe_switches.py"))
switches = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(switches)


def main() -> None:
    from orbit_lightning.quant.formats import INT4_LAYOUTS

    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-1.7b")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--gens", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--layers", type=int, default=None, help="override num_hidden_layers (smoke tests)")
    ap.add_argument("--quant", default="int4", help="the base's format; 'bf16' keeps the base unquantized (baseline)")
    ap.add_argument("--int4-layout", default="auto", choices=INT4_LAYOUTS,
                    help="how int4 is stored (model.int4_layout; auto: tiled on CUDA)")
    ap.add_argument("--expert-chunk", type=int, default=None,
                    help="routed experts per dequantized chunk (model.expert_chunk; default: what 1 GiB holds)")
    ap.add_argument("--deterministic", action="store_true",
                    help="batch-invariant mode in the engine and the trainer (rollout.deterministic)")
    switches.add_switches(ap)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    switches.apply_switches(args)

    import lightning as L
    import peft
    from orbit_lightning.callbacks import AdapterPush, MemoryTracker

    from orbit_lightning import add_adapter, load_model
    from orbit_lightning.algorithms.config import AlgoConfig
    from orbit_lightning.build import resolve_device
    from orbit_lightning.module import RLModule
    from orbit_lightning.rewards import RewardRunner
    from orbit_lightning.rl.config import OptimConfig, RolloutConfig
    from orbit_lightning.strategies import ColocatedRLStrategy

    dev = resolve_device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    over = {"num_hidden_layers": args.layers} if args.layers else {}
    t0 = time.perf_counter()
    model = load_model(args.shape, quant=None if args.quant == "bf16" else args.quant, int4_layout=args.int4_layout,
                       dtype=dtype, device=dev, **over)
    if args.expert_chunk is not None:
        from orbit_lightning.build import set_expert_chunks
        from orbit_lightning.models.moe import DEFAULT_CHUNK_MIB

        set_expert_chunks(model, args.expert_chunk, DEFAULT_CHUNK_MIB)
    add_adapter(model, peft.LoraConfig(r=32, lora_alpha=64, target_modules="all-linear"))
    load_s = time.perf_counter() - t0
    vocab = model.config.vocab_size

    class Tok:  # token ids in, token ids out: the workload has no text
        pad_token_id, eos_token_id = 0, 1

        def decode(self, ids):
            return " ".join(map(str, ids))

    def random_reward(prompt, completion, metadata):  # non-degenerate advantages, cheap
        return random.random()

    rng = random.Random(0)
    total = (args.steps + args.warmup) * args.prompts
    items = [{"prompt_ids": [rng.randrange(2, vocab) for _ in range(args.prompt_tokens)], "prompt": "",
              "answer": None, "metadata": {}, "index": i} for i in range(total)]
    batches = [items[i : i + args.prompts] for i in range(0, total, args.prompts)]
    rollout = RolloutConfig(group_size=args.gens, max_new_tokens=args.new_tokens, ignore_eos=True,
                            kv_fraction=0.5 if dev.type == "cuda" else None, deterministic=args.deterministic)
    algo = AlgoConfig(kl_coef=0.04, updates_per_step=1, micro_batch_tokens=16384)
    module = RLModule(model, Tok(), rewards=RewardRunner([(random_reward, 1.0)]), algo=algo, rollout=rollout,
                      optim=OptimConfig(lr=1e-5))
    diffs: list[dict] = []
    prepare = module.prepare

    def prepare_and_record(exp):  # keep the train-rollout |dlogprob| of each step
        m = prepare(exp)
        diffs.append(m)
        return m

    module.prepare = prepare_and_record
    mem = MemoryTracker()
    trainer = L.Trainer(accelerator="gpu" if dev.type == "cuda" else "cpu", devices=1,
                        strategy=ColocatedRLStrategy(device=dev), max_steps=len(batches), logger=False,
                        enable_checkpointing=False, callbacks=[AdapterPush(), mem], limit_val_batches=0,
                        num_sanity_val_steps=0, enable_progress_bar=False, enable_model_summary=False)
    step_times: list[float] = []

    class Clock(L.Callback):
        def on_train_batch_start(self, *a):
            self.t = time.perf_counter()

        def on_train_batch_end(self, *a):
            if dev.type == "cuda":
                torch.cuda.synchronize()
            step_times.append(time.perf_counter() - self.t)

    trainer.callbacks.append(Clock())
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None,
                                                                      collate_fn=lambda b: b))
    timed = mem.history[args.warmup :]
    phases = sorted({k[5:] for h in timed for k in h if k.startswith("time/")})
    result = {
        "shape": args.shape, "layers": model.config.num_hidden_layers, "quant": args.quant,
        "P": args.prompts, "G": args.gens, "L": args.new_tokens, "load_s": load_s,
        "step_s_median": statistics.median(step_times[args.warmup :]),
        "phase_s_median": {p: statistics.median(h[f"time/{p}"] for h in timed if f"time/{p}" in h) for p in phases},
        "peak_bytes": {p: max(h[f"memory/{p}_peak_bytes"] for h in timed if f"memory/{p}_peak_bytes" in h)
                       for p in phases},
        "gen_tokens_per_s": args.prompts * args.gens * args.new_tokens
        / statistics.median(h["time/rollout"] for h in timed),
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        "logprob_diff_abs_mean": statistics.mean(d["rollout/logprob_diff_abs_mean"] for d in diffs),
        "logprob_diff_abs_max": max(d["rollout/logprob_diff_abs_max"] for d in diffs),
    }
    mode = "deterministic " if args.deterministic else ""
    chunk = f" expert_chunk={args.expert_chunk}" if args.expert_chunk is not None else ""
    print(f"{mode}{args.shape} x{result['layers']}L {args.quant}{chunk} P={args.prompts} G={args.gens} "
          f"L={args.new_tokens}: step {result['step_s_median']:.2f}s")
    for p in phases:
        print(f"  {p:<13} {result['phase_s_median'][p]:8.3f}s  peak {result['peak_bytes'][p] / 2**30:7.2f} GiB")
    print(f"  rollout throughput {result['gen_tokens_per_s']:.0f} tok/s; train-rollout |dlogprob| mean "
          f"{result['logprob_diff_abs_mean']:.2e} max {result['logprob_diff_abs_max']:.2e}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"rl_step_{args.shape}.json"), "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
