//! Servers of a test's own, reached through explicit settings (the job's
//! `[sink.s3]`, endpoints, token servers, the child's own environment):
//! REST catalogs, the BigQuery double, token servers, moto per test. No test
//! here reads the process's cloud environment, except the two vended-
//! credential tests, which point it at their own moto one at a time
//! (`sluice_tests::harness::aws_env_lock`).

mod aws_chain;
mod bigquery;
mod bigquery_overwrite;
mod bigquery_upsert;
mod file_io_s3;
mod google_auth;
mod grpc_connections;
mod iceberg_rest;
mod iceberg_rest_oauth;
mod iceberg_rest_refused;
mod iceberg_rest_vended;
mod object_store;
