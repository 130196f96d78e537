//! Durations the job file gives as a float number of seconds: checked once
//! at load against their key's range, so that no later conversion can fail.

use std::time::Duration;

/// `value` seconds as a duration, refused outside `range` (inclusive).
/// Every float duration of the job file goes through here at load, so
/// that no later conversion can fail.
pub fn seconds(value: f64, range: (f64, f64)) -> Result<Duration, String> {
    let (min, max) = range;
    if !(value.is_finite() && min <= value && value <= max) {
        return Err(format!("must be between {} and {} seconds, got {}", show(min), show(max), show(value)));
    }
    Duration::try_from_secs_f64(value).map_err(|e| format!("{} seconds: {e}", show(value)))
}

/// `value` seconds taken into `range`: for a spec changed after load
/// (load refuses values outside it, see [`seconds`]).
pub fn seconds_within(value: f64, range: (f64, f64)) -> Duration {
    let clamped = if value.is_nan() { range.0 } else { value.clamp(range.0, range.1) };
    Duration::try_from_secs_f64(clamped).unwrap_or(Duration::ZERO)
}

/// A number as a person writes it: `0.001`, `604800`, `1e300`.
pub fn show(value: f64) -> String {
    let magnitude = value.abs();
    if value == 0.0 || (1e-4..1e7).contains(&magnitude) || !value.is_finite() {
        format!("{value}")
    } else {
        format!("{value:e}")
    }
}
