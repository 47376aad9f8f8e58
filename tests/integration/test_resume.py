"""Resume after SIGKILL, SIGTERM or Ctrl-C continues the run exactly: the adapter after N steps equals an
uninterrupted run's, and metrics.csv holds the same rows."""

import csv
import os
import signal
import subprocess
import time

import pytest
import torch

from orbit_lightning.csv_log import row_rl_step
from tests.integration.cli_runs import SHIPPED, adapter, command, run


def metric_rows(run_dir) -> list[tuple[float, str]]:
    """(RL step, loss or eval accuracy) of each metrics.csv row, in file order."""
    with (run_dir / "metrics.csv").open(newline="") as f:
        return [(row_rl_step(r), r.get("loss/policy") or r.get("eval/accuracy")) for r in csv.DictReader(f)]


STEPS = ["trainer.max_steps=6", "trainer.checkpoint_every=1"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """An uninterrupted run of STEPS."""
    out = tmp_path_factory.mktemp("straight")
    run(*SHIPPED, *STEPS, f"trainer.output_dir={out}")
    return out


def assert_same_run(straight, resumed):
    a, b = adapter(straight), adapter(resumed)
    assert a.keys() == b.keys() and len(a) > 0
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert any(v.abs().sum() > 0 for k, v in a.items() if "lora_B" in k)  # training really moved the adapter
    # Lightning's CSV writer deleted metrics.csv on resume; ours keeps the checkpointed steps' rows, drops the
    # later ones the killed run wrote, and the resumed run logs those again: the same rows, each once.
    rows = metric_rows(straight)
    assert len(rows) > 6
    assert metric_rows(resumed) == rows
    samples = (straight / "eval_samples.jsonl").read_text().splitlines()  # the same goes for the sample table
    assert len(samples) > 0 and (resumed / "eval_samples.jsonl").read_text().splitlines() == samples


def test_sigkill_then_resume_matches_uninterrupted(tmp_path, straight):
    killed = tmp_path / "killed"
    proc = subprocess.Popen(command(*SHIPPED, *STEPS, f"trainer.output_dir={killed}"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)

    def reached_step_2() -> bool:  # RLStepCheckpoint writes rl_step=N.ckpt after RL step N
        return any(int(p.stem.split("=")[1]) >= 2 for p in (killed / "checkpoints").glob("rl_step=*.ckpt"))

    def logged_step_2() -> bool:  # and a few ms later its row (csv_log's docstring: a kill between loses the row)
        try:
            return reached_step_2() and any(step >= 2 for step, _ in metric_rows(killed))
        except (OSError, TypeError, ValueError):  # the file is being written
            return False

    deadline = time.time() + 300
    while not logged_step_2() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    assert logged_step_2(), "the run never reached its second checkpoint"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (killed / "adapter").exists()  # it really died before finishing

    run(*SHIPPED, *STEPS, f"trainer.output_dir={killed}", "trainer.resume=auto")
    assert_same_run(straight, killed)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_checkpoints_the_step_under_way(tmp_path, straight, signum):
    """SIGTERM (preemption) or Ctrl-C: the step under way finishes, last.ckpt holds it (no periodic checkpoint is due
    in these 6 steps), the exit status says which signal, and resume=auto continues from it exactly."""
    out = tmp_path / "signalled"
    args = [*SHIPPED, *STEPS, "trainer.checkpoint_every=100", f"trainer.output_dir={out}"]
    proc = subprocess.Popen(command(*args), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def trained_a_step() -> bool:
        try:
            return any(step >= 1 for step, loss in metric_rows(out) if loss)
        except (OSError, TypeError, ValueError):  # not written yet, or being written
            return False

    deadline = time.time() + 300
    while not trained_a_step() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    proc.send_signal(signum)
    stderr = proc.communicate(timeout=300)[1]
    assert proc.returncode == 128 + signum, stderr[-3000:]
    assert f"stopped by {signum.name} after RL step" in stderr and "resume with trainer.resume=auto" in stderr
    assert (out / "checkpoints" / "last.ckpt").is_file() and not (out / "checkpoints" / "crash.ckpt").exists()
    assert not (out / "adapter").exists()

    resumed = run(*args, "trainer.resume=auto")
    assert "resuming from" in resumed.stderr and "last.ckpt" in resumed.stderr
    assert_same_run(straight, out)
