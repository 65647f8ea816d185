"""Fail CI unless pytest's JUnit report shows tests that ran and passed: no report, no tests, all skipped, or any
failure or error is a non-zero exit. pytest's own status 5 (no tests collected) already fails `make test`; this
also catches a run where every test was skipped, which pytest reports as success."""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def verdict(path: Path) -> tuple[bool, str]:
    if not path.is_file():
        return False, f"{path}: no JUnit report (pytest did not run, or ran without --junitxml)"
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    count = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "skipped", "failures", "errors")}
    passed = count["tests"] - count["skipped"] - count["failures"] - count["errors"]
    summary = (f"{count['tests']} tests: {passed} passed, {count['skipped']} skipped, {count['failures']} failed, "
               f"{count['errors']} errors")
    if count["failures"] or count["errors"]:
        return False, summary
    if passed < 1:
        return False, f"{summary}: no test ran, which CI does not count as a pass"
    return True, summary


def main(argv: list[str]) -> int:
    ok, summary = verdict(Path(argv[1]) if len(argv) > 1 else Path("reports/ci-junit.xml"))
    print(f"ci: {summary}", file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
