"""Expert LoRA on device groups (A/B over all experts, empty ones included, on device offsets) vs host-sized
chunks: outputs and gradients of x and of every LoRA tensor, on a plain and a packed base, r aligned for torch's
grouped GEMM (4 in fp32) and not (2)."""

import pytest
import torch
import torch.nn.functional as F

from orbit_lightning.adapters import lora as lora_mod
from orbit_lightning.adapters.lora import LoraExperts
from orbit_lightning.adapters.slots import AdapterState
from orbit_lightning.quant.experts import QuantExperts
from orbit_lightning.quant.grouped import grouped_mm, per_row_mm
from tests.models.moe_cases import ROUTINGS, dispatch_path, random_experts, routing


def _lora(base, r: int) -> LoraExperts:
    lora = LoraExperts(base, AdapterState(), r=r, alpha=2 * r)
    g = torch.Generator().manual_seed(r)
    with torch.no_grad():
        for name in lora.PARAMS:
            p = getattr(lora, name)
            p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return lora


def _run(lora, x, ids, w, device_groups: bool):
    xg = x.clone().requires_grad_()
    with dispatch_path(lora, device_groups, chunk=2):
        y = lora(xg, ids, w)
    y.pow(2).sum().backward()
    grads = {n: getattr(lora, n).grad.clone() for n in lora.PARAMS}
    lora.zero_grad()
    return y.detach(), xg.grad, grads


@pytest.mark.parametrize("name", sorted(ROUTINGS))
@pytest.mark.parametrize("r", [4, 2])
@pytest.mark.parametrize("base", ["plain", "int4"])
def test_lora_device_groups_equal_host_chunks(name, r, base):
    experts = random_experts().requires_grad_(False)
    if base == "int4":
        experts = QuantExperts.from_experts(experts, "int4")
        experts.compute_dtype = torch.float32
    lora = _lora(experts, r)
    x, ids, w = routing(name)
    y_dev, dx_dev, g_dev = _run(lora, x, ids, w, device_groups=True)
    y_host, dx_host, g_host = _run(lora, x, ids, w, device_groups=False)
    tol = 1e-6 if base == "plain" else 1e-5  # the packed base's device path is the fused kernel
    assert (y_dev - y_host).abs().max() <= tol * y_host.abs().max()
    assert (dx_dev - dx_host).abs().max() <= tol * dx_host.abs().max()
    used = ids.unique()
    for n in lora.PARAMS:
        assert (g_dev[n] - g_host[n]).abs().max() <= tol * max(g_host[n].abs().max(), 1e-3), n
        unused = torch.ones(g_dev[n].shape[0], dtype=torch.bool)
        unused[used] = False
        assert not g_dev[n][unused].any(), n  # experts without rows get no gradient


def test_lora_experts_match_a_per_token_reference():
    base = random_experts().requires_grad_(False)
    lora = _lora(base, 4)
    x, ids, w = routing("top3")
    with torch.no_grad():
        got = lora(x, ids, w)
        want = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for j in range(ids.shape[1]):
                e = ids[t, j]

                def lin(p, v, e=e):
                    a, b = getattr(lora, f"{p}_lora_A")[e], getattr(lora, f"{p}_lora_B")[e]
                    return F.linear(v, getattr(base, p)[e]) + lora.scaling * F.linear(F.linear(v, a), b)

                h = F.silu(lin("gate_proj", x[t])) * lin("up_proj", x[t])
                want[t] += w[t, j] * lin("down_proj", h)
    assert (got - want).abs().max() <= 1e-5


@pytest.mark.parametrize("name", ["empty-experts", "top3"])
def test_per_row_lora_fallback_equals_host_chunks(name, monkeypatch):
    """Device groups on CUDA without torch's grouped GEMM (fp32, or r not 16-byte aligned): each row reads its
    expert's A/B. Forced here on the CPU."""
    lora = _lora(random_experts().requires_grad_(False), 2)
    x, ids, w = routing(name)
    y_host, dx_host, g_host = _run(lora, x, ids, w, device_groups=False)
    monkeypatch.setattr(
        lora_mod, "grouped_mm", lambda x, w, g: per_row_mm(x, w, g) if g.on_device else grouped_mm(x, w, g)
    )
    y_dev, dx_dev, g_dev = _run(lora, x, ids, w, device_groups=True)
    assert (y_dev - y_host).abs().max() <= 1e-6 * y_host.abs().max()
    assert (dx_dev - dx_host).abs().max() <= 1e-6 * dx_host.abs().max()
    for n in lora.PARAMS:
        assert (g_dev[n] - g_host[n]).abs().max() <= 1e-6 * max(g_host[n].abs().max(), 1e-3), n
