"""`orbit-rl mode=eval adapter_path=...`: greedy accuracy and pass@k of a saved PEFT adapter."""

import json

from orbit_lightning.cli import compose
from orbit_lightning.train import run_eval, run_train
from tests.integration.cli_runs import SHIPPED, run


def test_eval_mode_scores_a_trained_adapter(tmp_path):
    cfg, _ = compose([*SHIPPED, "trainer.max_steps=2", f"trainer.output_dir={tmp_path}"])
    run_train(cfg)
    out = run(*SHIPPED, "mode=eval", f"adapter_path={tmp_path / 'adapter'}", "trainer.eval_max_items=8")
    metrics = json.loads(out.stdout[out.stdout.index("{"):])
    assert 0.0 <= metrics["eval/accuracy"] <= 1.0 and "eval/pass@2" in metrics
    # The same adapter evaluated in-process gives the same numbers (seeded sampling).
    cfg_eval, _ = compose([*SHIPPED, "mode=eval", f"adapter_path={tmp_path / 'adapter'}", "trainer.eval_max_items=8"])
    assert run_eval(cfg_eval) == metrics
