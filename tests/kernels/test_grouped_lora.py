"""Expert LoRA at decode: grouped_lora_a (u = A_e x per routed row) under the interpreter against float64, and on the
GPU the decode kernel's LoRA epilogue (grouped_mma.py) against LoraExperts.linear's torch steps, and the model's path.

Interpreter bound: fp32 inputs, fp32 products and sums: (K + 2) 2^-24 of sum |A||x|, plus the output's rounding.
GPU bound for the epilogue, against torch's steps on the same bf16 values: u and B u are each rounded to bf16 after fp32
sums in another order than torch's grouped GEMM, so either may land one bf16 ulp away (2^-8 relative: of s sum |B||u|
for u's), and the final add rounds once more: 2^-7 (|out| + 2 s sum |B||u|) covers the three roundings.
"""

import pytest
import torch

from orbit_lightning import kernels
from tests.kernels.kernel_oracles import assert_within, expert_offsets, gpu, random_weight

cpu = pytest.mark.usefixtures("cpu_kernels")


def _per_expert_a(x: torch.Tensor, a: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """float64 u [T, r]: each expert's rows times its A [r, K]."""
    return torch.cat([c.double() @ a[e].double().T for e, c in enumerate(x.split(counts))])


@cpu
@pytest.mark.parametrize("r,k", [(8, 200), (16, 256)])  # r below tl.dot's 16 (padded); K past one 128 block
def test_grouped_lora_a_matches_fp64(r, k):
    counts = [3, 0, 19, 1, 0]  # empty experts, one row, one expert over two 16-row tiles
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(sum(counts), k, generator=gen)
    a = tuple(torch.randn(len(counts), r, k, generator=gen) for _ in range(2))
    for projections in (a[:1], a):
        u = kernels.grouped_lora_a(x, expert_offsets(counts), projections)
        assert u.shape == (sum(counts), len(projections), r)
        for j, a_j in enumerate(projections):
            ref = _per_expert_a(x, a_j, counts)
            bound = (k + 2) * 2.0**-24 * torch.cat([c.abs().double() @ a_j[e].abs().double().T
                                                    for e, c in enumerate(x.split(counts))])  # fmt: skip
            assert_within(u[:, j], ref, bound)


@cpu
def test_grouped_lora_a_rejects_mismatched_adapters():
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="one or two A"):
        kernels.grouped_lora_a(x, expert_offsets([4, 0]), (torch.randn(2, 8, 32),))
    with pytest.raises(ValueError, match="one or two A"):
        kernels.grouped_lora_a(x, expert_offsets([4, 0]), (torch.randn(2, 8, 64),) * 3)
    assert kernels.grouped_lora_a(x[:0], expert_offsets([0, 0]), (torch.randn(2, 8, 64),)).shape == (0, 1, 8)
    with pytest.raises(ValueError, match="3 experts but expert_offsets has 3 entries"):
        kernels.grouped_lora_a(x, expert_offsets([4, 0]), (torch.randn(3, 8, 64),))


@cpu
def test_the_decode_kernel_takes_ranks_up_to_its_limit_and_checks_the_experts(monkeypatch):
    """Ranks past configs.GROUPED_MMA_MAX_RANK are left to torch (None); an A with another expert count than the
    weights is refused. (The dispatch is forced as on a GPU, as in the plumbing test below.)"""
    import importlib

    from orbit_lightning.kernels import configs

    linear = importlib.import_module("orbit_lightning.kernels.linear")
    monkeypatch.setattr(linear, "fast_int4", lambda w, dtype: dtype == torch.bfloat16)
    monkeypatch.setattr(linear, "pick_grouped_mma", lambda x, w, swiglu=False: next(
        c for c in configs._GROUPED_MMA_NARROW if configs.mma_ok(w, c, stacked=True)))
    e, n, k = 2, 32, 256
    packed, _ = random_weight("int4", (e, n, k), seed=2)
    x, offsets = torch.randn(3, k).bfloat16(), expert_offsets([1, 2])
    for r, served in ((16, True), (configs.GROUPED_MMA_MAX_RANK, True), (2 * configs.GROUPED_MMA_MAX_RANK, False)):
        lora = kernels.ExpertLora((torch.zeros(e, r, k).bfloat16(),), (torch.zeros(e, n, r).bfloat16(),), 1.0)
        out = kernels.grouped_dequant_lora(x, offsets, "int4", packed, lora)
        assert (out is not None) == served, r
    lora = kernels.ExpertLora((torch.zeros(e + 1, 16, k).bfloat16(),), (torch.zeros(e, n, 16).bfloat16(),), 1.0)
    with pytest.raises(ValueError, match="LoRA takes"):
        kernels.grouped_dequant_lora(x, offsets, "int4", packed, lora)


