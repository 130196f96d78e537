//! The `sluice` binary: inspect, check, run, the compiled-plugin cache, and
//! clear errors for bad job files.

use std::time::Duration;

use sluice_tests::{FILES_PLUGIN, TestJob, assert_exactly_once, read_visible, run_cli, run_example};

#[test]
fn plugin_inspect_shows_world_options_and_imports() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (code, out, err) = run_cli(&["plugin", "inspect", FILES_PLUGIN], dir.path());
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("contract:    sluice:connector@0.2.4"), "{out}");
    assert!(out.contains("world:       sluice:connector/sink-plugin@0.2.4"), "{out}");
    assert!(out.contains("plugin:      files 0.1.0"), "{out}");
    assert!(out.contains("path") && out.contains("required"), "{out}");
    assert!(out.contains("sluice:connector/file-io@0.2.4"), "{out}");
    assert!(out.contains("sluice:connector/sink@0.2.4"), "{out}");
}

#[test]
fn second_start_skips_compilation() {
    let dir = tempfile::tempdir().expect("temp dir");
    let cache = dir.path().join("cache");
    let cache = cache.to_str().expect("utf-8 path");
    let (code, _, first) = run_cli(&["--cache-dir", cache, "plugin", "inspect", FILES_PLUGIN], dir.path());
    assert_eq!(code, 0, "{first}");
    assert!(first.contains("compiled plugin"), "{first}");
    let (code, _, second) = run_cli(&["--cache-dir", cache, "plugin", "inspect", FILES_PLUGIN], dir.path());
    assert_eq!(code, 0, "{second}");
    assert!(second.contains("loaded precompiled plugin from the cache (compilation skipped)"), "{second}");
    assert!(!second.contains("INFO compiled plugin"), "{second}");
}

/// A compiled plugin is stored, then loaded back from its file; a damaged
/// artifact is compiled again and replaced, never fatal.
#[test]
fn a_damaged_cached_plugin_is_compiled_again_and_replaced() {
    let dir = tempfile::tempdir().expect("temp dir");
    let cache = dir.path().join("cache");
    let cache_arg = cache.to_str().expect("utf-8 path");
    let inspect = |dir: &std::path::Path| run_cli(&["--cache-dir", cache_arg, "plugin", "inspect", FILES_PLUGIN], dir);
    let (code, out, first) = inspect(dir.path());
    assert_eq!(code, 0, "{first}");
    assert!(out.contains("plugin:      files 0.1.0"), "{out}");
    let artifacts: Vec<_> = std::fs::read_dir(&cache)
        .expect("the cache")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "cwasm"))
        .collect();
    assert_eq!(artifacts.len(), 1, "one artifact: {artifacts:?}");
    std::fs::write(&artifacts[0], b"not a compiled component").expect("damage it");
    let (code, out, second) = inspect(dir.path());
    assert_eq!(code, 0, "{second}");
    assert!(out.contains("plugin:      files 0.1.0"), "{out}");
    assert!(second.contains("ignoring unusable cached component; recompiling"), "{second}");
    assert!(second.contains("INFO compiled plugin"), "{second}");
    let (code, _, third) = inspect(dir.path());
    assert_eq!(code, 0, "{third}");
    assert!(third.contains("loaded precompiled plugin from the cache (compilation skipped)"), "{third}");
}

#[test]
fn check_accepts_a_good_job() {
    let job = TestJob::files("check-ok", 100, 2, 50);
    job.load(&[]).expect("valid");
    let (code, out, err) = run_cli(&["check", "job.toml"], job.dir.path());
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("ok: plugin files 0.1.0"), "{out}");
    assert!(out.contains("the plugin accepts the options and the source schema"), "{out}");
    assert!(out.contains("job check-ok is ready to run"), "{out}");
    assert!(!job.out().exists() || std::fs::read_dir(job.out()).expect("dir").next().is_none(), "check moved data");
}

