//! Crashes and kills: the crash matrix in process, and the real `sluice`
//! binary SIGKILLed mid-job, once or at random moments (the soak).

mod crash_matrix;
mod kill;
mod overwrite_kill;
mod soak;
mod sync_order;
mod upsert_kill;
