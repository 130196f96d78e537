//! WASI's blocking imports, bounded by the plugin call's deadline.
//!
//! Invariants:
//! - `wasi:io/poll` (`poll`, `pollable.block`) and the blocking methods of
//!   `wasi:io/streams` are where a guest waits in WASI: a sleep
//!   (`wasi:clocks` pollables), an HTTP response or body, a stream's
//!   readiness. They are linked here over wasmtime-wasi's own (shadowing
//!   them), and each waits as wasmtime-wasi's does, but no later than the
//!   deadline of the call under way (`capability::limits::CallDeadline`);
//! - past the deadline the wait is dropped (which cancels it) and the import
//!   traps with a [`HostDeadline`] naming itself;
//! - everything else is wasmtime-wasi's, untouched.

use wasmtime::component::{HasData, Linker, Resource, ResourceTable};
use wasmtime_wasi::WasiView;
use wasmtime_wasi::p2::bindings::sync::io::poll as sync_poll;
use wasmtime_wasi::p2::bindings::sync::io::streams as sync_streams;
use wasmtime_wasi::p2::{DynPollable, StreamError, StreamResult};
use wasmtime_wasi_io::bindings::wasi::io::poll::{Host as AsyncPoll, HostPollable as AsyncPollable};
use wasmtime_wasi_io::bindings::wasi::io::streams::{HostInputStream as AsyncInput, HostOutputStream as AsyncOutput};
use wasmtime_wasi_io::streams::{DynInputStream, DynOutputStream};

use sluice_capability::limits::{CallDeadline, HostDeadline};

/// The resource table, seen by the bounded imports.
pub struct Bounded<'a> {
    table: &'a mut ResourceTable,
}

struct BoundedIo;

impl HasData for BoundedIo {
    type Data<'a> = Bounded<'a>;
}

/// Links the bounded `wasi:io/poll` and `wasi:io/streams` over those
/// `wasmtime_wasi::p2::add_to_linker_sync` linked.
pub fn add_to_linker<T: WasiView>(linker: &mut Linker<T>) -> wasmtime::Result<()> {
    linker.allow_shadowing(true);
    sync_poll::add_to_linker::<T, BoundedIo>(linker, |t| Bounded { table: t.ctx().table })?;
    sync_streams::add_to_linker::<T, BoundedIo>(linker, |t| Bounded { table: t.ctx().table })?;
    linker.allow_shadowing(false);
    Ok(())
}

/// Runs `fut` as wasmtime-wasi runs its blocking calls (on its runtime),
/// giving up at the call's deadline.
fn wait<F: Future>(import: &'static str, fut: F) -> Result<F::Output, HostDeadline> {
    match CallDeadline::current() {
        None => Ok(wasmtime_wasi::runtime::in_tokio(fut)),
        Some(at) => {
            let at = tokio::time::Instant::from_std(at);
            wasmtime_wasi::runtime::in_tokio(async move { tokio::time::timeout_at(at, fut).await })
                .map_err(|_| HostDeadline { import })
        }
    }
}

fn trap(late: HostDeadline) -> wasmtime::Error {
    wasmtime::Error::new(late)
}

fn stream_trap(late: HostDeadline) -> StreamError {
    StreamError::Trap(trap(late))
}

impl sync_poll::Host for Bounded<'_> {
    fn poll(&mut self, pollables: Vec<Resource<DynPollable>>) -> wasmtime::Result<Vec<u32>> {
        wait("wasi:io/poll.poll", AsyncPoll::poll(self.table, pollables)).map_err(trap)?
    }
}

impl sync_poll::HostPollable for Bounded<'_> {
    fn ready(&mut self, pollable: Resource<DynPollable>) -> wasmtime::Result<bool> {
        wait("wasi:io/poll.[method]pollable.ready", AsyncPollable::ready(self.table, pollable)).map_err(trap)?
    }

    fn block(&mut self, pollable: Resource<DynPollable>) -> wasmtime::Result<()> {
        wait("wasi:io/poll.[method]pollable.block", AsyncPollable::block(self.table, pollable)).map_err(trap)?
    }

    fn drop(&mut self, pollable: Resource<DynPollable>) -> wasmtime::Result<()> {
        AsyncPollable::drop(self.table, pollable)
    }
}

impl sync_streams::Host for Bounded<'_> {
    fn convert_stream_error(&mut self, err: StreamError) -> wasmtime::Result<sync_streams::StreamError> {
        sync_streams::Host::convert_stream_error(self.table, err)
    }
}

