"""bench/gemv_probe.py: the probes' PTX rewrites (the timings need a GPU)."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton.language as tl
from orbit_lightning.kernels import gemv, gemv_mma
from orbit_lightning.kernels.configs import GemvConfig
from orbit_lightning.kernels.formats import resolve

from tests.kernels.kernel_oracles import assert_within, matmul_bound, random_weight
from tests.kernels.sm90_compile import needs_sm90_compiler
from tests.kernels.test_gemv_mma import _cpu_tickets

_ROOT = Path(__file__).parents[2]

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
                       (["bogus"], "unknown variant 'bogus'; choose from ship"),
                       (["ship", "w16"], "w16 patches the row-major word-pair loads; add --layout row-major"),
                       (["--layout", "diagonal"], "argument --layout: invalid choice: 'diagonal'"),
                       (["--wide-tiles", "3", "ship"], "argument --wide-tiles: invalid choice: 3")):  # fmt: skip
        run = subprocess.run([sys.executable, script, *argv], capture_output=True, text=True, timeout=300)
        assert run.returncode != 0 and said in run.stderr, run.stderr[-2000:]


def _compile_script(script: str, *args: str, env: dict | None = None) -> str:
    """stdout of `script` (formatted with the bench dir) run with `args` in a process of its own, compiling for real
    (no interpreter), with `env` added."""
    full = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | (env or {})
    run = subprocess.run([sys.executable, "-c", script.format(bench=str(_ROOT / "bench")), *args], capture_output=True,
                         text=True, env=full, timeout=600, cwd=_ROOT)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


_LOADONLY_SASS = """
import sys
sys.path.insert(0, {bench!r})
import gemv_probe, mma_sass
from orbit_lightning.kernels import gemv_mma
shipped = gemv_mma.tile_asm
for config in ("mt1-nt1-u2", "mt1-nt2-u1-p-t", "mt1-nt2-u2-p-t"):
    mt, nt, u, pairs, interleave, tiled, _ = mma_sass.parse_config(config)
    counts = []
    for text in (shipped, lambda nt, pairs, *nibbles: gemv_probe.probe_text("", "loadonly", nt, pairs)):
        gemv_mma.tile_asm = text
        sass, _ = mma_sass.compile_sass(mt, nt, u, 2048, pairs=pairs, tiled=tiled)
        counts += [sass.count("HMMA"), sass.count("LDG")]
    per_step = u * shipped(nt, pairs, tiled).count("mma.sync")
    print(config, per_step, *counts)
