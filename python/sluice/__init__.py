"""Sluice from Python: exactly-once landing of Arrow data through sandboxed
WebAssembly sink plugins.

The engine is Rust (``sluice._native``); this package adds what is easier
said in Python: turning pyarrow objects into the Arrow IPC bytes that cross
into a plugin, and the Ray runner (``sluice.ray``).

Every call into a plugin, the checkpoint store or the coordinator releases
the GIL. Errors are ``SluiceError`` with the message ``sluice`` prints.
"""

from __future__ import annotations

from typing import Iterable, List, Optional, Sequence, Tuple

from ._native import (
    CheckpointStore,
    Committer,
    Host,
    Job,
    Landing,
    Retryable,
    Sink,
    SluiceError,
    Worker,
    Writer,
    WriterLost,
    init_logging,
    run,
)

__all__ = [
    "CheckpointStore",
    "Committer",
    "Host",
    "Job",
    "Landing",
    "Retryable",
    "Sink",
    "SluiceError",
    "Worker",
    "Writer",
    "WriterLost",
    "init_logging",
    "ipc_batch",
    "ipc_schema",
    "run",
    "sink_context",
    "tables",
    "write",
]


def ipc_batch(batch) -> bytes:
    """A pyarrow ``RecordBatch`` as one Arrow IPC stream (schema and batch):
    the form in which rows cross into a plugin, a whole batch at a time."""
    import pyarrow as pa

    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as stream:
        stream.write_batch(batch)
    return sink.getvalue().to_pybytes()


def ipc_schema(schema) -> bytes:
    """A pyarrow ``Schema`` as an Arrow IPC stream without batches."""
    import pyarrow as pa

    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema):
        pass
    return sink.getvalue().to_pybytes()


def tables(schemas) -> List[Tuple[str, bytes]]:
    """``[(name, schema_ipc)]`` for ``Sink.open_writer``/``open_committer``,
    from a pyarrow schema (the one unnamed table) or a ``{name: schema}``."""
    if isinstance(schemas, dict):
        return [(name, ipc_schema(s)) for name, s in schemas.items()]
    return [("", ipc_schema(schemas))]


def write(writer: Writer, data, table: str = "") -> int:
    """Writes a pyarrow ``RecordBatch`` or ``Table`` (batch by batch, each as
    one IPC stream); returns the rows written."""
    batches: Iterable = data.to_batches() if hasattr(data, "to_batches") else [data]
    rows = 0
    for batch in batches:
        if batch.num_rows == 0:
            continue
        writer.write(ipc_batch(batch), table)
        rows += batch.num_rows
    return rows


def sink_context(
    job: Job,
    incarnation: str,
    subtask: int,
    parallelism: Optional[int] = None,
    attempt: int = 0,
    refuse_other_incarnations: bool = False,
    beside: bool = False,
) -> dict:
    """The sink context of an instance of ``job``'s sink (``Landing.context``
    gives the one its writers open with)."""
    return {
        "job_id": job.id,
        "sink_id": job.sink_id,
        "incarnation": incarnation,
        "refuse_other_incarnations": refuse_other_incarnations,
        "beside": beside,
        "subtask": subtask,
        "parallelism": job.parallelism if parallelism is None else parallelism,
        "attempt": attempt,
    }
