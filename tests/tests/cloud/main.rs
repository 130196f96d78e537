//! Object stores through the process's standard environment: one moto
//! server and one fake-gcs-server for the whole binary
//! (`sluice_tests::harness::{moto, gcs}`), every module on buckets of its
//! own (`harness::buckets`), and the AWS and `STORAGE_EMULATOR_HOST`
//! environment set once, so the host in this process and every `sluice`
//! process a test starts reach the same servers.
//!
//! Only `state_s3` sets moto's fault switch (one rule per server).

mod files_s3;
mod hostile_cloud;
mod iceberg_gcs;
mod iceberg_object;
mod iceberg_s3;
mod state_gcs;
mod state_object;
mod state_s3;
mod unknown_outcome_s3;
