"""Arrow IPC batches to JSON Lines: one object per row, keyed by column."""

import json
import math

from .arrow_ipc import read_batches


def _finite(value):
    # JSON has no NaN or infinities: they are written as strings, not lost.
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, bytes):
        return value.hex()
    return value


def to_lines(ipc):
    """(rows, bytes of JSON Lines) of one IPC stream."""
    fields, batches = read_batches(ipc)
    names = [f.name for f in fields]
    out = []
    total = 0
    dumps = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode
    for length, columns in batches:
        columns = [[_finite(v) for v in col] if _needs_fixing(col) else col for col in columns]
        for row in zip(*columns):
            out.append(dumps(dict(zip(names, row))))
        total += length
    text = "\n".join(out)
    return total, (text + "\n").encode("utf-8") if out else b""


def _needs_fixing(column):
    for v in column:
        if isinstance(v, bytes) or (isinstance(v, float) and not math.isfinite(v)):
            return True
    return False
