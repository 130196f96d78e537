//! The capabilities as contract 0.1 plugins import them
//! (`sluice:connector/*@0.1.0`): every call converts its arguments, delegates
//! to the 0.2 implementation on the same view, and converts the answer back.
//! Nothing here decides anything, so a 0.1 plugin gets exactly the
//! behaviour, grants and faults of a 0.2 plugin.

use wasmtime::component::{Linker, Resource};

use super::CapabilityHost;
use super::catalog::{self, CatalogView, IcebergCatalog};
use super::file_io::{self, FileIo, FileIoView, OutputFileHandle};
use super::grpc::{self, BidiStream, Grpc, GrpcView};
use super::log::{self, Log, LogView, Types};
use crate::bindings::v0_1::sluice::connector as old;
use crate::bindings::v0_2::sluice::connector as new;

pub(super) fn add_to_linker<T: CapabilityHost>(linker: &mut Linker<T>) -> wasmtime::Result<()> {
    old::types::add_to_linker::<T, Types>(linker, |_| ())?;
    old::log::add_to_linker::<T, Log>(linker, log::view::<T>)?;
    old::file_io::add_to_linker::<T, FileIo>(linker, file_io::view::<T>)?;
    old::iceberg_catalog::add_to_linker::<T, IcebergCatalog>(linker, catalog::view::<T>)?;
    old::grpc::add_to_linker::<T, Grpc>(linker, grpc::view::<T>)
}

impl old::types::Host for () {}

impl old::log::Host for LogView<'_> {
    fn log(&mut self, level: old::log::Level, message: String) {
        let level = match level {
            old::log::Level::Trace => new::log::Level::Trace,
            old::log::Level::Debug => new::log::Level::Debug,
            old::log::Level::Info => new::log::Level::Info,
            old::log::Level::Warn => new::log::Level::Warn,
            old::log::Level::Error => new::log::Level::Error,
        };
        self.record(level, &message);
    }
}

fn io_error(e: new::file_io::IoError) -> old::file_io::IoError {
    use new::file_io::IoError as N;
    use old::file_io::IoError as O;
    match e {
        N::Denied(m) => O::Denied(m),
        N::NotFound(m) => O::NotFound(m),
        N::AlreadyExists(m) => O::AlreadyExists(m),
        N::Other(m) => O::Other(m),
    }
}

type IoResult<T> = wasmtime::Result<Result<T, old::file_io::IoError>>;

impl old::file_io::Host for FileIoView<'_> {
    fn exists(&mut self, location: String) -> IoResult<bool> {
        Ok(new::file_io::Host::exists(self, location)?.map_err(io_error))
    }

    fn stat(&mut self, location: String) -> IoResult<old::file_io::FileStatus> {
        let status = new::file_io::Host::stat(self, location)?.map_err(io_error);
        Ok(status.map(|s| old::file_io::FileStatus { size: s.size, is_dir: s.is_dir }))
    }

    fn read(&mut self, location: String, offset: u64, length: u64) -> IoResult<Vec<u8>> {
        Ok(new::file_io::Host::read(self, location, offset, length)?.map_err(io_error))
    }

    fn list_dir(&mut self, location: String) -> IoResult<Vec<String>> {
        Ok(new::file_io::Host::list_dir(self, location)?.map_err(io_error))
    }

    fn create_dir_all(&mut self, location: String) -> IoResult<()> {
        Ok(new::file_io::Host::create_dir_all(self, location)?.map_err(io_error))
    }

    fn write_file(&mut self, location: String, contents: Vec<u8>, overwrite: bool) -> IoResult<()> {
        Ok(new::file_io::Host::write_file(self, location, contents, overwrite)?.map_err(io_error))
    }

    fn rename(&mut self, from: String, to: String) -> IoResult<()> {
        Ok(new::file_io::Host::rename(self, from, to)?.map_err(io_error))
    }

    fn delete(&mut self, location: String) -> IoResult<()> {
        Ok(new::file_io::Host::delete(self, location)?.map_err(io_error))
    }
}

impl old::file_io::HostOutputFile for FileIoView<'_> {
    fn create(&mut self, location: String, overwrite: bool) -> IoResult<Resource<OutputFileHandle>> {
        Ok(new::file_io::HostOutputFile::create(self, location, overwrite)?.map_err(io_error))
    }

    fn write(&mut self, this: Resource<OutputFileHandle>, contents: Vec<u8>) -> IoResult<()> {
        Ok(new::file_io::HostOutputFile::write(self, this, contents)?.map_err(io_error))
    }

    fn finish(&mut self, this: Resource<OutputFileHandle>) -> IoResult<()> {
        Ok(new::file_io::HostOutputFile::finish(self, this)?.map_err(io_error))
    }

    fn drop(&mut self, this: Resource<OutputFileHandle>) -> wasmtime::Result<()> {
        new::file_io::HostOutputFile::drop(self, this)
    }
}

