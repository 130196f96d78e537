//! Names of options the host hands a plugin itself (the host's
//! `sluice_plugin::reserved` says what each carries). A plugin declares the
//! ones it takes in `describe()`; every plugin spells them from here.

/// The job's dead-letter table (`[job.dead_letter] table`), as the source
/// names it: a sink that changes what a table holds keeps that one
/// append-only.
pub const DEAD_LETTER_TABLE: &str = "sluice.dead-letter-table";

/// When the job's incarnation began, in milliseconds since the Unix epoch:
/// the same in every run of the incarnation.
pub const INCARNATION_CREATED_MS: &str = "sluice.incarnation-created-ms";