def _lora(e, n, k, r, projections, seed, device="cuda"):
    gen = torch.Generator().manual_seed(seed)
    a = tuple((torch.randn(e, r, k, generator=gen) / k**0.5).bfloat16().to(device) for _ in range(projections))
    b = tuple((torch.randn(e, n, r, generator=gen) / r**0.5).bfloat16().to(device) for _ in range(projections))
    return kernels.ExpertLora(a, b, 0.5)


def _torch_lora(y, x, counts, a, b, scale):
    """LoraExperts.linear's steps on device groups: y + (grouped(grouped(x, A), B) * s), each rounded to bf16; with
    s sum |B| |u| (a rounding of u moves the delta by at most its relative error times that) for the bound."""
    u = torch.cat([c.float() @ a[e].float().T for e, c in enumerate(x.split(counts))]).bfloat16()
    delta = torch.cat([c.float() @ b[e].float().T for e, c in enumerate(u.split(counts))]).bfloat16()
    mag = torch.cat([c.float().abs() @ b[e].float().abs().T for e, c in enumerate(u.split(counts))]) * scale
    return y + (delta * scale).to(y.dtype), mag


def _epilogue_against_torch(r, device, rel, shape=(8, 96, 768), routings=([20, 0, 0, 1, 3, 8, 9, 0], [1] + [0] * 7)):
    from orbit_lightning.kernels import configs
    from orbit_lightning.kernels.formats import resolve
    from orbit_lightning.kernels.grouped_mma import grouped_mma

    e, n, k = shape
    gate, _ = random_weight("int4", (e, n, k), seed=5, device=device)
    up, _ = random_weight("int4", (e, n, k), seed=6, device=device)
    wg, wu = resolve("int4", gate, stacked=True), resolve("int4", up, stacked=True)
    narrow = configs._GROUPED_MMA_NARROW[0]
    for counts in routings:
        x = torch.randn(sum(counts), k, generator=torch.Generator().manual_seed(1)).to(device, torch.bfloat16)
        offsets = expert_offsets(counts, device=device)
        lora = _lora(e, n, k, r, 2, seed=r, device=device)
        for cfg in (narrow, configs._GROUPED_MMA):  # one projection: one and two row tiles per warp
            one = kernels.ExpertLora(lora.a[:1], lora.b[:1], lora.scale)
            y = grouped_mma(x, offsets, wg, cfg, lora=one)
            ref, mag = _torch_lora(grouped_mma(x, offsets, wg, cfg), x, counts, one.a[0], one.b[0], one.scale)
            assert_within(y.float(), ref.double(), rel * (ref.abs().double() + 2 * mag.double()))
        h = grouped_mma(x, offsets, wg, narrow, up=wu, lora=lora)
        g_ref, _ = _torch_lora(grouped_mma(x, offsets, wg, narrow), x, counts, lora.a[0], lora.b[0], lora.scale)
        u_ref, _ = _torch_lora(grouped_mma(x, offsets, wu, narrow), x, counts, lora.a[1], lora.b[1], lora.scale)
        ref = kernels.silu_mul(g_ref, u_ref)
        torch.testing.assert_close(h, ref, rtol=4 * rel, atol=4 * rel * ref.abs().max().item())


@cpu
def test_lora_epilogue_under_the_interpreter():
    """The epilogue's indexing (B rows, u rows and projection, masks) with the mma emulated (kernels/emulate.py).
    Bound 2^-5: under the interpreter each of the four bf16 roundings (u, B u, its scaling, the sum) may truncate."""
    _epilogue_against_torch(16, "cpu", 2.0**-5, shape=(4, 32, 256), routings=([9, 0, 1, 3],))


@gpu
@pytest.mark.parametrize("r", [8, 16, 64])
def test_gpu_lora_epilogue_matches_torchs_steps(r):
    _epilogue_against_torch(r, "cuda", 2.0**-7)


