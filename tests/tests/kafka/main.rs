//! The Kafka source against a real broker (tansu, started per test by
//! `sluice_tests::kafka::Broker`); `kafka_s3` also reaches the process's
//! moto (`sluice_tests::harness::moto`).

mod debezium;
mod example;
mod kafka;
mod kafka_avro;
mod kafka_s3;
