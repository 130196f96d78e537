"""Options, layout and file helpers shared by the writer and the committer."""

import json
import re

from componentize_py_types import Err
from wit_world.imports import file_io, log, types

NAME = "python-jsonl"
VERSION = "0.1.0"

OPTIONS = [
    types.OptionSpec(
        "path",
        "location of the visible output directory; each committed checkpoint becomes one sub-directory of JSON Lines files",
        True,
        None,
    ),
    types.OptionSpec(
        "format",
        "`jsonl` (JSON Lines, encoded here in Python) or `parquet` (encoded by the host, natively, through the `columnar` capability: the rows go on as the engine hands them over)",
        False,
        "jsonl",
    ),
    types.OptionSpec(
        "staging_path",
        "location where uncommitted files are staged; on the same filesystem as `path` and outside it (default: `<path>.staging`)",
        False,
        None,
    ),
]


def config_error(message):
    return Err(types.SinkError_Config(message))


def fatal(message):
    return Err(types.SinkError_Fatal(message))


def info(message):
    log.log(log.Level.INFO, message)


class Config:
    def __init__(self, options):
        known = {spec.name for spec in OPTIONS}
        values = {}
        for key, value in options:
            if key not in known:
                raise config_error(f"unknown option `{key}`; this sink takes: {', '.join(sorted(known))}")
            values[key] = value
        path = values.get("path", "").rstrip("/")
        if not path:
            raise config_error("option `path` is required and must not be empty")
        self.path = path
        self.staging = values.get("staging_path", f"{path}.staging").rstrip("/")
        self.format = values.get("format", "jsonl")
        if self.format not in ("jsonl", "parquet"):
            raise config_error(f"option `format` = {self.format!r} is not supported; use `jsonl` or `parquet`")


def join(base, name):
    return f"{base}/{name}" if base else name


_TABLE_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")


def check_table_name(table):
    if table == "" or (table != "_" and not table.startswith(".") and _TABLE_NAME.match(table)):
        return
    raise config_error(f"table name {table!r} cannot name a directory: use letters, digits, `_`, `-` and `.`")


def table_dir(table):
    return table or "_"


def key(ctx):
    if ctx.incarnation:
        return f"{ctx.job_id}.{ctx.sink_id}.{ctx.incarnation}"
    return f"{ctx.job_id}.{ctx.sink_id}"


def attempt_dir(cfg, ctx):
    return join(join(cfg.staging, key(ctx)), f"attempt-{ctx.attempt}")


def inprogress_dir(cfg, ctx, table):
    return join(join(attempt_dir(cfg, ctx), "inprogress"), table_dir(table))


def checkpoint_dir(cfg, ctx, c):
    return join(attempt_dir(cfg, ctx), f"c{c:010d}")


def table_path(cfg, table):
    return join(cfg.path, table) if table else cfg.path


def visible_dir(cfg, ctx, table, c):
    return join(table_path(cfg, table), f"{key(ctx)}.c{c:010d}")


def io_error(what, err):
    """A `file-io` failure as a sink error: a denied location is the job's
    configuration, anything else may pass (the host retries commits)."""
    value = err.value if isinstance(err, Err) else err
    detail = getattr(value, "value", str(value))
    kind = type(value).__name__
    if kind == "IoError_Denied":
        return config_error(f"{what}: access denied ({detail}); grant the location in [sink.grants]")
    if kind == "IoError_NotFound":
        return fatal(f"{what}: not found ({detail})")
    return Err(types.SinkError_Retryable(f"{what}: {detail}"))


def columnar_error(what, err):
    """A `columnar` failure as a sink error: its `io` case as `io_error`,
    a batch it cannot encode as invalid data, a host limit as configuration."""
    value = err.value if isinstance(err, Err) else err
    kind = type(value).__name__
    if kind == "ColumnarError_Io":
        return io_error(what, value.value)
    if kind == "ColumnarError_Limit":
        return config_error(f"{what}: {value.value}")
    return Err(types.SinkError_InvalidData(f"{what}: {getattr(value, 'value', value)}"))


def is_kind(err, kind):
    return isinstance(err, Err) and type(err.value).__name__ == kind


def exists(location, what):
    try:
        return file_io.exists(location)
    except Err as e:
        raise io_error(what, e)


def refuse_other_incarnations(cfg, ctx, tables):
    """Stops a fresh state directory's first run when a table's directory
    holds a committed checkpoint of this job and sink from another
    incarnation."""
    if not ctx.refuse_other_incarnations:
        return
    prefix = f"{ctx.job_id}.{ctx.sink_id}."
    for table in tables:
        directory = table_path(cfg, table)
        try:
            names = file_io.list_dir(directory)
        except Err as e:
            if is_kind(e, "IoError_NotFound"):
                continue
            raise io_error(f"listing {directory}", e)
        for name in names:
            if not name.startswith(prefix):
                continue
            match = re.fullmatch(r"(?:([^.]+)\.)?c\d{10}", name[len(prefix):])
            if match is None:
                continue
            found = match.group(1)
            if found == ctx.incarnation:
                continue
            earlier = f"incarnation {found}" if found else "an incarnation from before incarnation ids"
            raise config_error(
                f"job `{ctx.job_id}` sink `{ctx.sink_id}`: {directory} already holds committed checkpoints "
                f"(e.g. {name}) of {earlier} of this job, and this run starts incarnation {ctx.incarnation} "
                "in a fresh state directory. To go on with that job, point job.state_dir at its state directory. "
                "To land the source again beside what is there, run `sluice run --new-incarnation`"
            )


def to_json(value):
    return json.dumps(value, separators=(",", ":")).encode("utf-8")


def from_json(data, what):
    try:
        return json.loads(bytes(data).decode("utf-8"))
    except ValueError as e:
        raise fatal(f"{what} is not valid: {e}")
