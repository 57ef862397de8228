"""All client events of a run as columns sorted by time: what the report's rows are built from.

A run writes about two event rows per token (loadtest.records), tens of MB at 256 users: an H200 run
of nine levels wrote ~55 MB (~1.6M rows) in 8 files. One Python object per row and a scan of all of
them per level cost ~1 s per MB there. Here a file in the writer's own format is parsed by numpy's C
reader, the rows of all files are sorted once, and a time window's rows are two binary searches away
(`span`): 55 MB in ~1.2 s on 2 cores (loadtest/results/loadtest_reader_cpu.md). A file in any other
shape (written by hand, or by another version) is read row by row as before, with the same result.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from loadtest.records import EVENT_FIELDS, EVENT_KINDS, EVENTS_GLOB, Event

_HEADER = (",".join(EVENT_FIELDS) + "\r\n").encode()  # what EventWriter writes first (csv's line end)
# One parsed line; a kind longer than 16 bytes is cut, and then is no known kind either.
_ROW = np.dtype([("t", np.float64), ("step", np.int64), ("kind", "S16"), ("value", np.float64)])


@dataclass(frozen=True, eq=False)
class EventTable:
    """Every event of a run, one array per field, ordered by `t`. Rows with equal `t` keep the order
    of a stable sort of all files' rows (files by name, rows in file order), as the report always
    had: its sums run in that order."""

    t: np.ndarray  # float64: wall-clock seconds, ascending
    step: np.ndarray  # int64: the Locust step the request started in (-1: before the first)
    kind: np.ndarray  # int32: index into `kinds`
    value: np.ndarray  # float64: unit per kind (loadtest.records)
    kinds: tuple[str, ...] = EVENT_KINDS  # EVENT_KINDS, then any other kind a file held

    def __len__(self) -> int:
        return len(self.t)

    def event(self, i: int) -> Event:
        return Event(float(self.t[i]), int(self.step[i]), self.kinds[self.kind[i]], float(self.value[i]))

    def span(self, t0: float, t1: float) -> slice:
        """The rows with t0 <= t < t1."""
        lo, hi = np.searchsorted(self.t, (t0, t1), side="left")
        return slice(int(lo), int(max(lo, hi)))

    def values(self, kind: str, rows: slice) -> np.ndarray:
        """The values of the `kind` rows among `rows`, in row order."""
        if kind not in self.kinds:
            return np.empty(0)
        return self.value[rows][self.kind[rows] == self.kinds.index(kind)]

    def count(self, kind: str, rows: slice) -> int:
        if kind not in self.kinds:
            return 0
        return int(np.count_nonzero(self.kind[rows] == self.kinds.index(kind)))

    @classmethod
    def from_rows(cls, rows: list[tuple[float, int, str, float]]) -> EventTable:
        """(t, step, kind, value) rows in file order (tests, hand-made sets)."""
        kinds = list(EVENT_KINDS)
        return _sorted([_columns(rows, kinds)], kinds)


def read_events(out_dir: Path) -> EventTable:
    """The events of every `events-*.csv` under `out_dir`; a row that does not parse (the torn last
    line of a killed process) is left out."""
    kinds = list(EVENT_KINDS)
    return _sorted([_read_file(path, kinds) for path in sorted(Path(out_dir).glob(EVENTS_GLOB))], kinds)


_Columns = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # t, step, kind, value in file order


def _sorted(parts: list[_Columns], kinds: list[str]) -> EventTable:
    if not parts:
        return EventTable(np.empty(0), np.empty(0, np.int64), np.empty(0, np.int32), np.empty(0), tuple(kinds))
    t, step, kind, value = (np.concatenate(col) for col in zip(*parts))
    order = np.argsort(t, kind="stable")  # stable: ties keep file order (sums depend on the order)
    return EventTable(t[order], step[order], kind[order], value[order], tuple(kinds))


def _read_file(path: Path, kinds: list[str]) -> _Columns:
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    columns = _parse_writer_format(data[len(_HEADER):end]) if data.startswith(_HEADER) else None
    if columns is None:  # another shape: the old rules, row by row
        return _columns(_parse_rows(data.decode("utf-8", "replace")), kinds)
    if end == len(data):
        return columns
    # A killed process can leave its last line torn (no newline after it): it counts if its fields parse.
    tail = _columns(_parse_rows((_HEADER + data[end:]).decode("utf-8", "replace")), kinds)
    return tuple(np.concatenate(pair) for pair in zip(columns, tail))


def _parse_writer_format(body: bytes) -> _Columns | None:
    """Complete lines `t,step,kind,value` as EventWriter writes them -> columns, parsed by numpy's C
    reader (np.loadtxt: strict, four fields a line, an integer step, floats correctly rounded like
    float()); None when a line has another shape or a kind is not one of EVENT_KINDS: the caller then
    reads the file row by row, by the old rules."""
    if not body.strip():
        return np.empty(0), np.empty(0, np.int64), np.empty(0, np.int32), np.empty(0)
    try:
        rows = np.loadtxt(io.StringIO(body.decode("ascii")), delimiter=",", comments=None, ndmin=1, dtype=_ROW)
    except (UnicodeDecodeError, ValueError):
        return None
    kind = np.full(len(rows), -1, np.int32)
    for code, name in enumerate(EVENT_KINDS):
        kind[rows["kind"] == name.encode()] = code
    if np.any(kind < 0):  # a kind the report does not know (kept by the row-by-row reading)
        return None
    return rows["t"].copy(), rows["step"].copy(), kind, rows["value"].copy()


def _parse_rows(text: str) -> list[tuple[float, int, str, float]]:
    """Row by row, header from the first line (csv.DictReader): what the report always did. A row
    whose fields do not parse is left out."""
    rows = []
    for row in csv.DictReader(io.StringIO(text, newline="")):
        try:
            rows.append((float(row["t"]), int(row["step"]), row["kind"], float(row["value"])))
        except (KeyError, TypeError, ValueError):
            continue
    return rows


def _columns(rows: list[tuple[float, int, str, float]], kinds: list[str]) -> _Columns:
    """Rows -> columns; a kind not yet in `kinds` is added to it."""
    index = {k: i for i, k in enumerate(kinds)}
    codes = []
    for _, _, k, _ in rows:
        if k not in index:
            index[k] = len(kinds)
            kinds.append(k)
        codes.append(index[k])
    return (np.array([r[0] for r in rows], np.float64), np.array([r[1] for r in rows], np.int64),
            np.array(codes, np.int32), np.array([r[3] for r in rows], np.float64))
