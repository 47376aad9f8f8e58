"""Resume after SIGKILL continues the run exactly: the adapter after N steps equals an uninterrupted run's."""

import os
import signal
import subprocess
import time

import torch

from tests.integration.cli_runs import SHIPPED, adapter, command, run


def test_sigkill_then_resume_matches_uninterrupted(tmp_path):
    steps = ["trainer.max_steps=6", "trainer.checkpoint_every=1"]
    straight = tmp_path / "straight"
    run(*SHIPPED, *steps, f"trainer.output_dir={straight}")

    killed = tmp_path / "killed"
    proc = subprocess.Popen(command(*SHIPPED, *steps, f"trainer.output_dir={killed}"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)

    def reached_step_2() -> bool:  # ModelCheckpoint writes step=N.ckpt after optimizer step N
        return any(int(p.stem.split("=")[1]) >= 2 for p in (killed / "checkpoints").glob("step=*.ckpt"))

    deadline = time.time() + 300
    while not reached_step_2() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    assert reached_step_2(), "the run never reached its second checkpoint"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (killed / "adapter").exists()  # it really died before finishing

    run(*SHIPPED, *steps, f"trainer.output_dir={killed}", "trainer.resume=auto")
    a, b = adapter(straight), adapter(killed)
    assert a.keys() == b.keys() and len(a) > 0
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert any(v.abs().sum() > 0 for k, v in a.items() if "lora_B" in k)  # training really moved the adapter
