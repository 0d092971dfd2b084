"""The layout stays as built: the import graph of ``src/epmoe`` (read from the source, imports inside
functions included) has no cycle, and no module imports another module's private name."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "epmoe"


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, list[str]]]:
    """``(imported module, names taken from it)`` for every import of the package in one module's source."""
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names if a.name.split(".")[0] == "epmoe"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "epmoe":
                continue
            names = [a.name for a in node.names]
            found += [(f"{target}.{n}", []) for n in names if f"{target}.{n}" in modules]
            rest = [n for n in names if f"{target}.{n}" not in modules]
            if rest:  # names defined in ``target`` itself (a submodule import alone is an edge to the submodule)
                found.append((target, rest))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and str(node.args[0].value).startswith("epmoe")):
            found.append((node.args[0].value, []))
    return found


def _graph() -> tuple[dict[str, set[str]], list[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    private = []
    for name, path in modules.items():
        for target, names in _imports(name, path, modules):
            assert target in modules, f"{name} imports {target}, which is not a module of src/epmoe"
            if target != name:
                graph[name].add(target)
                private += [f"{name} imports {target}.{n}" for n in names if n.startswith("_") and n != "__version__"]
    return graph, private


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_is_read_from_the_source():
    graph, _ = _graph()
    assert "epmoe.dispatch.base" in graph["epmoe.dispatch.fixed_capacity"]
    assert "epmoe.dispatch.layout_triton" in graph["epmoe.dispatch.layout"]  # a function-level import counts
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles():
    graph, _ = _graph()
    assert _cycles(graph) == []


def test_no_private_names_imported_across_modules():
    _, private = _graph()
    assert private == []


def test_at_most_a_dozen_top_level_modules():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 12, top


def test_import_epmoe_is_light_and_its_api_and_subpackages_load_on_use():
    """``import epmoe`` imported PyTorch (seconds, and a Ctrl-C then was a traceback); it now imports the public API
    on first use, and ``epmoe.spec``-style access to subpackages still works after a bare ``import epmoe``."""
    import subprocess
    import sys

    code = ("import sys, epmoe\n"
            "assert 'torch' not in sys.modules, 'torch imported by import epmoe'\n"
            "from epmoe import Comm, load_moe_spec, MoELayer\n"
            "assert epmoe.spec.load_moe_spec is load_moe_spec\n"
            "assert epmoe.placement.ExpertPlacement is epmoe.ExpertPlacement\n"
            "assert set(epmoe.__all__) <= set(dir(epmoe)) and 'importlib' not in dir(epmoe)\n"
            "try:\n    epmoe.nope\nexcept AttributeError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "module 'epmoe' has no attribute 'nope'"
