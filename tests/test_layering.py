"""The architecture in layers that only import downwards (README, "Layout"):

    application   deploy (config, launch, CLI)      loadtest (benchmarks, load tests)
    services      prefill_worker    decode_worker    router          (independent of each other)
    engine core   cluster.* (model, attention, kernels, KV cache, sampler, transport, messages)

Every import of every module is checked, including imports inside functions (a lazy import is still
a dependency)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("cluster", "prefill_worker", "decode_worker", "router", "deploy", "loadtest")
SERVICES = ("prefill_worker", "decode_worker", "router")


def layer(module: str) -> tuple[int, str] | None:
    """(level, unit) of one of our modules, or None for third-party / stdlib modules."""
    top = module.split(".")[0]
    if top not in PACKAGES:
        return None
    if top in ("deploy", "loadtest"):
        return 2, top
    if top == "cluster":
        return 0, "cluster"
    return 1, top


def imports_of(path: Path, module: str) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    pkg = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            out.append((node.lineno, name))
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
        for lineno, target in imports_of(path, module):
            dst = layer(target)
            if dst is None or dst[1] == src[1]:
                continue
            ok = dst[0] < src[0] or (src[0] == dst[0] == 2)  # the application may use the tools and back
            if not ok:
                kind = "sideways" if dst[0] == src[0] else "upward"
                bad.append(f"{path.relative_to(ROOT)}:{lineno}: {module} ({src[1]}) imports {target} ({dst[1]}): {kind}")
    return bad


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
