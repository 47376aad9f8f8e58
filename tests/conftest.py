"""Root conftest: loaded before any test module is imported.

Triton's interpreter must be on before `triton` is first imported anywhere (peft, torchao and transformers
import it too): triton.language's own @jit helpers (e.g. tl.cdiv) are built at import time, and the CPU
kernel tests need them interpreted. Without CUDA there is nothing else Triton could run on, so switching the
interpreter on for the whole CPU test session changes nothing else.
"""

import os

import pytest
import torch

# Before any test module imports transformers: moves the checkout root (its `kernels/`) behind the HF `kernels`
# package that transformers imports (see orbit_lightning/__init__.py).
import orbit_lightning  # noqa: F401

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def cpu_kernels():
    """Skip (with the reason) when the interpreter could not be enabled for this process."""
    from orbit_lightning import kernels

    if not kernels.kernels_available("cpu"):
        pytest.skip("orbit_lightning.kernels was imported before TRITON_INTERPRET=1 was set")

# Each xdist worker is a process, and torch takes one thread per core in each: on CI's 2 cores, 2 workers ran 4 busy
# threads, and a test that shared the cores that way ran far slower (the shortened default experiment, 2 threads of
# its own: 656 s beside the interpreter runs, ~250 s before). A worker, and what it starts (OMP_NUM_THREADS reaches
# subprocesses), takes its share of the cores instead.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    WORKER_THREADS = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    torch.set_num_threads(WORKER_THREADS)
    os.environ["OMP_NUM_THREADS"] = str(WORKER_THREADS)


# CI runs `-n auto --dist loadfile`: each file goes wholly to one worker, and xdist hands the files out by their
# number of tests, most first (ties in collection order). The suite's longest files hold 1-3 long tests each, so
# they came last: the default experiment (~250 s on the 2-core CI machine) was the 5th file from the end, the
# deterministic run and the engine = trainer interpreter runs (~5 min together) shortly before it, and the run
# ended with one worker on them while the other had nothing left. Hand them out first instead; the many short files
# then fill in around them and both workers finish together. Only the order changes (a path not collected, e.g.
# after a rename, is skipped); keep the list to the files of minutes.
HEAVY_FILES = (
    "tests/integration/test_deterministic_mode.py",
    "tests/integration/test_default_experiment.py",
    "tests/rollout/test_invariance.py",
)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class HeavyFirst(LoadFileScheduling):
        # (xdist's private queue: should a release rename it, the order falls back to xdist's own, nothing fails)
        def _assign_work_unit(self, node):
            queue = getattr(self, "workqueue", None)
            if hasattr(queue, "move_to_end"):
                for scope in reversed(HEAVY_FILES):  # the first assignment moves them to the queue's front, in order
                    if scope in queue:
                        queue.move_to_end(scope, last=False)
            super()._assign_work_unit(node)

    return HeavyFirst(config, log)
