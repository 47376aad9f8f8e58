"""Run model-written Python in a separate, resource-limited process, and the ``code_tests`` reward.

This guards the trainer against runaway programs (infinite loops, memory blow-ups, huge output, stray
children): it is not a jail for hostile code, which needs a container or a VM.
"""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from orbit_lightning.rewards.base import RewardFn, register_reward

# The limits are set inside the child by this bootstrap, which then execs the program. Not via
# ``preexec_fn``: CPython documents it as unsafe when the parent has threads (the child can deadlock
# between fork and exec), and rewards run in RewardRunner's threads. Limits survive exec.
_BOOTSTRAP = """\
import os, resource, sys
mem, cpu, fsize = (int(a) for a in sys.argv[1:4])
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
os.execv(sys.executable, [sys.executable, "-I", "main.py"])
"""
# The interpreter itself needs some address space before it can run a line of the program.
_MIN_MEMORY_MB = 64
_FENCED = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


@dataclass(frozen=True)
class SandboxResult:
    stdout: str
    stderr: str
    returncode: int  # negative: killed by that signal (-9 after a timeout)
    timed_out: bool


def run_python(
    code: str, stdin: str = "", timeout_s: float = 5.0, memory_mb: int = 512, max_output_bytes: int = 1 << 20
) -> SandboxResult:
    """Run ``code`` as ``main.py`` under ``python3 -I`` in a fresh temp dir, with ``stdin`` as its input.

    Limits: wall time ``timeout_s`` (then the whole process group is killed), CPU time, address space
    ``memory_mb``, and ``max_output_bytes`` per output stream and per written file. The child gets a clean
    environment (no inherited tokens or keys) and its own session, so its children die with it.
    """
    if not (timeout_s > 0 and math.isfinite(timeout_s)):
        raise ValueError(f"timeout_s must be a positive finite number of seconds, got {timeout_s!r}")
    if memory_mb < _MIN_MEMORY_MB:
        raise ValueError(f"memory_mb={memory_mb} is too small to start Python; use >= {_MIN_MEMORY_MB}")
    with tempfile.TemporaryDirectory(prefix="orbit_sandbox_") as root:
        work, io = os.path.join(root, "work"), os.path.join(root, "io")
        os.mkdir(work)
        os.mkdir(io)
        with open(os.path.join(work, "main.py"), "w", encoding="utf-8") as f:
            f.write(code)
        with open(os.path.join(io, "stdin"), "w", encoding="utf-8") as f:
            f.write(stdin)
        # Output goes to files, not pipes: RLIMIT_FSIZE then caps it, and nothing can fill the
        # parent's memory or block on a full pipe.
        with (
            open(os.path.join(io, "stdin"), "rb") as fin,
            open(os.path.join(io, "stdout"), "w+b") as fout,
            open(os.path.join(io, "stderr"), "w+b") as ferr,
        ):
            limits = [memory_mb << 20, math.ceil(timeout_s) + 1, max_output_bytes]
            proc = subprocess.Popen(
                [sys.executable, "-I", "-c", _BOOTSTRAP, *map(str, limits)],
                stdin=fin,
                stdout=fout,
                stderr=ferr,
                cwd=work,
                env={"PATH": os.defpath, "HOME": work, "TMPDIR": work, "LANG": "C.UTF-8"},
                start_new_session=True,
            )
            timed_out = False
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_group(proc.pid)
                returncode = proc.wait()
            fout.seek(0)
            ferr.seek(0)
            out, err = fout.read(max_output_bytes), ferr.read(max_output_bytes)
    return SandboxResult(
        stdout=out.decode("utf-8", errors="replace"),
        stderr=err.decode("utf-8", errors="replace"),
        returncode=returncode,
        timed_out=timed_out,
    )


def _kill_group(pgid: int) -> None:
    """SIGKILL the child's whole session group, including anything it spawned and left running."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def extract_code(completion: str) -> str:
    """The last fenced code block (```python, ```py or bare ```), else the whole completion."""
    blocks = _FENCED.findall(completion)
    return blocks[-1] if blocks else completion


def _same_output(actual: str, expected: str) -> bool:
    """Equal up to trailing whitespace on each line and trailing blank lines."""
    norm = lambda s: "\n".join(line.rstrip() for line in s.strip("\n").splitlines()).rstrip()
    return norm(actual) == norm(expected)


def code_tests_reward(timeout_s: float = 5.0, memory_mb: int = 512) -> RewardFn:
    """Factory: fraction of ``metadata["tests"]`` (``[(stdin, expected_stdout), ...]``) the code passes.

    ``metadata["timeout_s"]`` / ``metadata["memory_mb"]`` override the per-test limits. A test passes when
    the program exits 0 in time and prints the expected output.
    """

    def code_tests(prompt: str, completion: str, metadata: dict[str, Any]) -> float:
        tests = metadata.get("tests")
        if not isinstance(tests, Sequence) or isinstance(tests, str) or not tests:
            raise ValueError(
                "code_tests needs metadata['tests'] = a non-empty list of (stdin, expected_stdout) pairs; "
                f"got {tests!r:.80}"
            )
        code = extract_code(completion)
        passed = 0
        for k, test in enumerate(tests):
            if not (isinstance(test, Sequence) and len(test) == 2 and all(isinstance(t, str) for t in test)):
                raise ValueError(f"metadata['tests'][{k}] must be a (stdin, expected_stdout) pair of strings")
            result = run_python(
                code,
                stdin=test[0],
                timeout_s=metadata.get("timeout_s", timeout_s),
                memory_mb=metadata.get("memory_mb", memory_mb),
            )
            passed += result.returncode == 0 and not result.timed_out and _same_output(result.stdout, test[1])
        return passed / len(tests)

    return code_tests


register_reward("code_tests")(code_tests_reward())
