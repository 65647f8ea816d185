"""Imports: a function-level import says why it is not at the top, and `python -m pipeline` starts without the heavy
packages (torch, transformers, tritonclient, ...), which load only in the verbs that use them."""

from __future__ import annotations

import ast
import io
import subprocess
import sys
import textwrap
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Loaded by the verbs that need them, never by building the command line (`python -m pipeline --help`).
HEAVY = ("torch", "transformers", "tritonclient", "grpc", "starlette", "uvicorn", "matplotlib", "gguf", "pytriton",
         "safetensors")


def _comments(source: str) -> tuple[set[int], set[int]]:
    """(lines holding a comment that says something, of them the lines holding nothing else). A bare `# noqa: ...` or
    `# type: ...` directive says nothing."""
    said, alone = set(), set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            text = tok.string.lstrip("#").strip()
            if text and not text.startswith(("noqa", "type:")):
                said.add(tok.start[0])
                if not tok.line[: tok.start[1]].strip():
                    alone.add(tok.start[0])
    return said, alone


def unexplained_imports(source: str) -> list[int]:
    """Lines of function-level imports with no comment on their own lines or on a comment line just above. A comment
    line above an import also covers the import statements that follow it directly (a grouped block; the blank lines
    between isort's groups allowed)."""
    said, alone = _comments(source)
    bare = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):
            stmts = getattr(node, field, None)
            if not isinstance(stmts, list):
                continue
            block = False  # inside a run of import statements that a comment line above one of them covers
            for st in stmts:
                if isinstance(st, ast.Import | ast.ImportFrom):
                    block = block or st.lineno - 1 in alone
                    own = any(ln in said for ln in range(st.lineno, st.end_lineno + 1))
                    if in_function and not (own or block):
                        bare.append(st.lineno)
                else:
                    block = False
                visit(st, in_function or isinstance(st, ast.FunctionDef | ast.AsyncFunctionDef))

    visit(ast.parse(source), False)
    return bare


def test_the_check_finds_a_bare_function_level_import_and_accepts_a_commented_one():
    src = textwrap.dedent('''
        import os


        def f():
            """doc"""
            import json
            return json, os


        class C:
            def g(self):
                if True:
                    from pathlib import Path  # noqa: F401
                    import torch  # lazy: torch (~1.5 s) only here
                    import numpy
                    # lazy: the stub's path is set only above
                    from a import b

                    from c import d
                    x = 1
                    import e
                try:
                    pass
                except ImportError:
                    import f
                return Path, torch, numpy, b, d, x, e, f
        ''')
    lines = src.splitlines()
    assert [lines[n - 1].strip() for n in unexplained_imports(src)] == [
        "import json", "from pathlib import Path  # noqa: F401", "import numpy", "import e", "import f"]


def test_every_function_level_import_in_pipeline_says_why_it_is_not_at_the_top():
    bare = [f"{path.relative_to(ROOT)}:{line}" for path in sorted((ROOT / "pipeline").rglob("*.py"))
            for line in unexplained_imports(path.read_text())]
    assert not bare, ("function-level imports with no comment saying why (move each to the top of its module, or, "
                      "where it avoids a heavy import at start, runs only inside tritonserver or breaks a cycle, "
                      "say so on its line or the line above, e.g. `# lazy: loads torch (~1.5 s)`): " + ", ".join(bare))


def test_building_the_command_line_loads_none_of_the_heavy_packages():
    code = ("import contextlib, io, sys\n"
            "from pipeline.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
            "    main(['--help'])\n"
            f"print(' '.join(sorted(m for m in {HEAVY!r} if m in sys.modules)))\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [], (f"`python -m pipeline --help` imports {r.stdout.strip()}: a module the CLI "
                                    "imports at start (pipeline.cli and the modules of _extra_verbs) takes it at its "
                                    "top; import it inside the function that needs it, with a `# lazy: ...` comment")


# The ground of the house: what every client and the spec stand on. A module here imports only the others listed
# with it (and pipeline.runtime's light spec config, pipeline.tree for the spec), never a stage built on top of them
# (the servers, the engine plans, load, deploy), so a client carries no server and a spec check no deployment code.
GROUND = {
    "pipeline/contract.py": (),
    "pipeline/door.py": (),
    "pipeline/client.py": ("pipeline.door",),
    "pipeline/openai_client.py": ("pipeline.client", "pipeline.door"),
    "pipeline/spec.py": ("pipeline.runtime.specconfig", "pipeline.tree"),
}


def pipeline_imports(source: str) -> set[str]:
    """Every `pipeline.*` module a source imports, at the top or inside a function (`from pipeline import x` as
    pipeline.x)."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "pipeline"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "pipeline":
            out |= ({f"pipeline.{a.name}" for a in node.names} if node.module == "pipeline" else {node.module})
    return out


def test_pipeline_imports_reads_top_and_function_level_imports_of_either_form():
    src = textwrap.dedent("""
        import json
        from pipeline import door
        from pipeline.client import RequestError
        def f():
            import pipeline.triton.server
            from pipeline.load import served_methods  # why
    """)
    assert pipeline_imports(src) == {"pipeline.door", "pipeline.client", "pipeline.triton.server", "pipeline.load"}


def test_the_ground_modules_import_no_stage_built_on_them():
    for path, allowed in GROUND.items():
        above = pipeline_imports((ROOT / path).read_text()) - set(allowed)
        assert not above, f"{path} imports {sorted(above)}: move what it needs down beside it (GROUND lists the ground)"
