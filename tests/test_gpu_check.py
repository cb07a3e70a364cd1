"""`.ci/gpu-check.sh`'s verdict (`.ci/gpu_skips.py`) on crafted junit reports, and the CUDA tests' collection.

The GPU check itself needs a GPU; what decides whether a run passed does not, so it is tested here.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SKIPS = ROOT / ".ci" / "gpu_skips.py"
NCCL_SKIP = "NCCL p2p needs two GPUs (one per process)"


def report(tmp_path: Path, *cases: str) -> Path:
    path = tmp_path / "junit.xml"
    body = "".join(cases)
    path.write_text(f'<?xml version="1.0"?><testsuites><testsuite name="pytest">{body}</testsuite></testsuites>')
    return path


def case(name: str, inner: str = "") -> str:
    return f'<testcase classname="tests.test_cuda" name="{name}" time="0.1">{inner}</testcase>'


def skipped(reason: str) -> str:
    return f'<skipped type="pytest.skip" message="{reason}">skip</skipped>'


def verdict(path: Path, status: int = 0, gpus: int = 1) -> tuple[int, str]:
    done = subprocess.run(
        [sys.executable, str(SKIPS), str(path), str(status), str(gpus)], capture_output=True, text=True, timeout=60
    )
    return done.returncode, done.stdout


def test_a_run_where_every_test_ran_passes_and_prints_the_figures(tmp_path: Path) -> None:
    """Figures recorded as junit properties are printed, never gating."""
    figure = '<properties><property name="figure" value="save 20.1 GB/s (raw pinned 24.0, 0.84x)"/></properties>'
    code, out = verdict(report(tmp_path, case("test_a"), case("test_b", figure)))
    assert code == 0 and "passed, 2 test(s) ran" in out
    assert "figure (not gating): test_b: save 20.1 GB/s" in out


def test_nccl_skips_are_allowed_on_one_gpu_and_listed_as_not_tested(tmp_path: Path) -> None:
    path = report(tmp_path, case("test_a"), case("test_nccl_p2p_moves_blocks", skipped(NCCL_SKIP)))
    code, out = verdict(path, gpus=1)
    assert code == 0 and "test_nccl_p2p_moves_blocks (NCCL p2p needs two GPUs" in out
    assert "1 skip(s) allowed" in out


def test_an_nccl_skip_on_two_gpus_fails_the_run(tmp_path: Path) -> None:
    code, out = verdict(report(tmp_path, case("test_a"), case("test_nccl_x", skipped(NCCL_SKIP))), gpus=2)
    assert code == 1 and "unexpected skips" in out and "test_nccl_x" in out


def test_any_other_skip_fails_the_run_and_names_the_test(tmp_path: Path) -> None:
    """A CUDA test skipped on the GPU machine (a fixture missing, CUDA unseen) is a failure, not a pass."""
    code, out = verdict(report(tmp_path, case("test_a"), case("test_store_halves", skipped("needs a CUDA device"))))
    assert code == 1 and "FAILED, unexpected skips" in out and "test_store_halves (needs a CUDA device)" in out


def test_a_failed_test_fails_with_pytests_status(tmp_path: Path) -> None:
    code, out = verdict(report(tmp_path, case("test_a", '<failure message="boom">x</failure>')), status=1)
    assert code == 1 and "failed:" in out and "tests.test_cuda::test_a" in out


@pytest.mark.parametrize("status", [0, 124])
def test_a_missing_report_or_a_run_with_no_test_fails(tmp_path: Path, status: int) -> None:
    """124 is ``timeout``'s status: the run passed its time limit before pytest wrote a report."""
    code, out = verdict(tmp_path / "absent.xml", status=status)
    assert code == (status or 1) and "no test report" in out
    code, out = verdict(report(tmp_path), status=0)
    assert code == 1 and "no test ran" in out


def test_the_cuda_tests_are_collected_and_all_marked_cuda() -> None:
    """What ``gpu-check.sh`` runs (``-m cuda tests/test_cuda.py``) is every test of that module."""
    args = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests/test_cuda.py"]
    every = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=120)
    marked = subprocess.run([*args, "-m", "cuda"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert every.returncode == marked.returncode == 0, every.stdout + every.stderr
    ids = [line for line in marked.stdout.splitlines() if line.startswith("tests/test_cuda.py::")]
    assert len(ids) >= 20 and ids == [line for line in every.stdout.splitlines() if line.startswith("tests/")]


def test_the_script_checks_its_syntax_and_downloads_wheels_for_the_gpu_machines_python() -> None:
    """``bash -n`` parses it; ``--wheels`` asks pip for CPython 3.12 manylinux x86_64, not this machine's."""
    assert subprocess.run(["bash", "-n", str(ROOT / ".ci" / "gpu-check.sh")], timeout=30).returncode == 0
    text = (ROOT / ".ci" / "gpu-check.sh").read_text()
    for flag in ("--python-version", "--implementation cp", "--platform manylinux_2_28_x86_64", "--only-binary=:all:"):
        assert flag in text
