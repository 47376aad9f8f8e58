"""Rollout decode benchmark: the native engine vs transformers `generate` vs the HBM roofline.

For each preset (INT4 base generated directly in packed form + a LoRA adapter) and batch size, it generates
`--new-tokens` tokens after `--prompt-len`-token prompts (T = 1, ignore_eos) and reports decode throughput
and time per decode step. Decode steps are those with the whole batch running and no prefill or CUDA-graph
capture in them. Compared in the same run:
- transformers `generate` on the same shape in bf16 (random weights): decode time = (t(N) - t(1)) / (N - 1);
- the roofline: (weight bytes a step touches + KV bytes it reads) / measured device copy bandwidth.
Also reports the train/rollout |Δlogprob| (engine vs teacher-forced trainer forward) on a few samples.

GPU:   python bench/rollout.py                        (writes $OUT/rollout.json when OUT is set)
Fewer layers (times scale ~linearly in layers; the ratios barely move): --override num_hidden_layers=8
CPU smoke test: python bench/rollout.py --smoke
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib
import importlib.util
import json
import os
import time

# First, before transformers loads: moves this directory (bench/kernels.py) behind the HF `kernels` package.
import orbit_lightning  # noqa: F401

_HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("moe_switches", os.path.join(_HERE, "moe_switches.py"))
switches = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(switches)

import peft
import torch
from orbit_lightning.kernels import pdl as kernels_pdl

from orbit_lightning import add_adapter, load_model
from orbit_lightning.adapters import AdapterLayer
from orbit_lightning.models import preset_hf_config, token_logprobs
from orbit_lightning.models.moe import Experts
from orbit_lightning.quant.formats import INT4_LAYOUTS
from orbit_lightning.rollout import RolloutEngine, SamplingParams, kv_cache, runner
from orbit_lightning.rollout.blocks import blocks_for
from orbit_lightning.rollout.kv_cache import KVLayout


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", nargs="+", default=["qwen3-8b", "qwen3-30b-a3b"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64, 256])
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--override", nargs="*", default=[], metavar="KEY=INT",
                    help="preset config overrides, e.g. num_hidden_layers=8 hidden_size=1024")
    ap.add_argument("--quant", default="int4",
                    help="the base's format; 'bf16' keeps the base unquantized in --dtype (the baseline)")
    ap.add_argument("--int4-layout", default="auto", choices=INT4_LAYOUTS,
                    help="how int4 is stored (model.int4_layout; auto: tiled on CUDA)")
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--lora-targets", default="all-linear", help="'all-linear' or a comma list of module names")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument("--decode-steps", type=int, default=None,
                    help="tokens per sequence per engine step (multi-step decode); default: the engine's")
    ap.add_argument("--gather-attention", action="store_true",
                    help="decode attention by gathering the paged KV + SDPA instead of the paged kernel")
    ap.add_argument("--no-pdl", action="store_true",
                    help="launch the decode kernels without programmatic dependent launch (kernels.pdl), to A/B it")
    ap.add_argument("--one-graph-per-step", action="store_true",
                    help="replay the one-step graph per step, not the all-steps graph (runner.MULTI_STEP_GRAPH)")
    switches.add_switches(ap)
    ap.add_argument("--attn-warps", type=int, default=None,
                    help="warps per attention program (kernels.attention.NUM_WARPS), to A/B it")
    ap.add_argument("--profile", type=int, default=0, metavar="STEPS",
                    help="profile this many steady decode steps of each run and print the top kernels")
    ap.add_argument("--trace", default=None, metavar="DIR",
                    help="with --profile: write each profiled run's Chrome trace to DIR (for bench/trace_gaps.py)")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--hf-max-batch", type=int, default=256)
    ap.add_argument("--logprob-samples", type=int, default=8)
    ap.add_argument("--smoke", action="store_true", help="tiny presets on the CPU, seconds")
    ap.add_argument("--out", default=None, help="JSON path (default $OUT/rollout.json when OUT is set)")
    a = ap.parse_args()
    if a.smoke:
        a.presets, a.batches, a.prompt_len, a.new_tokens = ["tiny-qwen3", "tiny-qwen3-moe"], [1, 4], 16, 8
        a.device, a.dtype, a.lora_r, a.logprob_samples = "cpu", "float32", 4, 2
    if a.trace and not a.profile:
        ap.error("--trace writes the profiled steps' trace: give --profile STEPS too")
    a.override = {k: int(v) for k, v in (o.split("=", 1) for o in a.override)}
    a.dtype = getattr(torch, a.dtype)
    if a.gather_attention:
        kv_cache.PAGED_KERNEL = False
    if a.no_pdl:
        kernels_pdl.ENABLED = False
    switches.apply_switches(a)
    if a.attn_warps:
        importlib.import_module("orbit_lightning.kernels.attention").NUM_WARPS = a.attn_warps
    if a.one_graph_per_step:
        runner.MULTI_STEP_GRAPH = False
    return a


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device) -> float:
    """Bytes/s of a large device-to-device copy, counting the read and the write."""
    n = (1 << 30) if device.type == "cuda" else (1 << 26)
    src, dst = torch.empty(n, dtype=torch.uint8, device=device), torch.empty(n, dtype=torch.uint8, device=device)
    for _ in range(2):
        dst.copy_(src)
    sync(device)
    reps = 10
    t = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    sync(device)
    return 2 * n * reps / (time.perf_counter() - t)


def weight_bytes_per_step(model, batch: int, slot: str = "slot0") -> float:
    """Bytes of weights one decode step reads: everything once, except the embedding (batch rows), routed
    experts (the expected fraction of experts that `batch` uniformly routed tokens touch) and adapter slots
    (only the active one)."""
    cfg = model.config
    frac = 1.0
    if cfg.num_experts:
        e, k = cfg.num_experts, cfg.num_experts_per_tok
        frac = 1 - (1 - k / e) ** batch
    embed = model.model.embed_tokens
    total = 0.0
    for module in model.modules():
        tensors = list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False))
        for name, t in tensors:
            if isinstance(module, AdapterLayer) and not name.startswith(f"slot_{slot}_"):
                continue
            if module is embed:
                total += batch * t.shape[-1] * t.element_size()
                continue
            expert = isinstance(module, Experts) or (isinstance(module, AdapterLayer) and t.dim() == 3)
            total += t.numel() * t.element_size() * (frac if expert else 1.0)
    return total


def lora_model(args, preset: str):
    quant = None if args.quant == "bf16" else args.quant
    model = load_model(preset, quant=quant, int4_layout=args.int4_layout, device=args.device, dtype=args.dtype,
                       **args.override)
    targets = args.lora_targets if args.lora_targets == "all-linear" else args.lora_targets.split(",")
    add_adapter(model, peft.LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, target_modules=targets))
    with torch.no_grad():  # a nonzero B so that the adapter really runs (PEFT initialises B to zero)
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(0, 0.01)
    return model


def run_engine(args, model, batch: int) -> tuple[dict, list]:
    device = torch.device(args.device)
    p_len, n_new = args.prompt_len, args.new_tokens
    layout = KVLayout.from_config(model.config, args.dtype)
    blocks = batch * blocks_for(p_len + n_new, 16) + 2
    # Every prompt prefills in the first step, so the whole batch decodes together from then on.
    engine = RolloutEngine(model, kv_budget_bytes=blocks * 16 * layout.bytes_per_token(), max_batch_size=batch,
                           max_model_len=p_len + n_new + 1, cuda_graphs=not args.no_graphs,
                           decode_steps=args.decode_steps, max_prefill_tokens=max(8192, batch * p_len))
    g = torch.Generator().manual_seed(batch)
    prompts = torch.randint(0, model.config.vocab_size, (batch, p_len), generator=g).tolist()
    engine.generate(prompts[:2], SamplingParams(max_new_tokens=4, ignore_eos=True, seed=0))  # compile/autotune
    for i, p in enumerate(prompts):
        engine.add_request(p, SamplingParams(max_new_tokens=n_new, ignore_eos=True, seed=i))
    # Steady decode steps only (whole batch running, no capture): (seconds, decode forwards) per engine step.
    # A multi-step engine step runs several decode forwards between host reads; time per token step is the ratio.
    # Profiled steps are left out: the profiler slows the host (it once inflated batch 1 from 1.01 to 1.09 ms).
    steps: list[tuple[float, int]] = []
    outs: list = []
    prof, prof_at, profiled = None, None, 0
    t_all = time.perf_counter()
    while engine.has_unfinished():
        before = engine.stats()
        if args.profile and len(steps) == 2 and prof is None:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                      torch.profiler.ProfilerActivity.CUDA])
            prof.__enter__()
            prof_at = time.perf_counter()
        sync(device)
        t = time.perf_counter()
        outs += engine.step(stream=False)
        sync(device)
        dt = time.perf_counter() - t
        after = engine.stats()
        steady = (before["waiting"] == 0 and before["running"] == batch and after["graphs_captured"] ==
                  before["graphs_captured"])  # fmt: skip
        forwards = after["decode_forwards"] - before["decode_forwards"]
        if steady and prof_at is None:
            steps.append((dt, forwards))
        elif steady:
            profiled += forwards
        if prof_at is not None and profiled >= args.profile:
            sync(device)
            prof.__exit__(None, None, None)
            print_profile(prof, profiled, time.perf_counter() - prof_at, batch)
            if args.trace:
                os.makedirs(args.trace, exist_ok=True)
                prof.export_chrome_trace(os.path.join(args.trace, f"b{batch}_steps{engine.decode_steps}.json"))
            prof_at = None
    wall = time.perf_counter() - t_all
    n_steps = sum(n for _, n in steps)
    if not n_steps:
        raise RuntimeError(f"batch {batch}: no decode step ran with the whole batch; raise --new-tokens")
    step = sum(dt for dt, _ in steps) / n_steps
    row = dict(batch=batch, engine_step_ms=1e3 * step, engine_tok_s=batch / step, decode_steps=n_steps,
               engine_wall_s=wall, cuda_graphs=engine.stats()["cuda_graphs"], steps_per_sync=engine.decode_steps)
    del engine
    return row, outs


def timeline_split(intervals: list[tuple[float, float]], host_gap_us: float = 20.0) -> dict:
    """GPU activity intervals (start, end), µs -> where the time from the first start to the last end went: `busy`
    (their union), `short_gaps` (idle stretches under host_gap_us: launch latency between kernels of a graph
    replay) and `long_gaps` (longer ones, `n_long` of them: the GPU waiting for the host), all in µs."""
    out = dict(busy=0.0, short_gaps=0.0, long_gaps=0.0, n_long=0)
    end = None
    for start, stop in sorted(intervals):
        if end is not None and start > end:
            gap = start - end
            out["short_gaps" if gap < host_gap_us else "long_gaps"] += gap
            out["n_long"] += gap >= host_gap_us
        if end is None or start >= end:
            out["busy"] += stop - start
        elif stop > end:
            out["busy"] += stop - end
        end = stop if end is None else max(end, stop)
    return out


def print_profile(prof, steps: int, wall_s: float, batch: int) -> None:
    """Per decode step: wall time, summed GPU kernel time, the kernels that take it, and how the wall time splits
    into GPU busy time, short gaps (launches inside a replay) and long ones (host work between engine steps)."""
    events = [e for e in prof.key_averages() if e.device_time_total > 0 and e.device_type.name == "CUDA"]
    gpu_us = sum(e.device_time_total for e in events) / steps
    print(f"[profile] batch {batch}: {steps} steps, wall {1e3 * wall_s / steps:.3f} ms/step, "
          f"GPU kernels {gpu_us / 1e3:.3f} ms/step", flush=True)
    spans = [(e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type.name == "CUDA"]
    if spans:
        split = timeline_split(spans)
        span = max(e for _, e in spans) - min(s for s, _ in spans)
        per = {k: v / steps for k, v in split.items() if k != "n_long"}
        print(f"[profile] per step: GPU busy {per['busy']:.1f} us, gaps < 20 us {per['short_gaps']:.1f} us, longer "
              f"gaps {per['long_gaps']:.1f} us ({split['n_long']} in all), outside the first-to-last kernel span "
              f"{(1e6 * wall_s - span) / steps:.1f} us", flush=True)
    for e in sorted(events, key=lambda e: -e.device_time_total)[:18]:
        print(f"[profile]   {e.device_time_total / steps:9.1f} us/step {e.count / steps:6.1f}x  {e.key[:90]}",
              flush=True)
    ops = [e for e in prof.key_averages() if e.device_type.name == "CPU" and e.key.startswith("aten::")]
    print(f"[profile] host: {sum(e.count for e in ops) / steps:.0f} aten ops/step; by self CPU time:", flush=True)
    for e in sorted(ops, key=lambda e: -e.self_cpu_time_total)[:10]:
        print(f"[profile]   {e.self_cpu_time_total / steps:9.1f} us/step {e.count / steps:6.1f}x  {e.key[:60]}",
              flush=True)


def logprob_diff(model, outs, prompts_n: int) -> dict:
    """Engine log-probs vs the trainer's teacher-forced forward on the same tokens (adapter on)."""
    diffs = []
    for o in outs[:prompts_n]:
        c = o.outputs[0]
        ids = torch.tensor([o.prompt_token_ids + c.token_ids], device=model.lm_head.weight.device)
        with torch.no_grad():
            ref, _ = token_logprobs(model, ids, start=len(o.prompt_token_ids) - 1)
        diffs.append((ref[0].float().cpu() - torch.tensor(c.logprobs)).abs())
    d = torch.cat(diffs)
    return dict(mean_abs=d.mean().item(), max_abs=d.max().item(), tokens=d.numel())


