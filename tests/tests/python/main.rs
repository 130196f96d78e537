//! Sluice from Python: a sink plugin written in Python, and Sluice on a
//! local Ray cluster (each test starts what it needs).

mod python_sink;
mod ray;
