"""A Ray driver of its own that writes the suite's dataset through
`sluice.ray.Datasink`; cluster_suite.py runs it as a separate process so
that it can die by SIGKILL.

Usage: datasink_driver.py ADDRESS JOB_FILE ROWS CACHE_DIR

With `SLUICE_TEST_CRASH=after-persist` (a test build of the wheel), the
engine stops right after the checkpoint record is durable and before any
commit; this driver then SIGKILLs itself there, leaving the commit pending
as a driver killed at that moment would. It prints `crash point reached`
first, so the suite can tell that kill from any other death.
"""

import logging
import os
import signal
import sys

import ray

import sluice.ray


def dataset(rows):
    """The suite's dataset: ids 0..rows, names `row-<id>`, amounts 3 × id."""

    def shape(batch):
        ids = batch["id"]
        return {
            "id": ids.astype("int64"),
            "name": [f"row-{i}" for i in ids],
            "amount": (ids * 3).astype("int64"),
        }

    return ray.data.range(rows, override_num_blocks=6).map_batches(shape, batch_format="numpy")


def main():
    address, job, rows, cache_dir = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
    try:
        dataset(rows).write_datasink(sluice.ray.Datasink(job, cache_dir=cache_dir))
    except Exception as e:  # noqa: BLE001 - Ray wraps the driver-side error
        if "injected crash at after-persist" in str(e):
            print("crash point reached", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        raise
    print("written", flush=True)


if __name__ == "__main__":
    main()
