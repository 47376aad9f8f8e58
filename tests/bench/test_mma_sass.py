"""bench/mma_sass.py: the mma GEMV's main loop found in real sm_90 SASS (Triton's compiler and bundled tools, no GPU),
with the loads and mmas its config implies, run as a user runs it (a subprocess without TRITON_INTERPRET)."""

import os
import subprocess
import sys
from pathlib import Path

from tests.kernels.sm90_compile import needs_sm90_compiler

_ROOT = Path(__file__).parents[2]


@needs_sm90_compiler
def test_the_table_counts_each_configs_mmas_and_loads_per_trip():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(_ROOT / "bench" / "mma_sass.py"), "--configs", "mt1-nt1-u2",
                          "mt1-nt2-u1", "--k", "2048"], capture_output=True, text=True, env=env, timeout=600,
                         cwd=_ROOT)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {line.split()[0]: line for line in run.stdout.splitlines() if line.startswith("mt")}
    assert set(rows) == {"mt1-nt1-u2", "mt1-nt2-u1"}, run.stdout
    for name, (tiles, ntiles) in {"mt1-nt1-u2": (2, 1), "mt1-nt2-u1": (1, 2)}.items():
        regs, local, loop, per_tile = rows[name].split()[1:5]
        order = rows[name].rsplit("; ", 1)[1]
        # 8 mmas per K tile and n8 tile; per K tile 2 word and 2 scale loads, and 4 activation loads per n8 tile
        assert order.count("H") == 8 * tiles * ntiles, rows[name]
        assert order.count("L") == tiles * (4 + 4 * ntiles), rows[name]
        assert int(local) == 0 and int(regs) <= 128, rows[name]
        assert float(per_tile) == int(loop) / tiles, rows[name]


def test_a_malformed_config_is_named():
    run = subprocess.run([sys.executable, str(_ROOT / "bench" / "mma_sass.py"), "--configs", "mt1-u2"],
                         capture_output=True, text=True, timeout=600, cwd=_ROOT)  # fmt: skip
    assert run.returncode != 0 and "config 'mt1-u2': expected mt<row tiles>-nt<1|2>-u<1|2|4>" in run.stderr
