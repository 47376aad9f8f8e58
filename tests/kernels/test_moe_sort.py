"""`kernels.sort_by_expert` against torch: the stable argsort, its inverse and the searchsorted offsets, exactly."""

import pytest
import torch

from orbit_lightning import kernels

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _check(ids: torch.Tensor, num_experts: int) -> None:
    order, inverse, offsets = kernels.sort_by_expert(ids, num_experts)
    want = ids.argsort(stable=True)
    assert order.dtype == inverse.dtype == torch.int64 and offsets.dtype == torch.int32
    assert torch.equal(order, want)
    assert torch.equal(inverse[want], torch.arange(ids.numel(), device=ids.device))
    experts = torch.arange(num_experts + 1, device=ids.device)
    assert torch.equal(offsets.long(), torch.searchsorted(ids[want].long(), experts))


@pytest.mark.usefixtures("cpu_kernels")
@pytest.mark.parametrize("n,experts", [(8, 128), (37, 5), (37, 7), (64, 5), (1, 1), (0, 4)],
                         ids=["decode-top8", "odd", "pad-bin-is-expert-count", "no-pads", "one", "empty"])
def test_sort_by_expert_cpu(n, experts):
    gen = torch.Generator().manual_seed(n)
    ids = torch.randint(experts, (n,), generator=gen)  # repeats: the sort must keep their order
    _check(ids, experts)
    _check(ids.int(), experts)


@pytest.mark.usefixtures("cpu_kernels")
def test_sort_by_expert_rejects_what_one_program_cannot_sort():
    with pytest.raises(ValueError, match=f"at most {kernels.moe_sort.MAX_ROWS}"):
        kernels.sort_by_expert(torch.zeros(kernels.moe_sort.MAX_ROWS + 1, dtype=torch.int64), 8)
    with pytest.raises(ValueError, match="int32/int64"):
        kernels.sort_by_expert(torch.zeros(4, 2, dtype=torch.int64), 8)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("n,experts", [(8, 128), (512, 128), (2048, 256), (2047, 384), (100, 1)])
def test_sort_by_expert_gpu(n, experts):
    gen = torch.Generator(device="cuda").manual_seed(n)
    _check(torch.randint(experts, (n,), generator=gen, device="cuda"), experts)
