"""Sluice on a Ray cluster.

``run(job_file)`` runs a job file, the same one ``sluice run`` takes, with
one Ray actor per writer subtask, spread over the cluster's nodes. Each
actor reads its own split of the source and writes it through its own
plugin instance. The driver (this process) is the one committer: the Rust
coordinator persists every checkpoint to the job's state directory before
committing it, exactly as ``sluice run`` does; only where the writers run
differs.

When an actor or its node dies, the coordinator stops the open round (the
surviving writers release what they prepared), this runner kills the
remaining actors, and a new run resumes from the last persisted checkpoint
with new actors: its pending commits are committed again (commits are
idempotent) and the writers replay from their recorded positions. Rows stay
exactly once.

``Datasink`` writes a Ray ``Dataset`` through any Sluice sink plugin, with
one commit at the end, which the engine persists and commits
(``sluice.Landing``).

Every node must see the same paths: the plugin, the job's data and
warehouse, and, for the driver, the state directory (a local path in tests,
a shared file system in production).
"""

from __future__ import annotations

import json
import logging
import random
from typing import Any, Dict, List, Optional, Sequence

import ray
import ray.data
import ray.exceptions

from .. import Host, Job, Landing, Sink, SluiceError, Worker, WriterLost, _native
from .. import ipc_batch, ipc_schema

__all__ = ["Datasink", "RayPool", "run"]

log = logging.getLogger("sluice.ray")

#: Ray errors that mean an actor, its worker process or its node is gone.
_LOST = (
    ray.exceptions.RayActorError,
    ray.exceptions.NodeDiedError,
    ray.exceptions.WorkerCrashedError,
    ray.exceptions.ObjectLostError,
    ray.exceptions.OwnerDiedError,
)
if hasattr(ray.exceptions, "ActorUnavailableError"):
    _LOST = _LOST + (ray.exceptions.ActorUnavailableError,)


def _job_parts(job: Job) -> Dict[str, Any]:
    return {"text": job.text, "path": str(job.path), "overrides": list(job.overrides)}


def _job_from(parts: Dict[str, Any]) -> Job:
    return Job.from_text(parts["text"], parts["path"], parts["overrides"])


@ray.remote(max_restarts=0, max_task_retries=0)
class WriterActor:
    """One writer subtask: a ``sluice._native.Worker`` in an actor.

    Job errors come back as ``("error", message)``, so that only a lost
    actor surfaces as a Ray error."""

    def __init__(self, job: Dict[str, Any], cache_dir: Optional[str], setup: bytes):
        self._error: Optional[str] = None
        self._worker: Optional[Worker] = None
        try:
            self._worker = Worker(_job_from(job), Host(cache_dir), setup)
        except Exception as e:  # noqa: BLE001 - a job error, or a node without the package: the driver says which
            self._error = str(e) if isinstance(e, SluiceError) else f"{type(e).__name__}: {e}"

    def ready(self):
        if self._error is not None:
            return ("error", self._error)
        return ("ok", ray.get_runtime_context().get_node_id())

    def _call(self, f, *args):
        if self._worker is None:
            return ("error", self._error or "the writer did not open")
        try:
            return ("ok", f(*args))
        except SluiceError as e:
            return ("error", str(e))

    def round(self, c: int):
        return self._call(lambda: self._worker.round(c))

    def apply(self, changes: bytes):
        return self._call(lambda: self._worker.apply(changes))

    def abort_prepare(self, c: int):
        return self._call(lambda: self._worker.abort_prepare(c))

    def close(self):
        return self._call(lambda: self._worker.close())


def _answer(result):
    """The value of an actor's ``("ok", value)``; raises its error."""
    kind, value = result
    if kind == "ok":
        return value
    raise SluiceError(value)


