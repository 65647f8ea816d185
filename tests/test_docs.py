"""The README is a short front door with a complete code map, and the pages in docs/ stay true to the code.

What drifts silently when code moves: a code map that names a module that is gone or misses a new one, a link to a
page or heading that was renamed, a served tensor that the serving page does not list.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pipeline.readme import BEGIN, END

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MAX_LINES = 260  # issue 31: "at most about 250 lines"
SECTIONS = ("## The two commands", "## Prerequisites", "## Measured results", "## Code map", "## Read more")
# Pages other branches write (issue 29's LLM API era, issue 28's llama-server peer). Lead: empty this after merging.
COMING: set[str] = set()
MERGE_MARK = "<!-- merge:"  # code-map rows the lead checks after merging; their paths are not checked until then


def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    nxt = text.find("\n## ", start + len(heading))
    return text[start:] if nxt < 0 else text[start:nxt]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation other than `-` and `_` dropped, spaces to `-`."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_readme_is_a_front_door_of_at_most_260_lines_with_its_sections():
    text = README.read_text()
    assert len(text.splitlines()) <= MAX_LINES, "README.md grew: move the depth to a page in docs/"
    positions = [text.index(s) for s in SECTIONS]
    assert positions == sorted(positions), f"sections out of order: {SECTIONS}"
    assert "make all" in _section(text, "## The two commands") and "make test" in _section(text, "## The two commands")
    results = _section(text, "## Measured results")
    assert results.count(BEGIN) == 1 and results.count(END) == 1, "the rendered figures belong under Measured results"


def _code_map_rows() -> list[str]:
    return [ln for ln in _section(README.read_text(), "## Code map").splitlines() if ln.startswith("| `")]


def test_every_path_the_code_map_names_exists():
    checked = 0
    for row in _code_map_rows():
        if MERGE_MARK in row:
            continue
        for token in re.findall(r"`([^`\s]+)`", row.split("|")[1]):
            assert list(ROOT.glob(token)), f"code map names {token}, which does not exist: {row}"
            checked += 1
    assert checked >= 15  # the rows were found at all


def test_the_code_map_has_a_row_for_every_module_and_package_of_pipeline():
    named = set()
    for row in _code_map_rows():
        for token in re.findall(r"`pipeline/([^`/\s]+)/?`", row.split("|")[1]):
            named.add(token)
    rooms = {p.name for p in (ROOT / "pipeline").iterdir()
             if (p.suffix == ".py" and not p.name.startswith("__")) or (p.is_dir() and (p / "__init__.py").exists())}
    missing = sorted(rooms - named)
    assert not missing, f"pipeline rooms without a code-map row in README.md: {missing}"


def _links(page: Path) -> list[tuple[str, str]]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return re.findall(r"\]\(([^)\s#]*)(?:#([^)\s]*))?\)", text)


@pytest.mark.parametrize("page", [README, *sorted((ROOT / "docs").glob("*.md"))], ids=lambda p: p.name)
def test_every_relative_link_and_heading_anchor_resolves(page):
    for target, anchor in _links(page):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path = (page.parent / target).resolve() if target else page
        rel = path.relative_to(ROOT).as_posix()
        if rel in COMING and not path.exists():
            continue
        assert path.exists(), f"{page.name} links to {target}, which does not exist"
        if anchor and path.suffix == ".md":
            slugs = {_slug(h) for h in re.findall(r"^#+ (.+)$", path.read_text(), flags=re.M)}
            assert anchor in slugs, f"{page.name} links to {target}#{anchor}; {rel} has no such heading"


TRITON_TYPE = {"TYPE_STRING": "BYTES", "TYPE_INT32": "INT32", "TYPE_UINT64": "UINT64", "TYPE_FP32": "FP32",
               "TYPE_FP16": "FP16", "TYPE_BOOL": "BOOL"}


def _table(text: str, begin: str, end: str) -> dict[str, str]:
    """name -> the type cell, for every backticked name in the first column of the table between the markers."""
    block = text[text.index(begin):text.index(end)]
    out = {}
    for row in block.splitlines():
        cells = row.split("|")
        if not row.startswith("| `"):
            continue
        names, types = re.findall(r"`([^`]+)`", cells[1]), [t.strip().split(" [")[0] for t in cells[2].split(",")]
        for i, name in enumerate(names):
            out[name] = types[i] if len(types) == len(names) else types[0]
    return out


def test_the_serving_page_lists_exactly_the_tensors_the_torch_repository_declares_with_their_types():
    from pipeline.triton import repo

    text = (ROOT / "docs" / "serving.md").read_text()
    inputs = _table(text, "<!-- what-runs-where:inputs -->", "<!-- what-runs-where:outputs -->")
    outputs = _table(text, "<!-- what-runs-where:outputs -->", "<!-- what-runs-where:end -->")
    for listed, declared in ((inputs, repo.INPUTS), (outputs, repo.OUTPUTS)):
        want = {n: TRITON_TYPE[t] for n, t, _ in declared}
        extra, missing = sorted(set(listed) - set(want)), sorted(set(want) - set(listed))
        assert not extra and not missing, f"docs/serving.md lists {extra}, undeclared; misses {missing}"
        for name, typ in listed.items():
            assert typ in ("various", want[name]), f"docs/serving.md: {name} is {want[name]}, not {typ}"
