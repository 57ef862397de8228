"""python_source.parse holds while another thread formats tracebacks and the parsing thread's garbage
has finalizers (the race it exists for: python_source.py)."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

from python_source import parse

SOURCE = (Path(__file__).parents[1] / "cluster" / "transport" / "receiver_side.py").read_text()


class _Finalized:
    def __init__(self):
        self.me = self  # a cycle: only a collection frees it, and runs __del__ then

    def __del__(self):
        sum(range(2000))  # Python code, during which another thread may run


def test_parse_while_another_thread_formats_tracebacks():
    log, stop = logging.getLogger("test.python_source.spam"), threading.Event()
    sink = open(os.devnull, "w")
    handler = logging.StreamHandler(sink)  # (formats each traceback, as every real handler does)
    log.addHandler(handler)
    log.propagate = False

    def spam():  # a thread failing every round, as a transport's did against a store that was gone
        while not stop.is_set():
            try:
                {}["key"] + 1
            except KeyError:
                log.exception("round failed")
    t = threading.Thread(target=spam, daemon=True)
    t.start()
    try:
        for _ in range(100):
            for _ in range(30):
                _Finalized()
            tree = parse(SOURCE, "receiver_side.py")  # plain ast.parse: SystemError on 3.11 within a few
            assert tree.body
    finally:
        stop.set()
        t.join()
        log.removeHandler(handler)
        sink.close()
