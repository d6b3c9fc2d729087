//! Retries: [`RetryPolicy`] (backoff with full jitter under a shared token budget) and the
//! loop that runs one request's attempts under it, counting attempts, retries and failures.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;

use super::error::{Failed, S3Error};

/// Retries with exponential backoff and full jitter, under a shared budget.
///
/// Attempt `n` (from 1) that fails transiently waits a uniform random time in
/// `[0, min(max_delay, base_delay · 2ⁿ⁻¹)]` before the next. Each retry spends
/// `retry_cost` tokens of the client's budget (`timeout_cost` after a timeout) and each success
/// returns one, up to `budget`: while the store is healthy retries are free, and when it fails
/// everywhere the budget runs out and requests fail fast instead of multiplying the load
/// (the AWS SDKs' "standard" retry mode works the same way).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Attempts per request, the first included (1 = no retries).
    pub max_attempts: u32,
    /// The first backoff's upper bound.
    pub base_delay: Duration,
    /// The largest backoff.
    pub max_delay: Duration,
    /// Tokens in the client's retry budget.
    pub budget: u64,
    /// Tokens a retry costs.
    pub retry_cost: u64,
    /// Tokens a retry after a timeout costs.
    pub timeout_cost: u64,
}

impl Default for RetryPolicy {
    /// 5 attempts, 50 ms → 5 s backoff, a budget of 500 tokens, 5 per retry, 10 after a timeout.
    fn default() -> Self {
        Self {
            max_attempts: 5,
            base_delay: Duration::from_millis(50),
            max_delay: Duration::from_secs(5),
            budget: 500,
            retry_cost: 5,
            timeout_cost: 10,
        }
    }
}

/// Runs requests under a [`RetryPolicy`]: the budget and the counters of one client.
#[derive(Debug)]
pub(super) struct Retrier {
    policy: RetryPolicy,
    attempt_timeout: Duration,
    bucket: String,
    budget: Mutex<u64>,
    pub(super) attempts: AtomicU64,
    pub(super) retries: AtomicU64,
    pub(super) failures: AtomicU64,
    jitter: AtomicU64,
}

impl Retrier {
    pub(super) fn new(policy: RetryPolicy, attempt_timeout: Duration, bucket: String) -> Self {
        Self {
            policy,
            attempt_timeout,
            bucket,
            budget: Mutex::new(policy.budget),
            attempts: AtomicU64::new(0),
            retries: AtomicU64::new(0),
            failures: AtomicU64::new(0),
            jitter: AtomicU64::new(0x2545_F491_4F6C_DD1D),
        }
    }

    /// Tokens left in the budget.
    pub(super) fn budget_left(&self) -> u64 {
        *self.budget.lock()
    }

    /// Runs `attempt` until it succeeds, fails fatally, or the attempts or budget run out;
    /// each attempt is cut off after the client's attempt timeout.
    pub(super) async fn run<T, F, Fut>(&self, key: &str, attempt: F) -> Result<T, S3Error>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, Failed>>,
    {
        self.run_with(key, true, attempt).await
    }

    /// [`run`](Self::run); with `whole_attempt` false the attempt enforces its own timeouts
    /// (a long download that keeps receiving is not cut off; one that stalls is).
    pub(super) async fn run_with<T, F, Fut>(
        &self,
        key: &str,
        whole_attempt: bool,
        mut attempt: F,
    ) -> Result<T, S3Error>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, Failed>>,
    {
        let policy = self.policy;
        let timeout = self.attempt_timeout;
        let mut n = 0u32;
        loop {
            n += 1;
            self.attempts.fetch_add(1, Ordering::Relaxed);
            let outcome = if whole_attempt {
                match tokio::time::timeout(timeout, attempt()).await {
                    Ok(r) => r,
                    Err(_) => Err(Failed::Transient {
                        cause: format!("attempt timed out after {timeout:?}"),
                        timeout: true,
                    }),
                }
            } else {
                attempt().await
            };
            let (cause, timed_out) = match outcome {
                Ok(v) => {
                    let mut budget = self.budget.lock();
                    *budget = (*budget + 1).min(policy.budget);
                    return Ok(v);
                }
                Err(Failed::Fatal(mut e)) => {
                    if let S3Error::Request { attempts, .. } = &mut e {
                        *attempts = n;
                    }
                    self.failures.fetch_add(1, Ordering::Relaxed);
                    return Err(e);
                }
                Err(Failed::Transient { cause, timeout }) => (cause, timeout),
            };
            let cost = if timed_out {
                policy.timeout_cost
            } else {
                policy.retry_cost
            };
            let may_retry = n < policy.max_attempts && {
                let mut budget = self.budget.lock();
                let ok = *budget >= cost;
                if ok {
                    *budget -= cost;
                }
                ok
            };
            if !may_retry {
                self.failures.fetch_add(1, Ordering::Relaxed);
                let bucket = self.bucket.clone();
                let key = key.to_owned();
                return Err(if timed_out {
                    S3Error::Timeout {
                        bucket,
                        key,
                        attempts: n,
                        timeout,
                    }
                } else {
                    let spent = if n < policy.max_attempts {
                        " (retry budget spent)"
                    } else {
                        ""
                    };
                    S3Error::Request {
                        bucket,
                        key,
                        attempts: n,
                        cause: format!("{cause}{spent}"),
                    }
                });
            }
            self.retries.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(key, attempt = n, cause = %cause, "s3 retry");
            tokio::time::sleep(self.backoff(n)).await;
        }
    }

    /// Full jitter: uniform in `[0, min(max, base · 2ⁿ⁻¹)]`.
    fn backoff(&self, n: u32) -> Duration {
        let p = self.policy;
        let cap = p
            .base_delay
            .saturating_mul(1u32 << (n - 1).min(20))
            .min(p.max_delay);
        let seed = self
            .jitter
            .fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed);
        let u = flowgate_tuner::Rng::new(seed).uniform();
        cap.mul_f64(u)
    }
}
