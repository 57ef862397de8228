"""The architecture in layers that only import downwards (README, "Layout"):

    tools         loadtest (`pdserve loadtest`)    benchmarks (a checkout's measurements, not installed)
    application   deploy (config, launch, CLI)
    services      prefill_worker    decode_worker    router          (independent of each other)
    engine core   cluster.* (model, attention, kernels, KV cache, sampler, transport, messages)

Every import of every module is checked, including imports inside functions (a lazy import is still
a dependency). And no import cycle anywhere among our modules, lazy imports and imports under
`if TYPE_CHECKING:` included: a helper that names its owner's type holds its owner (STYLE.md, "Objects
that point one way"); it gets the narrow objects it uses instead. `from a.b import c` is an edge to the
module a.b.c where there is one, else to a.b; a package's __init__ counts as a module of its own."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

from python_source import parse

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("cluster", "prefill_worker", "decode_worker", "router", "deploy", "loadtest", "benchmarks")
TOOLS = ("loadtest", "benchmarks")
SERVICES = ("prefill_worker", "decode_worker", "router")


def layer(module: str) -> tuple[int, str] | None:
    """(level, unit) of one of our modules, or None for third-party / stdlib modules."""
    top = module.split(".")[0]
    if top not in PACKAGES:
        return None
    if top in TOOLS:
        return 3, top
    if top == "deploy":
        return 2, top
    if top == "cluster":
        return 0, "cluster"
    return 1, top


class Imported(NamedTuple):
    lineno: int
    module: str  # `import a.b` -> a.b; `from a.b import c, d` -> a.b (relative imports resolved)
    names: tuple[str, ...]  # what a from-import takes from it: (c, d); () for `import a.b`
    types_only: bool  # under `if TYPE_CHECKING:`


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(node: ast.AST, types_only: bool = False) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement under `node`, at module level or inside a function, class or try."""
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node, types_only
    elif isinstance(node, ast.If) and _is_type_checking(node.test):
        for child in node.body:
            yield from _import_nodes(child, True)
        for child in node.orelse:
            yield from _import_nodes(child, types_only)
    else:
        for child in ast.iter_child_nodes(node):
            yield from _import_nodes(child, types_only)


def imports_of(path: Path, module: str) -> list[Imported]:
    tree = parse(path.read_text(), str(path))
    pkg = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node, types_only in _import_nodes(tree):
        if isinstance(node, ast.Import):
            out += [Imported(node.lineno, a.name, (), types_only) for a in node.names]
            continue
        if node.level:  # relative: resolve against this module's package
            base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
            name = ".".join(base + ([node.module] if node.module else []))
        else:
            name = node.module or ""
        out.append(Imported(node.lineno, name, tuple(a.name for a in node.names), types_only))
    return out


def modules():
    for top in PACKAGES:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = list(rel.parts[:-1]) if rel.name == "__init__" else list(rel.parts)
            yield path, ".".join(parts)


def violations() -> list[str]:
    bad = []
    for path, module in modules():
        src = layer(module)
        for lineno, target, _, _ in imports_of(path, module):
            dst = layer(target)
            if dst is None or dst[1] == src[1]:
                continue
            ok = dst[0] < src[0] or (src[0] == dst[0] == 3)  # the tools may use one another
            if not ok:
                kind = "sideways" if dst[0] == src[0] else "upward"
                bad.append(f"{path.relative_to(ROOT)}:{lineno}: {module} ({src[1]}) imports {target} ({dst[1]}): {kind}")
    return bad


def import_graph() -> dict[str, list[tuple[str, str]]]:
    """module -> [(module it imports, "path:line")], among our modules, types-only imports included."""
    found = {module: path for path, module in modules()}
    graph: dict[str, list[tuple[str, str]]] = {m: [] for m in found}
    for module, path in found.items():
        for imp in imports_of(path, module):
            where = f"{path.relative_to(ROOT)}:{imp.lineno}"
            targets = [f"{imp.module}.{n}" if f"{imp.module}.{n}" in found else imp.module for n in imp.names]
            for target in dict.fromkeys(targets or [imp.module]):
                if target in found and target != module:
                    graph[module].append((target, where))
    return graph


def import_cycles() -> list[str]:
    """One line per set of modules that import one another in a ring (a strongly connected component
    of the import graph), with one such ring spelled out import by import."""
    graph = import_graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        for w, _ in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    out = []
    for component in components:
        start, inside = component[0], set(component)
        came: dict[str, tuple[str, str]] = {}  # module -> (who imports it on the way, where)
        frontier = [start]
        while start not in came:  # breadth first from start back to it, inside the component
            reached = []
            for v in frontier:
                for w, where in graph[v]:
                    if w in inside and w not in came:
                        came[w] = (v, where)
                        reached.append(w)
            frontier = reached
        ring, v = [], start
        while True:
            prev, where = came[v]
            ring.append(f"{prev} imports {v} ({where})")
            v = prev
            if v == start:
                break
        out.append(f"cycle among {component}: " + ", ".join(reversed(ring)))
    return out


