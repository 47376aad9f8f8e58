"""LoRA at decode: on a packed base whose dispatch reaches the decode GEMV, the LoRA's up-projection rides in the
GEMV's epilogue (two launches per linear instead of three); every base gives base(x) + s * B(A x), PEFT's LoRA."""

import pytest
import torch
from orbit_lightning.kernels import gemm, gemv
from orbit_lightning.kernels import lora as kernel_lora
from torch import nn

from orbit_lightning import kernels
from orbit_lightning.adapters import lora as adapter_lora
from orbit_lightning.adapters.slots import AdapterState
from orbit_lightning.quant import dispatch
from orbit_lightning.quant.linear import QuantLinear
from tests.kernels.kernel_oracles import assert_within

KERNELS = {"gemv": (gemv, "_gemv_kernel"), "dense": (gemm, "_dense_kernel"),
           "lora_down": (kernel_lora, "_lora_down_kernel"), "lora_up": (kernel_lora, "_lora_up_kernel")}  # fmt: skip


class _Spy:
    def __init__(self, kernel, name: str, log: list[str]):
        self.kernel, self.name, self.log = kernel, name, log

    def __getitem__(self, grid):
        self.log.append(self.name)
        return self.kernel[grid]


@pytest.fixture
def launches(monkeypatch):
    """Names of the Triton kernels launched, in order."""
    log = []
    for name, (module, attr) in KERNELS.items():
        monkeypatch.setattr(module, attr, _Spy(getattr(module, attr), name, log))
    return log


@pytest.fixture
def decode_kernels_on_cpu(monkeypatch):
    """The decode paths take the kernels on CUDA only; here Triton's interpreter stands in for the GPU."""
    if not kernels.kernels_available("cpu"):
        pytest.skip("orbit_lightning.kernels was imported before TRITON_INTERPRET=1 was set")
    monkeypatch.setattr(dispatch, "_cuda_kernels", lambda x, fmt: kernels if kernels.supports(fmt) else None)
    monkeypatch.setattr(adapter_lora, "_fused_decode", lambda x, a, dropout: x.numel() <= 64 * x.shape[-1])


def _lora_layer(base: nn.Module, r: int = 8, seed: int = 0) -> adapter_lora.LoraLinear:
    layer = adapter_lora.LoraLinear(base, AdapterState(), r=r, alpha=2 * r)
    g = torch.Generator(device=layer.lora_A.device).manual_seed(seed)
    with torch.no_grad():
        layer.lora_B.copy_(0.1 * torch.randn(layer.lora_B.shape, generator=g, device=g.device))
    return layer


def _packed_base(n: int, k: int, dtype: torch.dtype, device="cpu", bias: bool = False) -> QuantLinear:
    base = QuantLinear(k, n, "int4", bias=bias, dtype=dtype).to(device)
    base.random_init(torch.Generator(device=device).manual_seed(1))
    if bias:
        base.bias.normal_()
    return base


def _peft_reference(layer: adapter_lora.LoraLinear, x: torch.Tensor):
    """base(x) + s * B(A x) in fp64, and the elementwise magnitude the roundings scale with."""
    base = layer.base_layer
    w = (base.dequantize(torch.float64) if isinstance(base, QuantLinear) else base.weight).double()
    xd, a, b = x.double(), layer.lora_A.double(), layer.lora_B.double()
    y = xd @ w.T + layer.scaling * (xd @ a.T) @ b.T
    if base.bias is not None:
        y = y + base.bias.double()
    return y, xd.abs() @ w.abs().T + layer.scaling * (xd.abs() @ a.abs().T) @ b.abs().T + y.abs()


@pytest.mark.usefixtures("decode_kernels_on_cpu")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("rows", "route"), [(1, ["lora_down", "gemv"]), (16, ["lora_down", "gemv"]),
                                             (24, ["lora_down", "dense", "lora_up"])])  # fmt: skip
def test_lora_on_packed_base_at_decode(rows, route, dtype, launches):
    layer = _lora_layer(_packed_base(37, 160, dtype))
    x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(rows)).to(dtype)
    with torch.no_grad():
        y = layer(x)
    assert launches == route  # <= 16 rows: the GEMV adds the LoRA; beyond, the tile GEMM and lora_up
    ref, size = _peft_reference(layer, x)
    # fp32: sums of <= 160 products (2^-24 each); fp16: the weights, t, the delta, its scaled value, y and the
    # sum each round once to fp16 (2^-11), a few ulps of the magnitudes involved.
    assert_within(y, ref, size * (2.0**-16 if dtype == torch.float32 else 2.0**-8))


OTHER_BASES = {"linear": (lambda: nn.Linear(160, 37), ["lora_down", "lora_up"]),
               "packed-with-bias": (lambda: _packed_base(37, 160, torch.float32, bias=True),
                                    ["lora_down", "gemv", "lora_up"])}  # fmt: skip


@pytest.mark.usefixtures("decode_kernels_on_cpu")
@pytest.mark.parametrize("base", list(OTHER_BASES))
def test_lora_beside_other_bases_keeps_lora_up(base, launches):
    # A plain linear, and a packed one with a bias (the LoRA is added after the bias), keep today's lora_up.
    make, route = OTHER_BASES[base]
    layer = _lora_layer(make())
    x = torch.randn(2, 1, 160, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        y = layer(x)
    assert launches == route and y.shape == (2, 1, 37)
    ref, size = _peft_reference(layer, x)
    assert_within(y, ref, size * 2.0**-16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 16])
def test_gpu_bf16_lora_decode_in_two_launches(rows, launches):
    # Qwen3-8B's q_proj shape, with the real decode gates (CUDA, no autograd, <= 64 rows).
    layer = _lora_layer(_packed_base(4096, 4096, torch.bfloat16, device="cuda"), r=16)
    x = torch.randn(rows, 4096, generator=torch.Generator("cuda").manual_seed(rows), device="cuda").bfloat16()
    with torch.no_grad():
        y = layer(x)
        assert launches == ["lora_down", "gemv"]
        assert torch.equal(y, layer(x))  # deterministic: ordered split and slice reductions
    ref, size = _peft_reference(layer, x)
    # bf16: each weight, t, the delta, its scaled value, y and the sum round once (2^-9): 2^-7 of the magnitudes.
    assert_within(y, ref, size * 2.0**-7)
