"""Worker calls are typed (cluster/worker_api.py, router/workers/worker_client.py): nowhere in router/ or
deploy/ is a method named by a string, neither passed to a call helper (`client.call("reserve", ...)`)
nor looked up and called (`getattr(handle, name)(...)`, `fn = getattr(handle, name); fn.remote()`).
Every module is parsed (AST), so a call inside a function counts too."""

from __future__ import annotations

import ast
from pathlib import Path

from python_source import parse

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("router", "deploy")
# Names of helpers that take the method to call as their first argument.
CALL_HELPERS = {"call", "_call", "call_method", "remote_call", "invoke", "invoke_method"}


def _is_getattr(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"


def _callee_name(func: ast.AST) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def string_dispatch(source: str, filename: str = "<src>") -> list[str]:
    """Where `source` calls a method it names by a string."""
    tree = parse(source, filename)
    found = []
    scopes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for scope in scopes:
        looked_up = {t.id for n in ast.walk(scope) if isinstance(n, ast.Assign) and _is_getattr(n.value)
                     for t in n.targets if isinstance(t, ast.Name)}
        for node in ast.walk(scope):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            if (_callee_name(f) in CALL_HELPERS and node.args and isinstance(node.args[0], ast.Constant)
                    and isinstance(node.args[0].value, str)):
                found.append(f"{filename}:{node.lineno}: method {node.args[0].value!r} passed by name to {_callee_name(f)}()")
            target = f.value if isinstance(f, ast.Attribute) and f.attr == "remote" else f
            if _is_getattr(target) or (isinstance(target, ast.Name) and target.id in looked_up):
                found.append(f"{filename}:{node.lineno}: calls a method looked up by name (getattr)")
    return sorted(set(found))


def test_no_worker_method_is_called_by_name():
    bad = []
    for top in PACKAGES:
        for path in sorted((ROOT / top).rglob("*.py")):
            bad += string_dispatch(path.read_text(), str(path.relative_to(ROOT)))
    assert not bad, "methods called by name:\n" + "\n".join(bad)


def test_the_checker_catches_calls_by_name():
    old_client = (
        "class WorkerClient:\n"
        "    async def call(self, method, *args, timeout=None):\n"
        "        fn = getattr(self.handle, method)\n"
        "        if hasattr(fn, 'remote'):\n"
        "            result = fn.remote(*args)\n"
        "        else:\n"
        "            result = fn(*args)\n"
        "        return await result\n"
    )
    assert len(string_dispatch(old_client)) == 2  # fn.remote(...) and fn(...)
    assert string_dispatch("async def f(c, r):\n    await c.call('submit_local', r, timeout=1.0)\n")
    assert string_dispatch("def f(h):\n    return getattr(h, 'stats').remote()\n")
    assert string_dispatch("def f(h, m):\n    return getattr(h, m)()\n")
    # Typed calls, attribute reads and the Ray method handles are fine.
    ok = ("async def f(c, h, r):\n"
          "    await c.reserve(r, timeout=1.0)\n"
          "    h.stats.remote()\n"
          "    x = getattr(r, 'headers', None)\n"
          "    return hasattr(h, 'remote'), x\n")
    assert string_dispatch(ok) == []