/// Each broken job file gives exit code 1 and one clear line naming the key.
#[test]
fn bad_job_files_name_the_offending_key() {
    let job = TestJob::files("bad", 100, 2, 50);
    job.load(&[]).expect("valid to start with");
    let cases: &[(&[&str], &str)] = &[
        (&["--set", "sink.options.pth=x"], "key `sink.options.pth`: plugin 'files' has no such option"),
        (&["--set", "job.parallelism=0"], "key `job.parallelism`: must be between 1 and 1024"),
        (&["--set", "job.parallelism=\"two\""], "key `job.parallelism`"),
        (&["--set", "sink.plugin=nope.wasm"], "key `sink.plugin`: no plugin file at"),
        (&["--set", "source.kind=pulsar"], "pulsar"),
        (&["--set", "sink.options.compression=lz5"], "option `compression` = \"lz5\" is not supported"),
        (&["--set", "job.checkpont.every_rows=5"], "checkpont"),
    ];
    for (sets, expected) in cases {
        let mut args = vec!["check", "job.toml"];
        args.extend_from_slice(sets);
        let (code, out, err) = run_cli(&args, job.dir.path());
        let all = format!("{out}{err}");
        assert_eq!(code, 1, "{sets:?}: {all}");
        assert!(all.contains(expected), "{sets:?}: expected {expected:?} in:\n{all}");
        assert!(!all.contains("panicked"), "{all}");
    }
    std::fs::write(job.dir.path().join("broken.toml"), "[job\nid = 1\n").expect("write");
    let (code, _, err) = run_cli(&["run", "broken.toml"], job.dir.path());
    assert_eq!(code, 1);
    assert!(err.contains("broken.toml is not valid TOML") && err.contains("line 1"), "{err}");
    let (code, _, err) = run_cli(&["run", "missing.toml"], job.dir.path());
    assert_eq!(code, 1);
    assert!(err.contains("cannot read job file missing.toml"), "{err}");
}

/// `examples/files.toml`, as the README runs it, redirected into a temp dir.
#[test]
fn example_job_runs_to_an_exact_result() {
    let dir = tempfile::tempdir().expect("temp dir");
    let out = dir.path().join("files");
    let sets = [
        format!("sink.plugin={FILES_PLUGIN}"),
        format!("job.state_dir={}", dir.path().join("state").display()),
        format!("sink.options.path={}", out.display()),
        format!("sink.grants.locations=[\"{}\"]", dir.path().display()),
    ];
    let (code, stdout, err) = run_example("files.toml", &sets, dir.path());
    assert_eq!(code, 0, "{err}");
    assert!(stdout.contains("job files-demo finished: 200000 rows"), "{stdout}");
    assert!(err.contains("checkpoint committed"), "plain progress logs each commit:\n{err}");
    assert_exactly_once(&read_visible(&out), 200_000);
}

/// The README's main command, `sluice run examples/iceberg.toml`, with the
/// example's own job file: redirected into a temp dir and shortened to
/// 20,000 rows (the example lands 1,000,000), it runs to its end, says so in
/// its summary, commits one snapshot per checkpoint, and PyIceberg and
/// DuckDB's `iceberg_scan` both read every row exactly once.
#[test]
fn main_example_lands_the_iceberg_table_exactly_once() {
    let dir = tempfile::tempdir().expect("temp dir");
    let warehouse = dir.path().join("warehouse");
    std::fs::create_dir_all(&warehouse).expect("warehouse dir");
    let sets = [
        format!("sink.plugin={}", sluice_tests::ICEBERG_PLUGIN),
        format!("job.state_dir={}", dir.path().join("state").display()),
        format!("sink.catalog.database={}", warehouse.join("catalog.db").display()),
        format!("sink.catalog.warehouse={}", warehouse.display()),
        "source.rows=20000".to_string(),
        "job.checkpoint.every_rows=1500".to_string(),
    ];
    let (code, stdout, err) = run_example("iceberg.toml", &sets, dir.path());
    assert_eq!(code, 0, "{err}");
    assert!(stdout.contains("job iceberg-demo finished: 20000 rows"), "{stdout}");
    // 4 subtasks of 5,000 rows, a checkpoint every 1,500 rows each: 3 full
    // checkpoints and the end.
    assert!(stdout.contains("4 checkpoint(s)"), "{stdout}");
    let table = sluice_tests::read_iceberg(&warehouse, "demo.events");
    assert_eq!(table.snapshots_of("iceberg-demo"), 4, "one snapshot per checkpoint: {:?}", table.commits);
    table.assert_no_checkpoint_twice();
    assert_eq!(sluice_tests::readers_ids(&warehouse, "demo.events"), (0..20_000).collect::<Vec<i64>>());
}

