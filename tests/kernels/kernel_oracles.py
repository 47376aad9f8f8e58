"""Reference computations for the kernel tests: float64 dequantization and rounding-error bounds; and the helpers
the kernel test files share (the GPU marker, expert offsets)."""

import pytest
import torch

from orbit_lightning.quant.formats import get_format
from orbit_lightning.quant.formats.tiled import untile_packed


def random_weight(fmt: str, shape: tuple[int, ...], seed: int = 0, device="cpu"):
    """(packed tensors, float64 dequantized oracle [..., N, K]) for a random weight in format `fmt`."""
    gen = torch.Generator(device=device).manual_seed(seed)
    f = get_format(fmt)
    packed = f.random_packed(shape, device=device, generator=gen)
    return packed, f.dequantize(packed, torch.float64)


def row_major(fmt: str, packed: dict[str, torch.Tensor]) -> tuple[str, dict[str, torch.Tensor]]:
    """An int4-tiled weight (`fmt` ends in -tiled) as the same values in the row-major format: (its name, tensors)."""
    f = get_format(fmt)
    return f.name.removesuffix("-tiled"), untile_packed(packed)


def matmul_bound(a: torch.Tensor, w: torch.Tensor, ref: torch.Tensor, rel: float) -> torch.Tensor:
    """Elementwise error bound rel * (|a| @ |w|^T + |ref|): a rounding of every product term (the weight
    cast to the dot dtype, accumulation) and of the output, each at relative precision `rel`."""
    return rel * (a.abs().double() @ w.abs().transpose(-1, -2) + ref.abs())


def assert_within(out: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor) -> None:
    assert out.shape == ref.shape, f"shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    if out.numel() == 0:
        return
    err = (out.double() - ref).abs()
    worst = (err - bound).max().item()
    assert worst <= 0, f"max error {err.max().item():.3e} exceeds its bound by {worst:.3e}"


def bits(x: torch.Tensor) -> torch.Tensor:
    """The bit patterns of a 16- or 32-bit float tensor, so that equality also tells signed zeros apart."""
    return x.view({2: torch.int16, 4: torch.int32}[x.element_size()])


def gpu(test):
    """Mark a test `gpu` and skip it without CUDA."""
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")(test))


def expert_offsets(counts: list[int], dtype=torch.int32, device="cpu") -> torch.Tensor:
    """[E + 1] offsets of rows sorted by expert, expert e holding counts[e] rows (grouped_gemm's contract)."""
    return torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=dtype, device=device)


def uneven_int4_experts(counts: list[int], n: int, k: int, features: int, seed: int, fmt: str = "int4"):
    """For the grouped GPU tests: stacked random experts [E = len(counts), n, k] in int4 format `fmt` (packed, and
    resolved for the kernels), bf16 rows [sum(counts), features] sorted by expert (expert e holding counts[e]) and
    their int32 offsets, all on CUDA."""
    from orbit_lightning.kernels.formats import resolve

    packed, _ = random_weight(fmt, (len(counts), n, k), seed=seed, device="cuda")
    gen = torch.Generator("cuda").manual_seed(seed)
    rows = torch.randn(sum(counts), features, generator=gen, device="cuda").bfloat16()
    return packed, resolve(fmt, packed, stacked=True), rows, expert_offsets(counts, device="cuda")
