import os
import time

import pytest

from orbit_lightning.rewards import extract_code, get_reward, run_python

ECHO_SUM = "a, b = map(int, input().split())\nprint(a + b)\n"


def test_correct_program():
    result = run_python(ECHO_SUM, stdin="2 40\n", timeout_s=5)
    assert (result.stdout, result.returncode, result.timed_out) == ("42\n", 0, False)


def test_failing_program_reports_stderr():
    result = run_python("raise SystemExit('bad input')\n", timeout_s=5)
    assert result.returncode == 1 and "bad input" in result.stderr and not result.timed_out


def test_infinite_loop_times_out_quickly():
    start = time.monotonic()
    result = run_python("while True:\n    pass\n", timeout_s=0.5)
    assert result.timed_out and result.returncode == -9
    assert time.monotonic() - start < 2.0


def test_memory_limit():
    result = run_python("x = bytearray(2 << 30)\nprint('allocated')\n", memory_mb=256, timeout_s=5)
    assert result.returncode != 0 and "MemoryError" in result.stderr and "allocated" not in result.stdout


def test_clean_environment_and_temp_cwd(monkeypatch):
    monkeypatch.setenv("ORBIT_TEST_SECRET_TOKEN", "hunter2")
    code = "import os\nprint(sorted(os.environ))\nprint(os.getcwd())\nprint(sorted(os.listdir()))\n"
    lines = run_python(code, timeout_s=5).stdout.splitlines()
    assert "ORBIT_TEST_SECRET_TOKEN" not in lines[0]
    assert lines[1] != os.getcwd() and "orbit_sandbox_" in lines[1]
    assert lines[2] == "['main.py']"


def test_output_is_capped():
    result = run_python("while True:\n    print('x' * 1000)\n", timeout_s=5, max_output_bytes=10_000)
    assert not result.timed_out and result.returncode != 0 and len(result.stdout) <= 10_000


def test_spawned_children_are_killed():
    code = (
        "import subprocess, sys\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print(p.pid)\n"
    )
    result = run_python(code, timeout_s=5)
    child = int(result.stdout)
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{child}/stat") as f:
                if f.read().split(") ")[1].startswith("Z"):  # killed, waiting for init to reap it
                    break
        except FileNotFoundError:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"grandchild {child} still running after the sandbox returned")


def test_code_tests_reward():
    tests = [("1 2\n", "3\n"), ("10 -4\n", "6"), ("0 0\n", "0\n")]
    code_tests = get_reward("code_tests")
    assert code_tests("p", f"Here:\n```python\n{ECHO_SUM}```\n", {"tests": tests}) == 1.0
    wrong = "a, b = map(int, input().split())\nprint(a - b if a > 5 else a + b)\n"
    assert code_tests("p", f"```\n{wrong}```", {"tests": tests}) == pytest.approx(2 / 3)
    looping = "```py\nwhile True:\n    pass\n```"
    assert code_tests("p", looping, {"tests": tests[:1], "timeout_s": 0.3}) == 0.0
    with pytest.raises(ValueError, match="tests"):
        code_tests("p", ECHO_SUM, {})


def test_extract_code_takes_last_block():
    text = "```python\nprint(1)\n```\ntext\n```python\nprint(2)\n```"
    assert extract_code(text) == "print(2)\n"
    assert extract_code("print(3)") == "print(3)"
