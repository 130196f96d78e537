//! The one retry policy of Sluice: exponential backoff with jitter, built on
//! `backon`. The engine uses it for commits (`[job.commit]`), the plugins for
//! the calls they own (a BigQuery append, a stream's creation), so a delay
//! means the same thing everywhere.
//!
//! Invariants:
//! - an operation runs at most `attempts` times;
//! - the wait before retry `n` (1-based) grows from `initial` by a factor of
//!   2 up to `max`, plus a random jitter of up to the same again, so writers
//!   that failed together do not retry together;
//! - only errors the caller calls retryable are retried; any other error
//!   ends the operation at once.

use std::time::Duration;

use backon::{BackoffBuilder, BlockingRetryable, ExponentialBuilder};

/// How often, and how patiently, an operation is tried.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    /// Tries in all, the first included (at least 1).
    pub attempts: u32,
    /// Wait before the first retry, before jitter.
    pub initial: Duration,
    /// Longest wait between two tries, before jitter.
    pub max: Duration,
}

/// The last error of an operation, and how many times it ran.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failed<E> {
    pub error: E,
    pub attempts: u32,
}

impl Policy {
    fn builder(&self) -> ExponentialBuilder {
        ExponentialBuilder::new()
            .with_min_delay(self.initial)
            .with_max_delay(self.max)
            .with_factor(2.0)
            .with_jitter()
            .with_max_times(self.attempts.saturating_sub(1) as usize)
    }

    /// The wait before retry `retry` (1 for the first retry), jitter included;
    /// `None` once the attempts are used up.
    pub fn delay(&self, retry: u32) -> Option<Duration> {
        let index = usize::try_from(retry.checked_sub(1)?).ok()?;
        self.builder().build().nth(index)
    }

    /// Runs `op` (given the attempt number, from 1) until it succeeds, fails
    /// with an error `retryable` rejects, or the attempts run out, sleeping
    /// between tries. `notify` hears of each error about to be retried, with
    /// the wait before the retry.
    pub fn run<T, E>(
        &self,
        mut op: impl FnMut(u32) -> Result<T, E>,
        retryable: impl Fn(&E) -> bool,
        mut notify: impl FnMut(&E, u32, Duration),
    ) -> Result<T, Failed<E>> {
        let mut attempt = 0u32;
        let result = (|| {
            attempt += 1;
            op(attempt).map_err(|e| (e, attempt))
        })
        .retry(self.builder())
        .sleep(std::thread::sleep)
        .when(|(e, _)| retryable(e))
        .notify(|(e, n), wait| notify(e, *n, wait))
        .call();
        result.map_err(|(error, attempts)| Failed { error, attempts })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FAST: Policy = Policy { attempts: 4, initial: Duration::from_millis(1), max: Duration::from_millis(4) };

    #[test]
    fn retries_only_what_may_be_retried_and_counts_attempts() {
        let mut seen = Vec::new();
        let out: Result<u32, Failed<&str>> =
            FAST.run(|n| if n < 3 { Err("busy") } else { Ok(n) }, |e| *e == "busy", |_, n, _| seen.push(n));
        assert_eq!(out, Ok(3));
        assert_eq!(seen, vec![1, 2]);

        let out: Result<(), _> = FAST.run(|_| Err("busy"), |_| true, |_, _, _| {});
        assert_eq!(out, Err(Failed { error: "busy", attempts: 4 }));

        let out: Result<(), _> = FAST.run(|_| Err("broken"), |e| *e == "busy", |_, _, _| {});
        assert_eq!(out, Err(Failed { error: "broken", attempts: 1 }));
    }

    #[test]
    fn delays_grow_to_the_cap_with_jitter_and_end_with_the_attempts() {
        let p = Policy { attempts: 6, initial: Duration::from_millis(100), max: Duration::from_millis(400) };
        for retry in 1..=5u32 {
            let base = Duration::from_millis(100 * 2u64.pow(retry - 1)).min(p.max);
            let d = p.delay(retry).expect("a delay");
            // backon computes with f32 seconds: allow for rounding.
            let slack = Duration::from_millis(1);
            assert!(
                d + slack >= base && d <= base * 2 + slack,
                "retry {retry}: {d:?} not within {base:?}..{:?}",
                base * 2
            );
        }
        assert_eq!(p.delay(6), None);
        assert_eq!(p.delay(0), None);
    }
}
