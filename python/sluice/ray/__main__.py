"""``python -m sluice.ray run JOB.toml --address ADDR``: runs a job file on
a Ray cluster (see ``sluice.ray.run``)."""

from __future__ import annotations

import argparse
import sys

from .. import SluiceError, init_logging


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sluice.ray", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    r = commands.add_parser("run", help="run a job file with its writers as Ray actors")
    r.add_argument("job", help="the job file (the one `sluice run` takes)")
    r.add_argument("--address", default=None, help="the Ray cluster (default: RAY_ADDRESS, else a local Ray)")
    r.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE", help="override a job key")
    r.add_argument("--cache-dir", default=None, help="compiled-plugin cache, seen by every node")
    r.add_argument("--cpus-per-writer", type=float, default=1.0, help="CPUs Ray reserves per writer actor (default 1)")
    r.add_argument("--max-recoveries", type=int, default=10, help="lost writers tolerated before giving up")
    r.add_argument("--open-timeout", type=float, default=600.0, help="seconds to wait for writers to be placed")
    r.add_argument("--new-incarnation", action="store_true", help="as `sluice run --new-incarnation`")
    r.add_argument("-q", "--quiet", action="store_true", help="warnings and errors only")
    args = parser.parse_args(argv)

    init_logging("warn" if args.quiet else "info")
    from . import run  # imports ray

    try:
        summary = run(
            args.job,
            address=args.address,
            overrides=args.sets,
            cache_dir=args.cache_dir,
            cpus_per_writer=args.cpus_per_writer,
            max_recoveries=args.max_recoveries,
            open_timeout=args.open_timeout,
            new_incarnation=args.new_incarnation,
            quiet=args.quiet,
        )
    except SluiceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    line = summary["text"]
    if summary.get("recoveries"):
        line += f", {len(summary['recoveries'])} recovery(ies) after lost writers"
    print(f"{line}, writers on {summary.get('nodes', 0)} node(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
