"""The upsert benchmark's inputs, its PyIceberg side and its judge, for
`bench/src/bin/upsert-bench.rs` (issue 41, point 8).

    python3 pyiceberg_upsert.py gen DIR ROWS ROUNDS CHANGES UPDATE_SHARE SEED
    python3 pyiceberg_upsert.py upsert WAREHOUSE TABLE DIR ROUNDS
    python3 pyiceberg_upsert.py digest WAREHOUSE TABLE

`gen` writes DIR/000-initial.parquet (ROWS rows, ids 0..ROWS) and
DIR/rounds/NNN-round.parquet (CHANGES rows each: UPDATE_SHARE of them update
distinct existing ids, the rest insert new ids), from SEED, and prints the
model's digest: the table every side must end with.

`upsert` is PyIceberg's side: it creates TABLE, appends the initial rows (not
timed), then calls `table.upsert(round, join_cols=["id"])` once per round,
one commit each, and prints one JSON line with each round's wall and
process CPU seconds (every thread of the process, pyarrow's included) and
what PyIceberg reports it updated and inserted.

`digest` prints the row count and a SHA-256 over the table's rows sorted by
id, as PyIceberg's scan reads them (position deletes applied).
"""

import hashlib
import json
import os
import random
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
from pyiceberg.catalog.sql import SqlCatalog

SCHEMA = pa.schema(
    [
        pa.field("id", pa.int64(), nullable=False),
        pa.field("name", pa.string()),
        pa.field("amount", pa.int64()),
        pa.field("score", pa.float64()),
    ]
)


def catalog(warehouse):
    return SqlCatalog("sluice", uri=f"sqlite:///{warehouse}/catalog.db", warehouse=f"file://{warehouse}")


def rows_of(ids, version, rng):
    return pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "name": pa.array([f"customer-{i}-v{version}" for i in ids]),
            "amount": pa.array([rng.randrange(0, 1_000_000) for _ in ids], pa.int64()),
            "score": pa.array([rng.random() for _ in ids], pa.float64()),
        },
        schema=SCHEMA,
    )


def digest_of(table):
    table = table.sort_by("id")
    h = hashlib.sha256()
    cols = [table.column(c).to_pylist() for c in ("id", "name", "amount", "score")]
    for row in zip(*cols):
        h.update(repr(row).encode())
    return {"rows": table.num_rows, "sha256": h.hexdigest()}


def gen(out, rows, rounds, changes, update_share, seed):
    rng = random.Random(seed)
    os.makedirs(os.path.join(out, "rounds"), exist_ok=True)
    initial = rows_of(list(range(rows)), 0, rng)
    pq.write_table(initial, os.path.join(out, "000-initial.parquet"))
    model = {r["id"]: r for r in initial.to_pylist()}
    next_id = rows
    for k in range(1, rounds + 1):
        updates = int(changes * update_share)
        ids = rng.sample(range(next_id), updates) + list(range(next_id, next_id + changes - updates))
        next_id += changes - updates
        rng.shuffle(ids)
        batch = rows_of(ids, k, rng)
        pq.write_table(batch, os.path.join(out, "rounds", f"{k:03}-round.parquet"))
        for r in batch.to_pylist():
            model[r["id"]] = r
    final = pa.Table.from_pylist([model[i] for i in sorted(model)], schema=SCHEMA)
    print(json.dumps(digest_of(final)))


def upsert(warehouse, ident, data, rounds):
    cat = catalog(warehouse)
    cat.create_namespace_if_not_exists(ident.split(".")[0])
    table = cat.create_table(ident, schema=SCHEMA)
    table.append(pq.read_table(os.path.join(data, "000-initial.parquet")))
    out = []
    for k in range(1, rounds + 1):
        batch = pq.read_table(os.path.join(data, "rounds", f"{k:03}-round.parquet"))
        wall, cpu = time.perf_counter(), time.process_time()
        table = cat.load_table(ident)
        result = table.upsert(batch, join_cols=["id"])
        out.append(
            {
                "wall": time.perf_counter() - wall,
                "cpu": time.process_time() - cpu,
                "changes": batch.num_rows,
                "updated": result.rows_updated,
                "inserted": result.rows_inserted,
            }
        )
    print(json.dumps({"rounds": out}))


def digest(warehouse, ident):
    print(json.dumps(digest_of(catalog(warehouse).load_table(ident).scan().to_arrow())))


def main(argv):
    cmd = argv[1] if len(argv) > 1 else ""
    if cmd == "gen" and len(argv) == 8:
        gen(argv[2], int(argv[3]), int(argv[4]), int(argv[5]), float(argv[6]), int(argv[7]))
    elif cmd == "upsert" and len(argv) == 6:
        upsert(argv[2], argv[3], argv[4], int(argv[5]))
    elif cmd == "digest" and len(argv) == 4:
        digest(argv[2], argv[3])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv)
