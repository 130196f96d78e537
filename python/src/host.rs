//! `Host`: the WebAssembly engine and its compiled-component cache, and
//! what a loaded plugin says of itself.
//!
//! Invariant: loading (and compiling) a plugin runs with the GIL released.

use std::path::PathBuf;
use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use sluice_engine::plugin::{ComponentCache, Plugin, PluginHost};

use crate::errors::to_py;

/// The WebAssembly engine and the compiled-component cache (default:
/// `$SLUICE_CACHE_DIR` or `~/.cache/sluice/components`, as for `sluice`).
#[pyclass(frozen, module = "sluice._native")]
pub(crate) struct Host {
    pub(crate) host: Arc<PluginHost>,
}

#[pymethods]
impl Host {
    #[new]
    #[pyo3(signature = (cache_dir = None))]
    fn new(py: Python<'_>, cache_dir: Option<PathBuf>) -> PyResult<Self> {
        let dir = cache_dir.or_else(ComponentCache::default_dir);
        let host = py.detach(|| PluginHost::new(dir)).map_err(to_py)?;
        Ok(Self { host: Arc::new(host) })
    }

    /// Loads a plugin (from the cache when it was compiled before) and
    /// returns what it says of itself.
    fn describe<'py>(&self, py: Python<'py>, plugin: PathBuf) -> PyResult<Bound<'py, PyDict>> {
        let host = self.host.clone();
        let plugin = py.detach(move || host.load(&plugin)).map_err(to_py)?;
        describe(py, &plugin)
    }
}

pub(crate) fn describe<'py>(py: Python<'py>, plugin: &Plugin) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("path", plugin.path.clone())?;
    d.set_item("contract", plugin.version().to_string())?;
    d.set_item("loaded_from_cache", matches!(plugin.loaded_from, sluice_engine::plugin::LoadedFrom::Cache(_)))?;
    if let Some(info) = plugin.info() {
        d.set_item("name", info.name.clone())?;
        d.set_item("version", info.version.clone())?;
        d.set_item("description", info.description.clone())?;
        d.set_item("multi_table", info.multi_table)?;
        let options = PyList::empty(py);
        for o in &info.options {
            let od = PyDict::new(py);
            od.set_item("name", o.name.clone())?;
            od.set_item("description", o.description.clone())?;
            od.set_item("required", o.required)?;
            od.set_item("default", o.default_value.clone())?;
            options.append(od)?;
        }
        d.set_item("options", options)?;
    }
    Ok(d)
}
