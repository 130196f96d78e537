"""The `python-jsonl` sink: rows as JSON Lines files, exactly once.

Layout (all through the host's `file-io` capability, inside the granted
locations), in the spirit of the Rust `files` sink:
- a writer streams each table's rows into
  `<staging>/<key>/attempt-<a>/inprogress/<table>/part-<subtask>-<seq>.jsonl`,
  where `<key>` is `<job>.<sink>.<incarnation>` and `<table>` is `_` for the
  single unnamed table;
- `prepare-commit(c)` finishes the open files and moves them into
  `<staging>/<key>/attempt-<a>/c<c>/<table>/` (still invisible);
- the committer makes checkpoint `c` visible with one atomic directory
  rename per table, to `<path>/<key>.c<c>/` or `<path>/<table>/<key>.c<c>/`.

Invariants:
- nothing under `<path>` is written except by those renames, so a reader of
  `<path>` sees whole checkpoints or nothing;
- the visible name depends on job, sink, incarnation, table and checkpoint
  only: a repeated commit finds it and answers `already-committed`, table by
  table, and another incarnation never finds it;
- staging names carry the run attempt, so a restarted run never mixes its
  files with what a crashed run left;
- a fresh state directory's first run refuses a `<path>` holding another
  incarnation's checkpoints of this job and sink, before writing;
- `close` publishes nothing.
"""
