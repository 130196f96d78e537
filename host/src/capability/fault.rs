//! Test-only crash injection inside a plugin call.
//!
//! When armed, the first host operation with a side effect (a file written,
//! renamed or deleted) is carried out and then the call is aborted with a
//! trap, as if the process had died right after the side effect and before
//! the plugin could answer. This reproduces "the commit was applied but the
//! reply was lost" at the exact point where it hurts.

/// Message of the trap raised by an injected crash.
#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error("injected crash after a side effect of the plugin call")]
pub struct InjectedCrash;

/// Per-instance arming switch.
#[derive(Debug, Default)]
pub struct SideEffectFault {
    armed: bool,
}

impl SideEffectFault {
    pub fn arm(&mut self, armed: bool) {
        self.armed = armed;
    }

    /// Called after every side effect; traps once when armed.
    pub fn after_side_effect(&mut self) -> wasmtime::Result<()> {
        if self.armed {
            self.armed = false;
            return Err(wasmtime::Error::new(InjectedCrash));
        }
        Ok(())
    }
}
