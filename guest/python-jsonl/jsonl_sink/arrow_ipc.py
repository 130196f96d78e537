"""Arrow IPC stream decoding in pure Python, for a sandbox without pyarrow.

Batches reach a Sluice sink as Arrow IPC *streams* (a schema message, record
batch messages, an end-of-stream marker), and table schemas as streams of a
schema message alone. This module reads the flatbuffer metadata with the
`flatbuffers` runtime (the layout is Arrow's `Schema.fbs` and `Message.fbs`,
format version 5) and the body buffers with `memoryview` casts, and turns each
column into a list of Python values.

Invariants:
- only what the format defines is accepted: an unknown message, a body
  compression, a dictionary batch or a type this module does not decode is
  an `ArrowError` naming it, never a guess;
- a value is `None` exactly where the validity bitmap says null.
"""

import datetime
import struct
from dataclasses import dataclass, field

from flatbuffers.table import Table
from flatbuffers import number_types as N


class ArrowError(Exception):
    """A stream this decoder cannot read, with the reason."""


# Message.fbs: MessageHeader union.
_SCHEMA, _DICTIONARY_BATCH, _RECORD_BATCH = 1, 2, 3
# Schema.fbs: Type union.
_TYPES = {
    1: "null", 2: "int", 3: "floatingpoint", 4: "binary", 5: "utf8", 6: "bool",
    7: "decimal", 8: "date", 9: "time", 10: "timestamp", 11: "interval",
    12: "list", 13: "struct", 14: "union", 15: "fixedsizebinary",
    16: "fixedsizelist", 17: "map", 18: "duration", 19: "largebinary",
    20: "largeutf8", 21: "largelist", 22: "runendencoded", 23: "binaryview",
    24: "utf8view", 25: "listview", 26: "largelistview",
}
_TIME_UNITS = {0: 1_000_000, 1: 1_000, 2: 1, 3: None}  # to microseconds (nano handled apart)
_EPOCH = datetime.datetime(1970, 1, 1)
_EPOCH_DATE = datetime.date(1970, 1, 1)


def _slot(t, i):
    """Absolute position of field `i` of table `t`, or 0 when absent."""
    o = t.Offset(4 + 2 * i)
    return t.Pos + o if o else 0


def _scalar(t, i, flags, default):
    o = t.Offset(4 + 2 * i)
    return t.Get(flags, t.Pos + o) if o else default


def _table(t, i):
    o = t.Offset(4 + 2 * i)
    return Table(t.Bytes, t.Indirect(t.Pos + o)) if o else None


def _string(t, i):
    o = t.Offset(4 + 2 * i)
    return t.String(t.Pos + o).decode("utf-8") if o else None


def _vector(t, i):
    """(start, length) of vector field `i`, (0, 0) when absent."""
    o = t.Offset(4 + 2 * i)
    if not o:
        return 0, 0
    return t.Vector(o), t.VectorLen(o)


@dataclass
class Field:
    name: str
    nullable: bool
    kind: str
    # int: (bit width, signed); floatingpoint: precision; decimal: (precision,
    # scale, bit width); date/time/timestamp: unit; timestamp: time zone.
    params: tuple = ()
    children: list = field(default_factory=list)

    def describe(self):
        return f"{self.kind}{list(self.params) if self.params else ''}"


def _read_field(t):
    name = _string(t, 0) or ""
    nullable = bool(_scalar(t, 1, N.BoolFlags, False))
    type_id = _scalar(t, 2, N.Uint8Flags, 0)
    kind = _TYPES.get(type_id, f"type #{type_id}")
    ty = _table(t, 3)
    params = ()
    if kind == "int" and ty is not None:
        params = (_scalar(ty, 0, N.Int32Flags, 0), bool(_scalar(ty, 1, N.BoolFlags, False)))
    elif kind == "floatingpoint" and ty is not None:
        params = (_scalar(ty, 0, N.Int16Flags, 0),)
    elif kind == "decimal" and ty is not None:
        params = (_scalar(ty, 0, N.Int32Flags, 0), _scalar(ty, 1, N.Int32Flags, 0), _scalar(ty, 2, N.Int32Flags, 128))
    elif kind == "date" and ty is not None:
        params = (_scalar(ty, 0, N.Int16Flags, 1),)
    elif kind == "timestamp" and ty is not None:
        params = (_scalar(ty, 0, N.Int16Flags, 0), _string(ty, 1))
    elif kind == "time" and ty is not None:
        params = (_scalar(ty, 0, N.Int16Flags, 1), _scalar(ty, 1, N.Int32Flags, 32))
    if _slot(t, 4):
        raise ArrowError(f"column {name!r} is dictionary-encoded, which this sink does not read")
    start, n = _vector(t, 5)
    children = [_read_field(Table(t.Bytes, t.Indirect(start + 4 * k))) for k in range(n)]
    return Field(name, nullable, kind, params, children)


