"""bench/decode_chain.py: its bit check names the first output that differs, and on the GPU the shipped launches of
a whole Qwen3-8B decode layer (PDL everywhere, the warpgroup-MMA projections' early weight loads included), replayed
back to back in a CUDA graph, give the bits of the eager chain without PDL."""

import importlib.util
from pathlib import Path

import pytest
import torch

_spec = importlib.util.spec_from_file_location("decode_chain", Path(__file__).parents[2] / "bench" / "decode_chain.py")
decode_chain = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(decode_chain)


def test_first_difference_names_the_layer_projection_and_size():
    outs = [torch.full((2, 3), float(i)) for i in range(8)]  # two layers of the four projections
    assert decode_chain.first_difference(outs, [o.clone() for o in outs]) == "-"
    other = [o.clone() for o in outs]
    other[6][1, 2] += 0.5  # layer 1's gate_up
    other[7][0, 0] += 1.0  # (a later difference is not the first)
    assert decode_chain.first_difference(outs, other) == "L1.gate_up: 1 of 6 differ, max 0.5"
    nan = [o.clone() for o in outs]
    nan[1][0, 1] = float("nan")  # (a NaN output differs, even from a NaN)
    assert decode_chain.first_difference(nan, [o.clone() for o in nan]) == "L0.o: 1 of 6 differ, max nan"


def test_an_unknown_setting_is_refused():
    with pytest.raises(ValueError, match="unknown setting 'all'"):
        decode_chain.apply("all")
    assert set(decode_chain.SETTINGS) == {"shipped", "plain-wg", "none"}


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                    reason="the 16-row projections take the warpgroup-MMA kernel on Hopper (sm_90)")
def test_shipped_launches_replayed_back_to_back_keep_the_eager_bits():
    from orbit_lightning.kernels import pdl
    from orbit_lightning.kernels import wgmma_int4 as wg

    shipped = (pdl.ENABLED, wg.PDL_LAUNCH)
    try:
        weights = decode_chain.layer_weights(1, "cuda")
        norm = torch.rand(decode_chain.HIDDEN, generator=torch.Generator("cuda").manual_seed(1),
                          device="cuda").bfloat16() + 0.5
        h = decode_chain.hidden(16)
        decode_chain.apply("none")
        ref = decode_chain.chain(h, weights, norm)
        decode_chain.apply("shipped")
        graph, out, eager = decode_chain.capture(h, weights, norm, torch.cuda.Stream())
        decode_chain.replay_us(graph, 50)  # (back to back, as the timing rounds replay)
        assert decode_chain.first_difference(eager, ref) == "-"
        assert decode_chain.first_difference(out, ref) == "-"
        assert all(o.isfinite().all() for o in out)
    finally:
        pdl.ENABLED, wg.PDL_LAUNCH = shipped