/// A row of `examples/backfill.toml`'s table: `(order_id, amount_cents)`, by day.
type Days = std::collections::BTreeMap<String, Vec<(i64, i64)>>;

/// Rows of `order_id,order_date,customer_id,amount_cents` CSV files, by day.
fn csv_days(files: &[std::path::PathBuf]) -> Days {
    let mut days = Days::new();
    for file in files {
        let text = std::fs::read_to_string(file).expect("csv");
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split(',').collect();
            days.entry(f[1].to_string()).or_default().push((f[0].parse().expect("id"), f[3].parse().expect("value")));
        }
    }
    days.values_mut().for_each(|rows| rows.sort_unstable());
    days
}

/// `shop.daily_orders` of `warehouse` by day, as PyIceberg reads it; panics
/// when DuckDB's `iceberg_scan` reads anything else.
fn daily_orders(warehouse: &std::path::Path) -> Days {
    let script = format!(
        "{}\n\
         import sys, json\n\
         from pyiceberg.catalog.sql import SqlCatalog\n\
         w = sys.argv[1]\n\
         t = SqlCatalog('sluice', uri=f'sqlite:///{{w}}/catalog.db', warehouse=f'file://{{w}}').load_table('shop.daily_orders')\n\
         a = t.scan(selected_fields=('order_id', 'order_date', 'amount_cents')).to_arrow()\n\
         py = sorted([str(d), i, v] for i, d, v in zip(a.column('order_id').to_pylist(), a.column('order_date').to_pylist(), a.column('amount_cents').to_pylist()))\n\
         con = _duckdb.connect()\n\
         con.execute('SET enable_progress_bar = false')\n\
         for ext in ('avro', 'iceberg'):\n\
         \x20   con.load_extension(_duckdb_extension(ext))\n\
         path = t.metadata_location.removeprefix('file://')\n\
         dd = sorted([str(d), i, v] for i, d, v in con.execute('select order_id, order_date, amount_cents from iceberg_scan(?)', [path]).fetchall())\n\
         if py != dd:\n\
         \x20   sys.exit(f'PyIceberg reads {{len(py)}} rows, DuckDB {{len(dd)}}: {{py}} / {{dd}}')\n\
         print(json.dumps(py))",
        sluice_tests::DUCKDB_ICEBERG
    );
    let out = sluice_tests::python(&script, &[&warehouse.display().to_string()])
        .unwrap_or_else(|e| panic!("reading shop.daily_orders with PyIceberg and DuckDB: {e}"));
    let rows: Vec<(String, i64, i64)> = serde_json::from_str(out.trim()).expect("rows as JSON");
    let mut days = Days::new();
    for (day, id, v) in rows {
        days.entry(day).or_default().push((id, v));
    }
    days
}

