"""The top-level package: importing it from a checkout keeps transformers' `kernels` import working."""

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Prints where `import kernels` would resolve before and after `import orbit_lightning`, then imports the
# transformers module that imports the HF `kernels` package by that name (transformers >= 5.25).
PROBE = """
import importlib.util, json
before = importlib.util.find_spec("kernels").origin
import orbit_lightning
after = importlib.util.find_spec("kernels").origin
import transformers.activations
print(json.dumps([before, after]))
"""


@pytest.mark.parametrize(
    ("cwd", "ours"), [(ROOT, ROOT / "kernels" / "__init__.py"), (ROOT / "bench", ROOT / "bench" / "kernels.py")]
)
def test_a_checkout_does_not_shadow_the_kernels_distribution(cwd, ours):
    try:
        importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("the HF `kernels` package is not installed (transformers < 5.25 does not require it)")
    # `python -c` puts the working directory first on sys.path, as `python -m pytest` and bench scripts do.
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    before, after = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(before) == ours  # the premise: the checkout's module comes first
    assert Path(after) not in {ROOT / "kernels" / "__init__.py", ROOT / "bench" / "kernels.py"}
