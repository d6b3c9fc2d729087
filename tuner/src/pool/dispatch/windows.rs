//! The sizer's windows: at each, what the loop waited, the units decoded and in flight, the
//! workers' measured rates, the [`PoolSizer`](crate::pool::PoolSizer)'s decision (workers started or retired), and
//! the trace of windows and deaths the front ends show (`tuner_trace()`).

use std::collections::VecDeque;

use super::{Command, Dispatcher, Worker};
use crate::pool::PoolObservation;

/// Windows kept in the trace.
pub const TRACE_WINDOWS: usize = 1000;

/// One window as the sizer saw it.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct WindowRecord {
    /// The fraction of the window the loop waited.
    pub wait: f64,
    /// Units decoded and not taken yet.
    pub ready: usize,
    /// Units in the workers' hands, not decoded yet.
    pub in_flight: usize,
    /// Workers started that have not finished a unit.
    pub starting: usize,
    /// Units a second the loop took.
    pub rate: f64,
    /// Units a second one busy remote worker decodes.
    pub worker_rate: f64,
    /// Units a second the training process decodes.
    pub local_rate: f64,
}

/// A trace entry: a window, or a worker's death. Serialised flat (the window's fields beside
/// the others), as the Python package's `tuner_trace()` gives it.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct TraceRecord {
    /// Seconds since the dispatcher was made.
    pub t: f64,
    /// Remote workers (not retiring) after it.
    pub workers: usize,
    /// Whether the training process decodes.
    pub local: bool,
    /// The window, for a window's entry.
    #[serde(flatten)]
    pub window: Option<WindowRecord>,
    /// What changed and why.
    pub decisions: Vec<String>,
}

impl Dispatcher {
    /// Whether a sizer's window has passed (the caller then counts the decoded units in
    /// hand and calls [`resize`](Self::resize)).
    pub fn window_due(&self, now: f64) -> bool {
        now - self.window_start >= self.settings.window_seconds
    }

    /// Whether the pool is sized (it wants the cluster's free CPUs at each window).
    pub fn sized(&self) -> bool {
        self.sizer.is_some()
    }

    /// Ends a window at `now` (nothing when it has not passed): `decoded` of the units
    /// [`in_hand`](Self::in_hand) are decoded, the cluster has `free_cpus` free. A sized
    /// pool starts or retires workers as its sizer says; the window goes into the trace.
    pub fn resize(&mut self, now: f64, decoded: usize, free_cpus: f64) -> Vec<Command> {
        let mut out = Vec::new();
        if !self.window_due(now) {
            return out;
        }
        let span = now - self.window_start;
        let mut waited = self.waited;
        if let Some(since) = self.waiting_since.as_mut() {
            // A wait in progress counts in this window, and its rest in the next.
            waited += (now - *since).max(0.0);
            *since = now;
        }
        self.waited = 0.0;
        self.window_start = now;
        let in_hand = self.in_hand().len();
        let before = self.workers();
        let local = self.local.as_ref();
        let window = WindowRecord {
            wait: (waited / span).clamp(0.0, 1.0),
            ready: decoded.min(in_hand),
            in_flight: in_hand - decoded.min(in_hand),
            starting: self.remote().filter(|w| w.finished == 0).count(),
            rate: self.consumed as f64 / span,
            worker_rate: rate(self.remote()),
            local_rate: rate(local.into_iter()),
        };
        self.consumed = 0;
        let mut decisions = Vec::new();
        if let Some(sizer) = self.sizer.as_mut() {
            let d = sizer.decide(&PoolObservation {
                workers: before,
                starting: window.starting,
                wait: window.wait,
                ready: window.ready,
                in_flight: window.in_flight,
                free_cpus,
                rate: window.rate,
                worker_rate: window.worker_rate,
                local_rate: window.local_rate,
            });
            while self.workers() < d.workers {
                out.push(self.start());
            }
            while self.workers() > d.workers {
                self.retire_idlest(&mut out);
            }
            if let Some(why) = d.why {
                decisions.push(format!(
                    "RemoteWorkers({before} -> {}): {why}",
                    self.workers()
                ));
            }
        }
        self.record(now, Some(window), decisions);
        out
    }

    /// The recent windows and deaths, oldest first.
    pub fn trace(&self) -> &VecDeque<TraceRecord> {
        &self.trace
    }

    /// Adds an entry to the trace (the oldest goes beyond [`TRACE_WINDOWS`]).
    pub(super) fn record(
        &mut self,
        now: f64,
        window: Option<WindowRecord>,
        decisions: Vec<String>,
    ) {
        if self.trace.len() == TRACE_WINDOWS {
            self.trace.pop_front();
        }
        self.trace.push_back(TraceRecord {
            t: now - self.t0,
            workers: self.workers(),
            local: self.local.is_some(),
            window,
            decisions,
        });
    }
}

/// Units a second one busy worker decodes, over what `workers` have finished (0: none yet).
fn rate<'a>(workers: impl Iterator<Item = &'a Worker>) -> f64 {
    let (done, busy) = workers.fold((0u64, 0.0f64), |(d, b), w| {
        (d + w.finished, b + w.busy_seconds)
    });
    if busy > 0.0 && done > 0 {
        done as f64 / busy
    } else {
        0.0
    }
}