/// `examples/backfill.toml`, as the Backfills page runs it, redirected into
/// a temp dir: over a table whose days 2024-03-01 to 2024-03-06 already hold
/// other rows (appended by the same job file in `mode = "append"`), it
/// replaces the five days of `examples/data/backfill/` and leaves the sixth
/// alone; the page's rerun,
/// `cargo run --release -p sluice -- run examples/backfill.toml --set job.state_dir=../out/state/backfill-again --new-incarnation`,
/// in a fresh state directory, replaces them again and says so. After each
/// run PyIceberg and DuckDB's `iceberg_scan` read each day with exactly its
/// rows (day, id and value), not doubled.
#[test]
fn backfill_example_replaces_its_days_and_a_rerun_leaves_them_as_they_were() {
    let dir = tempfile::tempdir().expect("temp dir");
    let warehouse = dir.path().join("warehouse");
    std::fs::create_dir_all(&warehouse).expect("warehouse dir");
    let sets = |state: &str| {
        vec![
            format!("sink.plugin={}", sluice_tests::ICEBERG_PLUGIN),
            format!("job.state_dir={}", dir.path().join(state).display()),
            format!("sink.catalog.database={}", warehouse.join("catalog.db").display()),
            format!("sink.catalog.warehouse={}", warehouse.display()),
        ]
    };
    // The old rows: three a day for 2024-03-01 ..= 2024-03-06, value 0.
    let old_dir = dir.path().join("old");
    std::fs::create_dir_all(&old_dir).expect("old/");
    let mut old_csv = String::from("order_id,order_date,customer_id,amount_cents\n");
    for d in 1..=6 {
        for i in 0..3 {
            old_csv.push_str(&format!("{},2024-03-{d:02},0,0\n", d * 10 + i));
        }
    }
    std::fs::write(old_dir.join("old.csv"), old_csv).expect("old.csv");
    let old = csv_days(&[old_dir.join("old.csv")]);
    let mut before = sets("state-before");
    before.extend([
        format!("source.path={}", old_dir.display()),
        "sink.options.mode=\"append\"".to_string(),
        "job.id=\"orders-before\"".to_string(),
    ]);
    let (code, _, err) = run_example("backfill.toml", &before, dir.path());
    assert_eq!(code, 0, "{err}");
    assert_eq!(daily_orders(&warehouse), old);

    let mut inputs: Vec<_> =
        std::fs::read_dir(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/data/backfill"))
            .expect("examples/data/backfill")
            .map(|e| e.expect("entry").path())
            .filter(|p| p.extension().is_some_and(|x| x == "csv"))
            .collect();
    inputs.sort();
    let new = csv_days(&inputs);
    assert_eq!(new.len(), 5, "five days of input: {new:?}");
    let mut want = new.clone();
    want.insert("2024-03-06".to_string(), old["2024-03-06"].clone());

    let (code, stdout, err) = run_example("backfill.toml", &sets("state"), dir.path());
    assert_eq!(code, 0, "{err}");
    assert!(stdout.contains("job backfill-demo finished: 200 rows"), "{stdout}");
    assert_eq!(daily_orders(&warehouse), want, "the five days replaced, the sixth kept");

    let example = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/backfill.toml");
    let example = example.display().to_string();
    let mut args = vec!["run", example.as_str(), "--progress", "plain"];
    let again = sets("state-again");
    for s in &again {
        args.extend(["--set", s.as_str()]);
    }
    args.push("--new-incarnation");
    let (code, stdout, err) = run_cli(&args, dir.path());
    assert_eq!(code, 0, "{err}");
    assert!(stdout.contains("job backfill-demo finished: 200 rows"), "{stdout}");
    assert!(err.contains("mode overwrite-partitions: incarnation") && err.contains("replaces the partitions"), "{err}");
    assert_eq!(daily_orders(&warehouse), want, "the rerun leaves every day as the first run did");
}

/// `crm.customers` of `warehouse` as `[id, name, tier, balance_cents]` rows
/// sorted by id, as PyIceberg reads it; panics when DuckDB's
/// `iceberg_scan` reads anything else.
fn customers(warehouse: &std::path::Path) -> Vec<(i64, String, String, i64)> {
    let script = format!(
        "{}\n\
         import sys, json\n\
         from pyiceberg.catalog.sql import SqlCatalog\n\
         w = sys.argv[1]\n\
         t = SqlCatalog('sluice', uri=f'sqlite:///{{w}}/catalog.db', warehouse=f'file://{{w}}').load_table('crm.customers')\n\
         cols = ('id', 'name', 'tier', 'balance_cents')\n\
         a = t.scan(selected_fields=cols).to_arrow()\n\
         py = sorted(list(r) for r in zip(*(a.column(c).to_pylist() for c in cols)))\n\
         con = _duckdb.connect()\n\
         con.execute('SET enable_progress_bar = false')\n\
         for ext in ('avro', 'iceberg'):\n\
         \x20   con.load_extension(_duckdb_extension(ext))\n\
         path = t.metadata_location.removeprefix('file://')\n\
         dd = sorted(list(r) for r in con.execute('select id, name, tier, balance_cents from iceberg_scan(?)', [path]).fetchall())\n\
         if py != dd:\n\
         \x20   sys.exit(f'PyIceberg reads {{py}}, DuckDB {{dd}}')\n\
         print(json.dumps(py))",
        sluice_tests::DUCKDB_ICEBERG
    );
    let out = sluice_tests::python(&script, &[&warehouse.display().to_string()])
        .unwrap_or_else(|e| panic!("reading crm.customers with PyIceberg and DuckDB: {e}"));
    serde_json::from_str(out.trim()).expect("rows as JSON")
}

/// `examples/cdc.toml`, as the Upserts page runs it, redirected into a temp
/// dir: its change stream (`examples/data/cdc/`, Debezium-shaped rows with
/// `op`) ends with every customer in its last state, as a model that
/// applies the files' changes in name and line order says, read by PyIceberg
/// and DuckDB alike; the `op` column is not in the table; a second run of
/// the same job finds nothing new and changes nothing.
#[test]
fn cdc_example_lands_each_customer_in_its_last_state() {
    let dir = tempfile::tempdir().expect("temp dir");
    let warehouse = dir.path().join("warehouse");
    std::fs::create_dir_all(&warehouse).expect("warehouse dir");
    let sets = vec![
        format!("sink.plugin={}", sluice_tests::ICEBERG_PLUGIN),
        format!("job.state_dir={}", dir.path().join("state").display()),
        format!("sink.catalog.database={}", warehouse.join("catalog.db").display()),
        format!("sink.catalog.warehouse={}", warehouse.display()),
    ];
    let data = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/data/cdc");
    let mut files: Vec<_> = std::fs::read_dir(&data)
        .expect("examples/data/cdc")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "jsonl"))
        .collect();
    files.sort();
    let mut model = std::collections::BTreeMap::new();
    let mut changes = 0;
    for file in &files {
        for line in std::fs::read_to_string(file).expect("jsonl").lines() {
            let v: serde_json::Value = serde_json::from_str(line).expect("json line");
            let id = v["id"].as_i64().expect("id");
            changes += 1;
            match v["op"].as_str().expect("op").to_ascii_lowercase().as_str() {
                "d" | "delete" => {
                    model.remove(&id);
                }
                _ => {
                    let s = |k: &str| v[k].as_str().expect("a string").to_string();
                    model.insert(id, (id, s("name"), s("tier"), v["balance_cents"].as_i64().expect("balance")));
                }
            }
        }
    }
    let want: Vec<_> = model.into_values().collect();
    assert_eq!(want.iter().map(|r| r.0).collect::<Vec<_>>(), [1, 2, 3, 4, 5, 7, 8, 10], "the example's comment");

    let (code, stdout, err) = run_example("cdc.toml", &sets, dir.path());
    assert_eq!(code, 0, "{err}");
    assert!(stdout.contains(&format!("job cdc-demo finished: {changes} rows")), "{stdout}");
    assert_eq!(customers(&warehouse), want);
    let ident = iceberg::TableIdent::from_strs(["crm", "customers"]).expect("ident");
    let snapshots = sluice_tests::catalog(&warehouse).load(&ident).expect("table").metadata().snapshots().count();

    let (code, _, err) = run_example("cdc.toml", &sets, dir.path());
    assert_eq!(code, 0, "{err}");
    assert_eq!(customers(&warehouse), want, "a second run changes nothing");
    let after = sluice_tests::catalog(&warehouse).load(&ident).expect("table").metadata().snapshots().count();
    assert_eq!(after, snapshots, "a second run commits nothing");
}

