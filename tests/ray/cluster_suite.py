"""Sluice on a local Ray cluster of three nodes (one CPU each).

Run by tests/tests/ray.rs, which writes the job files, starts the BigQuery
double and checks what landed; this script runs the jobs through
`sluice.ray` and reads Iceberg tables back with PyIceberg. It prints one
JSON document (the results) as its last line.

Usage: cluster_suite.py SPEC.json, where SPEC names each scenario's job
file and expectations (see tests/tests/ray.rs).
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback

import ray
from ray.cluster_utils import Cluster

import sluice
import sluice.ray
from datasink_driver import dataset

DRIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "datasink_driver.py")

NODE = {"num_cpus": 1, "object_store_memory": 128 * 1024 * 1024}


def pyiceberg_ids(warehouse, table):
    from pyiceberg.catalog.sql import SqlCatalog

    cat = SqlCatalog("sluice", uri=f"sqlite:///{warehouse}/catalog.db", warehouse=f"file://{warehouse}")
    t = cat.load_table(table)
    ids = t.scan(selected_fields=("id",)).to_arrow().column("id").to_pylist()
    checkpoints = [s.summary.additional_properties.get("sluice.checkpoint-id") for s in t.snapshots()]
    return ids, checkpoints


def exactly_once(ids, first, rows):
    """None when `ids` is first..first+rows once each, else what is wrong."""
    if len(ids) != len(set(ids)):
        return f"{len(ids) - len(set(ids))} duplicated ids"
    missing = set(range(first, first + rows)) - set(ids)
    extra = set(ids) - set(range(first, first + rows))
    if missing or extra:
        return f"{len(missing)} ids missing, {len(extra)} unexpected"
    return None


def run_job(spec, cache_dir, cpus_per_writer=0.5, **kw):
    started = time.time()
    summary = sluice.ray.run(
        spec["job"], cache_dir=cache_dir, cpus_per_writer=cpus_per_writer, open_timeout=180, quiet=True, **kw
    )
    summary["wall"] = time.time() - started
    return summary


def iceberg_result(spec, summary, **more):
    """A run's summary with what PyIceberg reads back from its table."""
    ids, checkpoints = pyiceberg_ids(spec["warehouse"], spec["table"])
    return dict(
        more,
        summary=summary,
        pyiceberg_rows=len(ids),
        problem=exactly_once(ids, 0, spec["rows"]),
        snapshots=len(checkpoints),
        distinct_checkpoints=len(set(checkpoints)),
    )


def scenario_iceberg(spec, cache_dir, cluster):
    return iceberg_result(spec, run_job(spec, cache_dir))


def records(state_dir):
    """How many checkpoint records the state directory holds: a local one,
    or one on S3 (`s3://bucket/prefix`, read with boto3 through the same
    AWS environment the engine reads)."""
    if state_dir.startswith("s3://"):
        import boto3

        bucket, _, prefix = state_dir[len("s3://") :].partition("/")
        s3 = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])
        listed = s3.list_objects_v2(Bucket=bucket, Prefix=prefix + "/")
        return sum(1 for o in listed.get("Contents", []) if "/checkpoints/chk-" in o["Key"])
    checkpoints = os.path.join(state_dir, "checkpoints")
    return sum(1 for n in os.listdir(checkpoints) if n.endswith(".json")) if os.path.isdir(checkpoints) else 0


