"""Write build/edit_set.json: the edit cases validate's `edit` section sends (issue 49 item 5).

Each case is a piece of Python's own standard library (PSF-2.0, shipped with the installed Python: the module and the
top-level definitions taken are recorded in the case), an instruction of the kind an editor sends (rename, type
hints, docstrings, a small refactor, a bug fix) and, for the bug fix, the bug put in here on purpose (the case says
which). The originals are stored in the JSON, so the set does not change with the Python that runs validate.

    .venv/bin/python experiments/make_edit_set.py [--tokenizer engines/qwen_coder/target] [--out build/edit_set.json]
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import json
import platform
import textwrap
from pathlib import Path

# The trimmed main job runs the first validate.max_edit_cases: a bug fix, docstrings, a rename, a refactor.
# (id, kind, module, top-level names taken in source order (empty: the whole module), instruction, (old, new) bug)
CASES = [
    ("calendar_fix", "bug fix", "calendar", ["isleap", "leapdays", "weekday", "monthrange"],
     "`isleap` gives the wrong answer for years divisible by 400. Find the bug and fix it. Change nothing else.",
     ("return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)",
      "return year % 4 == 0 and (year % 100 != 0 and year % 400 == 0)")),
    ("fnmatch_docstrings", "docstrings", "fnmatch", ["fnmatch", "_compile_pattern", "filter", "fnmatchcase"],
     "Add a one-line docstring to every function in this file that has none, and shorten each existing docstring "
     "to its first sentence. Change nothing else.", None),
    ("textwrap_dedent_rename", "rename", "textwrap", ["dedent", "indent"],
     "Rename the local variable `margin` to `common_margin` in `dedent`. Change nothing else.", None),
    ("shlex_split_refactor", "refactor", "shlex", ["split", "join", "quote", "_print_tokens", "shlex.push_source",
                                                   "shlex.pop_source"],
     "In `quote`, replace the early returns with a single return at the end of the function. Change nothing else.",
     None),
    ("colorsys_rename", "rename", "colorsys", ["rgb_to_yiq", "yiq_to_rgb", "rgb_to_hls", "hls_to_rgb", "_v"],
     "Rename the function `rgb_to_hls` to `rgb_to_hue_lightness_saturation` and `_v` to `_hue_value` everywhere in "
     "this file. Change nothing else.", None),
    ("bisect_hints", "type hints", "bisect", [],
     "Add type hints to every function signature in this file (use `list` for `a`, `int` for the indices, and "
     "`Callable | None` for `key`). Change nothing else.", None),
    ("heapq_merge_hints", "type hints", "heapq", ["merge"],
     "Add type hints to the signature of `merge` (iterables of any type, an optional key callable, a bool "
     "`reverse`) and to its return (an iterator). Change nothing else.", None),
    ("statistics_median_fix", "bug fix", "statistics", ["median", "median_low", "median_high"],
     "`median` returns the wrong value for lists of even length. Find the bug and fix it. Change nothing else.",
     ("return (data[i - 1] + data[i]) / 2", "return (data[i - 1] + data[i + 1]) / 2")),
    ("difflib_close_matches_docstring", "docstrings", "difflib", ["get_close_matches"],
     "Rewrite the docstring of `get_close_matches` in Google style with Args, Returns and Raises sections. Keep the "
     "examples. Change nothing else.", None),
    ("glob_refactor", "refactor", "glob", ["glob", "iglob", "_iglob"],
     "In `glob`, build the result with a list comprehension instead of calling `list` on the iterator, if that is "
     "equivalent; otherwise leave it. Then rename the parameter `dironly` to `directories_only` in `_iglob` and "
     "its calls. Change nothing else.", None),
    ("string_capwords_hints", "type hints", "string", ["capwords", "Template"],
     "Add type hints to `capwords` and to every method of `Template`. Change nothing else.", None),
    ("keyword_json_decoder_rename", "rename", "json.decoder", ["JSONDecodeError", "py_scanstring"],
     "Rename `py_scanstring` to `scan_json_string` and the parameter `strict` to `strict_control_chars`. Change "
     "nothing else.", None),
    ("random_docstrings", "docstrings", "random", ["Random.shuffle", "Random.sample"],
     "Add a short Examples section to the docstrings of `shuffle` and `sample`. Change nothing else.", None),
]


def _source(module: str, names: list[str]) -> str:
    """The module's text, or its named top-level definitions (or methods, `Class.method`) in the order given."""
    mod = importlib.import_module(module)
    if not names:
        return inspect.getsource(mod)
    parts = []
    for n in names:
        obj = mod
        for part in n.split("."):
            obj = getattr(obj, part)
        parts.append(textwrap.dedent(inspect.getsource(obj)).rstrip())
    return "\n\n\n".join(parts) + "\n"


def build(tokenizer: str | None) -> list[dict]:
    tok = None
    if tokenizer:
        from transformers import AutoTokenizer  # only when counting tokens

        tok = AutoTokenizer.from_pretrained(tokenizer)
    out = []
    for cid, kind, module, names, instruction, bug in CASES:
        text = _source(module, names)
        ast.parse(text)
        case = {"id": cid, "kind": kind, "instruction": instruction,
                "source": f"Python {platform.python_version()} standard library, module {module}"
                          + (f" ({', '.join(names)})" if names else " (whole file)"),
                "license": "PSF-2.0 (Python Software Foundation License)"}
        if bug:
            assert text.count(bug[0]) == 1, (cid, bug[0])
            text = text.replace(bug[0], bug[1])
            case["bug_introduced"] = f"{bug[0]!r} -> {bug[1]!r}"
        case["original"] = text
        if tok is not None:
            case["tokens"] = len(tok(text, add_special_tokens=False)["input_ids"])
        out.append(case)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", default="engines/qwen_coder/target", help="counts each file's tokens ('' skips)")
    ap.add_argument("--out", default="build/edit_set.json")
    a = ap.parse_args(argv)
    cases = build(a.tokenizer or None)
    Path(a.out).write_text(json.dumps({"about": __doc__.split("\n\n")[1].replace("\n", " "), "cases": cases},
                                      indent=1) + "\n")
    for c in cases:
        print(f"{c['id']}: {c.get('tokens', '?')} tokens ({c['kind']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
