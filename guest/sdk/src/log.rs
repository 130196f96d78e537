//! Logging into the host's log through the `log` capability.

use crate::bindings::sluice::connector::log::{Level, log};

pub fn debug(message: &str) {
    log(Level::Debug, message);
}
pub fn info(message: &str) {
    log(Level::Info, message);
}
pub fn warn(message: &str) {
    log(Level::Warn, message);
}
