"""The writer and committer resources of the `python-jsonl` sink (the module
name `sink` is where componentize-py looks for the `sink` interface's
resources). See `jsonl_sink` for the layout and its invariants."""

from componentize_py_types import Err
from wit_world.exports import sink as contract
from wit_world.imports import columnar, file_io, types

from jsonl_sink import core
from jsonl_sink.arrow_ipc import ArrowError, read_schema
from jsonl_sink.rows import to_lines


class Writer(contract.Writer):
    @classmethod
    def open(cls, ctx, options, tables, restored_state):
        cfg = core.Config(options)
        writer = cls()
        writer.cfg = cfg
        writer.ctx = ctx
        writer.tables = {}
        for table in tables:
            writer._announce(table)
        # table -> (output file, name, rows) of the file being written
        writer.open_files = {}
        # (table, name, rows) finished since the last checkpoint
        writer.finished = []
        # checkpoint -> the (table, name) it staged, for abort-prepare
        writer.prepared = {}
        writer.seq = 0
        writer.checkpoint = 0
        if restored_state is not None:
            writer.checkpoint = core.from_json(restored_state, "restored writer state").get("checkpoint", 0)
        return writer

    def _announce(self, table):
        core.check_table_name(table.name)
        try:
            read_schema(table.schema)
        except ArrowError as e:
            raise core.config_error(f"table {table.name!r}: {e}")
        # The schema as the engine encoded it (an Arrow IPC schema message).
        self.tables[table.name] = table.schema

    def write(self, table, rows):
        if table not in self.tables:
            raise Err(types.SinkError_InvalidData(f"rows of table {table!r}, which the engine has not announced"))
        if self.cfg.format == "parquet":
            return self._write_parquet(table, rows)
        try:
            count, data = to_lines(rows)
        except ArrowError as e:
            raise Err(types.SinkError_InvalidData(f"table {table!r}: {e}"))
        except UnicodeDecodeError as e:
            raise Err(types.SinkError_InvalidData(f"table {table!r}: a string column is not UTF-8: {e}"))
        if count == 0:
            return
        entry = self.open_files.get(table)
        if entry is None:
            self.seq += 1
            name = f"part-{self.ctx.subtask:04d}-{self.seq:06d}.jsonl"
            location = core.join(core.inprogress_dir(self.cfg, self.ctx, table), name)
            try:
                out = file_io.OutputFile.create(location, False)
            except Err as e:
                raise core.io_error(f"creating {location}", e)
            entry = [out, name, 0]
            self.open_files[table] = entry
        try:
            entry[0].write(data)
        except Err as e:
            raise core.io_error(f"writing {entry[1]}", e)
        entry[2] += count

    def _write_parquet(self, table, rows):
        """Hands the batch, as it came, to a Parquet file the host encodes."""
        entry = self.open_files.get(table)
        if entry is None:
            self.seq += 1
            name = f"part-{self.ctx.subtask:04d}-{self.seq:06d}.parquet"
            location = core.join(core.inprogress_dir(self.cfg, self.ctx, table), name)
            options = columnar.WriterOptions(
                compression=columnar.Compression.SNAPPY,
                compression_level=None,
                dictionary=True,
                statistics=columnar.Statistics.PAGE,
                max_row_group_rows=None,
                max_row_group_bytes=None,
                data_page_size_bytes=None,
                data_page_row_limit=None,
                dictionary_page_size_bytes=None,
                write_batch_size=None,
                statistics_truncate_length=None,
                columns=[],
                key_value_metadata=[],
                created_by=f"sluice {core.NAME} sink {core.VERSION}",
            )
            try:
                out = columnar.ParquetWriter.create(location, self.tables[table], options, False)
            except Err as e:
                raise core.columnar_error(f"creating {location}", e)
            entry = [out, name, 0]
            self.open_files[table] = entry
        try:
            status = entry[0].write(rows)
        except Err as e:
            raise core.columnar_error(f"table {table!r}: encoding {entry[1]} as Parquet", e)
        entry[2] = status.rows

    def _finish_open_files(self):
        for table, (out, name, rows) in list(self.open_files.items()):
            try:
                if isinstance(out, columnar.ParquetWriter):
                    out.close()
                else:
                    out.finish()
            except Err as e:
                if isinstance(out, columnar.ParquetWriter):
                    raise core.columnar_error(f"finishing {name}", e)
                raise core.io_error(f"finishing {name}", e)
            self.finished.append((table, name, rows))
        self.open_files = {}

    def prepare_commit(self, c):
        self._finish_open_files()
        if not self.finished:
            self.checkpoint = c
            return None
        directory = core.checkpoint_dir(self.cfg, self.ctx, c)
        staged = []
        by_table = {}
        for table, name, rows in self.finished:
            src = core.join(core.inprogress_dir(self.cfg, self.ctx, table), name)
            dst_dir = core.join(directory, core.table_dir(table))
            try:
                file_io.create_dir_all(dst_dir)
                file_io.rename(src, core.join(dst_dir, name))
            except Err as e:
                raise core.io_error(f"checkpoint {c}: staging {name}", e)
            staged.append((table, name))
            by_table.setdefault(table, []).append({"name": name, "rows": rows})
        self.finished = []
        self.prepared[c] = staged
        self.checkpoint = c
        info = {"dir": directory, "tables": [{"table": t, "files": f} for t, f in sorted(by_table.items())]}
        return core.to_json(info)

    def snapshot_state(self, c):
        return core.to_json({"checkpoint": c})

    def apply_changes(self, changes):
        # Each file's lines carry their own keys: a new or evolved table
        # needs nothing but to be known.
        for change in changes:
            self._announce(change.table)

    def abort_prepare(self, c):
        directory = core.checkpoint_dir(self.cfg, self.ctx, c)
        for table, name in self.prepared.pop(c, []):
            location = core.join(core.join(directory, core.table_dir(table)), name)
            try:
                file_io.delete(location)
            except Err as e:
                if not core.is_kind(e, "IoError_NotFound"):
                    raise core.io_error(f"checkpoint {c}: removing {name}", e)

    def close(self):
        # Rows no checkpoint covers stay in staging, invisible.
        self._finish_open_files()