fn catalog_error(e: new::iceberg_catalog::CatalogError) -> old::iceberg_catalog::CatalogError {
    use new::iceberg_catalog::CatalogError as N;
    use old::iceberg_catalog::CatalogError as O;
    match e {
        N::Conflict(m) => O::Conflict(m),
        N::UnknownOutcome(m) => O::UnknownOutcome(m),
        N::NotFound(m) => O::NotFound(m),
        N::Other(m) => O::Other(m),
    }
}

fn table_ident(t: old::iceberg_catalog::TableIdent) -> new::iceberg_catalog::TableIdent {
    new::iceberg_catalog::TableIdent { namespace: t.namespace, name: t.name }
}

type CatalogResult = wasmtime::Result<Result<old::iceberg_catalog::LoadedTable, old::iceberg_catalog::CatalogError>>;

fn loaded(
    result: Result<new::iceberg_catalog::LoadedTable, new::iceberg_catalog::CatalogError>,
) -> Result<old::iceberg_catalog::LoadedTable, old::iceberg_catalog::CatalogError> {
    result
        .map(|t| old::iceberg_catalog::LoadedTable {
            metadata_location: t.metadata_location,
            metadata_json: t.metadata_json,
        })
        .map_err(catalog_error)
}

impl old::iceberg_catalog::Host for CatalogView<'_> {
    fn load_table(&mut self, table: old::iceberg_catalog::TableIdent) -> CatalogResult {
        Ok(loaded(new::iceberg_catalog::Host::load_table(self, table_ident(table))?))
    }

    fn create_table(&mut self, table: old::iceberg_catalog::TableIdent, request_json: String) -> CatalogResult {
        Ok(loaded(new::iceberg_catalog::Host::create_table(self, table_ident(table), request_json)?))
    }

    fn commit_table(
        &mut self,
        table: old::iceberg_catalog::TableIdent,
        requirements_json: String,
        updates_json: String,
    ) -> CatalogResult {
        let result =
            new::iceberg_catalog::Host::commit_table(self, table_ident(table), requirements_json, updates_json)?;
        Ok(loaded(result))
    }
}

fn grpc_error(e: new::grpc::GrpcError) -> old::grpc::GrpcError {
    match e {
        new::grpc::GrpcError::Denied(m) => old::grpc::GrpcError::Denied(m),
        new::grpc::GrpcError::Status(s) => {
            old::grpc::GrpcError::Status(old::grpc::Status { code: s.code, message: s.message, details: s.details })
        }
    }
}

type GrpcResult<T> = wasmtime::Result<Result<T, old::grpc::GrpcError>>;

impl old::grpc::Host for GrpcView<'_> {
    fn unary(&mut self, endpoint: String, method: String, request: Vec<u8>, timeout_ms: u32) -> GrpcResult<Vec<u8>> {
        Ok(new::grpc::Host::unary(self, endpoint, method, request, timeout_ms)?.map_err(grpc_error))
    }
}

impl old::grpc::HostBidiStream for GrpcView<'_> {
    fn open(&mut self, endpoint: String, method: String) -> GrpcResult<Resource<BidiStream>> {
        Ok(new::grpc::HostBidiStream::open(self, endpoint, method)?.map_err(grpc_error))
    }

    fn send(&mut self, stream: Resource<BidiStream>, message: Vec<u8>) -> GrpcResult<()> {
        Ok(new::grpc::HostBidiStream::send(self, stream, message)?.map_err(grpc_error))
    }

    fn receive(&mut self, stream: Resource<BidiStream>, timeout_ms: u32) -> GrpcResult<old::grpc::Received> {
        let received = new::grpc::HostBidiStream::receive(self, stream, timeout_ms)?.map_err(grpc_error);
        Ok(received.map(|r| match r {
            new::grpc::Received::Message(m) => old::grpc::Received::Message(m),
            new::grpc::Received::Pending => old::grpc::Received::Pending,
            new::grpc::Received::Ended => old::grpc::Received::Ended,
        }))
    }

    fn drop(&mut self, stream: Resource<BidiStream>) -> wasmtime::Result<()> {
        new::grpc::HostBidiStream::drop(self, stream)
    }
}
