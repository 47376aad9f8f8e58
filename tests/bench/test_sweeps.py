"""The sweep scripts' shared command line (bench/kernels.run_sweep): a section name it does not know is refused before
anything is timed, with the names it does know, in a real subprocess (no GPU needed to reach that check)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


@pytest.mark.parametrize("script", ["gemv_sweep.py", "mma_sweep.py", "dequant_sweep.py"])
def test_an_unknown_section_is_refused_by_name(script):
    run = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--sections", "nope"], capture_output=True,
                         text=True, timeout=300, cwd=ROOT)  # fmt: skip
    assert run.returncode == 2
    assert "unknown section(s) nope; choose from" in run.stderr, run.stderr