impl sync_streams::HostOutputStream for Bounded<'_> {
    fn drop(&mut self, stream: Resource<DynOutputStream>) -> wasmtime::Result<()> {
        wait("wasi:io/streams.[drop]output-stream", AsyncOutput::drop(self.table, stream)).map_err(trap)?
    }

    fn check_write(&mut self, stream: Resource<DynOutputStream>) -> StreamResult<u64> {
        sync_streams::HostOutputStream::check_write(self.table, stream)
    }

    fn write(&mut self, stream: Resource<DynOutputStream>, bytes: Vec<u8>) -> StreamResult<()> {
        sync_streams::HostOutputStream::write(self.table, stream, bytes)
    }

    fn blocking_write_and_flush(&mut self, stream: Resource<DynOutputStream>, bytes: Vec<u8>) -> StreamResult<()> {
        wait(
            "wasi:io/streams.[method]output-stream.blocking-write-and-flush",
            AsyncOutput::blocking_write_and_flush(self.table, stream, bytes),
        )
        .map_err(stream_trap)?
    }

    fn blocking_write_zeroes_and_flush(&mut self, stream: Resource<DynOutputStream>, len: u64) -> StreamResult<()> {
        wait(
            "wasi:io/streams.[method]output-stream.blocking-write-zeroes-and-flush",
            AsyncOutput::blocking_write_zeroes_and_flush(self.table, stream, len),
        )
        .map_err(stream_trap)?
    }

    fn subscribe(&mut self, stream: Resource<DynOutputStream>) -> wasmtime::Result<Resource<DynPollable>> {
        sync_streams::HostOutputStream::subscribe(self.table, stream)
    }

    fn write_zeroes(&mut self, stream: Resource<DynOutputStream>, len: u64) -> StreamResult<()> {
        sync_streams::HostOutputStream::write_zeroes(self.table, stream, len)
    }

    fn flush(&mut self, stream: Resource<DynOutputStream>) -> StreamResult<()> {
        sync_streams::HostOutputStream::flush(self.table, stream)
    }

    fn blocking_flush(&mut self, stream: Resource<DynOutputStream>) -> StreamResult<()> {
        let borrowed = Resource::new_borrow(stream.rep());
        wait("wasi:io/streams.[method]output-stream.blocking-flush", AsyncOutput::blocking_flush(self.table, borrowed))
            .map_err(stream_trap)?
    }

    fn splice(&mut self, dst: Resource<DynOutputStream>, src: Resource<DynInputStream>, len: u64) -> StreamResult<u64> {
        sync_streams::HostOutputStream::splice(self.table, dst, src, len)
    }

    fn blocking_splice(
        &mut self,
        dst: Resource<DynOutputStream>,
        src: Resource<DynInputStream>,
        len: u64,
    ) -> StreamResult<u64> {
        wait(
            "wasi:io/streams.[method]output-stream.blocking-splice",
            AsyncOutput::blocking_splice(self.table, dst, src, len),
        )
        .map_err(stream_trap)?
    }
}

impl sync_streams::HostInputStream for Bounded<'_> {
    fn drop(&mut self, stream: Resource<DynInputStream>) -> wasmtime::Result<()> {
        wait("wasi:io/streams.[drop]input-stream", AsyncInput::drop(self.table, stream)).map_err(trap)?
    }

    fn read(&mut self, stream: Resource<DynInputStream>, len: u64) -> StreamResult<Vec<u8>> {
        sync_streams::HostInputStream::read(self.table, stream, len)
    }

    fn blocking_read(&mut self, stream: Resource<DynInputStream>, len: u64) -> StreamResult<Vec<u8>> {
        wait("wasi:io/streams.[method]input-stream.blocking-read", AsyncInput::blocking_read(self.table, stream, len))
            .map_err(stream_trap)?
    }

    fn skip(&mut self, stream: Resource<DynInputStream>, len: u64) -> StreamResult<u64> {
        sync_streams::HostInputStream::skip(self.table, stream, len)
    }

    fn blocking_skip(&mut self, stream: Resource<DynInputStream>, len: u64) -> StreamResult<u64> {
        wait("wasi:io/streams.[method]input-stream.blocking-skip", AsyncInput::blocking_skip(self.table, stream, len))
            .map_err(stream_trap)?
    }

    fn subscribe(&mut self, stream: Resource<DynInputStream>) -> wasmtime::Result<Resource<DynPollable>> {
        sync_streams::HostInputStream::subscribe(self.table, stream)
    }
}
