"""Kernel-side view of the packed weight formats: name -> layout facts, plus input validation.

The layouts are the contract with `orbit_lightning.quant.formats` (which quantizes and holds the
pure-torch reference) and format names follow its registry. Each weight is a mapping of tensor
name -> tensor (extra keys such as int4's weight_shape are ignored); stacked MoE experts add a
leading E dim to every tensor:

- int4:  weight_packed int32 [N, K/8], value j of a word at bits 4j..4j+3 stored as q+8;
         weight_scale bf16 [N, ceil(K/g)]; w = q * scale.
- int4-tiled: the same tensors, shapes and values in blocks (quant/formats/tiled.py): words in blocks of 16 rows x
         128 values, scales of 16 rows x 8 groups, a block's rows one after another, a row tile's blocks along K;
         within a word, value j in nibble j // 2 + 4 (j % 2) (values 2i, 2i + 1 are one decoded bf16 pair).
- fp8:   weight float8_e4m3fn [N, K]; weight_scale_inv float32 [ceil(N/128), ceil(K/128)].
- mxfp4: weight_packed uint8 [N, K/2], low nibble = even k, e2m1 codes;
         weight_scale uint8 e8m0 [N, K/32] meaning 2^(e-127).
- nvfp4: same codes; weight_scale float8_e4m3fn [N, K/16]; weight_global_scale float32, one per
         matrix (0-dim, or [E]), w = e2m1 * scale * global_scale.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

# Integer ids the kernels receive as a constexpr to pick the in-register decoder. PLAIN is an unquantized
# bf16/fp16/fp32 weight read as stored, so the same tile loops give batch-invariant plain matmuls.
INT4, FP8, MXFP4, NVFP4, PLAIN, INT4_TILED = 0, 1, 2, 3, 4, 5
# int4-tiled's blocks (quant/formats/tiled.py, whose layout this is): words of 16 rows x 128 values, scales of 16 rows
# x 8 groups
TILE_ROWS, TILE_K, SCALE_GROUPS = 16, 128, 8


@dataclass(frozen=True)
class KernelFormat:
    name: str
    code: int  # constexpr id, one of INT4/FP8/MXFP4/NVFP4/INT4_TILED
    values_key: str
    scale_key: str
    values_dtype: torch.dtype
    scale_dtype: torch.dtype
    per_word: int  # values along K held by one stored element
    group_k: int | None  # K-length of one scale group; None: taken from the `group_size` kwarg
    group_n: int = 1  # rows sharing one scale (128 for fp8 blocks)
    global_key: str | None = None


FORMATS: dict[str, KernelFormat] = {
    "int4": KernelFormat("int4", INT4, "weight_packed", "weight_scale", torch.int32, torch.bfloat16, 8, None),
    "int4-tiled": KernelFormat("int4-tiled", INT4_TILED, "weight_packed", "weight_scale", torch.int32, torch.bfloat16,
                               8, None),
    "fp8": KernelFormat(
        "fp8", FP8, "weight", "weight_scale_inv", torch.float8_e4m3fn, torch.float32, 1, 128, group_n=128
    ),
    "mxfp4": KernelFormat("mxfp4", MXFP4, "weight_packed", "weight_scale", torch.uint8, torch.uint8, 2, 32),
    "nvfp4": KernelFormat(
        "nvfp4", NVFP4, "weight_packed", "weight_scale", torch.uint8, torch.float8_e4m3fn, 2, 16,
        global_key="weight_global_scale",
    ),
}


@dataclass(frozen=True)
class PackedWeight:
    """A validated packed weight, ready to hand to a kernel."""

    fmt: KernelFormat
    values: Tensor  # [E?, N, K/per_word]
    scale: Tensor  # [E?, ceil(N/group_n), ceil(K/group)]
    global_scale: Tensor | None  # float32 [E] or [1]; None when the format has none
    n: int
    k: int
    group: int  # K-length of one scale group
    experts: int | None  # None for a dense weight

    @property
    def int4(self) -> bool:
        """int4 in either layout (the same values and decoders)."""
        return self.fmt.code in (INT4, INT4_TILED)

    @property
    def tiled(self) -> bool:
        return self.fmt.code == INT4_TILED


def parse_format(fmt) -> tuple[KernelFormat, int | None]:
    """(kernel format, group size fixed by the name or None) for a quant-format name ("int4",
    "int4-g128", "int4-tiled", "int4-g128-tiled", "fp8", "mxfp4", "nvfp4") or a `QuantFormat` object (its `.name` is
    used)."""
    name = fmt if isinstance(fmt, str) else getattr(fmt, "name", None)
    if not isinstance(name, str):
        raise TypeError(f"fmt must be a format name or a QuantFormat, got {type(fmt).__name__}")
    tiled = name.endswith("-tiled")
    base, _, suffix = name.removesuffix("-tiled").partition("-g")
    if base == "int4" and (not suffix or suffix.isdigit()):
        return FORMATS["int4-tiled" if tiled else "int4"], int(suffix) if suffix else None
    if base in FORMATS and base != "int4-tiled" and not (suffix or tiled):
        return FORMATS[base], FORMATS[base].group_k
    raise ValueError(f"the kernels do not read format {name!r}; they read {sorted(FORMATS)}, int4-g<N> and "
                     f"int4-g<N>-tiled")


def supports(fmt) -> bool:
    """Whether the kernels read format `fmt` (name or QuantFormat)."""
    try:
        parse_format(fmt)
    except (TypeError, ValueError):
        return False
    return True


_PLAIN = KernelFormat("plain", PLAIN, "weight", "weight", torch.bfloat16, torch.bfloat16, 1, None)


def plain(weight: Tensor, stacked: bool) -> PackedWeight:
    """An unquantized weight [N, K] (or stacked experts [E, N, K]) in the kernels' PackedWeight form."""
    ndim = 3 if stacked else 2
    if not isinstance(weight, Tensor) or weight.dim() != ndim or not weight.is_floating_point():
        what = "stacked experts [E, N, K]" if stacked else "a matrix [N, K]"
        raise ValueError(f"a plain weight must be a floating-point {what}, got {getattr(weight, 'shape', weight)}")
    if weight.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"plain weights must be bf16, fp16 or fp32, got {weight.dtype}")
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    # The scale slot is never read for PLAIN; the values stand in so every kernel argument is a tensor.
    return PackedWeight(_PLAIN, w, w, None, w.shape[-2], w.shape[-1], 16, w.shape[0] if stacked else None)


