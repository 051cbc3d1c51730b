"""The project's shape: no import cycles between the modules of ``sequoia_decoding`` (any
import, also one inside a function), and the decoding loop imports what it uses at the top."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "python_api" / "sequoia_decoding"


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """The sequoia_decoding modules ``path`` imports, anywhere in the file."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # "from . import a" imports the submodule a (the package itself is already loaded)
            targets = ([] if node.module is None else [mod]) + [f"{mod}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        out |= {t for t in targets if t.startswith("sequoia_decoding")}
    return out


def test_no_import_cycles_in_the_python_layer():
    files = {_module_name(p): p for p in PKG.rglob("*.py")}
    graph = {m: {t for t in _imports(p) if t in files and t != m} for m, p in files.items()}
    # the package's __init__ re-exports its submodules' names: a module importing
    # "sequoia_decoding" itself would close a cycle through it, and is counted
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(t):] + [t]))
            if t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert "sequoia_decoding.generate" in graph and "sequoia_decoding.cli" in graph


def test_the_decoding_loop_imports_at_the_top():
    tree = ast.parse((PKG / "generate.py").read_text())
    nested = [n.lineno for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
              for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert nested == [], f"imports inside functions of generate.py at lines {nested}"


def _functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node.end_lineno - node.lineno + 1


def test_line_budgets():
    """The loop stays readable: one step <= 40 lines, the generation loop <= 50, no function of the
    Python layer over 80, generate.py <= 450 lines, planner.py < 400 (issue 23's budgets)."""
    long = [(p.name, n, k) for p in PKG.rglob("*.py") for n, k in _functions(p) if k > 80]
    assert long == [], f"functions over 80 lines: {long}"
    loop = dict(_functions(PKG / "generate.py"))
    assert loop["_step"] <= 40 and loop["_generate"] <= 50, loop
    assert len((PKG / "generate.py").read_text().splitlines()) <= 450
    assert len((PKG / "planner.py").read_text().splitlines()) < 400


def test_the_library_entry_point_does_not_import_the_demo():
    assert not any(t.startswith("sequoia_decoding.demo") for t in _imports(PKG / "hf_generate.py"))
    assert not any(t.startswith("sequoia_decoding.demo") for t in _imports(PKG / "profiles.py"))


def test_nvcc_units_include_no_torch_header():
    """The CUDA units nvcc compiles (``csrc/cuda/*.cu``) and every project header they reach are
    framework-free: torch's headers are parsed by the host compiler once (``csrc/cuda/bindings.cpp``),
    not by nvcc once per GPU architecture (which made each unit ~25 s)."""
    import re

    csrc = PKG.parents[1] / "csrc"
    units = sorted((csrc / "cuda").glob("*.cu"))
    assert len(units) == 4
    seen, todo = set(), list(units)
    while todo:
        f = todo.pop()
        if f in seen:
            continue
        seen.add(f)
        text = f.read_text()
        torch_inc = re.findall(r"#include\s*<((?:ATen|torch|c10|pybind11)/[^>]+)>", text)
        assert not torch_inc, f"{f.relative_to(csrc)} includes {torch_inc}: nvcc would parse torch's headers"
        for inc in re.findall(r'#include\s*"([^"]+)"', text):
            todo += [p for p in (f.parent / inc, csrc / inc) if p.exists()][:1]
    assert {p.name for p in seen} >= {"launch.h", "tree_attention.cuh", "verify_tree.h", "sampling.h"}


def test_every_script_compiles():
    """The benchmarks and scripts no test imports still parse (a quoting slip in an f-string
    once made `bench/hf_entry.py` a SyntaxError that only its next run would have shown)."""
    repo = PKG.parents[1]
    files = sorted(p for d in ("bench", "scripts", "custom_generate") for p in (repo / d).rglob("*.py"))
    assert files
    for f in files:
        compile(f.read_text(encoding="utf-8"), str(f), "exec")  # a SyntaxError names the file and line
