"""The README's module map (section "Module map") names every package directory, one line each, and
names nothing that is gone: a package added, moved or deleted without its line fails here."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The serving packages, the tools and the run recipes: every one of them is in the map.
ROOTS = ("cluster", "prefill_worker", "decode_worker", "router", "deploy", "loadtest", "benchmarks", "scripts")


def package_dirs(root: Path = ROOT) -> set[str]:
    """Each root, and every directory under one that holds Python modules (namespace packages too)."""
    found = {f"{top}/" for top in ROOTS}
    for top in ROOTS:
        for f in (root / top).rglob("*.py"):
            if "__pycache__" not in f.parts:
                found.add(f"{f.parent.relative_to(root).as_posix()}/")
    return found


def mapped_dirs(readme: str) -> list[str]:
    """The first word of each line of the fenced block under the "Module map" heading."""
    section = re.search(r"^#+ Module map\n(.*?)^#+ ", readme + "\n# end", re.S | re.M)
    assert section, 'README.md has no "Module map" section'
    block = re.search(r"^```\n(.*?)^```", section.group(1), re.S | re.M)
    assert block, "the module map is not a fenced block"
    return [line.split()[0] for line in block.group(1).splitlines() if line.strip()]


def map_problems(root: Path = ROOT) -> list[str]:
    mapped = mapped_dirs((root / "README.md").read_text())
    dirs = package_dirs(root)
    problems = [f"{d} is not in the README's module map" for d in sorted(dirs - set(mapped))]
    problems += [f"{d} is in the module map but is no package directory" for d in sorted(set(mapped) - dirs)]
    problems += [f"{d} is in the module map twice" for d in sorted({d for d in mapped if mapped.count(d) > 1})]
    return problems


def test_the_module_map_names_every_package_once_and_nothing_else():
    assert map_problems() == []


def test_the_check_catches_a_missing_a_stale_and_a_repeated_line(tmp_path):
    for top in ROOTS:
        (tmp_path / top).mkdir()
    (tmp_path / "cluster" / "kv").mkdir()
    (tmp_path / "cluster" / "kv" / "block_pool.py").write_text("")
    lines = [f"{top}/   what it holds" for top in ROOTS] + ["cluster/gone/   moved away", "router/   again"]
    (tmp_path / "README.md").write_text("# x\n\n## Module map\n\n```\n" + "\n".join(lines) + "\n```\n\n## Next\n")
    assert map_problems(tmp_path) == [
        "cluster/kv/ is not in the README's module map",
        "cluster/gone/ is in the module map but is no package directory",
        "router/ is in the module map twice",
    ]
