"""Packed experts on device groups (the fused grouped kernel on device offsets [E+1]; on the CPU through Triton's
interpreter) vs host-sized chunks (dequantize `chunk` experts, grouped GEMM): forward and dX, with empty experts,
one token and top-k > 1. Plus the choice of path and the reasons it names."""

import pytest
import torch

from orbit_lightning.quant.experts import QuantExperts
from orbit_lightning.triton_kernels import kernels_module
from tests.models.moe_cases import ROUTINGS, E, dispatch_path, random_experts, routing

TOL = 1e-5  # fp32: the kernel and the dequantize-then-matmul path differ in summation order only


def _kernels_on_cpu() -> bool:
    k = kernels_module()
    return k is not None and k.kernels_available("cpu")


def _packed(fmt: str = "int4") -> QuantExperts:
    q = QuantExperts.from_experts(random_experts(), fmt)
    q.compute_dtype = torch.float32
    return q


@pytest.mark.parametrize("name", sorted(ROUTINGS))
def test_device_groups_equal_host_chunks_packed(name):
    q = _packed()
    x, ids, w = routing(name)
    outs = []
    for device_groups in (True, False):
        xg = x.clone().requires_grad_()
        with dispatch_path(q, device_groups, chunk=2):
            y = q(xg, ids, w)
        y.pow(2).sum().backward()
        outs.append((y.detach(), xg.grad))
    (y_dev, dx_dev), (y_host, dx_host) = outs
    scale = y_host.abs().max()
    assert (y_dev - y_host).abs().max() <= TOL * scale
    assert (dx_dev - dx_host).abs().max() <= TOL * dx_host.abs().max()


def test_device_groups_hand_the_kernel_offsets_over_all_experts(monkeypatch):
    if not _kernels_on_cpu():
        pytest.skip("Triton's interpreter is off (TRITON_INTERPRET=1 must be set before import)")
    k = kernels_module()
    seen = []
    real = k.grouped_dequant_linear

    def spy(x, offsets, fmt, packed, **kw):
        seen.append(offsets.clone())
        return real(x, offsets, fmt, packed, **kw)

    monkeypatch.setattr(k, "grouped_dequant_linear", spy)
    q = _packed()
    x, ids, w = routing("empty-experts")
    with torch.no_grad(), dispatch_path(q, device_groups=True):
        q(x, ids, w)
    counts = torch.bincount(ids.reshape(-1), minlength=E)
    want = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]).to(torch.int32)
    assert len(seen) == 3  # one launch per projection, all experts at once
    assert all(s.dtype == torch.int32 and torch.equal(s, want) for s in seen)


def test_path_choice_and_reasons():
    q = _packed()
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert q.chunk_size(4, cpu) == q.experts_per_chunk()  # the fused kernel is a CUDA path
    assert "CUDA" in q.device_groups_blocker(cpu)
    nf4 = QuantExperts(E, 64, 64, "nf4")
    assert "format nf4" in nf4.device_groups_blocker(cuda)
    assert nf4.chunk_size(4, cuda) == nf4.experts_per_chunk()
    if torch.cuda.is_available():
        assert q.device_groups_blocker(cuda) is None
        assert q.chunk_size(16, cuda) is None  # decode: few rows per expert
        assert q.chunk_size(64 * E + 1, cuda) == q.experts_per_chunk()  # many rows: chunked dequant + grouped GEMM