def as_rows(t: Tensor, width: int) -> Tensor:
    """t [..., width] as [rows, width] with a unit last stride, as the kernels index rows: a view where the
    layout allows (e.g. a column slice of a wider output), else a contiguous copy."""
    t2 = t.reshape(-1, width)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def resolve(fmt_spec, packed: Mapping[str, Tensor], stacked: bool, **fmt_kw) -> PackedWeight:
    """Check `packed` against the format's layout and return it with N, K and the group size.

    fmt_spec: a name or QuantFormat (see `parse_format`). The only option is int4's `group_size`
    (default 32), which must agree with a "-g<N>" name suffix when both are given."""
    fmt, group = parse_format(fmt_spec)
    kw_group = fmt_kw.pop("group_size", None)
    if fmt_kw:
        raise TypeError(f"unexpected keyword(s) {sorted(fmt_kw)} for format {fmt.name!r}")
    if kw_group is not None and group is not None and kw_group != group:
        raise ValueError(f"group_size={kw_group} contradicts format {fmt_spec!r}, whose group is {group}")
    group = group or kw_group or 32
    if not isinstance(group, int) or group < fmt.per_word or group & (group - 1):
        raise ValueError(f"group_size must be a power of two >= {fmt.per_word}, got {group!r}")
    if not isinstance(packed, Mapping):
        raise TypeError(f"packed must be a mapping of tensor name -> tensor, got {type(packed).__name__}")
    keys = [fmt.values_key, fmt.scale_key] + ([fmt.global_key] if fmt.global_key else [])
    missing = [k for k in keys if k not in packed]
    if missing:
        raise KeyError(f"packed {fmt.name} weight lacks {missing}; it has {sorted(packed)}")
    values, scale = packed[fmt.values_key], packed[fmt.scale_key]
    for key, dtype in ((fmt.values_key, fmt.values_dtype), (fmt.scale_key, fmt.scale_dtype)):
        if packed[key].dtype != dtype:
            raise TypeError(f"{fmt.name} {key} must be {dtype}, got {packed[key].dtype}")
    ndim = 3 if stacked else 2
    if values.dim() != ndim or scale.dim() != ndim:
        what = "stacked experts [E, N, ...]" if stacked else "a dense matrix [N, ...]"
        raise ValueError(
            f"{fmt.name} tensors must be {ndim}-D for {what}; got {fmt.values_key} {tuple(values.shape)}, "
            f"{fmt.scale_key} {tuple(scale.shape)}"
        )
    n, k = values.shape[-2], values.shape[-1] * fmt.per_word
    want = (_cdiv(n, fmt.group_n), _cdiv(k, group))
    if tuple(scale.shape[-2:]) != want or (stacked and scale.shape[0] != values.shape[0]):
        raise ValueError(
            f"{fmt.name} {fmt.scale_key} has shape {tuple(scale.shape)} but {fmt.values_key} "
            f"{tuple(values.shape)} with group {group} needs {want} per matrix"
        )
    experts = values.shape[0] if stacked else None
    if fmt.code == INT4_TILED and (n % TILE_ROWS or k % TILE_K or k % (SCALE_GROUPS * group)):
        raise ValueError(f"int4-tiled weights are whole blocks of {TILE_ROWS} rows x {TILE_K} values (words) and x "
                         f"{SCALE_GROUPS} groups (scales); got N = {n}, K = {k}, group {group}")
    if fmt.global_key:
        gs = packed[fmt.global_key]
        if gs.numel() != (experts or 1):
            raise ValueError(f"{fmt.global_key} must hold one value per matrix, got shape {tuple(gs.shape)}")
        gs = gs.reshape(-1).to(torch.float32).contiguous()
    else:
        gs = None
    if scale.device != values.device or (gs is not None and gs.device != values.device):
        raise ValueError(f"{fmt.name} tensors must share one device")
    # The kernels index the last dim with unit stride (packed rows are read as contiguous words).
    values = values if values.stride(-1) == 1 else values.contiguous()
    scale = scale if scale.stride(-1) == 1 else scale.contiguous()
    return PackedWeight(fmt, values, scale, gs, n, k, group, experts)