def test_imports_only_go_down():
    bad = violations()
    assert not bad, "layering broken:\n" + "\n".join(bad)


def test_the_checker_catches_an_upward_import(tmp_path, monkeypatch):
    """A core module that imports a worker, and a worker that imports its sibling, are reported."""
    fake = tmp_path / "cluster" / "model"
    fake.mkdir(parents=True)
    (fake / "bad.py").write_text("def f():\n    from decode_worker.scheduler import DecodeScheduler\n")
    side = tmp_path / "router"
    side.mkdir()
    (side / "bad.py").write_text("import prefill_worker.prefill_worker\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    found = violations()
    assert any("cluster.model.bad" in v and "upward" in v for v in found), found
    assert any("router.bad" in v and "sideways" in v for v in found), found


def test_no_import_cycle():
    """No module reaches a module that reaches it back, type-only imports counted (issue 34: the
    transport's sides are given a link and a payload instead of their owner)."""
    cycles = import_cycles()
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_cycle_check_catches_a_planted_cycle_also_through_a_types_only_import(tmp_path, monkeypatch):
    """A ring through a lazy import is reported, and so is one through an import under `if TYPE_CHECKING:`."""
    pkg = tmp_path / "cluster" / "ring"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from cluster.ring import b\n")
    (pkg / "b.py").write_text("from cluster.ring.c import C\n")
    (pkg / "c.py").write_text("class C:\n    def f(self):\n        from cluster.ring.a import x\n")
    (pkg / "typed.py").write_text("from cluster.ring.hint import H\n")
    (pkg / "hint.py").write_text("from cluster.ring.nothing import H\n")  # no ring through typed.py yet
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (found,) = import_cycles()
    assert found.startswith("cycle among ['cluster.ring.a', 'cluster.ring.b', 'cluster.ring.c']: "), found
    assert "cluster.ring.a imports cluster.ring.b (cluster/ring/a.py:1)" in found, found
    assert "cluster.ring.b imports cluster.ring.c (cluster/ring/b.py:1)" in found, found
    assert "cluster.ring.c imports cluster.ring.a (cluster/ring/c.py:3)" in found, found
    (pkg / "hint.py").write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
                                 "    from cluster.ring.typed import T\n")  # types only: still a ring
    assert any("cluster.ring.hint" in c and "cluster.ring.typed" in c for c in import_cycles())


@pytest.mark.parametrize("argv", [["serve", "--help"], ["generate", "--max-tokens", "2", "--ignore-eos", "Hi"]])
def test_serve_and_generate_do_not_import_the_load_test_tooling(argv, demo_model_dir):
    code = (
        "import sys\n"
        "from deploy import cli\n"
        "try:\n"
        f"    cli.main({argv!r})\n"
        "except SystemExit:\n"
        "    pass\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('loadtest', 'locust', 'gevent', 'matplotlib'))\n"
        "print('LOADED', bad)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "LOADED []" in r.stdout, r.stdout[-2000:]


# STYLE.md: no serving file past ~500 lines (one concept per file). The load-test tool and the
# benchmarks are scripts, not serving code, and are not held to it.
MAX_SERVING_FILE_LINES = 500


def serving_files_too_long(root: Path = ROOT, limit: int = MAX_SERVING_FILE_LINES) -> dict[str, int]:
    too_long = {}
    for pkg in PACKAGES:
        if pkg in TOOLS:
            continue
        for f in sorted((root / pkg).rglob("*.py")):
            n = len(f.read_text().splitlines())
            if n > limit:
                too_long[str(f.relative_to(root))] = n
    return too_long


def test_no_serving_file_is_past_the_size_limit():
    assert serving_files_too_long() == {}


def test_the_size_check_catches_a_long_file(tmp_path):
    (tmp_path / "router").mkdir()
    (tmp_path / "router" / "big.py").write_text("x = 1\n" * (MAX_SERVING_FILE_LINES + 1))
    (tmp_path / "loadtest").mkdir()
    (tmp_path / "loadtest" / "bench.py").write_text("x = 1\n" * (MAX_SERVING_FILE_LINES + 1))
    for pkg in PACKAGES:
        (tmp_path / pkg).mkdir(exist_ok=True)
    assert serving_files_too_long(tmp_path) == {"router/big.py": MAX_SERVING_FILE_LINES + 1}
