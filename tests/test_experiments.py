"""Every experiment kept under experiments/ still runs against today's code: it imports, every name it takes from
`pipeline` (at the top or inside a function) exists, its command line parses (`--help`, or the call its
`__main__` block makes binds to `main`), and the C ones compile with the flags their comment gives. An experiment
that no longer does is deleted (git history keeps it), not left to rot."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted((ROOT / "experiments").glob("*.py"))
C_FILES = sorted((ROOT / "experiments").glob("*.c"))


def _load(path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(f"experiments_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pipeline_names(tree: ast.AST) -> list[str]:
    """What a script uses from `pipeline` that does not exist today: imported names, and attributes of imported
    pipeline modules (`kernels.argmax_prob`)."""
    missing, modules = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "pipeline":
            mod = importlib.import_module(node.module)
            for alias in node.names:
                try:
                    obj = getattr(mod, alias.name) if hasattr(mod, alias.name) else importlib.import_module(
                        f"{node.module}.{alias.name}")
                except ImportError:
                    missing.append(f"{node.module}.{alias.name} (line {node.lineno})")
                    continue
                if isinstance(obj, types.ModuleType):
                    modules[alias.asname or alias.name] = obj
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "pipeline":
                    importlib.import_module(alias.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
            if not hasattr(modules[node.value.id], node.attr):
                missing.append(f"{node.value.id}.{node.attr} (line {node.lineno})")
    return missing


def _main_calls(tree: ast.Module) -> list[ast.Call]:
    """The calls to main() in the script's `if __name__ == "__main__":` block."""
    calls = []
    for node in tree.body:
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
            calls += [c for c in ast.walk(node) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)
                      and c.func.id == "main"]
    return calls


@pytest.mark.parametrize("path", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_each_experiment_imports_and_uses_only_names_that_exist(path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    module = _load(path)
    tree = ast.parse(path.read_text())
    assert _pipeline_names(tree) == [], f"{path.name} uses what pipeline no longer has"
    assert hasattr(module, "main"), f"{path.name}: an experiment runs through main() under a __main__ guard"
    calls = _main_calls(tree)
    assert calls, f"{path.name}: no main() call under `if __name__ == '__main__':`"
    if "argparse" in path.read_text():
        monkeypatch.setattr(sys, "argv", [str(path), "--help"])
        with pytest.raises(SystemExit) as e:
            module.main()
        assert e.value.code == 0
    else:  # positional sys.argv scripts: the call the __main__ block makes fits main's signature
        sig = inspect.signature(module.main)
        for call in calls:
            sig.bind(*[None] * len(call.args), **{k.arg: None for k in call.keywords if k.arg})


@pytest.mark.parametrize("path", C_FILES, ids=[p.name for p in C_FILES])
def test_each_c_experiment_compiles_with_the_command_its_comment_gives(path):
    if shutil.which("gcc") is None:
        pytest.skip("no gcc (the kernels need it too)")
    line = next((ln for ln in path.read_text().splitlines() if re.match(r"//\s+gcc ", ln)), None)
    assert line, f"{path.name}: its header comment gives no gcc command line"
    flags = [f for f in line.split() if f.startswith(("-m", "-O", "-D", "-std"))]
    res = subprocess.run(["gcc", "-fsyntax-only", *flags, str(path)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
