"""`build.build_model`: the config's model spec reaches the modules it names."""

import pytest

from orbit_lightning.build import build_model
from orbit_lightning.cli import compose
from orbit_lightning.models.moe import Experts
from tests.integration.cli_runs import TINY


@pytest.mark.parametrize("quant", ["int4", "none"])
def test_expert_chunk_reaches_every_experts_module(quant):
    cfg, _ = compose([*TINY, f"quant={quant}", "model.expert_chunk=3"])
    model = build_model(cfg.model, cfg.adapter)
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    assert experts and all(m.chunk == 3 and m.experts_per_chunk() == 3 for m in experts)


@pytest.mark.parametrize("quant", ["int4", "none"])
def test_expert_chunk_by_default_holds_what_the_budget_allows(quant):
    cfg, _ = compose([*TINY, f"quant={quant}", "model.expert_chunk_mib=1"])
    model = build_model(cfg.model, cfg.adapter)
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    assert experts
    for m in experts:  # one projection's weights of a chunk, in the dtype the chunk materializes, fit 1 MiB
        per_expert = m.hidden * m.intermediate * m.transient_dtype.itemsize
        want = (1 << 20) // per_expert
        assert want >= 2 and m.chunk == 0 and m.experts_per_chunk() == want


def test_the_tiled_int4_option_builds_and_keeps_narrow_layers_row_major():
    """quant=int4-tiled (configs/quant/int4-tiled.yaml) reaches the loader; the tiny model's layers are 128 wide, too
    narrow for int4-tiled's blocks (K a multiple of 256 at group 32), so every one stays int4, the same values."""
    cfg, _ = compose([*TINY, "quant=int4-tiled"])
    assert cfg.model.quant == "int4-tiled"
    model = build_model(cfg.model, cfg.adapter)
    assert {m.fmt.name for m in model.modules() if hasattr(m, "fmt")} == {"int4"}


def test_bad_expert_chunk_is_a_clear_error():
    with pytest.raises(ValueError, match="model.expert_chunk must be >= 0"):
        compose([*TINY, "model.expert_chunk=-1"])
