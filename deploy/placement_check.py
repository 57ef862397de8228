"""Whether the Ray cluster can ever hold the workers' placement group, asked before creating it.

A placement group whose bundles no node can hold is never ready, and Ray says nothing: `pdserve
serve` would wait silently (issue 36: a prefill worker of TP 2 on a 2-CPU local Ray). `unmet` packs
the bundles (largest first, each on one node, as a bundle must be) into the alive nodes' total
resources and names what is missing; the launcher raises it as a PdserveError at once. Totals, not
what is free now: resources held by others are waited for (the bounded placement wait), resources
that do not exist are an error.
"""

from __future__ import annotations

Bundle = dict[str, float]


def unmet(bundles: list[tuple[str, Bundle]], nodes: list[Bundle]) -> str | None:
    """bundles: (what it is, its resources); nodes: each alive node's total resources. None when
    every bundle fits on some node (first fit, largest first), else what does not fit and why."""
    free = [dict(n) for n in nodes]
    for what, bundle in sorted(bundles, key=lambda b: -sum(b[1].values())):
        for node in free:
            if all(node.get(k, 0.0) + 1e-9 >= v for k, v in bundle.items()):
                for k, v in bundle.items():
                    node[k] = node.get(k, 0.0) - v
                break
        else:
            need = ", ".join(f"{k} {v:g}" for k, v in sorted(bundle.items()))
            totals = {k: sum(n.get(k, 0.0) for n in nodes) for k in bundle}
            largest = {k: max((n.get(k, 0.0) for n in nodes), default=0.0) for k in bundle}
            return (f"{what} needs {need} on one node, and no node has that left "
                    f"(the cluster has {_fmt(totals)} in all, its largest node {_fmt(largest)}, "
                    f"for {len(bundles)} workers' bundles)")
    return None


def _fmt(res: Bundle) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in sorted(res.items()))