/// `sluice state` shows the incarnation, what is committed and what each
/// pending checkpoint will commit; `--drop-pending` drops one on request and
/// says so, and only then does the next run skip it.
#[test]
fn state_shows_pending_checkpoints_and_drops_one_on_request() {
    use sluice::engine::{CrashPoint, Fault};
    let job = TestJob::files("state-cli", 3000, 2, 500);
    let crash = Fault { point: CrashPoint::AfterPersist, checkpoint: 2, subtask: 0 };
    assert!(job.run(Some(crash)).expect_err("crash").is_injected_crash());

    let (code, out, err) = run_cli(&["state", "job.toml"], job.dir.path());
    assert_eq!(code, 0, "{err}");
    for part in [
        "job:          state-cli (sink out)",
        "incarnation:  ",
        "last record:  checkpoint 2",
        "committed:    up to checkpoint 1",
        "pending:      1 checkpoint(s)",
        "checkpoint 2: 1000 rows; commits:",
        // The plugin's own description of what the commit makes visible.
        "2 file(s), 1000 rows -> out/files/state-cli.out.",
    ] {
        assert!(out.contains(part), "{part:?} in:\n{out}");
    }

    let (code, _, err) = run_cli(&["state", "job.toml", "--drop-pending", "9"], job.dir.path());
    assert_eq!(code, 1);
    assert!(err.contains("checkpoint 9 is not pending (pending: 2)"), "{err}");

    let (code, out, err) = run_cli(&["state", "job.toml", "--drop-pending", "2"], job.dir.path());
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("dropped pending checkpoint 2 of job state-cli (1000 rows)"), "{out}");
    assert!(out.contains("pending:      none") && out.contains("dropped:      checkpoint 2 (1000 rows)"), "{out}");

    let summary = job.run(None).expect("the job goes on");
    assert!(summary.recovered.is_empty(), "the dropped checkpoint is not committed: {summary:?}");
    let visible = sluice_tests::ids(&read_visible(&job.out()));
    let expected: Vec<i64> = (0..3000).filter(|id| !(500..1000).contains(&(id % 1500))).collect();
    assert_eq!(visible, expected, "every row but the dropped checkpoint's, once");
}