@gpu
def test_gpu_lora_epilogue_rounds_as_torch_on_exact_inputs():
    """Bitwise LoraExperts.linear's steps where every sum is exact in fp32 whatever its order: small integers for x, A
    and B, int4 scales of 2^-4. Then only the roundings (of y, u, B u, the scaled delta and the sum) can differ, so
    a missing or extra one shows; the scale 0.3 makes the rounding after it count."""
    from orbit_lightning.kernels import configs
    from orbit_lightning.kernels.formats import resolve
    from orbit_lightning.kernels.grouped_mma import grouped_mma

    e, n, k, r, counts = 8, 96, 768, 16, [5, 0, 1, 9, 0, 3, 2, 4]
    gate, _ = random_weight("int4", (e, n, k), seed=7, device="cuda")
    gate["weight_scale"].fill_(2.0**-4)
    wg = resolve("int4", gate, stacked=True)
    gen = torch.Generator().manual_seed(3)

    def ints(*shape):
        return torch.randint(-2, 3, shape, generator=gen).to("cuda", torch.bfloat16)

    x, offsets = ints(sum(counts), k), expert_offsets(counts, device="cuda")
    lora = kernels.ExpertLora((ints(e, r, k),), (ints(e, n, r),), 0.3)
    for cfg in (configs._GROUPED_MMA_NARROW[0], configs._GROUPED_MMA):
        y = grouped_mma(x, offsets, wg, cfg, lora=lora)
        ref, _ = _torch_lora(grouped_mma(x, offsets, wg, cfg), x, counts, lora.a[0], lora.b[0], lora.scale)
        assert torch.equal(y, ref)


def _lora_experts_decode(device, monkeypatch, rel, experts=16, hidden=512, backward=True):
    """LoraExperts over packed experts, no autograd graph, a decode batch: SwiGLU and down with their LoRA take the
    decode kernel (spied), and agree with torch's grouped GEMMs (GROUPED_MMA_LORA off) within bf16 rounding; with
    adapters that need gradients the torch path runs."""
    from orbit_lightning.kernels import configs

    from orbit_lightning.adapters.lora import LoraExperts
    from orbit_lightning.adapters.slots import AdapterState
    from orbit_lightning.quant.experts import QuantExperts

    base = QuantExperts(experts, hidden, 128, "int4").to(device)
    base.random_init(torch.Generator(device).manual_seed(0))
    layer = LoraExperts(base, AdapterState(), r=16, alpha=32, dtype=torch.bfloat16)
    for name, p in layer.named_parameters():
        if name.endswith("lora_B"):
            torch.nn.init.normal_(p, std=0.05)
    calls = []
    for name in ("grouped_dequant_swiglu", "grouped_dequant_lora"):
        fn = getattr(kernels, name)
        def spy(*a, _fn=fn, _n=name, **kw):
            out = _fn(*a, **kw)
            calls.append((_n, out is not None))  # (None: not served, the torch path ran)
            return out

        monkeypatch.setattr(kernels, name, spy)
    gen = torch.Generator(device).manual_seed(1)
    x = torch.randn(4, hidden, device=device, generator=gen).bfloat16()
    ids = torch.rand(4, experts, device=device, generator=gen).topk(2, dim=-1).indices
    w = torch.rand(4, 2, device=device, generator=gen).bfloat16()
    with torch.no_grad():
        fused = layer(x, ids, w)
        assert calls == [("grouped_dequant_swiglu", True), ("grouped_dequant_lora", True)]
        monkeypatch.setattr(configs, "GROUPED_MMA_LORA", False)
        reference = layer(x, ids, w)
    torch.testing.assert_close(fused, reference, rtol=rel, atol=rel * reference.abs().max().item())
    if not backward:
        return
    calls.clear()
    monkeypatch.setattr(configs, "GROUPED_MMA_LORA", True)
    layer(x, ids, w).float().sum().backward()  # adapters need gradients: the torch path
    assert not calls and layer.gate_proj_lora_B.grad is not None


@cpu
def test_lora_experts_decode_plumbing_under_the_interpreter(monkeypatch):
    """The model's route to the decode kernel (LoraExperts -> QuantExperts.decode_by_kernel -> quant.dispatch ->
    kernels), forced onto the CPU: device groups and the mma kernel are CUDA-only choices, so the test takes them
    (dispatch.fused_grouped, linear.fast_int4 and linear.pick_grouped_mma answer as on a GPU); the kernels then run
    with their PTX emulated. Bound 2^-4: the interpreter truncates each of the ~6 bf16 roundings on either path."""
    import importlib

    from orbit_lightning.kernels import configs

    linear = importlib.import_module("orbit_lightning.kernels.linear")  # (the package's `linear` is the function)

    from orbit_lightning.quant import dispatch

    monkeypatch.setattr(dispatch, "fused_grouped", lambda *a: True)
    monkeypatch.setattr(linear, "fast_int4", lambda w, dtype: dtype == torch.bfloat16)
    monkeypatch.setattr(linear, "pick_grouped_mma", lambda x, w, swiglu=False: next(
        c for c in configs._GROUPED_MMA_NARROW if configs.mma_ok(w, c, stacked=True)))
    _lora_experts_decode("cpu", monkeypatch, 2.0**-4, experts=4, hidden=128, backward=False)  # (GPU test: backward)


@gpu
def test_gpu_lora_experts_decode_through_the_kernel(monkeypatch):
    _lora_experts_decode("cuda", monkeypatch, 2.0**-5)