class RayPool:
    """The writers of one run, as Ray actors; the coordinator drives it.

    ``open`` waits until every actor is placed and its writer open (at most
    ``open_timeout`` seconds: a cluster short of CPUs waits for a node to
    come back)."""

    def __init__(
        self,
        job: Job,
        cache_dir: Optional[str] = None,
        cpus_per_writer: float = 1.0,
        open_timeout: float = 600.0,
    ):
        self.job = job
        self.cache_dir = cache_dir
        self.cpus_per_writer = cpus_per_writer
        self.open_timeout = open_timeout
        self.actors: List[Any] = []
        self.nodes: List[str] = []
        self._round: List[Any] = []

    # The coordinator's calls (see `PyPool` in python/src/coordinator.rs).

    def open(self, setups: Sequence[bytes]) -> None:
        parts = _job_parts(self.job)
        self.actors = [
            WriterActor.options(num_cpus=self.cpus_per_writer, scheduling_strategy="SPREAD").remote(
                parts, self.cache_dir, setup
            )
            for setup in setups
        ]
        refs = [a.ready.remote() for a in self.actors]
        ready, waiting = ray.wait(refs, num_returns=len(refs), timeout=self.open_timeout)
        if waiting:
            raise SluiceError(
                f"{len(waiting)} of {len(refs)} writers were not placed within {self.open_timeout:.0f} s: "
                f"the cluster has too few CPUs for {len(refs)} writers of {self.cpus_per_writer} CPU each "
                f"({ray.available_resources().get('CPU', 0):g} of {ray.cluster_resources().get('CPU', 0):g} CPUs free)"
            )
        nodes = []
        for i, ref in enumerate(refs):
            try:
                nodes.append(_answer(ray.get(ref)))
            except _LOST as e:
                raise WriterLost(f"writer {i} was lost while opening: {type(e).__name__}") from None
        self.nodes = nodes
        log.info("%d writers on %d node(s)", len(nodes), len(set(nodes)))

    def start_round(self, c: int) -> None:
        self._round = [a.round.remote(c) for a in self.actors]

    def gather(self, c: int) -> List[Any]:
        out: List[Any] = []
        for i, ref in enumerate(self._round):
            try:
                kind, value = ray.get(ref)
                out.append(value if kind == "ok" else SluiceError(value))
            except _LOST as e:
                out.append(WriterLost(f"its actor died in round {c} ({type(e).__name__}: {_first_line(e)})"))
            except ray.exceptions.RayTaskError as e:
                out.append(SluiceError(f"the actor failed in round {c}: {_first_line(e)}"))
        self._round = []
        return out

    def abort_prepare(self, c: int, subtasks: Sequence[int]) -> None:
        refs = [self.actors[i].abort_prepare.remote(c) for i in subtasks]
        for ref in refs:
            try:
                _answer(ray.get(ref))
            except (ray.exceptions.RayError, SluiceError) as e:
                log.warning("abort-prepare of checkpoint %d failed: %s", c, _first_line(e))

    def apply(self, changes: bytes) -> None:
        refs = [a.apply.remote(changes) for a in self.actors]
        for i, ref in enumerate(refs):
            try:
                _answer(ray.get(ref))
            except _LOST as e:
                raise WriterLost(f"writer {i} was lost applying a schema change: {type(e).__name__}") from None

    def close(self) -> int:
        refs = [a.close.remote() for a in self.actors]
        peak = 0
        for i, ref in enumerate(refs):
            try:
                peak = max(peak, int(_answer(ray.get(ref))))
            except _LOST as e:
                raise WriterLost(f"writer {i} was lost while closing: {type(e).__name__}") from None
        return peak

    # The runner's.

    def shutdown(self) -> None:
        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001 - an actor already gone is fine
                pass
        self.actors = []


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _with_mode(overrides: Sequence[str], mode: Optional[str]) -> List[str]:
    """The overrides, plus ``sink.options.mode`` when ``mode`` is given (a
    TOML string, so any text reaches the plugin as it is, and the plugin
    refuses a mode it does not know, naming the option)."""
    out = list(overrides)
    if mode is not None:
        out.append(f"sink.options.mode={json.dumps(mode)}")
    return out


def run(
    job_file: str,
    address: Optional[str] = None,
    overrides: Sequence[str] = (),
    cache_dir: Optional[str] = None,
    cpus_per_writer: float = 1.0,
    max_recoveries: int = 10,
    open_timeout: float = 600.0,
    new_incarnation: bool = False,
    quiet: bool = False,
    mode: Optional[str] = None,
) -> Dict[str, Any]:
    """Runs a job file on a Ray cluster to the end of its source, resuming
    from its last checkpoint; returns the run's summary (``text`` is what
    ``sluice run`` prints). A lost writer (actor or node) costs a recovery:
    at most ``max_recoveries`` of them. ``mode`` sets the sink's
    ``[sink.options] mode`` (``"append"`` or ``"overwrite-partitions"``, as
    the plugin takes them), as in the job file."""
    if not ray.is_initialized():
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
    job = Job.load(job_file, _with_mode(overrides, mode))
    host = Host(cache_dir)
    recoveries: List[str] = []
    while True:
        pool = RayPool(job, cache_dir=cache_dir, cpus_per_writer=cpus_per_writer, open_timeout=open_timeout)
        try:
            summary = _native.run(job, host, pool, new_incarnation=new_incarnation and not recoveries, quiet=quiet)
            summary["recoveries"] = recoveries
            summary["nodes"] = len(set(pool.nodes))
            return summary
        except WriterLost as e:
            if len(recoveries) >= max_recoveries:
                raise
            recoveries.append(str(e))
            log.warning("%s; resuming from the last checkpoint with new writers (recovery %d)", e, len(recoveries))
        finally:
            pool.shutdown()


