"""`orbit-rl mode=plan_memory`: per-GPU memory from the model built on the meta device (nothing is allocated)."""

import pytest

from orbit_lightning.cli import compose
from orbit_lightning.planning import plan_memory

GIB = 2**30
# Qwen3-30B-A3B: hidden 2048, 128 experts of intermediate 768, 32 query heads of 128 (q_proj 4096 x 2048), bf16.
EXPERT = 768 * 2048 * 2
Q_PROJ = 4096 * 2048 * 2


def _row(plan: str, name: str) -> float:
    line = next(ln for ln in plan.splitlines() if ln.strip().startswith(name))
    return float(line.split()[-2])


@pytest.mark.parametrize("overrides, transient", [
    ([], 128 * EXPERT),  # 1 GiB holds all 128 experts of one projection: one chunk
    (["model.expert_chunk_mib=64"], (64 * 2**20 // EXPERT) * EXPERT),  # 21 experts per chunk
    (["model.expert_chunk=4"], Q_PROJ),  # 4 experts (12 MiB) are smaller than q_proj's dequantized weight
])  # fmt: skip
def test_the_plan_counts_the_largest_dequantized_transient(overrides, transient):
    cfg, _ = compose(["mode=plan_memory", "model=qwen3_30b_a3b", *overrides])
    plan = plan_memory(cfg)
    assert _row(plan, "dequantized transient") == pytest.approx(transient / GIB, abs=1e-3)
    rows = [ln for ln in plan.splitlines()[1:] if not ln.strip().startswith("total")]
    total = sum(float(ln.split()[-2]) for ln in rows)
    assert _row(plan, "total") == pytest.approx(total, abs=5e-3)
