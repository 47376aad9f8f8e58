"""The large-batch MoE paths of the Qwen3-30B-A3B layer, forward + dX, against bf16 torch grouped_mm.

    python bench/moe_paths.py [--tokens 8192 16384 32768] [--chunks 4 32 0] [--mlp]

This runs what the model runs, timed by do_bench *with* the host's launch cost (training runs eagerly, so the host
is part of it), and the alternatives. Per projection:

- chunked c: `quant.dispatch.dequant_grouped` on each chunk of c active experts, planned by `ExpertGroups.chunks` as
  `models.moe._chunked_mlp` plans them (c = 0: as many as the default 1 GiB budget holds, what ships);
- overlap c: the same chunks, the next chunk's dequantization issued on a side stream during this chunk's GEMM;
- fused:     the fused grouped kernel (device offsets, nothing materialized);
- dq-all:    dequantize all experts, one grouped_mm (unbounded transient).

Ratio = (bf16 grouped_mm fwd + dX) / (path fwd + dX): >= 0.8 is issue 6's target. --mlp also times the whole
routed-expert MLP (dispatch, gate, up, SwiGLU, down, combine) forward + backward of QuantExperts against bf16
Experts on device groups, with its peak memory (--profile: and its top CUDA ops), with the combine's kernels and
with torch's ops. Uniform routing over the experts.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import os
import sys
import time
from functools import partial

import torch

from orbit_lightning import kernels
from orbit_lightning.models import moe
from orbit_lightning.models.moe import Experts, dispatch_experts
from orbit_lightning.quant.experts import QuantExperts
from orbit_lightning.quant.grouped import ExpertGroups

_spec = importlib.util.spec_from_file_location("bench_kernels", os.path.join(os.path.dirname(__file__), "kernels.py"))
bk = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bk)
GROUPED_MM, randn, us, graph_us = bk.GROUPED_MM, bk.randn, bk.us, bk.graph_us
chunked, planned = bk.chunked, bk.planned  # the model's chunked path, one projection

EXPERTS, TOP_K, HIDDEN, INTER = 128, 8, 2048, 768  # Qwen3-30B-A3B
PROJECTIONS = {"gate": ("gate_proj", INTER), "gate_up": ("gate_proj", 2 * INTER), "down": ("down_proj", INTER)}


def host_us(fn, *args, calls: int = 20, **kwargs) -> float:
    """Host time per call of fn (the launches queue up; the GPU is not waited for between calls)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn(*args, **kwargs)
    host = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    return host


def _gmm(a, w, ends, dx):
    return GROUPED_MM(a, w if dx else w.transpose(1, 2), offs=ends)


_SIDE: list[torch.cuda.Stream] = []


def overlapped(a, experts, proj, counts, chunk, dx):
    """chunked, with chunk i + 1's dequantization on a side stream during chunk i's GEMM (two chunks live)."""
    if not _SIDE:
        _SIDE.append(torch.cuda.Stream())
    main, side = torch.cuda.current_stream(), _SIDE[0]
    chunks = ExpertGroups.chunks(counts, chunk, a.device)
    side.wait_stream(main)  # the plan's upload

    def issue(groups):
        with torch.cuda.stream(side):
            w = kernels.dequantize(experts.fmt, experts.packed(proj), a.dtype, expert_ids=groups.ids)
            done = torch.cuda.Event()
            done.record(side)
        return w, done

    outs, nxt = [], issue(chunks[0][2])
    for i, (r0, r1, groups) in enumerate(chunks):
        w, done = nxt
        if i + 1 < len(chunks):
            nxt = issue(chunks[i + 1][2])
        main.wait_event(done)
        w.record_stream(main)
        outs.append(_gmm(a[r0:r1], w, groups.offsets[1:], dx))
    return outs


def dq_all(a, fmt, packed, ends, dx):
    return _gmm(a, kernels.dequantize(fmt, packed, a.dtype), ends, dx)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384, 32768])
    p.add_argument("--chunks", type=int, nargs="+", default=[4, 32, 0], help="experts per chunk; 0: the default")
    p.add_argument("--mlp", action="store_true", help="also the whole expert MLP, forward + backward")
    p.add_argument("--gpu-only", action="store_true", help="also GPU-only times (CUDA graphs) and host cost")
    p.add_argument("--profile", action="store_true", help="with --mlp: the MLP's top CUDA ops (torch.profiler)")
    p.add_argument("--projections", nargs="+", default=list(PROJECTIONS), choices=list(PROJECTIONS))
    args = p.parse_args()
    if not torch.cuda.is_available() or GROUPED_MM is None:
        sys.exit("bench/moe_paths.py needs a CUDA GPU and torch's grouped GEMM")
    log = open(os.path.join(os.environ["OUT"], "moe_paths.log"), "w") if os.environ.get("OUT") else None

    def say(line):
        print(line, flush=True)
        if log:
            log.write(line + "\n")
            log.flush()

    say(f"GPU {torch.cuda.get_device_name()} | torch {torch.__version__}; us by do_bench with host cost; "
        "x = (gmm fwd + dX) / (path fwd + dX)")  # fmt: skip
    for name in args.projections:
        proj, inter = PROJECTIONS[name]
        experts = QuantExperts(EXPERTS, HIDDEN, inter, "int4", dtype=torch.bfloat16).cuda()
        experts.random_init(torch.Generator("cuda").manual_seed(0))
        for tokens in args.tokens:
            measure(say, name, experts, proj, tokens, args.chunks, args.gpu_only)
            torch.cuda.empty_cache()
    if args.mlp:
        try:
            for tokens in args.tokens:
                measure_mlp(say, tokens, args.profile)
                torch.cuda.empty_cache()
        finally:
            moe.KERNEL_COMBINE = True