class Datasink(ray.data.Datasink):
    """Writes a Ray ``Dataset`` through a job file's sink, exactly once, with
    one commit at the end.

    The job file's ``[sink]`` section names the plugin, its options and
    grants; its ``[source]`` is not read (the dataset is the source). Each
    write task opens a writer, writes its blocks as Arrow IPC batches and
    prepares checkpoint 1, returning its commit info. The driver hands the
    infos to the engine (``sluice.Landing``), which combines them, persists
    the checkpoint to the job's state directory and only then commits it,
    retrying under ``[job.commit]``, as ``sluice run`` does.

    A state directory lands one dataset: a second write with the same state
    directory first finishes a commit the first left pending, then refuses
    to write the dataset again. ``new_incarnation`` lands beside the job's
    other incarnations on purpose (``sluice run --new-incarnation``).
    ``mode`` sets the sink's ``[sink.options] mode`` (``"append"`` or
    ``"overwrite-partitions"``, as the plugin takes them): a rerun of an
    overwrite with ``new_incarnation`` and a fresh state directory replaces
    the partitions the dataset touches again."""

    def __init__(
        self,
        job_file: str,
        overrides: Sequence[str] = (),
        cache_dir: Optional[str] = None,
        schema=None,
        new_incarnation: bool = False,
        mode: Optional[str] = None,
    ):
        self._job = _job_parts(Job.load(job_file, _with_mode(overrides, mode)))
        self._cache_dir = cache_dir
        self._new_incarnation = new_incarnation
        # The writers' sink context, from the landing (set on the driver).
        self._ctx: Optional[Dict[str, Any]] = None
        # The dataset's schema (pyarrow), when the caller knows it; else
        # the first block's, when Ray tells it to `on_write_start`.
        self._schema: Optional[bytes] = ipc_schema(schema) if schema is not None else None
        # Driver-only: the landing (it holds the state directory's lock).
        self._driver: Dict[str, Any] = {}
        self.rows_written = 0
        self.outcome: Optional[str] = None

    def __getstate__(self):
        # The landing (and its lock) stays with the driver.
        state = dict(self.__dict__)
        state["_driver"] = {}
        return state

    def get_name(self) -> str:
        return "Sluice"

    def on_write_start(self, schema=None) -> None:
        # Ray calls this on the driver with the first block's schema, before
        # the write tasks are serialized: what it sets here reaches them.
        # Opening the landing finishes what an earlier write left pending
        # and refuses a state directory that already landed a dataset.
        landing = Landing(_job_from(self._job), Host(self._cache_dir), new_incarnation=self._new_incarnation)
        self._driver = {"landing": landing}
        self._ctx = dict(landing.context())
        if self._schema is None and schema is not None and hasattr(schema, "names"):
            self._schema = ipc_schema(schema)
        if self._schema is not None:
            # The committer opens first: a sink that creates its table
            # (Iceberg's `create_table`) does so before any writer opens.
            landing.open_committer(self._schema)

    def write(self, blocks, ctx) -> Dict[str, Any]:
        job = _job_from(self._job)
        sink = Sink(job, Host(self._cache_dir))
        writer = None
        schema = None
        rows = 0
        # Each write task (and each retry of one) writes under an attempt
        # of its own, so no two ever name a file alike.
        attempt = random.getrandbits(31)
        for block in blocks:
            table = block if hasattr(block, "to_batches") else _arrow(block)
            if writer is None:
                schema = ipc_schema(table.schema)
                if self._schema is None:
                    # Ray could not tell the schema before the first task:
                    # opening a committer instance makes the target take
                    # this block's schema (creating or evolving a table is
                    # idempotent and safe to race); it commits nothing.
                    sink.open_committer(dict(self._ctx, subtask=0), [("", schema)])
                c = dict(self._ctx, subtask=ctx.task_idx, parallelism=ctx.task_idx + 1, attempt=attempt)
                writer = sink.open_writer(c, [("", schema)])
            for batch in table.to_batches():
                if batch.num_rows:
                    writer.write(ipc_batch(batch), "")
                    rows += batch.num_rows
        if writer is None:
            return {"info": None, "rows": 0}
        info = writer.prepare_commit(1)
        writer.close()
        return {"info": info, "rows": rows, "schema": schema}

    def on_write_complete(self, write_result) -> None:
        returns = [r for r in write_result.write_returns if r]
        self.rows_written = sum(r["rows"] for r in returns)
        schema = self._schema or next((r["schema"] for r in returns if r.get("schema")), None)
        landing = self._driver["landing"]
        try:
            if schema is None:
                self.outcome = "nothing to commit"
                return
            summary = landing.land([(r.get("info"), r["rows"]) for r in returns], schema)
            self.outcome = summary["outcome"] or "nothing to commit"
        finally:
            landing.close()
            self._driver = {}

    def on_write_failed(self, error: Exception) -> None:
        log.warning("the dataset write failed before its commit; nothing was committed: %s", error)
        landing = self._driver.get("landing")
        if landing is not None:
            landing.close()
        self._driver = {}


def _arrow(block):
    """A block as a pyarrow Table (Ray Data blocks are Arrow or pandas)."""
    import pyarrow as pa

    return pa.Table.from_pandas(block, preserve_index=False)
