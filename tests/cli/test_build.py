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
    assert experts and all(m.chunk == 3 for m in experts)
