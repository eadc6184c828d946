"""The import graph: no module imports itself back through others, at module level or from
inside a function (an import moved into a function to dodge a circle is still a circle), and
the packages stack in layers: none reaches up into one that imports it."""
from __future__ import annotations

import ast
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGES = ("jaxllm", "serve", "pallas_kernels", "benchmarks")


def modules() -> dict[str, str]:
    out = {}
    for pkg in PACKAGES:
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, pkg)):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            for f in filenames:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(dirpath, f), ROOT)[:-3].replace(os.sep, ".")
                    out[rel.removesuffix(".__init__")] = os.path.join(dirpath, f)
    return out


def imports(name: str, path: str, known: dict) -> set[str]:
    """The project modules `name` imports anywhere in its file (TYPE_CHECKING blocks too)."""
    is_pkg = path.endswith("__init__.py")
    found = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".")[:len(name.split(".")) - node.level + is_pkg]
                base = ".".join(parts + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    sys.setrecursionlimit(10000)
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
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
            if len(comp) > 1:
                out.append(sorted(comp))
    for v in graph:
        if v not in index:
            visit(v)
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    return {m: imports(m, p, known) for m, p in known.items()}


def package_of(module: str) -> str:
    """jaxllm.runner.model_runner -> jaxllm.runner; top-level modules of jaxllm stand alone."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "jaxllm" else parts[0]


def test_no_module_imports_itself_back():
    assert cycles(graph()) == []


def test_packages_stack_in_layers():
    g = graph()
    packages: dict[str, set[str]] = {}
    for m, targets in g.items():
        packages.setdefault(package_of(m), set()).update(
            package_of(t) for t in targets if package_of(t) != package_of(m))
    # the package roots (jaxllm's __init__ re-exports the API) sit above everything
    packages.pop("jaxllm", None)
    for deps in packages.values():
        deps.discard("jaxllm")
    assert cycles(packages) == []


def test_core_imports_no_jax():
    """core/ is plain Python, unit-testable in microseconds (design rule 2)."""
    known = modules()
    for m, path in known.items():
        if m.startswith("jaxllm.core"):
            tree = ast.parse(open(path).read())
            names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
            names |= {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
            assert not names & {"jax", "jaxlib", "flax", "numpy"}, m


def test_the_check_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
