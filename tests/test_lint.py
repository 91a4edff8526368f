"""The project passes its own linter (ruff, configured in pyproject.toml; installed by the test extra)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_is_clean():
    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    result = subprocess.run([ruff, "check", "--quiet", str(ROOT)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_benchmark_starts():
    """Each benchmark imports what it names from memplan (no test runs them: they take minutes)."""
    for script in sorted((ROOT / "benchmarks").glob("*.py")):
        result = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True,
                                check=False, cwd=ROOT)
        assert result.returncode == 0, f"{script.name}: {result.stderr.strip().splitlines()[-1:]}"


@pytest.mark.parametrize("script, options, message", [
    ("hf_architectures.py", ["--models", "t5,nope"], "error: unknown model 'nope'; expected some of: t5, bart"),
    ("hf_architectures.py", ["--plan", "1.5"], "error: --plan takes a fraction of the unplanned peak in (0, 1], got 1.5"),
    ("hf_architectures.py", ["--grad-accum", "0"], "error: --grad-accum must be at least 1, got 0"),
    ("floor.py", ["--models", "gpt2,nope"], "error: unknown model 'nope'"),
    ("floor.py", ["--precision", "fp64"], "error: unknown precision 'fp64'"),
])
def test_a_benchmark_rejects_bad_options_in_one_line(script, options, message):
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *options],
                            capture_output=True, text=True, check=False, cwd=ROOT)
    assert result.returncode == 2  # argparse's usage error
    assert "Traceback" not in result.stderr
    assert message in result.stderr.strip().splitlines()[-1]
