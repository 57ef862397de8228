"""Every third-party module `pdserve serve` can import is a dependency the plain install declares.

`pip install -e .` (the quickstart's install line) brings `[project].dependencies` and nothing else,
so a module on the serving path that only an extra (or a transitive dependency) provides is a
ModuleNotFoundError on a fresh machine: triton was one (issue 23). This walks every import, lazy ones
included (tests/test_layering.py's reader), from the entry points of each process `pdserve serve`
starts: the launcher (`pdserve` -> deploy.cli -> deploy.serving_cluster), the API-server processes
(`python -m deploy.api_server`) and the Ray workers (prefill_worker.actor, decode_worker.actor), and
maps each imported top-level name to its distribution with importlib.metadata. Modules uvicorn loads
by name (`uvicorn.Config(loop="uvloop", http="httptools")`) count as imports. The load-test tooling
(loadtest/, `pdserve loadtest`) and the benchmarks are checked the same way against the plain install plus `[loadtest]`.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from test_layering import PACKAGES, ROOT, imports_of, modules
from python_source import parse

SERVE_ROOTS = ("deploy.cli", "deploy.serving_cluster", "deploy.api_server", "prefill_worker.actor",
               "decode_worker.actor")
LOADTEST_ROOTS = tuple(m for _, m in modules() if m.startswith(("loadtest", "benchmarks")))


def declared(*extras: str) -> set[str]:
    """Canonical names of the distributions the plain install (plus `extras`) asks for on this machine."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = list(project["dependencies"])
    for extra in extras:
        lines += project["optional-dependencies"][extra]
    names = set()
    for line in lines:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate():
            names.add(canonicalize_name(req.name))
    return names


# Modules of a library that import a third-party package of their own that the library does not
# require: importing ours imports theirs (deploy/bounded_http.py subclasses uvicorn's httptools protocol).
IMPLIED = {"uvicorn.protocols.http.httptools_impl": "httptools"}
# A benchmark whose extra is not `loadtest`: benchmarks/real_model_cpu.py runs with `[real-model]`, and
# so does its lm-eval run (also the test extra's: tests/real_model/test_lm_eval.py).
OWN_EXTRA = {"benchmarks.real_model_cpu": "real-model", "benchmarks.real_model_lm_eval": "real-model"}


def _ours(name: str) -> bool:
    return name.split(".")[0] in PACKAGES


def _by_name(path: Path) -> list[str]:
    """Modules a library imports by the name it is given: uvicorn's loop and HTTP implementations."""
    out = []
    for node in ast.walk(parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "Config":
            out += [kw.value.value for kw in node.keywords
                    if kw.arg in ("loop", "http") and isinstance(kw.value, ast.Constant) and isinstance(kw.value.value, str)
                    and kw.value.value not in ("auto", "asyncio", "none", "h11")]
    return out


def third_party_imports(roots, skip=("loadtest", "benchmarks")) -> dict[str, set[str]]:
    """Top-level third-party name -> the modules of ours (reachable from `roots`) that import it."""
    found = {m: p for p, m in modules()}
    seen, todo, out = set(), list(roots), {}
    while todo:
        module = todo.pop()
        if module in seen or module not in found:
            continue
        seen.add(module)
        path = found[module]
        for imp in imports_of(path, module):
            if _ours(imp.module):
                targets = [f"{imp.module}.{n}" for n in imp.names if f"{imp.module}.{n}" in found] or [imp.module]
                if imp.module.split(".")[0] not in skip:
                    # `from a.b import c`: the packages a and a.b run too
                    parts = imp.module.split(".")
                    todo += targets + [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
                continue
            top = imp.module.split(".")[0]
            if top and top not in sys.stdlib_module_names:
                out.setdefault(top, set()).add(module)
            for lib_module, implied in IMPLIED.items():
                if (imp.module + ".").startswith(lib_module + "."):
                    out.setdefault(implied, set()).add(module)
        for name in _by_name(path):
            out.setdefault(name, set()).add(module)
    return out


def undeclared(imports: dict[str, set[str]], allowed: set[str]) -> list[str]:
    dists = md.packages_distributions()
    bad = []
    for name, users in sorted(imports.items()):
        provided = {canonicalize_name(d) for d in dists.get(name, ())}
        if not provided:
            bad.append(f"{name} (imported by {sorted(users)}) is not installed here")
        elif not provided & allowed:
            bad.append(f"{name} (distribution {sorted(provided)}, imported by {sorted(users)}) is not declared")
    return bad


def test_serve_path_imports_only_declared_dependencies():
    imports = third_party_imports(SERVE_ROOTS)
    # The walk reaches what the workers and gateways import (guards against an empty walk).
    assert {"torch", "ray", "fastapi", "uvicorn", "zmq", "uvloop", "httptools", "triton"} <= set(imports), imports
    assert undeclared(imports, declared()) == []


def test_loadtest_imports_are_declared_in_its_extra():
    imports = third_party_imports([r for r in LOADTEST_ROOTS if r not in OWN_EXTRA], skip=())
    assert {"locust", "gevent", "httpx"} <= set(imports)
    assert undeclared(imports, declared("loadtest")) == []


@pytest.mark.parametrize("root", sorted(OWN_EXTRA))
def test_a_benchmark_with_its_own_extra_declares_its_imports(root):
    imports = third_party_imports([root], skip=())
    assert imports, root
    assert undeclared(imports, declared("loadtest", OWN_EXTRA[root])) == []


def test_the_check_catches_an_undeclared_import():
    allowed = declared() - {"pyzmq"}
    bad = undeclared(third_party_imports(SERVE_ROOTS), allowed)
    assert any(b.startswith("zmq (distribution ['pyzmq']") for b in bad), bad
    # gevent is the load test's (through locust): the plain install does not declare it
    assert undeclared({"gevent": {"loadtest.locustfile"}}, declared()) != []
