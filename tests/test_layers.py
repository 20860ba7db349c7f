"""The house's layers, checked from the source: no import circles, method names only where methods
live, and functions and files small enough to hold in your head.

Imports are read with `ast` from every module of the package (drafttrain/, decode/ and eval/, as
pyproject maps them), at module level AND inside functions: an import tucked into a function to
dodge a circle is still an arrow. A method name ("eagle3", "medusa2", ...) as a string literal
outside drafttrain/methods/ (and the registry) means some code branches on a method instead of
asking it. Sizes: no function over 80 lines of code, no file over 600 lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from drafttrain.methods.registry import BUILTIN

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"drafttrain": "drafttrain", "decode": "drafttrain.decode", "eval": "drafttrain.eval"}
# Literals that are an engine's or a file's vocabulary, not a branch on our method: each with why.
ALLOWED_LITERALS = {
    ("drafttrain/export/eagle.py", "eagle3"): "vLLM's own `speculators_model_type` / speculative-config value",
    ("drafttrain/engines/vllm.py", "eagle3"): "vLLM's own `speculators_model_type` / speculative-config method name",
}


def modules() -> dict[str, Path]:
    """module name -> file, for every module of the package."""
    out = {}
    for folder, name in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([name, *parts])] = path
    return out


def _typing_only(tree: ast.AST) -> set[int]:
    """ids of import nodes under `if TYPE_CHECKING:` (type hints only: never run)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            out |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return out


def imports_of(path: Path, known: set[str]) -> set[str]:
    """Modules of ours that `path` imports anywhere in its body (functions included; imports under
    `if TYPE_CHECKING:` are type hints, never executed, and do not count)."""
    found = set()
    tree = ast.parse(path.read_text())
    typing_only = _typing_only(tree)
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        found |= {n for n in names if n in known}
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), or a self-import."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph[v]:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    mods = modules()
    graph = {m: imports_of(p, set(mods)) - {m} for m, p in mods.items()}
    assert cycles(graph) == []
    assert any(graph.values())  # the walk saw imports at all


def test_the_walk_finds_a_planted_circle_and_imports_inside_functions(tmp_path):
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("import drafttrain.b\n")
    b.write_text("def f():\n    from drafttrain.a import x\n")
    known = {"drafttrain.a", "drafttrain.b"}
    graph = {"drafttrain.a": imports_of(a, known), "drafttrain.b": imports_of(b, known)}
    assert cycles(graph) == [["drafttrain.a", "drafttrain.b"]]


def method_literals(path: Path) -> list[tuple[int, str]]:
    names = set(BUILTIN)
    return [(n.lineno, n.value) for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in names]


def test_method_names_appear_only_in_method_modules():
    """Outside drafttrain/methods/ no code names a method: the trainer, the proposer loader and
    the exporter ask the registry (recipes name methods too, but they are YAML)."""
    found = []
    for path in modules().values():
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("drafttrain/methods/"):
            continue
        found += [f"{rel}:{line}: {name!r}" for line, name in method_literals(path)
                  if (rel, name) not in ALLOWED_LITERALS]
    assert found == []


def _code_lines(lines: list[str], start: int, end: int, skip: set[int]) -> int:
    return sum(1 for i in range(start, end + 1)
               if i not in skip and lines[i - 1].strip() and not lines[i - 1].strip().startswith("#"))


def _docstring_lines(tree: ast.AST) -> set[int]:
    skip = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(getattr(body[0], "value", None), ast.Constant) and isinstance(body[0].value.value, str):
            skip |= set(range(body[0].lineno, body[0].end_lineno + 1))
    return skip


@pytest.mark.parametrize("limit_fn, limit_file", [(80, 600)])
def test_functions_and_files_stay_small(limit_fn, limit_file):
    big = []
    for path in modules().values():
        text = path.read_text()
        lines = text.splitlines()
        rel = path.relative_to(ROOT).as_posix()
        if len(lines) > limit_file:
            big.append(f"{rel}: {len(lines)} lines")
        tree = ast.parse(text)
        skip = _docstring_lines(tree)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = _code_lines(lines, node.lineno, node.end_lineno, skip)
                if n > limit_fn:
                    big.append(f"{rel}:{node.lineno} {node.name}: {n} lines of code")
    assert big == []