def _messages(data):
    """Yields (header type, header table, body memoryview) of each message."""
    view = memoryview(data)
    pos = 0
    while pos + 4 <= len(view):
        (size,) = struct.unpack_from("<i", view, pos)
        pos += 4
        if size == -1:  # continuation marker (format version >= 0.15)
            if pos + 4 > len(view):
                raise ArrowError("stream ends inside a message header")
            (size,) = struct.unpack_from("<i", view, pos)
            pos += 4
        if size == 0:
            return  # end of stream
        if size < 0 or pos + size > len(view):
            raise ArrowError(f"message of {size} bytes does not fit the stream")
        meta = bytes(view[pos:pos + size])
        pos += size
        (root,) = struct.unpack_from("<I", meta, 0)
        msg = Table(meta, root)
        header_type = _scalar(msg, 1, N.Uint8Flags, 0)
        header = _table(msg, 2)
        body_len = _scalar(msg, 3, N.Int64Flags, 0)
        if pos + body_len > len(view):
            raise ArrowError("a message body runs past the end of the stream")
        body = view[pos:pos + body_len]
        pos += body_len
        yield header_type, header, body


def read_schema(data):
    """The fields of the first (schema) message of an IPC stream."""
    for header_type, header, _ in _messages(data):
        if header_type != _SCHEMA or header is None:
            raise ArrowError("an Arrow IPC stream must start with its schema")
        start, n = _vector(header, 1)
        return [_read_field(Table(header.Bytes, header.Indirect(start + 4 * k))) for k in range(n)]
    raise ArrowError("empty Arrow IPC stream")


class _Batch:
    """Walks a record batch's field nodes and buffers in order."""

    def __init__(self, header, body):
        self.length = _scalar(header, 0, N.Int64Flags, 0)
        if _table(header, 3) is not None:
            raise ArrowError("compressed IPC bodies are not supported")
        self.nodes_start, self.node_count = _vector(header, 1)
        self.buffers_start, self.buffer_count = _vector(header, 2)
        self.bytes = header.Bytes
        self.body = body
        self.node = 0
        self.buffer = 0

    def next_node(self):
        if self.node >= self.node_count:
            raise ArrowError("fewer field nodes than columns")
        length, nulls = struct.unpack_from("<qq", self.bytes, self.nodes_start + 16 * self.node)
        self.node += 1
        return length, nulls

    def next_buffer(self):
        if self.buffer >= self.buffer_count:
            raise ArrowError("fewer buffers than the columns need")
        offset, length = struct.unpack_from("<qq", self.bytes, self.buffers_start + 16 * self.buffer)
        self.buffer += 1
        if offset < 0 or offset + length > len(self.body):
            raise ArrowError("a buffer lies outside the message body")
        return self.body[offset:offset + length]


def _validity(buf, length, nulls):
    if nulls == 0 or len(buf) == 0:
        return None
    return [(buf[i >> 3] >> (i & 7)) & 1 == 1 for i in range(length)]


def _apply(values, valid):
    if valid is None:
        return values
    return [v if ok else None for v, ok in zip(values, valid)]


def _fixed(buf, fmt, length):
    size = struct.calcsize(fmt)
    if len(buf) < size * length:
        raise ArrowError("a values buffer is shorter than its column")
    return list(buf[:size * length].cast(fmt)) if len(buf) else []


