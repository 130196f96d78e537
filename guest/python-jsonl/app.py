"""The `python-jsonl` Sluice sink, written in Python and built into a
WebAssembly component with componentize-py (contract
`sluice:connector@0.2.1`, world `sink-plugin`). The interface's functions
live here; its `writer` and `committer` resources live in `sink.py`."""

from wit_world import exports
from wit_world.imports import types

from jsonl_sink import core


class Sink(exports.Sink):
    def describe(self):
        return types.PluginInfo(
            name=core.NAME,
            version=core.VERSION,
            description="Lands rows as JSON Lines files (or Parquet, encoded by the host), one directory per committed checkpoint, atomically and exactly once (written in Python)",
            options=core.OPTIONS,
            capabilities=["file-io: read-write on `path` and on `staging_path` (same filesystem)"],
            multi_table=True,
        )

    def describe_commit(self, options, combined):
        try:
            parsed = core.from_json(combined, "combined commit")
        except Exception:
            return ["(not a python-jsonl commit)"]
        lines = []
        for part in parsed.get("tables", []):
            rows = sum(f["rows"] for f in part["files"])
            name = f"table {part['table']}: " if part["table"] else ""
            lines.append(f"{name}{len(part['files'])} file(s), {rows} rows -> {part['visible_dir']}")
        return lines

    def validate(self, ctx, options, tables):
        cfg = core.Config(options)
        for table in tables:
            core.check_table_name(table.name)
        for what, location in (("path", cfg.path), ("staging_path", cfg.staging)):
            core.exists(location, f"option `{what}` ({location})")
