"""Rows/s of one job through Ray at 1, 2 and 3 nodes, beside `sluice run`
in one process, as ratios measured in the same run.

Every configuration runs the same job: the same generator rows, the same
parallelism (writers), the same rows per checkpoint, into a fresh Iceberg
warehouse (SQLite catalog) each time. Nodes of a local Ray cluster share
this machine's cores, so the ratios measure what Ray costs (actor start,
a barrier through the driver, reports crossing processes), not a speed-up.

Usage (from the repository root, after building the plugins, the release
`sluice` and the release wheel; see the README's "Running on Ray"):

    python bench/ray/ray_bench.py [--rows N] [--parallelism P] [--every-rows K] [--repeat R]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def job_toml(rows: int, parallelism: int, every_rows: int, plugin: str) -> str:
    return f"""
[job]
id = "ray-bench"
parallelism = {parallelism}
state_dir = "state"
[job.checkpoint]
every_rows = {every_rows}
[source]
kind = "generator"
rows = {rows}
[sink]
id = "lake"
plugin = "{plugin}"
[sink.options]
table = "bench.events"
partition_by = "day(day)"
[sink.catalog]
name = "sluice"
database = "warehouse/catalog.db"
warehouse = "warehouse"
[sink.sandbox]
memory_mb = 1024
"""


def fresh_job(args) -> str:
    d = tempfile.mkdtemp(prefix="sluice-ray-bench-")
    path = os.path.join(d, "job.toml")
    with open(path, "w") as f:
        f.write(job_toml(args.rows, args.parallelism, args.every_rows, args.plugin))
    return path


def run_cli(args) -> dict:
    path = fresh_job(args)
    started = time.time()
    out = subprocess.run(
        [args.sluice, "--cache-dir", args.cache_dir, "-q", "run", path], capture_output=True, text=True, check=False
    )
    wall = time.time() - started
    if out.returncode != 0:
        sys.exit(f"sluice run failed:\n{out.stderr}")
    record = record_sizes(os.path.dirname(path))
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)
    moving = re.search(r"over ([0-9.]+)s of data movement", out.stdout)
    data = float(moving.group(1)) if moving else wall
    return {"wall": wall, "data": data, "line": out.stdout.strip(), "record": record}


def record_sizes(job_dir: str) -> dict:
    """The largest checkpoint record kept (one that carries a pending
    commit), the part of it each writer adds (source position and writer
    state), and the pending commit's part."""
    d = os.path.join(job_dir, "state", "checkpoints")
    biggest = {"bytes": 0, "per_writer": 0, "pending": 0}
    for name in sorted(n for n in os.listdir(d) if n.endswith(".json")):
        with open(os.path.join(d, name)) as f:
            text = f.read()
        # A header line (magic, length, checksum), then the JSON record.
        record = json.loads(text.split("\n", 1)[1])
        if len(text) > biggest["bytes"]:
            per_writer = [len(json.dumps(s)) for s in record["subtasks"]]
            biggest = {
                "bytes": len(text),
                "per_writer": statistics.mean(per_writer) if per_writer else 0,
                "pending": sum(len(json.dumps(p)) for p in record["pending"]),
            }
    return biggest


def run_ray(args, nodes: int) -> dict:
    import ray
    from ray.cluster_utils import Cluster

    import sluice.ray

    # Each node may hold every writer: placement is spread, not limited.
    node = {"num_cpus": args.parallelism, "object_store_memory": 256 * 1024 * 1024}
    cluster = Cluster(initialize_head=True, head_node_args=dict(node, include_dashboard=False))
    for _ in range(nodes - 1):
        cluster.add_node(**node)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)
    try:
        # One warm-up run places the compiled plugin in every node's view
        # of the cache and starts Ray's worker processes.
        sluice.ray.run(fresh_job(args), cache_dir=args.cache_dir, quiet=True)
        walls, datas = [], []
        used = 0
        for _ in range(args.repeat):
            path = fresh_job(args)
            started = time.time()
            summary = sluice.ray.run(path, cache_dir=args.cache_dir, quiet=True)
            walls.append(time.time() - started)
            datas.append(summary["data_elapsed"])
            used = summary["nodes"]
            assert summary["rows_total"] == args.rows, summary
            shutil.rmtree(os.path.dirname(path), ignore_errors=True)
        return {"wall": statistics.median(walls), "data": statistics.median(datas), "nodes_used": used}
    finally:
        ray.shutdown()
        cluster.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=2_000_000)
    p.add_argument("--parallelism", type=int, default=4)
    p.add_argument("--every-rows", type=int, default=100_000, help="rows per checkpoint, per writer")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--sluice", default=os.path.join(os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target")), "release", "sluice"))
    p.add_argument(
        "--plugin",
        default=os.path.join(
            os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target")),
            "guests/wasm32-wasip2/release/sluice_sink_iceberg.wasm",
        ),
    )
    p.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "sluice-ray-bench-cache"))
    args = p.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

    print(
        f"# {args.rows:,} rows, {args.parallelism} writers, a checkpoint every {args.every_rows:,} rows per writer, "
        f"Iceberg (SQLite catalog), {os.cpu_count()} cores; median of {args.repeat}",
        flush=True,
    )
    run_cli(args)  # warm: compiles the plugin into the cache
    cli_runs = [run_cli(args) for _ in range(args.repeat)]
    cli = statistics.median(r["wall"] for r in cli_runs)
    cli_data = statistics.median(r["data"] for r in cli_runs)
    record = cli_runs[-1]["record"]
    rows = []
    rows.append(("sluice run (1 process)", 1, cli, cli_data))
    for nodes in (1, 2, 3):
        r = run_ray(args, nodes)
        rows.append((f"sluice.ray, {nodes} node(s)", r["nodes_used"], r["wall"], r["data"]))
    # Wall: the whole run (writers started, plugin loaded, every checkpoint
    # committed). Moving: from the first round to the end, without start-up.
    print(
        f"{'configuration':<24} {'nodes':>5} {'wall s':>7} {'rows/s':>10} {'ratio':>6} "
        f"{'start-up s':>10} {'moving rows/s':>13} {'ratio':>6}"
    )
    for name, used, wall, data in rows:
        print(
            f"{name:<24} {used:>5} {wall:>7.2f} {args.rows / wall:>10,.0f} {cli / wall:>5.2f}x "
            f"{wall - data:>10.2f} {args.rows / data:>13,.0f} {cli_data / data:>5.2f}x"
        )
    print(
        f"largest checkpoint record: {record['bytes']:,} bytes: {record['per_writer']:,.0f} bytes per writer "
        f"(source position and writer state), {record['pending']:,} bytes of pending commit"
    )
    print(json.dumps({name: {"wall": wall, "moving": data} for name, _, wall, data in rows}))


if __name__ == "__main__":
    main()