class Committer(contract.Committer):
    @classmethod
    def open(cls, ctx, options, tables):
        cfg = core.Config(options)
        names = [t.name for t in tables]
        for name in names:
            core.check_table_name(name)
        core.refuse_other_incarnations(cfg, ctx, names)
        try:
            file_io.create_dir_all(cfg.path)
        except Err as e:
            raise core.io_error(f"creating output directory {cfg.path}", e)
        committer = cls()
        committer.cfg = cfg
        committer.ctx = ctx
        return committer

    def evolve(self, changes):
        for change in changes:
            core.check_table_name(change.table.name)

    def combine(self, c, infos):
        directory = None
        tables = {}
        for raw in infos:
            info = core.from_json(raw, f"commit info of checkpoint {c}")
            if directory is not None and directory != info["dir"]:
                raise core.fatal(f"writers of checkpoint {c} staged into different directories")
            directory = info["dir"]
            for part in info["tables"]:
                tables.setdefault(part["table"], []).extend(part["files"])
        if directory is None:
            raise core.fatal(f"checkpoint {c} has no commit infos")
        combined = {
            "staging_dir": directory,
            "tables": [
                {
                    "table": table,
                    "staging_dir": core.join(directory, core.table_dir(table)),
                    "visible_dir": core.visible_dir(self.cfg, self.ctx, table, c),
                    "files": files,
                }
                for table, files in sorted(tables.items())
            ],
        }
        return core.to_json(combined)

    def _publish(self, c, part):
        staging, visible = part["staging_dir"], part["visible_dir"]
        if core.exists(visible, f"checkpoint {c}: checking {visible}"):
            return False
        for f in part["files"]:
            location = core.join(staging, f["name"])
            if not core.exists(location, f"checkpoint {c}: checking staged files"):
                raise core.fatal(
                    f"checkpoint {c} cannot be committed: staged file {location} is missing "
                    "(was the staging directory changed outside Sluice?)"
                )
        parent = visible.rsplit("/", 1)[0] if "/" in visible else ""
        try:
            if parent:
                file_io.create_dir_all(parent)
            file_io.rename(staging, visible)
        except Err as e:
            if core.is_kind(e, "IoError_AlreadyExists"):
                return False  # an earlier attempt of this very commit got there first
            raise core.io_error(f"checkpoint {c}: publishing {visible}", e)
        rows = sum(f["rows"] for f in part["files"])
        core.info(f"checkpoint {c}: published {len(part['files'])} file(s), {rows} row(s) in {visible}")
        return True

    def commit(self, c, combined):
        combined = core.from_json(combined, "combined commit")
        published = False
        for part in combined["tables"]:
            published |= self._publish(c, part)
        return types.CommitOutcome.COMMITTED if published else types.CommitOutcome.ALREADY_COMMITTED

    def abort(self, c, combined):
        combined = core.from_json(combined, "combined commit")
        try:
            file_io.delete(combined["staging_dir"])
        except Err as e:
            if not core.is_kind(e, "IoError_NotFound"):
                raise core.io_error(f"checkpoint {c}: removing the aborted checkpoint", e)
