"""CI (.ci/run): lint first, then the full suite, and a run in which no test passed is a failure, never a pass."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / ".ci"))

from ran_tests import verdict  # noqa: E402 - .ci is not a package


def _pytest(tmp_path: Path, body: str | None) -> tuple[int, Path]:
    """Run a real pytest on a throwaway directory (with one test file holding `body`, or none); its exit status
    and JUnit report."""
    suite = tmp_path / "suite"
    suite.mkdir()
    if body is not None:
        (suite / "test_one.py").write_text(body)
    junit = tmp_path / "junit.xml"
    # Without the venv's third-party plugins (hypothesis, anyio: 1.5 s of imports a run); pytest's own exit statuses
    # and JUnit report are what CI reads.
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(suite),
                          f"--junitxml={junit}", "--rootdir", str(suite)], cwd=suite, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})
    return res.returncode, junit


@pytest.mark.slow  # a pytest of its own
def test_no_tests_is_exit_5_and_ci_refuses_it(tmp_path):
    rc, junit = _pytest(tmp_path, None)
    assert rc == 5
    ok, why = verdict(junit)
    assert not ok and "no test ran" in why


@pytest.mark.slow  # a pytest of its own
def test_a_run_where_everything_skipped_passes_pytest_but_not_ci(tmp_path):
    rc, junit = _pytest(tmp_path, "import pytest\n\n@pytest.mark.skip(reason='x')\ndef test_a():\n    pass\n")
    assert rc == 0
    ok, why = verdict(junit)
    assert not ok and "1 skipped" in why


@pytest.mark.slow
@pytest.mark.parametrize("body, passes", [("def test_a():\n    assert True\n", True),
                                          ("def test_a():\n    assert False\n", False)], ids=["pass", "fail"])
def test_ci_passes_exactly_the_runs_whose_tests_passed(tmp_path, body, passes):
    rc, junit = _pytest(tmp_path, body)
    assert (rc == 0) == passes
    assert verdict(junit)[0] == passes


def test_a_missing_report_is_a_failure(tmp_path):
    ok, why = verdict(tmp_path / "none.xml")
    assert not ok and "no JUnit report" in why


def test_ci_lints_before_it_tests_and_stops_at_the_first_failure():
    run = (ROOT / ".ci" / "run").read_text()
    lines = [ln.strip() for ln in run.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    assert "set -euo pipefail" in lines
    lint = lines.index("make lint")
    test = next(i for i, ln in enumerate(lines) if ln.startswith("make test "))
    check = next(i for i, ln in enumerate(lines) if "ran_tests.py" in ln)
    assert lint < test < check
    assert "ruff check" in (ROOT / "Makefile").read_text().split("\nlint:", 1)[1].split("\n\n", 1)[0]


def test_the_code_is_lint_clean():
    """What `make lint` checks, so the quick loop catches it too."""
    ruff = Path(sys.executable).parent / "ruff"
    res = subprocess.run([str(ruff), "check", "pipeline", "tests", "experiments", ".ci"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
