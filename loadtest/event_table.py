"""All client events of a run as columns sorted by time: what the report's rows are built from.

A run writes about two event rows per token (loadtest.records), tens of MB at 256 users: an H200 run
of nine levels wrote ~55 MB, ~1.7M rows, in 8 files. One Python object per row cost ~1 s per MB; here
a file in the writer's own format is parsed by numpy in a few passes over its bytes, the rows of all
files are sorted once, and the rows of a time window are two binary searches away (`span`). A file in
any other shape (written by hand, or by another version) is read row by row, as before, with the same
result.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from loadtest.records import EVENT_FIELDS, EVENT_KINDS, EVENTS_GLOB, Event

_HEADER = (",".join(EVENT_FIELDS) + "\r\n").encode()  # what EventWriter writes first (csv's line end)


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
    end = data.rfind(b"\n") + 1  # a killed process can leave its last line torn: no newline after it
    table = _parse_writer_format(data[len(_HEADER):end]) if data.startswith(_HEADER) else None
    if table is None:
        return _columns(_parse_rows(data.decode("utf-8", "replace")), kinds)
    tail = _parse_rows((_HEADER + data[end:]).decode("utf-8", "replace")) if end < len(data) else []
    t, step, kind, value = table
    if not tail:
        return table
    tt, ts, tk, tv = _columns(tail, kinds)
    return np.append(t, tt), np.append(step, ts), np.append(kind, tk), np.append(value, tv)


def _parse_writer_format(body: bytes) -> _Columns | None:
    """Complete lines `t,step,kind,value\\r\\n` as EventWriter writes them -> columns, in a few C-level
    passes; None as soon as one line has another shape (the caller then reads the file row by row).

    Each known kind is replaced by its index + 0.5 and the whole body parsed as one list of numbers
    (np.fromstring: strtod, correctly rounded like float()). Accepted only if every line has exactly
    four fields, as many kinds were replaced as there are lines, every step is integral and every kind
    column holds an index + 0.5: a step that spelled a kind would be x.5 (not integral), and each line
    has one kind field, so each line's kind field was a known kind, replaced once."""
    n = body.count(b"\n")
    if n == 0:
        return np.empty(0), np.empty(0, np.int64), np.empty(0, np.int32), np.empty(0)
    raw = np.frombuffer(body, np.uint8)
    newlines = np.flatnonzero(raw == ord("\n"))
    commas = np.flatnonzero(raw == ord(","))
    if len(commas) != 3 * n:
        return None
    commas = commas.reshape(n, 3)
    line_starts = np.concatenate(([-1], newlines[:-1]))
    if not (np.all(commas[:, 0] > line_starts) and np.all(commas[:, 2] < newlines)):
        return None  # some line has more fields, another fewer
    replaced = 0
    for code, name in enumerate(EVENT_KINDS):
        pattern = b"," + name.encode() + b","
        replaced += body.count(pattern)
        body = body.replace(pattern, b",%d.5," % code)
    if replaced != n:
        return None
    try:
        flat = np.fromstring(body.replace(b"\r\n", b","), sep=",")
    except ValueError:  # a field that is no number
        return None
    if flat.size != 4 * n:
        return None
    cols = flat.reshape(n, 4)
    step, kind = cols[:, 1], cols[:, 2] - 0.5
    if not (np.all(np.abs(step) < 2**53) and np.all(step == np.floor(step))  # int() would take it
            and np.all(kind == np.floor(kind)) and kind.min() >= 0 and kind.max() < len(EVENT_KINDS)):
        return None
    return cols[:, 0].copy(), step.astype(np.int64), kind.astype(np.int32), cols[:, 3].copy()


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
