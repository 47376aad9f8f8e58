"""The kernels' A/B switches shared by bench/rollout.py and bench/rl_step.py (MoE kernels, the dense warpgroup-MMA
GEMM and the decode GEMV's dispatch): each flag puts one kernel back to what ran before it (torch's ops, or the kernel
it replaced), for this process; flags marked "candidate" instead turn on a change not yet measured, so that one run
can A/B it."""

from __future__ import annotations

import argparse
import importlib

# flag -> (module, attribute, value the flag sets, help)
SWITCHES = {
    "--torch-combine": ("orbit_lightning.models.moe", "KERNEL_COMBINE", False,
                        "MoE: combine (and the dispatch's backward) with torch's ops instead of kernels.moe_combine / "
                        "slot_sum"),
    "--torch-sort": ("orbit_lightning.models.moe", "KERNEL_SORT", False,
                     "MoE: route with torch's argsort instead of kernels.sort_by_expert"),
    "--torch-route": ("orbit_lightning.models.moe", "KERNEL_ROUTE", False,
                      "MoE: softmax top-k with torch's ops instead of kernels.softmax_topk"),
    "--no-grouped-mma": ("orbit_lightning.kernels.configs", "GROUPED_MMA_ROWS", 0,
                         "MoE decode through the grouped tile kernel instead of kernels/grouped_mma.py"),
    "--torch-expert-lora": ("orbit_lightning.kernels.configs", "GROUPED_MMA_LORA", False,
                            "MoE decode: expert LoRA by torch's grouped GEMMs, not the decode kernel's epilogue"),
    "--unfused-swiglu": ("orbit_lightning.kernels.configs", "GROUPED_MMA_SWIGLU", False,
                         "MoE decode: gate, up and SiLU-mul in three launches, not one (grouped_dequant_swiglu)"),
    "--no-wgmma": ("orbit_lightning.kernels.configs", "WGMMA_INT4", False,
                   "every warpgroup-MMA kernel off: dense int4 at 9-512 rows through the decode GEMV / tile kernel / "
                   "dequantize + cuBLAS, MoE prefill and dX through dequantize + grouped GEMM"),
    "--no-wgmma-grouped": ("orbit_lightning.kernels.configs", "WGMMA_GROUPED_MAX_ROWS", 0,
                           "MoE prefill/training forward: dequantize + torch's grouped GEMM, not wgmma_int4_grouped"),
    "--no-wgmma-dx": ("orbit_lightning.kernels.configs", "WGMMA_GROUPED_DX_MAX_ROWS", 0,
                      "MoE training dX: dequantize + torch's grouped GEMM, not kernels/wgmma_int4_dx.py"),
    "--no-wgmma-rows": ("orbit_lightning.kernels.wgmma_int4", "MAX_ROWS", 64,
                        "dense int4 past 64 rows: dequantize + cuBLAS (and the tile kernel), not wgmma_int4's wider "
                        "tiles (pick_tile)"),
    "--old-mma-dispatch": ("orbit_lightning.kernels.configs", "MMA_SHAPE_DISPATCH", False,
                           "dense int4 decode: 2-8 rows on one row tile a warp on tall matrices too, and 9-16 rows "
                           "of small weights on wgmma_int4, not the mma GEMV (the dispatch before the twenty-fifth "
                           "session)"),
    "--fuse-wide": ("orbit_lightning.quant.fusion", "DECODE_ROWS", 1024,
                    "candidate: q/k/v and gate/up as one stacked matmul up to 1024 rows (no autograd), not 64 "
                    "(qwen3-8b, batch 128 / 256: within noise, sixteenth session)"),
    "--fuse-16": ("orbit_lightning.quant.fusion", "DECODE_ROWS", 16,
                  "q/k/v and gate/up as one stacked matmul only up to 16 rows (the GEMV's), not 64"),
}  # fmt: skip


def add_switches(ap: argparse.ArgumentParser) -> None:
    for flag, (_, _, _, text) in SWITCHES.items():
        ap.add_argument(flag, action="store_true", help=text + " (the A/B of that kernel)")


def apply_switches(args: argparse.Namespace) -> None:
    for flag, (module, attribute, value, _) in SWITCHES.items():
        if getattr(args, flag[2:].replace("-", "_")):
            setattr(importlib.import_module(module), attribute, value)
