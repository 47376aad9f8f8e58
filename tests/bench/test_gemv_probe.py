"""bench/gemv_probe.py: the probes' PTX rewrites (the timings need a GPU)."""

import importlib.util
import subprocess
import sys
from pathlib import Path

_spec = importlib.util.spec_from_file_location("gemv_probe", Path(__file__).parents[2] / "bench" / "gemv_probe.py")
gemv_probe = importlib.util.module_from_spec(_spec)
sys.modules["gemv_probe"] = gemv_probe  # (its jit functions are looked up by module)
_spec.loader.exec_module(gemv_probe)


def test_w16_loads_each_rows_words_in_one_16_byte_load_and_keeps_the_scales():
    shipped = gemv_probe._real_load_w(0, True, 32)
    text = gemv_probe._one_load_a_row(0, True, 32)
    assert shipped.count(".v2.u32") == 4 and text.count(".v2.u32") == 0
    assert text.count("ld.global.nc.L1::no_allocate.v4.u32") == 2
    assert "{$0, $1, $2, $3}, [$12]" in text and "{$4, $5, $6, $7}, [$13]" in text
    scale_lines = [line for line in shipped.splitlines() if "$14" in line or "$15" in line or "prmt" in line]
    assert scale_lines and all(line in text.splitlines() for line in scale_lines)
    assert gemv_probe._one_load_a_row(128, False, 32) == gemv_probe._real_load_w(128, False, 32)  # words: as shipped


def test_every_probe_is_a_variant():
    assert set(gemv_probe._ADDRESS_PROBES) <= set(gemv_probe.VARIANTS)


def test_bad_arguments_are_named_before_any_gpu_work():
    script = str(Path(__file__).parents[2] / "bench" / "gemv_probe.py")
    for argv, said in ((["--m", "40", "ship"], "argument --m: invalid choice: 40"),
                       (["bogus"], "unknown variant 'bogus'; choose from ship")):  # fmt: skip
        run = subprocess.run([sys.executable, script, *argv], capture_output=True, text=True, timeout=300)
        assert run.returncode != 0 and said in run.stderr, run.stderr[-2000:]