/// Values out of range are refused when the job loads, with exit code 1
/// (never a panic's 101) and the full key: durations and rates past what a
/// `Duration` holds or below what makes sense, generator ids past
/// `i64::MAX`, and integers past what TOML holds given with `--set`.
#[test]
fn out_of_range_values_are_refused_naming_the_full_key() {
    let job = TestJob::files("ranges", 100, 2, 50);
    job.load(&[]).expect("valid to start with");
    let cases: &[(&[&str], &[&str])] = &[
        (
            &["job.checkpoint.interval_secs=1e300"],
            &["key `job.checkpoint.interval_secs`: must be between 0.001 and 604800 seconds, got 1e300"],
        ),
        (&["job.checkpoint.interval_secs=1e-9"], &["key `job.checkpoint.interval_secs`", "got 1e-9"]),
        (
            &["sink.sandbox.call_timeout_secs=1e300"],
            &["key `sink.sandbox.call_timeout_secs`: must be between 0.01 and 604800 seconds, got 1e300"],
        ),
        (&["source.rate=1e-300"], &["key `source.rate`: must be between 0.001 and 1e12 rows per second, got 1e-300"]),
        (&["source.rate=1e-12"], &["key `source.rate`", "got 1e-12"]),
        (&["source.rate=1e300"], &["key `source.rate`", "got 1e300"]),
        (&["job.lease_secs=1e300"], &["key `job.lease_secs`", "got 1e300"]),
        (&["job.commit.max_backoff_ms=9223372036854775807"], &["key `job.commit.max_backoff_ms`"]),
        (
            &["source.first_id=9223372036854775800", "source.rows=100"],
            &["key `source.rows`", "source.first_id = 9223372036854775800 with source.rows = 100 gives ids past"],
        ),
        (&["source.rows=18446744073709551616"], &["key `source.rows`: invalid type", "i64::MAX"]),
        (&["source.first_id=18446744073709551616"], &["key `source.first_id`: invalid type"]),
        (&["source.evolve_at=18446744073709551616"], &["key `source.evolve_at`: invalid type"]),
        (&["source.batch_rows=\"many\""], &["key `source.batch_rows`: invalid type"]),
        (&["source.kind=42"], &["key `source.kind`"]),
    ];
    for (sets, expected) in cases {
        let mut args = vec!["check", "job.toml"];
        for set in *sets {
            args.extend(["--set", set]);
        }
        let (code, out, err) = run_cli(&args, job.dir.path());
        let all = format!("{out}{err}");
        assert_eq!(code, 1, "{sets:?}: refused with exit code 1, not a panic:\n{all}");
        assert!(!all.contains("panicked"), "{sets:?}: {all}");
        for part in *expected {
            assert!(all.contains(part), "{sets:?}: expected {part:?} in:\n{all}");
        }
    }
    // At the edge: the last id is i64::MAX itself.
    let (code, out, err) = run_cli(
        &["check", "job.toml", "--set", "source.first_id=9223372036854775707", "--set", "source.rows=100"],
        job.dir.path(),
    );
    assert_eq!(code, 0, "ids up to i64::MAX are taken: {out}{err}");
}