def scenario_node_loss(spec, cache_dir, cluster):
    """Removes a worker node once the run has persisted a checkpoint, and
    adds a node back a few seconds later. The run goes on in a thread: Ray
    starts and stops nodes from the main thread only."""
    events = []
    outcome = {}

    def job():
        try:
            # Two writers per node: after the loss four run, and two wait
            # until a node comes back.
            outcome["summary"] = run_job(spec, cache_dir, overrides=[f"source.rate={spec['rate']}"])
        except Exception as e:  # reported with the scenario's result
            outcome["error"] = e

    t = threading.Thread(target=job, daemon=True)
    t.start()
    deadline = time.time() + 120
    while time.time() < deadline and t.is_alive():
        if records(spec["state_dir"]) > 0:
            break
        time.sleep(0.05)
    if not t.is_alive():
        events.append("the run ended before a node could be removed")
    else:
        victim = cluster.worker_nodes[-1] if isinstance(cluster.worker_nodes, list) else list(cluster.worker_nodes)[-1]
        events.append(f"removing a node after {records(spec['state_dir'])} record(s)")
        cluster.remove_node(victim, allow_graceful=False)
        time.sleep(3)
        cluster.add_node(**NODE)
        events.append("added a node back")
    t.join(timeout=300)
    if "error" in outcome:
        raise RuntimeError(f"{outcome['error']} (events: {events})") from outcome["error"]
    if "summary" not in outcome:
        raise RuntimeError(f"the run did not end within 300 s (events: {events})")
    return iceberg_result(spec, outcome["summary"], events=events)


def scenario_plain(spec, cache_dir, cluster):
    return {"summary": run_job(spec, cache_dir)}


def landed_values(spec):
    """What the Datasink's table holds: rows, and how many of them differ
    from the dataset's values (name `row-<id>`, amount 3 × id)."""
    from pyiceberg.catalog.sql import SqlCatalog

    w = spec["warehouse"]
    cat = SqlCatalog("sluice", uri=f"sqlite:///{w}/catalog.db", warehouse=f"file://{w}")
    landed = cat.load_table(spec["table"]).scan().to_arrow().to_pydict()
    wrong = sum(
        1
        for i, name, amount in zip(landed["id"], landed["name"], landed["amount"])
        if name != f"row-{i}" or amount != 3 * i
    )
    return len(landed["id"]), wrong


def write_again(spec, cache_dir):
    """The same state directory again: the error that refuses it, if any."""
    try:
        dataset(spec["rows"]).write_datasink(sluice.ray.Datasink(spec["job"], cache_dir=cache_dir))
    except Exception as e:  # Ray wraps the driver-side error
        return str(e)
    return None


def scenario_datasink(spec, cache_dir, cluster):
    rows = spec["rows"]
    sink = sluice.ray.Datasink(spec["job"], cache_dir=cache_dir)
    dataset(rows).write_datasink(sink)
    ids, checkpoints = pyiceberg_ids(spec["warehouse"], spec["table"])
    _, wrong = landed_values(spec)
    first = {
        "pyiceberg_rows": len(ids),
        "problem": exactly_once(ids, 0, rows),
        "snapshots": len(checkpoints),
        "wrong_values": wrong,
        "outcome": sink.outcome,
    }
    # The same state directory again: refused, nothing lands twice.
    again = write_again(spec, cache_dir)
    ids_after, _ = pyiceberg_ids(spec["warehouse"], spec["table"])
    # The dataset again as an overwrite (`mode`), from a fresh state
    # directory as a new incarnation: it replaces what it touches (the whole
    # unpartitioned table), so every id is there once, in one more snapshot.
    rerun = [f"job.state_dir={json.dumps(spec['rerun_state_dir'])}"]
    over = sluice.ray.Datasink(
        spec["job"], overrides=rerun, cache_dir=cache_dir, new_incarnation=True, mode="overwrite-partitions"
    )
    dataset(rows).write_datasink(over)
    ids_over, checkpoints_over = pyiceberg_ids(spec["warehouse"], spec["table"])
    # A mode the plugin does not know is refused, naming the option.
    try:
        elsewhere = [f"job.state_dir={json.dumps(spec['bad_mode_state_dir'])}"]
        dataset(10).write_datasink(
            sluice.ray.Datasink(spec["job"], overrides=elsewhere, cache_dir=cache_dir, mode="sideways")
        )
        bad_mode = None
    except Exception as e:  # Ray wraps the driver-side error
        bad_mode = str(e)
    return dict(
        first,
        second_write_error=again,
        rows_after_second=len(ids_after),
        overwrite_outcome=over.outcome,
        overwrite_problem=exactly_once(ids_over, 0, rows),
        overwrite_snapshots=len(checkpoints_over),
        bad_mode_error=bad_mode,
    )


