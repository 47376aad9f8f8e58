"""MoE dispatch on the CPU: device groups (every expert in one grouped call on device offsets) equal the chunked
host-sized path, the device path reads nothing on the host, and the combine sums a token's slots in slot order."""

import pytest
import torch
import torch.nn.functional as F

from orbit_lightning.adapters.lora import LoraExperts
from orbit_lightning.adapters.slots import AdapterState
from orbit_lightning.models.moe import _combine
from orbit_lightning.quant.grouped import ExpertGroups, grouped_mm, per_row_mm, torch_grouped_mm_blocker
from tests.models.moe_cases import ROUTINGS, D, E, I, dispatch_path, random_experts, routing


def _reference(experts, x, ids, w):
    """Token by token, slot by slot, with F.linear on each expert's weights."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[t, j]
            h = F.silu(F.linear(x[t], experts.gate_proj[e])) * F.linear(x[t], experts.up_proj[e])
            out[t] += w[t, j] * F.linear(h, experts.down_proj[e])
    return out


@pytest.mark.parametrize("name", sorted(ROUTINGS))
@pytest.mark.parametrize("chunk", [1, 3])
def test_device_groups_equal_host_chunks_plain(name, chunk):
    experts = random_experts()
    x, ids, w = routing(name)
    results = []
    for device_groups in (True, False):
        xg = x.clone().requires_grad_()
        with dispatch_path(experts, device_groups, chunk):
            y = experts(xg, ids, w)
        y.pow(2).sum().backward()
        results.append((y.detach(), xg.grad, [p.grad.clone() for p in experts.parameters()]))
        experts.zero_grad()
    (y_dev, dx_dev, dw_dev), (y_host, dx_host, dw_host) = results
    # Same per-group matmuls, same combine: identical bits.
    assert torch.equal(y_dev, y_host)
    assert torch.equal(dx_dev, dx_host)
    for a, b in zip(dw_dev, dw_host):
        assert torch.allclose(a, b, rtol=0, atol=1e-6)
    assert (y_dev - _reference(experts, x, ids, w)).abs().max() <= 1e-5
    with torch.no_grad():  # inference: torch's grouped GEMM where this torch has it on the CPU (no weight grad)
        outs = []
        for device_groups in (True, False):
            with dispatch_path(experts, device_groups, chunk):
                outs.append(experts(x, ids, w))
    assert torch.equal(outs[0], outs[1]) and torch.allclose(outs[0], y_dev, rtol=0, atol=1e-6)


def test_plain_experts_take_device_groups_where_torch_has_grouped_gemm():
    experts = random_experts()
    cpu_ok = torch_grouped_mm_blocker(torch.float32, (I, D), torch.device("cpu")) is None
    assert experts.chunk_size(10, torch.device("cpu")) == (None if cpu_ok else experts.experts_per_chunk())
    assert "bf16" in experts.device_groups_blocker(torch.device("cuda"))  # fp32 on CUDA: host-sized chunks


@pytest.mark.parametrize("lora", [False, True])
def test_device_path_reads_nothing_on_the_host(lora, monkeypatch):
    """Inference on device groups: no .tolist / .item / nonzero / bool anywhere, expert LoRA included."""
    experts = random_experts().requires_grad_(False)
    if experts.device_groups_blocker(torch.device("cpu")) is not None:
        pytest.skip("this torch has no CPU grouped GEMM")
    if lora:
        experts = LoraExperts(experts, AdapterState(), r=4, alpha=8)
        torch.nn.init.normal_(experts.up_proj_lora_B, std=0.1)
    x, ids, w = routing("empty-experts")
    with torch.no_grad():
        want = experts(x, ids, w)

        def host_read(*args, **kwargs):
            raise AssertionError("the device path read a tensor on the host")

        for name in ("tolist", "item", "nonzero", "__bool__", "__int__"):
            monkeypatch.setattr(torch.Tensor, name, host_read)
        got = experts(x, ids, w)
        monkeypatch.undo()
    assert torch.equal(got, want)


def test_combine_sums_slots_in_order_independent_of_the_batch():
    g = torch.Generator().manual_seed(3)
    t, k = 6, 3
    ids = torch.randint(0, E, (t, k), generator=g)
    order = ids.reshape(-1).argsort(stable=True)
    ys = torch.randn(t * k, D, generator=g)  # expert outputs, sorted by expert
    w = torch.rand(t, k, generator=g)
    y_tk = torch.empty_like(ys)
    y_tk[order] = ys
    y_tk = y_tk.view(t, k, D)
    want = y_tk[:, 0] * w[:, :1] + y_tk[:, 1] * w[:, 1:2] + y_tk[:, 2] * w[:, 2:3]
    assert torch.equal(_combine(ys, order, w, torch.float32), want)
    # A token alone gives the same bits as in the batch.
    for i in range(t):
        o = ids[i].argsort(stable=True)
        alone = _combine(y_tk[i][o], o, w[i : i + 1], torch.float32)
        assert torch.equal(alone[0], want[i])


def test_zero_tokens():
    experts = random_experts()
    x, ids, w = torch.zeros(0, D), torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2)
    for device_groups in (True, False):
        with dispatch_path(experts, device_groups):
            assert experts(x, ids, w).shape == (0, D)


def test_grouped_mm_paths_agree_with_empty_groups():
    g = torch.Generator().manual_seed(1)
    sizes = [3, 0, 0, 5, 1, 0]
    x = torch.randn(sum(sizes), 16, generator=g)
    w = torch.randn(len(sizes), 8, 16, generator=g)
    offsets = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32)
    want = torch.cat([xg @ wg.t() for xg, wg in zip(x.split(sizes), w)])
    device = ExpertGroups(offsets)
    assert device.row_groups(x.shape[0]).tolist() == [0, 0, 0, 3, 3, 3, 3, 3, 4]
    assert torch.allclose(grouped_mm(x, w, device), want, rtol=0, atol=1e-6)
    assert torch.allclose(per_row_mm(x, w, device), want, rtol=0, atol=1e-5)  # the CUDA fallback without sizes
    (_, _, chunk), = ExpertGroups.chunks(sizes, len(sizes), x.device)  # every active expert in one chunk
    assert torch.equal(grouped_mm(x, chunk.select(w), chunk), grouped_mm(x, w, device))
    # The chunked MoE path's plan: active experts two at a time, all offsets and ids in one upload.
    plan = ExpertGroups.chunks(sizes, 2, x.device)
    assert [(a, b, g.ids.tolist(), g.offsets.tolist(), g.sizes) for a, b, g in plan] == [
        (0, 8, [0, 3], [0, 3, 8], [3, 5]), (8, 9, [4], [0, 1], [1])]  # fmt: skip
    pieces = torch.cat([grouped_mm(x[a:b], g.select(w), g) for a, b, g in plan])
    assert torch.equal(pieces, grouped_mm(x, w, device))
    assert ExpertGroups.chunks([0, 0], 2, x.device) == []


@pytest.mark.parametrize("name", sorted(ROUTINGS))
def test_permutation_gathers_give_autograds_index_gradients_bitwise(name):
    # dispatch/combine move rows by a permutation with a gather-backward op; autograd's own advanced indexing
    # (scatter into zeros, then the k slots summed) is the oracle, bit for bit.
    from orbit_lightning.models import moe

    experts = random_experts()
    x, ids, w = routing(name)
    t, k = ids.shape

    def indexed(src_x, ys_fn):
        order = ids.reshape(-1).argsort(stable=True)
        inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel()))
        xs = src_x[:, None].expand(t, k, D)[order // k, order % k]
        y = ys_fn(xs)[inverse].view(t, k, D)
        return sum((y[:, j] * w[:, j : j + 1] for j in range(1, k)), (y[:, 0] * w[:, :1]))

    ys_fn = lambda xs: moe._expert_mlp(experts, xs, ExpertGroups(moe._expert_offsets(  # noqa: E731
        ids.reshape(-1).sort(stable=True).values, E)))
    grads = []
    for run in (lambda xx: experts(xx, ids, w), lambda xx: indexed(xx, ys_fn)):
        xg = x.clone().requires_grad_()
        y = run(xg)
        y.pow(2).sum().backward()
        grads.append((y.detach(), xg.grad, [p.grad.clone() for p in experts.parameters()]))
        experts.zero_grad()
    (y0, dx0, dw0), (y1, dx1, dw1) = grads
    assert torch.equal(y0, y1) and torch.equal(dx0, dx1)
    assert all(torch.equal(a, b) for a, b in zip(dw0, dw1))


def _routing_kernels_against_torch_ops(name, device, dtype, monkeypatch, force=False):
    """experts(x) forward + backward (x and the routing weights need gradients) with the routing's kernels, which
    must run (spied), and with torch's ops: the outputs bitwise, the gradients up to the order of their fp32 sums
    (bounded bit-tight in tests/kernels/test_moe_combine.py; here the dtype's default tolerance checks the wiring)."""
    from orbit_lightning import kernels
    from orbit_lightning.models import moe

    ran = set()

    def spied(name, fn):
        def spy(*args, **kwargs):
            ran.add(name)
            return fn(*args, **kwargs)

        return spy

    for name_ in ("sort_by_expert", "moe_combine", "moe_combine_backward", "slot_sum"):
        monkeypatch.setattr(kernels, name_, spied(name_, getattr(kernels, name_)))
    experts = random_experts(dtype=dtype).to(device).requires_grad_(False)
    x, ids, w = (t.to(device) for t in routing(name, dtype=dtype))
    runs = []
    for kernel in (True, False):
        monkeypatch.setattr(moe, "KERNEL_COMBINE", kernel)
        monkeypatch.setattr(moe, "KERNEL_SORT", kernel)
        if force:  # the CPU: the interpreter runs the kernels where the model would not take them
            monkeypatch.setattr(moe, "_kernel_combine", lambda rows, k=kernel: k)
            monkeypatch.setattr(moe, "_kernel_sort", lambda ids_, e, k=kernel: k)
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = experts(xg, ids, wg)
        y.float().pow(2).sum().backward()
        with torch.no_grad():
            y_decode = experts(x, ids, w)
        runs.append((y.detach(), y_decode, xg.grad, wg.grad))
        assert ran == ({"sort_by_expert", "moe_combine", "moe_combine_backward", "slot_sum"} if kernel else set())
        ran.clear()
    (y0, yd0, dx0, dw0), (y1, yd1, dx1, dw1) = runs
    assert torch.equal(y0, y1) and torch.equal(yd0, yd1) and torch.equal(y0, yd0)
    torch.testing.assert_close(dx0, dx1)
    torch.testing.assert_close(dw0, dw1)


@pytest.mark.parametrize("name", sorted(ROUTINGS))
def test_routing_kernels_equal_torch_ops_cpu(name, monkeypatch):
    from orbit_lightning import kernels

    if not kernels.kernels_available("cpu"):
        pytest.skip("Triton's interpreter was not enabled before the kernels were imported")
    _routing_kernels_against_torch_ops(name, "cpu", torch.float32, monkeypatch, force=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", sorted(ROUTINGS))
def test_routing_kernels_equal_torch_ops_gpu(name, monkeypatch):
    _routing_kernels_against_torch_ops(name, "cuda", torch.bfloat16, monkeypatch)
