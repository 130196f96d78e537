//! Host bindings of the `sluice:connector@0.1.0` `sink-plugin` world.
//!
//! Everything is synchronous: each plugin instance runs on its own thread,
//! so a guest blocked in a host call never stalls another guest.

wasmtime::component::bindgen!({
    path: "../wit",
    world: "sink-plugin",
    imports: {
        // File operations may inject a crash in tests (see `crate::fault`);
        // an injected crash is a trap.
        "sluice:connector/file-io": trappable,
        "sluice:connector/iceberg-catalog": trappable,
        // A successful unary call is a side effect an injected crash may follow.
        "sluice:connector/grpc": trappable,
        default: tracing,
    },
    // Calls into the plugin borrow their arguments: a batch is not copied
    // on the host side before it is copied into the guest.
    ownership: Borrowing { duplicate_if_necessary: true },
    with: {
        "sluice:connector/file-io.output-file": crate::capability::file_io::OutputFileHandle,
        "sluice:connector/grpc.bidi-stream": crate::capability::grpc::BidiStream,
    },
});

pub use exports::sluice::connector::sink::{CommitOutcome, PluginInfo, SinkContext, SinkError};