def scenario_datasink_kill(spec, cache_dir, cluster):
    """A driver SIGKILLed between persisting the Datasink's checkpoint and
    committing it; the next write into the same state directory finishes
    the commit, once, and refuses to land the dataset again."""
    env = dict(os.environ, SLUICE_TEST_CRASH="after-persist")
    args = [sys.executable, DRIVER, cluster.address, spec["job"], str(spec["rows"]), cache_dir]
    p = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    job = sluice.Job.load(spec["job"])
    # What the killed driver left: its record, and what is visible.
    store = sluice.CheckpointStore.for_job(job)
    latest = store.latest()
    del store  # releases the state directory's lock
    record = json.loads(latest) if latest else {}
    try:
        ids_before, _ = pyiceberg_ids(spec["warehouse"], spec["table"])
    except Exception:  # noqa: BLE001 - no table yet is nothing visible too
        ids_before = []
    again = write_again(spec, cache_dir)
    ids, checkpoints = pyiceberg_ids(spec["warehouse"], spec["table"])
    rows, wrong = landed_values(spec)
    store = sluice.CheckpointStore.for_job(job)
    after = json.loads(store.latest())
    del store
    return {
        "killed_by_sigkill": p.returncode == -signal.SIGKILL,
        "crash_point_reached": "crash point reached" in p.stdout,
        "driver_output": (p.stdout + p.stderr)[-2000:],
        "pending_after_kill": len(record.get("pending", [])),
        "committed_after_kill": record.get("last_committed"),
        "rows_visible_after_kill": len(ids_before),
        "second_write_error": again,
        "pyiceberg_rows": len(ids),
        "problem": exactly_once(ids, 0, spec["rows"]),
        "snapshots": len(checkpoints),
        "distinct_checkpoints": len(set(checkpoints)),
        "rows_read": rows,
        "wrong_values": wrong,
        "pending_at_end": len(after["pending"]),
        "committed_at_end": after["last_committed"],
    }