/// A checkpoint interval far shorter than reading a batch takes still
/// moves rows: every round reads at least one batch before its interval
/// can end it (a round that checked its deadline first ended empty, round
/// after round, and never read a row).
#[test]
fn a_tiny_checkpoint_interval_still_moves_every_row() {
    let job = TestJob::files("tiny-interval", 3000, 2, 1_000_000);
    std::fs::write(job.path(), &job.toml).expect("job file");
    let sets = ["job.checkpoint.interval_secs=0.001".to_string(), "source.batch_rows=100".to_string()];
    let (status, stdout, stderr) = run_with_deadline(sluice_tests::sluice_run(&job, &sets), Duration::from_secs(300));
    assert_eq!(status, Some(0), "{stdout}\n{stderr}");
    assert!(stdout.contains("job tiny-interval finished: 3000 rows"), "{stdout}");
    assert_exactly_once(&read_visible(&job.out()), 3000);
    // 15 batches per subtask, at least one per round (and the final one).
    let checkpoints: u64 = stdout
        .split(" checkpoint(s)")
        .next()
        .and_then(|head| head.rsplit(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no checkpoint count in {stdout}"));
    assert!((1..=17).contains(&checkpoints), "{checkpoints} checkpoints for 15 batches a subtask: {stdout}");
}

/// A source paced far below a row a second stops on one SIGTERM within a
/// second, committing what it read: its wait for the next row looks at the
/// stop request every 100 ms (it slept until the row was due, 2000 s here).
#[test]
fn a_rate_limited_source_stops_on_sigterm_at_once() {
    use std::time::Instant;
    let job = TestJob::files("slow-stop", 3000, 2, 1_000_000);
    std::fs::write(job.path(), &job.toml).expect("job file");
    // 0.001 rows a second over 2 subtasks: each reads its first row at
    // once, checkpoint 1 commits it after 0.5 s, and its second row is due
    // after 2000 s.
    let sets = ["source.rate=0.001".to_string(), "job.checkpoint.interval_secs=0.5".to_string()];
    let mut child = sluice_tests::sluice_run(&job, &sets)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("sluice");
    let started = Instant::now();
    let visible = || if job.out().exists() { sluice_tests::ids(&read_visible(&job.out())) } else { Vec::new() };
    while visible().len() < 2 {
        assert!(started.elapsed() < Duration::from_secs(120), "checkpoint 1 never committed");
        if let Ok(Some(status)) = child.try_wait() {
            panic!("the run ended on its own ({status})");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    // Now every subtask waits for its next row.
    std::thread::sleep(Duration::from_secs(1));
    let signalled = Instant::now();
    let status = std::process::Command::new("kill").args(["-TERM", &child.id().to_string()]).status().expect("kill");
    assert!(status.success());
    let (code, stdout, stderr) = wait_child(child, Duration::from_secs(30));
    let took = signalled.elapsed();
    assert_eq!(code, Some(0), "a clean stop exits 0:\n{stdout}\n{stderr}");
    assert!(took < Duration::from_secs(5), "stopped {took:?} after SIGTERM");
    assert!(stdout.contains("job slow-stop stopped on request after checkpoint"), "{stdout}");
    assert_eq!(visible(), vec![0, 1500], "each subtask's first row, once");
}

/// A header-only CSV as a table's first file is refused naming the file
/// and the table, in a one-table folder and in a tree of two tables.
#[test]
fn a_header_only_first_csv_is_named_with_its_table() {
    let job = TestJob::files("csv-empty", 100, 1, 50);
    let dir = job.dir.path();
    let write = |path: &str, text: &str| {
        let path = dir.join(path);
        std::fs::create_dir_all(path.parent().expect("parent")).expect("dir");
        std::fs::write(path, text).expect("csv");
    };
    write("one/a.csv", "id,name\n");
    write("one/b.csv", "id,name\n1,x\n");
    write("two/customers/a.csv", "id,name\n1,x\n");
    write("two/orders/a.csv", "id,qty\n");
    write("two/orders/b.csv", "id,qty\n1,2\n");
    let toml = job.toml.replace(
        "[source]\nkind = \"generator\"\nrows = 100\nfirst_id = 0\nbatch_rows = 700\n",
        "[source]\nkind = \"file\"\npath = \"one\"\n",
    );
    assert!(toml.contains("kind = \"file\""), "the generator section was replaced: {toml}");
    std::fs::write(dir.join("job.toml"), &toml).expect("job file");
    for (path, file, table) in
        [("one", "one/a.csv", "the source's table"), ("two", "two/orders/a.csv", "table \"orders\"")]
    {
        let (code, out, err) = run_cli(&["run", "job.toml", "--set", &format!("source.path=\"{path}\"")], dir);
        let all = format!("{out}{err}");
        assert_eq!(code, 1, "{all}");
        assert!(!all.contains("panicked"), "{all}");
        let named = dir.join(file).display().to_string();
        assert!(
            all.contains(&format!("source file {named}: is the first file of {table}"))
                && all.contains("holds no records (only a header)"),
            "{path}: expected {named} and {table} in:\n{all}"
        );
    }
}

/// Runs `cmd` to its end, killing it past `limit`; its exit code (`None`
/// when killed or signalled), stdout and stderr.
fn run_with_deadline(mut cmd: std::process::Command, limit: Duration) -> (Option<i32>, String, String) {
    let child = cmd.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped()).spawn().expect("sluice");
    wait_child(child, limit)
}

/// Waits for `child` (its output piped), killing it past `limit`.
fn wait_child(mut child: std::process::Child, limit: Duration) -> (Option<i32>, String, String) {
    use std::io::Read;
    let take = |pipe: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut text = String::new();
            if let Some(mut pipe) = pipe {
                let _ = pipe.read_to_string(&mut text);
            }
            text
        })
    };
    let out = take(child.stdout.take().map(|p| Box::new(p) as Box<dyn Read + Send>));
    let err = take(child.stderr.take().map(|p| Box::new(p) as Box<dyn Read + Send>));
    let started = std::time::Instant::now();
    let code = loop {
        if let Some(status) = child.try_wait().expect("waiting for sluice") {
            break status.code();
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    (code, out.join().unwrap_or_default(), err.join().unwrap_or_default())
}
