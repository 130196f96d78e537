//! Options the host hands a plugin itself, next to the job's
//! `[sink.options]`. Contract 0.1 has no field for what they carry, so a
//! plugin opts in by declaring them in `describe()`; one that does not gets
//! none of them. Their names start with `sluice.`, which the job file may
//! not use.

/// The incarnation id of the job's state directory: random, made when the
/// directory's first run starts. A plugin keys everything it writes with it
/// (besides job, sink and checkpoint), so a job started over in a fresh state
/// directory never takes an earlier incarnation's checkpoints for its own.
pub const INCARNATION: &str = "sluice.incarnation";

/// `refuse` on the first run of a fresh state directory: the plugin must
/// stop (a `config` error) before writing anything when the target holds
/// checkpoints of this job and sink from another incarnation, naming the
/// job, the target and that incarnation. `accept` otherwise (a resumed
/// incarnation, or `sluice run --new-incarnation`).
pub const OTHER_INCARNATIONS: &str = "sluice.other-incarnations";

/// `exclusive` or `beside`: how the incarnation treats the target's claim
/// (contract 0.1 and 0.2 alike). A target is claimed by at most one
/// incarnation of a job and sink, in an atomic step of the target (an
/// exclusive create, or the commit that publishes the rows); an `exclusive`
/// incarnation takes a free claim, goes on under its own and refuses,
/// before anything of it is visible, a target another incarnation holds.
/// `beside` (`sluice run --new-incarnation`) neither takes nor checks it.
/// The guest SDK's `claim` module is the plugin side.
pub const CLAIM: &str = "sluice.claim";

/// The job's dead-letter table (`[job.dead_letter] table`), as the source
/// names it, when the job sets bad records aside: a sink that changes what
/// a table holds (an overwrite) keeps that table append-only.
pub const DEAD_LETTER_TABLE: &str = "sluice.dead-letter-table";

/// A change stream's key columns, as a JSON array of names (`["id"]`):
/// given only when the job's source is a change stream (`[source] key`),
/// whose batches then carry `sluice_core::changes`' columns after the
/// table's own. A job whose source is a change stream is refused, before
/// anything is written, when its plugin does not declare this option.
pub const KEY: &str = sluice_core::changes::KEY_OPTION;

/// When the job's incarnation began, in milliseconds since the Unix epoch
/// (the state directory's record of it): the same in every run of the
/// incarnation, and later for a later incarnation as far as the clocks of
/// the machines that made them agree. A sink that orders changes by number
/// (BigQuery's `_CHANGE_SEQUENCE_NUMBER`) puts it first, so a new
/// incarnation's changes, over new input whose positions start again from
/// zero, are never taken for older ones.
pub const INCARNATION_CREATED_MS: &str = "sluice.incarnation-created-ms";

/// Prefix no job-file option may use.
pub const PREFIX: &str = "sluice.";

pub fn is_reserved(name: &str) -> bool {
    name.starts_with(PREFIX)
}