def scenario_low_level(spec, cache_dir, cluster):
    """The package without Ray: a writer driven by hand through one
    checkpoint, which the engine's landing persists and commits; the GIL is
    free while the plugin works; errors read as the CLI's."""
    import pyarrow as pa

    job = sluice.Job.load(spec["job"])
    host = sluice.Host(cache_dir)
    sink = sluice.Sink(job, host)
    landing = sluice.Landing(job, host)
    ctx = landing.context()
    rows = spec["rows"]
    batch = pa.record_batch(
        {
            "id": pa.array(range(rows), pa.int64()),
            "name": pa.array([f"row-{i}" for i in range(rows)], pa.string()),
        }
    )
    tables = sluice.tables(batch.schema)
    landing.open_committer(tables[0][1])
    writer = sink.open_writer(dict(ctx, subtask=0), tables)

    # A Python thread counts while the plugin writes. With a switch
    # interval of 10 s the interpreter never takes the GIL from the writing
    # thread, so the counter runs only while a call has released it.
    counted = [0]
    stop = threading.Event()

    def count():
        while not stop.is_set():
            counted[0] += 1
            time.sleep(0)  # hands the GIL back whenever the writer wants it

    ipc = sluice.ipc_batch(batch)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(10.0)
    try:
        t = threading.Thread(target=count, daemon=True)
        t.start()
        began = time.perf_counter()
        writes = 0
        while time.perf_counter() - began < 1.0:
            writer.write(ipc, "")
            writes += 1
        stop.set()
        t.join()
    finally:
        sys.setswitchinterval(interval)
    # Bytes that are not a whole Arrow IPC stream are refused with a message
    # that says so; nothing of them lands, and the writer goes on.
    refused = {}
    # A whole stream of the right schema whose strings are not UTF-8 (pyarrow
    # builds it unchecked): the host validates a user's bytes, as it promises
    # plugins only valid Arrow data.
    bad_utf8 = pa.record_batch(
        [
            pa.array([0], pa.int64()),
            pa.Array.from_buffers(pa.string(), 1, [None, pa.py_buffer(b"\x00\x00\x00\x00\x02\x00\x00\x00"), pa.py_buffer(b"\xff\xfe")]),
        ],
        schema=batch.schema,
    )
    for name, payload in (
        ("garbage", b"not arrow at all"),
        ("truncated", ipc[: len(ipc) // 2]),
        ("invalid_utf8", sluice.ipc_batch(bad_utf8)),
        # Valid, but the table's columns in another order: a plugin that
        # reads columns by position would land them under the wrong names.
        ("reordered", sluice.ipc_batch(batch.select(["name", "id"]))),
    ):
        try:
            writer.write(payload, "")
            refused[name] = None
        except sluice.SluiceError as e:
            refused[name] = str(e)
    # A pyarrow batch is taken as it is, too.
    writer.write(batch)
    writes += 1
    info = writer.prepare_commit(1)
    writer.close()
    landed = landing.land([(info, rows * writes)], tables[0][1])
    landing.close()
    store = sluice.CheckpointStore.for_job(job)
    latest = json.loads(store.latest())
    del store
    # A second landing into the same state directory is refused.
    try:
        sluice.Landing(job, host)
        again = None
    except sluice.SluiceError as e:
        again = str(e)
    # A job error, as a Python exception with the CLI's message.
    try:
        sluice.Sink(sluice.Job.load(spec["bad_job"]), host).open_writer(dict(ctx, subtask=0), tables)
        error = None
    except sluice.SluiceError as e:
        error = str(e)
    return {
        "writes": writes,
        "refused": refused,
        "rows": rows * writes,
        "counted_while_writing": counted[0],
        "outcome": landed["outcome"],
        "landed_rows": landed["rows"],
        "second_landing_error": again,
        "record_pending": len(latest["pending"]),
        "record_committed": latest["last_committed"],
        "error": None,
        "bad_job_error": error,
        "ray_error": ray_error(spec["bad_job"], cache_dir),
    }


def ray_error(path, cache_dir):
    try:
        sluice.ray.run(path, cache_dir=cache_dir, quiet=True)
    except sluice.SluiceError as e:
        return str(e)
    return None


SCENARIOS = {
    "low_level": scenario_low_level,
    "iceberg": scenario_iceberg,
    "files": scenario_plain,
    "bigquery": scenario_plain,
    "datasink": scenario_datasink,
    "datasink_kill": scenario_datasink_kill,
    "node_loss": scenario_node_loss,
    # A bounded Kafka source (three partitions over three writers): the
    # same runner, each actor reading the partitions the owner rule gives it.
    "kafka": scenario_iceberg,
}


def main():
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    cache_dir = spec["cache_dir"]
    started = time.time()
    cluster = Cluster(initialize_head=True, head_node_args=dict(NODE, include_dashboard=False))
    cluster.add_node(**NODE)
    cluster.add_node(**NODE)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)
    results = {"cluster_start": time.time() - started, "nodes": len(ray.nodes())}
    try:
        for name in spec["order"]:
            began = time.time()
            try:
                results[name] = SCENARIOS[name](spec[name], cache_dir, cluster)
            except Exception as e:  # reported to the Rust test, which fails with it
                results[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
            results[name].setdefault("error", None)
            results[name]["seconds"] = time.time() - began
            print(f"{name}: {time.time() - began:.1f} s", file=sys.stderr, flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()
    print(json.dumps(results, default=str))


if __name__ == "__main__":
    main()
