"""A run's client events as columns (loadtest/event_table.py): the writer's files, parsed in bulk, read
back exactly as row by row; torn last lines and files in other shapes are read as before."""

from __future__ import annotations

import random

import pytest

from loadtest.event_table import EventTable, _parse_writer_format, read_events
from loadtest.records import EVENT_KINDS, Event, EventWriter

HEADER = b"t,step,kind,value\r\n"


def _as_written(rows) -> list[Event]:
    """What each row reads back as: the writer's text (t to the microsecond, value to 4 decimals)."""
    return [Event(float(f"{t:.6f}"), step, kind, float(f"{v:.4f}")) for t, step, kind, v in rows]


def _random_rows(rng: random.Random, n: int, ties: list[float]) -> list[tuple[float, int, str, float]]:
    return [(rng.choice(ties) if rng.random() < 0.2 else 1_767_000_000.0 + rng.uniform(0, 60), rng.randint(-1, 8),
             rng.choice(EVENT_KINDS), rng.uniform(0, 5000) if rng.random() < 0.9 else 0.0) for _ in range(n)]


def _write(path, rows) -> None:
    w = EventWriter(path)
    w.write(rows)
    w.close()


def _events(table: EventTable) -> list[Event]:
    return [table.event(i) for i in range(len(table))]


def test_writer_files_read_back_in_bulk_sorted_stably(tmp_path):
    """Several files, out of time order, with equal times across and within files: every row as
    written, ordered by t, ties in file-name then row order (what a stable sort of all rows gives)."""
    rng = random.Random(7)
    ties = [1_767_000_010.25, 1_767_000_030.5, 1_767_000_059.125]
    per_file = {name: _random_rows(rng, 3000, ties) for name in ("events-30.csv", "events-4.csv", "events-101.csv")}
    for name, rows in per_file.items():
        _write(tmp_path / name, rows)
    # The bulk parser takes the writer's files (the row-by-row path would give the same rows, slowly).
    for name in per_file:
        assert _parse_writer_format((tmp_path / name).read_bytes()[len(HEADER):]) is not None
    expected = [e for name in sorted(per_file) for e in _as_written(per_file[name])]
    expected.sort(key=lambda e: e.t)
    table = read_events(tmp_path)
    assert _events(table) == expected
    assert table.t.dtype.kind == "f" and all(table.t[:-1] <= table.t[1:])
    assert len(read_events(tmp_path / "none")) == 0


def _one_row(line: str) -> list[Event]:
    """The old rule for a line on its own: four fields that float() / int() take, else nothing."""
    fields = line.rstrip("\r\n").split(",")
    try:
        return [Event(float(fields[0]), int(fields[1]), fields[2], float(fields[3]))] if len(fields) >= 4 else []
    except ValueError:
        return []


def test_a_torn_last_line_is_read_as_far_as_it_parses(tmp_path):
    """A killed process can leave its last line cut anywhere: the rows before it are all read; the cut
    line counts only if its four fields still parse (as the report always had it)."""
    rows = [(1_767_000_000.5 + i, i % 3, "itl", 12.5 + i) for i in range(5)]
    _write(tmp_path / "events-1.csv", rows)
    complete = (tmp_path / "events-1.csv").read_bytes()
    last = b"1767000012.345678,3,chunk_itl,12.3456\r\n"
    seen_tail = 0
    for cut in range(len(last) + 1):
        (tmp_path / "events-1.csv").write_bytes(complete + last[:cut])
        tail = _one_row(last[:cut].decode())
        seen_tail += bool(tail)
        assert _events(read_events(tmp_path)) == _as_written(rows) + tail, cut
    assert seen_tail == 9  # "...,chunk_itl,1" to the whole line: a cut value is read as cut
    (tmp_path / "events-1.csv").write_bytes(HEADER[:7])  # killed before its header was complete
    assert len(read_events(tmp_path)) == 0


def test_files_in_other_shapes_are_read_row_by_row(tmp_path):
    """Another header order, an unknown kind (kept, and no report column reads it), a step that is no
    integer or spells a kind (left out), an extra field (ignored), a blank line: the old rules."""
    good = [(1_767_000_001.0, 0, "itl", 10.0), (1_767_000_002.0, 0, "ttft", 40.0)]
    _write(tmp_path / "events-1.csv", good)
    (tmp_path / "events-2.csv").write_text(
        "kind,t,value,step\r\nitl,1767000001.5,11.0,0\r\nwarmup,1767000001.6,1.0,0\r\nitl,1767000001.7,9.0,1.5\r\n"
        "\r\ntpot,1767000001.8,7.0,0,extra\r\n")
    body = (b"1767000003.0,itl,tpot,3.0\r\n1767000003.1,itl,2,3.0\r\n1767000003.2,0,stall,1.0\r\n"
            b"1767000003.3,0,e2e,x\r\n1767000003.4,0,error\r\n")
    (tmp_path / "events-3.csv").write_bytes(HEADER + body)
    assert _parse_writer_format(body) is None
    table = read_events(tmp_path)
    assert [(e.t, e.kind, e.value) for e in _events(table)] == [
        (1_767_000_001.0, "itl", 10.0), (1_767_000_001.5, "itl", 11.0), (1_767_000_001.6, "warmup", 1.0),
        (1_767_000_001.8, "tpot", 7.0), (1_767_000_002.0, "ttft", 40.0), (1_767_000_003.2, "stall", 1.0)]
    whole = table.span(0.0, 2e9)
    assert table.kinds[-1] == "warmup" and table.values("itl", whole).tolist() == [10.0, 11.0]
    assert table.count("stall", whole) == 1 and table.count("nothing", whole) == 0
    # The same bytes with every line in the writer's shape take the bulk path.
    assert _parse_writer_format(b"1767000003.2,0,stall,1.0\r\n1767000003.3,-1,e2e,2.5\r\n") is not None


def test_span_is_half_open_and_values_keep_row_order():
    table = EventTable.from_rows([(2.0, 0, "itl", 5.0), (1.0, 0, "itl", 9.0), (2.0, 1, "ttft", 1.0),
                                  (3.0, 0, "itl", 7.0), (2.0, 1, "itl", 3.0)])
    assert table.t.tolist() == [1.0, 2.0, 2.0, 2.0, 3.0]
    rows = table.span(2.0, 3.0)
    assert (rows.start, rows.stop) == (1, 4)
    assert table.values("itl", rows).tolist() == [5.0, 3.0] and table.count("ttft", rows) == 1
    assert table.values("itl", table.span(3.0, 2.0)).size == 0
    with pytest.raises(IndexError):
        table.event(5)
