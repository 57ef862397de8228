"""`parse`: ast.parse for the tests that walk the project's source, safe while other threads run.

HAZARD (CPython 3.11, gh-106905; 3.12 and later keep the depth per thread): ast.parse counts its
recursion depth in state the whole interpreter shares, and checks the count when it is done. A garbage
collection during the parse runs finalizers, which are Python code, so another thread may take the GIL
and parse too: and 3.11 parses whenever it formats a traceback (for the ^^^ under each line). The first
parse then fails with "SystemError: AST constructor recursion depth mismatch". Seen in CI: a transport
thread that a failed test left running logged a traceback every 50 ms, and six AST-walking tests in
the same process failed. With collection off for the parse, no Python code runs inside it, and no other
thread can.
"""

from __future__ import annotations

import ast
import gc


def parse(source: str, filename: str = "<unknown>") -> ast.Module:
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return ast.parse(source, filename)
    finally:
        if was_enabled:
            gc.enable()