def hf_generate_s(hf, ids, n: int) -> float:
    """Seconds for transformers `generate` of exactly n tokens (sampling at T = 1, like the engine run)."""
    sync(ids.device)
    t = time.perf_counter()
    with torch.no_grad():
        hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=True,
                    temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0)
    sync(ids.device)
    return time.perf_counter() - t


def hf_decode(args, preset: str, batches: list[int]) -> dict[int, dict]:
    import transformers

    device = torch.device(args.device)
    cfg = dict(preset_hf_config(preset, **args.override))
    cfg = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    dtype = torch.bfloat16 if device.type == "cuda" else args.dtype
    try:
        with torch.device(device):
            hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    except torch.cuda.OutOfMemoryError:
        return {b: dict(hf_note="OOM loading the bf16 model") for b in batches}
    hf.generation_config.eos_token_id = None
    res = {}
    print(f"[progress] transformers {preset} loaded", flush=True)
    for b in batches:
        if b > args.hf_max_batch:
            res[b] = dict(hf_note=f"skipped (batch > --hf-max-batch {args.hf_max_batch})")
            continue
        ids = torch.randint(0, cfg.vocab_size, (b, args.prompt_len), device=device)
        try:
            hf_generate_s(hf, ids, 2)  # warm-up
            step = (hf_generate_s(hf, ids, args.new_tokens) - hf_generate_s(hf, ids, 1)) / (args.new_tokens - 1)
            res[b] = dict(hf_step_ms=1e3 * step, hf_tok_s=b / step)
        except torch.cuda.OutOfMemoryError:
            res[b] = dict(hf_note="OOM")
        print(f"[progress] transformers {preset} batch {b}: {res[b]}", flush=True)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    del hf
    return res


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    bw = copy_bandwidth(device)
    env = dict(date=datetime.datetime.now().isoformat(timespec="seconds"), torch=torch.__version__,
               device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               copy_bandwidth_GBps=bw / 1e9, args={k: str(v) for k, v in vars(args).items()})
    rows, lp = [], {}
    for preset in args.presets:
        t0 = time.perf_counter()
        model = lora_model(args, preset)
        print(f"[progress] {preset} built in {time.perf_counter() - t0:.1f}s", flush=True)
        layout = KVLayout.from_config(model.config, args.dtype)
        for b in args.batches:
            row, outs = run_engine(args, model, b)
            ctx = args.prompt_len + args.new_tokens / 2  # mean context over the decode steps
            step_bytes = weight_bytes_per_step(model, b) + b * ctx * layout.bytes_per_token()
            row.update(preset=preset, roofline_step_ms=1e3 * step_bytes / bw)
            row["roofline_frac"] = row["roofline_step_ms"] / row["engine_step_ms"]
            rows.append(row)
            print(f"[progress] {preset} batch {b}: {row['engine_step_ms']:.2f} ms/step, "
                  f"{row['roofline_frac']:.2f} of roofline, wall {row['engine_wall_s']:.1f}s", flush=True)
            if preset not in lp and b >= min(16, max(args.batches)):
                lp[preset] = logprob_diff(model, outs, args.logprob_samples)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if not args.no_hf:
            hf = hf_decode(args, preset, args.batches)
            for row in rows:
                if row["preset"] == preset:
                    row.update(hf[row["batch"]])
                    if "hf_step_ms" in row:
                        row["speedup_vs_hf"] = row["hf_step_ms"] / row["engine_step_ms"]
    print_table(rows, lp, env)
    out = args.out or (os.path.join(os.environ["OUT"], "rollout.json") if os.environ.get("OUT") else None)
    if out:
        with open(out, "w") as f:
            json.dump(dict(env=env, rows=rows, logprob_diff=lp), f, indent=1)
        print(f"wrote {out}")


