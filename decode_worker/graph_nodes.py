"""Counts the nodes of a captured CUDA graph by type, through the driver API (ctypes, no extra package).

A decode step's cost at small batch is its kernel count: each kernel node costs ~1.5-2.5 us of GPU
time even inside a graph. Used by the decode benchmark (`kernels_per_step`) and the GPU tests.
"""

from __future__ import annotations

import ctypes
import functools
from collections import Counter

# CUgraphNodeType values (cuda.h).
_NODE_TYPES = {0: "kernel", 1: "memcpy", 2: "memset", 3: "host", 4: "graph", 5: "empty", 6: "wait_event",
               7: "event_record", 8: "ext_semas_signal", 9: "ext_semas_wait", 10: "mem_alloc", 11: "mem_free",
               12: "batch_mem_op", 13: "conditional"}


@functools.cache
def _driver():
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuGraphGetNodes.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)]
    lib.cuGraphNodeGetType.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
    return lib


def graph_node_counts(raw_graph: int) -> dict[str, int]:
    """{node type: count} of a cudaGraph_t (torch.cuda.CUDAGraph(keep_graph=True).raw_cuda_graph())."""
    lib = _driver()
    n = ctypes.c_size_t(0)
    _check(lib.cuGraphGetNodes(raw_graph, None, ctypes.byref(n)), "cuGraphGetNodes")
    nodes = (ctypes.c_void_p * n.value)()
    _check(lib.cuGraphGetNodes(raw_graph, nodes, ctypes.byref(n)), "cuGraphGetNodes")
    counts: Counter[str] = Counter()
    kind = ctypes.c_int(0)
    for node in nodes[: n.value]:
        _check(lib.cuGraphNodeGetType(node, ctypes.byref(kind)), "cuGraphNodeGetType")
        counts[_NODE_TYPES.get(kind.value, f"type{kind.value}")] += 1
    return dict(counts)


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what} failed with CUresult {status}")
