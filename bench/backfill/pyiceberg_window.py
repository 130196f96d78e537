"""Seed 002's backfill task, as its write-up writes it, for `bench/src/bin/backfill.rs`.

    python3 pyiceberg_window.py write WAREHOUSE TABLE MAX_ATTEMPTS SEED WINDOW_DIR...
    python3 pyiceberg_window.py read WAREHOUSE TABLE

`write` is one task slot of the backfill: it takes its windows in turn (the
WINDOW_DIRs, in the order given), as one of the write-up's
`max_active_tis_per_dag` slots takes the next mapped window when its last
one ends. In each window it overwrites each day (one `orders-<day>.csv` per
day, read in name order), one commit per day, with the write-up's
`commit_with_retry`: the table reloaded on every attempt, only
`CommitFailedException` retried, full-jitter exponential backoff, re-raised
when MAX_ATTEMPTS attempts are spent. That is on top of PyIceberg's own
retries of a conflicting commit (`commit.retry.num-retries`, 4 by default in
0.12). A window whose retries run out fails, as the write-up's Airflow task
instance fails: the rest of that window is lost, and the slot goes on with
its next window. It prints one JSON line: the days it replaced, the
conflicts (each `CommitFailedException` it caught, and each retry PyIceberg
logged), and the error that stopped each failed window.

`read` prints every row of the table as JSON `[day, order_id, amount_cents]`,
as PyIceberg's scan reads it.
"""

import json
import logging
import os
import random
import sys
import time

import pyarrow.csv as pacsv
from pyiceberg.catalog.sql import SqlCatalog
from pyiceberg.exceptions import CommitFailedException


class _Retries(logging.Handler):
    """Counts PyIceberg's own retries of a conflicting commit (it logs each)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record):
        if "Commit failed due to a concurrent update" in record.getMessage():
            self.count += 1


def catalog(warehouse):
    return SqlCatalog("sluice", uri=f"sqlite:///{warehouse}/catalog.db", warehouse=f"file://{warehouse}")


def commit_with_retry(cat, ident, rows, predicate, max_attempts, conflicts):
    """The write-up's alternative A (section 5-2), conflicts counted."""
    for attempt in range(max_attempts):
        table = cat.load_table(ident)  # reload: the newest pointer on every attempt
        try:
            table.overwrite(rows, overwrite_filter=predicate)
            return
        except CommitFailedException:  # only the definite "not committed"
            conflicts[0] += 1
            if attempt == max_attempts - 1:
                raise  # never swallowed
            ceiling = min(10.0, 0.3 * 2**attempt)
            time.sleep(random.uniform(0, ceiling))  # backoff with full jitter


def write(warehouse, ident, max_attempts, seed, window_dirs):
    random.seed(seed)
    retries = _Retries()
    logging.getLogger("pyiceberg").addHandler(retries)
    cat = catalog(warehouse)
    schema = cat.load_table(ident).schema().as_arrow()
    conflicts = [0]
    replaced, errors = [], []
    for window_dir in window_dirs:
        for name in sorted(n for n in os.listdir(window_dir) if n.endswith(".csv")):
            day = name.removeprefix("orders-").removesuffix(".csv")
            rows = pacsv.read_csv(os.path.join(window_dir, name)).select(schema.names).cast(schema)
            try:
                commit_with_retry(cat, ident, rows, f"order_date = '{day}'", max_attempts, conflicts)
            except Exception as e:  # the window's task fails: the rest of this window is lost
                errors.append(f"{os.path.basename(window_dir)} {day}: {type(e).__name__}: {e}")
                break
            replaced.append(day)
    print(json.dumps({"replaced": replaced, "conflicts": conflicts[0] + retries.count, "errors": errors}))
    return 0 if not errors else 1


def read(warehouse, ident):
    a = catalog(warehouse).load_table(ident).scan(selected_fields=("order_id", "order_date", "amount_cents")).to_arrow()
    rows = zip(a.column("order_date").to_pylist(), a.column("order_id").to_pylist(), a.column("amount_cents").to_pylist())
    print(json.dumps([[str(d), i, v] for d, i, v in rows]))
    return 0


if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "write":
        sys.exit(write(args[0], args[1], int(args[2]), int(args[3]), args[4:]))
    sys.exit(read(args[0], args[1]))