def measure_mlp(say, tokens: int, profile: bool = False) -> None:
    """The routed-expert MLP forward + backward (dX only: frozen base), packed int4 against bf16 weights."""
    g = torch.Generator("cuda").manual_seed(0)
    packed = QuantExperts(EXPERTS, HIDDEN, INTER, "int4", dtype=torch.bfloat16).cuda()
    packed.random_init(g)
    plain = Experts(EXPERTS, HIDDEN, INTER).cuda().bfloat16().requires_grad_(False)
    for proj in plain.PROJECTIONS:
        getattr(plain, proj).normal_(std=0.02, generator=g)
    x = randn(tokens, HIDDEN).requires_grad_()
    ids = torch.rand(tokens, EXPERTS, device="cuda").topk(TOP_K, dim=-1).indices
    w = torch.rand(tokens, TOP_K, device="cuda").softmax(-1).bfloat16()
    dy = randn(tokens, HIDDEN)

    def step(experts):
        dispatch_experts(x, ids, w, experts).backward(dy)
        x.grad = None

    times, peaks = {}, {}
    for label, experts, kernel_combine in (("bf16", plain, True), ("int4", packed, True),
                                           ("bf16 torch-combine", plain, False), ("int4 torch-combine", packed, False)):
        moe.KERNEL_COMBINE = kernel_combine  # (restored in main, whatever happens here)
        step(experts)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step(experts)
        peaks[label] = (torch.cuda.max_memory_allocated() - base) / 2**20
        times[label] = us(step, experts)
        if profile:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                step(experts)
                torch.cuda.synchronize()
            say(f"\n{label} expert MLP, {tokens} tokens, one step:")
            say(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
    for tag in ("", " torch-combine"):
        bf, q = f"bf16{tag}", f"int4{tag}"
        say(f"\nexpert MLP fwd+bwd{tag or ' (kernel combine)'}, {tokens} tokens: bf16 grouped_mm {times[bf]:.0f} us "
            f"(peak +{peaks[bf]:.0f} MiB), int4 chunked {times[q]:.0f} us (+{peaks[q]:.0f} MiB; "
            f"{packed.experts_per_chunk()} experts per chunk): x {times[bf] / times[q]:.2f}")  # fmt: skip


def fused(a, fmt, packed, ends, dx):
    offsets = torch.cat([ends.new_zeros(1), ends])
    return (kernels.grouped_dequant_linear_dx if dx else kernels.grouped_dequant_linear)(a, offsets, fmt, packed)


def measure(say, name, experts, proj, tokens, chunks, gpu_only: bool = False) -> None:
    packed, fmt = experts.packed(proj), experts.fmt
    _, n, k = experts.proj_shape(proj)
    w16 = randn(EXPERTS, n, k, scale=0.02)
    rows = tokens * TOP_K
    counts = torch.bincount(torch.randint(EXPERTS, (rows,)), minlength=EXPERTS).tolist()
    ends = torch.tensor(list(itertools.accumulate(counts)), dtype=torch.int32, device="cuda")
    x, dy = randn(rows, k), randn(rows, n)
    base = {False: us(_gmm, x, w16, ends, False), True: us(_gmm, dy, w16, ends, True)}
    paths = {"fused": partial(fused, fmt=fmt, packed=packed, ends=ends),
             "dq-all": partial(dq_all, fmt=fmt, packed=packed, ends=ends)}  # fmt: skip
    for c in chunks:
        per = c or experts.experts_per_chunk()
        paths[f"chunked {c}"] = partial(chunked, experts=experts, proj=proj, counts=counts, chunk=per)
        if per < EXPERTS:
            paths[f"overlap {c}"] = partial(overlapped, experts=experts, proj=proj, counts=counts, chunk=per)
    say(f"\n{name} [E={EXPERTS}, N={n}, K={k}] tokens={tokens} (rows {rows}): gmm fwd {base[False]:.0f} us, "
        f"dX {base[True]:.0f} us")  # fmt: skip
    for label, fn in paths.items():
        fwd, bwd = us(fn, x, dx=False), us(fn, dy, dx=True)
        say(f"  {label:12} fwd {fwd:8.0f}  dX {bwd:8.0f}  x {(base[False] + base[True]) / (fwd + bwd):5.2f}")
    if gpu_only:  # the same paths as CUDA graphs (no host cost), and the host's cost per call
        gb = graph_us(_gmm, x, w16, ends, False) + graph_us(_gmm, dy, w16, ends, True)
        graphed = {"dq-all": paths["dq-all"]}
        for c in chunks:
            plan = ExpertGroups.chunks(counts, c or experts.experts_per_chunk(), x.device)
            graphed[f"chunked {c}"] = partial(planned, experts=experts, proj=proj, plan=plan)
        say(f"  GPU only (CUDA graphs): gmm fwd + dX {gb:.0f} us")
        for label, fn in graphed.items():
            fwd, bwd = graph_us(fn, x, dx=False), graph_us(fn, dy, dx=True)
            say(f"  {label:12} fwd {fwd:8.0f}  dX {bwd:8.0f}  x {gb / (fwd + bwd):5.2f}  host per fwd call "
                f"{host_us(fn, x, dx=False):6.0f} us")  # fmt: skip


if __name__ == "__main__":
    main()