"""


@needs_sm90_compiler
def test_loadonly_keeps_every_load_of_the_shipped_kernel_and_no_mma_at_one_and_sixteen_rows():
    # (16 rows at one K tile a step, as shipped, and at two: --wide-tiles 2)
    # Real sm_90 SASS (Triton's bundled ptxas, no GPU): if the fold left any loaded register unused, ptxas would drop
    # its load and loadonly would time fewer bytes than the kernel reads.
    out = _compile_script(_LOADONLY_SASS)
    rows = {line.split()[0]: line for line in out.splitlines()}
    assert set(rows) == {"mt1-nt1-u2", "mt1-nt2-u1-p-t", "mt1-nt2-u2-p-t"}, out
    for row in rows.values():
        per_step, ship_mma, ship_ldg, probe_mma, probe_ldg = map(int, row.split()[1:])
        # the tile's mmas gone from the main loop and its peeled last step (at 16 rows the output tile's store keeps
        # an mma of its own, in both)
        assert ship_mma - probe_mma == 2 * per_step > 0, row
        assert probe_ldg == ship_ldg > 0, row


@pytest.mark.usefixtures("cpu_kernels")
def test_xcopies_reads_program_p_s_activations_from_copy_p_mod_8():
    # Under the interpreter (the loads emulated per lane): 12 programs of 16 weight rows over copies that differ, so a
    # program on the wrong copy (all on copy 0, or p % 4) is off by whole products; on copies_of(x) the outputs are
    # ship's.
    n, k, m = 192, 256, 9  # 12 programs: copies 0-7, then 0-3 again
    cfg = GemvConfig(16, 16, 128, mma=True, num_warps=1, mma_word_pairs=True)
    packed, w = random_weight("int4", (n, k), seed=1)
    wk = resolve("int4", packed, stacked=False)
    buf = torch.randn(gemv_probe.X_COPIES, 16, k, generator=torch.Generator().manual_seed(2)).bfloat16()
    x = buf.view(-1, k)[:m]

    def run(x):
        return gemv.gemv(x, wk, torch.empty((x.shape[0], n), dtype=torch.bfloat16), cfg, _cpu_tickets, True)

    shipped = run(x)
    real = gemv_mma.activation_lanes
    try:
        gemv_mma.activation_lanes = gemv_probe._activations_of_a_copy
        probed, same = run(x), run(gemv_probe.copies_of(x))
    finally:
        gemv_mma.activation_lanes = real
    for p in range(n // 16):
        rows = slice(16 * p, 16 * p + 16)
        xp = buf[p % gemv_probe.X_COPIES, :m]
        ref = xp.double() @ w[rows].T
        assert_within(probed[:, rows], ref, matmul_bound(xp, w[rows], ref, 2.0**-7))
    assert torch.equal(same, shipped)


@pytest.mark.parametrize("fmt, k, cfg", [
    ("int4", 1024, dict(mma_word_pairs=True)),  # 8 one-tile steps a warp: programs 0-3 start step 1 at 1 + p
    ("int4-tiled", 2048, dict(mma_word_pairs=True, num_warps=2)),  # tiled scales found from each step's group
    ("int4", 2048, dict(mma_tiles=2, num_warps=2, mma_interleave_k=True)),  # warps on alternate steps
])  # fmt: skip
@pytest.mark.usefixtures("cpu_kernels")
def test_xstagger_takes_every_step_once(fmt, k, cfg):
    # Under the interpreter: 4 programs whose warps take their steps after the first in orders rotated by program; a
    # step skipped or taken twice, or a scale of another step, is off by whole products. (The order itself shows only
    # in the fp32 sums' last bits, which the bf16 outputs round away: the timing is the probe's point.)
    n = 64
    config = GemvConfig(16, 16, 128, mma=True, **{"num_warps": 1, **cfg})
    packed, w = random_weight(fmt, (n, k), seed=3)
    wk = resolve(fmt, packed, stacked=False)
    real = gemv_mma._STAGGER
    try:
        gemv_mma._STAGGER = tl.constexpr(True)
        for m in (1, 16):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
            y = gemv.gemv(x, wk, torch.empty((m, n), dtype=torch.bfloat16), config, _cpu_tickets, True)
            ref = x.double() @ w.T
            assert_within(y, ref, matmul_bound(x, w, ref, 2.0**-7))
    finally:
        gemv_mma._STAGGER = real


_ADDRESS_SASS = """
import sys
sys.path.insert(0, {bench!r})
import triton.language as tl
import gemv_probe, mma_sass
from orbit_lightning.kernels import gemv_mma
mt, nt, u, pairs, interleave, tiled, _ = mma_sass.parse_config("mt1-nt2-u1-p-t")
variant, cap = sys.argv[1], None
if variant == "xcopies":
    gemv_mma.activation_lanes = gemv_probe._activations_of_a_copy
elif variant == "xstagger":
    gemv_mma._STAGGER, cap = tl.constexpr(True), 80
sass, usage = mma_sass.compile_sass(mt, nt, u, 2048, pairs=pairs, tiled=tiled, maxnreg=cap)
print(variant, usage.split("REG:")[1].split()[0], usage.split("LOCAL:")[1].split()[0], sass.count("LDG"))
"""


@needs_sm90_compiler
def test_xcopies_and_xstagger_compile_for_sm90_with_the_shipped_loads_in_80_registers(tmp_path):
    # Real sm_90 SASS of the 16-row tiled loop (the interpreter cannot see what only the compiler rejects, such as a
    # jit function reading a plain Python global). Each in a process and Triton cache of its own: _STAGGER is read
    # when the kernel compiles.
    rows = {}
    for variant in ("ship", "xcopies", "xstagger"):
        out = _compile_script(_ADDRESS_SASS, variant, env={"TRITON_CACHE_DIR": str(tmp_path / variant)})
        name, regs, local, ldg = out.split()[-4:]
        rows[name] = int(regs), int(local), int(ldg)
    assert set(rows) == {"ship", "xcopies", "xstagger"}
    for name, (regs, local, ldg) in rows.items():  # no spill, and three 8-warp programs a SM as shipped
        assert regs <= 80 and local == 0 and ldg == rows["ship"][2] > 0, (name, rows)