def print_table(rows: list[dict], lp: dict, env: dict) -> None:
    print(f"\n{env['device']}  torch {env['torch']}  copy bandwidth {env['copy_bandwidth_GBps']:.0f} GB/s")
    head = f"{'preset':<16}{'batch':>6}{'tok/s':>10}{'ms/step':>9}{'HF tok/s':>10}{'vs HF':>7}" \
           f"{'roof ms':>9}{'% roof':>8}  graphs"
    print(head + "\n" + "-" * len(head))
    for r in rows:
        hf = f"{r['hf_tok_s']:>10.0f}{r['speedup_vs_hf']:>6.1f}x" if "hf_tok_s" in r else f"{'-':>10}{'-':>7}"
        print(f"{r['preset']:<16}{r['batch']:>6}{r['engine_tok_s']:>10.0f}{r['engine_step_ms']:>9.2f}{hf}"
              f"{r['roofline_step_ms']:>9.2f}{100 * r['roofline_frac']:>7.0f}%  "
              f"{'on' if r['cuda_graphs'] == 'on' else 'eager'}")
        if "hf_note" in r:
            print(f"{'':<22}HF: {r['hf_note']}")
    for reason in sorted({r["cuda_graphs"] for r in rows} - {"on"}):
        print(f"eager decode: {reason}")
    for preset, d in lp.items():
        print(f"{preset}: train/rollout |dlogprob| mean {d['mean_abs']:.2e} max {d['max_abs']:.2e} "
              f"over {d['tokens']} tokens")


if __name__ == "__main__":
    main()