def _to_text_micros(micros):
    return (_EPOCH + datetime.timedelta(microseconds=micros)).isoformat()


def _decimal_text(unscaled, scale):
    sign = "-" if unscaled < 0 else ""
    digits = str(abs(unscaled))
    if scale <= 0:
        return sign + digits + "0" * (-scale)
    digits = digits.rjust(scale + 1, "0")
    return f"{sign}{digits[:-scale]}.{digits[-scale:]}"


def _column(f, batch):
    length, nulls = batch.next_node()
    if f.kind == "null":
        return [None] * length
    valid = _validity(batch.next_buffer(), length, nulls)
    if f.kind == "int":
        bits, signed = f.params
        fmt = {8: "b", 16: "h", 32: "i", 64: "q"}.get(bits)
        if fmt is None:
            raise ArrowError(f"column {f.name!r}: integers of {bits} bits")
        return _apply(_fixed(batch.next_buffer(), fmt if signed else fmt.upper(), length), valid)
    if f.kind == "floatingpoint":
        fmt = {1: "f", 2: "d"}.get(f.params[0])
        if fmt is None:
            raise ArrowError(f"column {f.name!r}: half-precision floats")
        return _apply(_fixed(batch.next_buffer(), fmt, length), valid)
    if f.kind == "bool":
        buf = batch.next_buffer()
        return _apply([(buf[i >> 3] >> (i & 7)) & 1 == 1 for i in range(length)], valid)
    if f.kind in ("utf8", "binary", "largeutf8", "largebinary"):
        offsets = _fixed(batch.next_buffer(), "q" if f.kind.startswith("large") else "i", length + 1)
        data = batch.next_buffer()
        raw = [bytes(data[offsets[i]:offsets[i + 1]]) for i in range(length)]
        if f.kind.endswith("utf8"):
            raw = [b.decode("utf-8") for b in raw]
        return _apply(raw, valid)
    if f.kind == "decimal":
        _, scale, bits = f.params
        width = bits // 8
        buf = batch.next_buffer()
        values = [
            _decimal_text(int.from_bytes(buf[i * width:(i + 1) * width], "little", signed=True), scale)
            for i in range(length)
        ]
        return _apply(values, valid)
    if f.kind == "date":
        if f.params[0] == 0:  # DAY: int32 days
            days = _fixed(batch.next_buffer(), "i", length)
            return _apply([(_EPOCH_DATE + datetime.timedelta(days=d)).isoformat() for d in days], valid)
        millis = _fixed(batch.next_buffer(), "q", length)
        return _apply([(_EPOCH + datetime.timedelta(milliseconds=m)).date().isoformat() for m in millis], valid)
    if f.kind == "timestamp":
        unit, tz = f.params
        raw = _fixed(batch.next_buffer(), "q", length)
        micros = [v // 1000 for v in raw] if unit == 3 else [v * _TIME_UNITS[unit] for v in raw]
        suffix = "Z" if tz else ""
        return _apply([_to_text_micros(m) + suffix for m in micros], valid)
    raise ArrowError(
        f"column {f.name!r} has Arrow type {f.describe()}, which this sink does not decode "
        "(it reads integers, floats, booleans, strings, binary, decimals, dates and timestamps)"
    )


def read_batches(data):
    """(fields, [columns of each record batch]) of an IPC stream; each
    column is a list of Python values (decimals, dates and timestamps as
    ISO text)."""
    fields = None
    batches = []
    for header_type, header, body in _messages(data):
        if header_type == _SCHEMA:
            start, n = _vector(header, 1)
            fields = [_read_field(Table(header.Bytes, header.Indirect(start + 4 * k))) for k in range(n)]
        elif header_type == _RECORD_BATCH:
            if fields is None:
                raise ArrowError("a record batch came before the schema")
            batch = _Batch(header, body)
            batches.append((batch.length, [_column(f, batch) for f in fields]))
        elif header_type == _DICTIONARY_BATCH:
            raise ArrowError("dictionary batches are not supported")
        else:
            raise ArrowError(f"unexpected IPC message type {header_type}")
    if fields is None:
        raise ArrowError("empty Arrow IPC stream")
    return fields, batches
