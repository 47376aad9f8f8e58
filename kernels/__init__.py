"""Triton kernels for the frozen low-precision base (installed as `orbit_lightning.kernels`).

Fused dequant-GEMM forward and dX for int4 (row-major or int4-tiled) / fp8-block / mxfp4 / nvfp4 packed weights,
small-M (decode) GEMVs, a grouped MoE GEMM over active experts (and its decode GEMV), a one-pass `dequantize` (for
chunked paths), the MoE routing (softmax top-k, the sort by expert), combine and its backward, and a batch-invariant
mode (`set_batch_invariant` / `batch_invariant()`) with a matching RMSNorm. All entry points are plain torch
functions without autograd.

Triton launches a kernel on the *current* CUDA device, not on its tensors' device: with tensors on another
GPU, call the kernels inside `torch.cuda.device(that_device)` (the rollout engine steps under its own).

On the CPU the kernels run under Triton's interpreter, which must be enabled before this package is
imported: `TRITON_INTERPRET=1` in the environment (tests/kernels/conftest.py sets it).
"""

from . import interpreter_dot
from .activation import silu_mul
from .attention import attention, paged_attention
from .configs import TileConfig
from .decode_advance import advance_decode
from .dequant_weight import dequantize
from .formats import FORMATS, supports
from .gemv_lora import LoraDelta
from .grouped_lora import ExpertLora, grouped_lora_a
from .kv_write import kv_write
from .linear import (
    dequant_linear,
    dequant_linear_dx,
    grouped_dequant_linear,
    grouped_dequant_linear_dx,
    grouped_dequant_lora,
    grouped_dequant_swiglu,
    grouped_linear,
    grouped_prefill_linear,
    int4_linear,
    int4_linear_dx,
    kernels_available,
    linear,
    prefill_linear,
)
from .logsumexp import logsumexp
from .lora import lora_add, lora_add_many
from .mode import batch_invariant, is_batch_invariant, set_batch_invariant
from .moe_combine import COMBINE_DTYPES, moe_combine, moe_combine_backward, slot_sum
from .moe_route import softmax_topk
from .moe_sort import sort_by_expert
from .rmsnorm import add_rms_norm, rms_norm
from .rope import rope
from .sampling import sample

# Under the interpreter, dots row by row where the CPU's BLAS would let a row's bits depend on its neighbours.
interpreter_dot.install()

__all__ = [
    "FORMATS",
    "ExpertLora",
    "LoraDelta",
    "TileConfig",
    "add_rms_norm",
    "advance_decode",
    "attention",
    "batch_invariant",
    "dequant_linear",
    "dequant_linear_dx",
    "dequantize",
    "grouped_dequant_linear",
    "grouped_prefill_linear",
    "prefill_linear",
    "grouped_dequant_linear_dx",
    "grouped_dequant_lora",
    "grouped_dequant_swiglu",
    "grouped_linear",
    "grouped_lora_a",
    "int4_linear",
    "int4_linear_dx",
    "is_batch_invariant",
    "kernels_available",
    "kv_write",
    "linear",
    "logsumexp",
    "lora_add",
    "lora_add_many",
    "COMBINE_DTYPES",
    "moe_combine",
    "moe_combine_backward",
    "paged_attention",
    "rms_norm",
    "rope",
    "sample",
    "set_batch_invariant",
    "silu_mul",
    "slot_sum",
    "softmax_topk",
    "sort_by_expert",
    "supports",
]
