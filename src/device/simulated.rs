//! The simulated backend: a copy engine with a bandwidth and a latency, for tests and tuner
//! experiments. Bytes move at once; each copy's event completes when the link would have
//! carried them, one copy at a time. It keeps a [`SimLog`] of what a real device would be
//! asked to do (copies, the consumer's stream waits, host waits that blocked, frees and the
//! streams they waited for), so tests can check the device path's rules without a GPU.

use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::{Backend, CopyEvent, Cpu, DeviceError, DeviceMemory, Staging, StreamHandle};

/// A simulated copy engine: one copy at a time, `latency + bytes / bandwidth` each.
#[derive(Debug)]
pub struct Simulated {
    bandwidth: f64,
    latency: Duration,
    /// When the copy engine is free again.
    free_at: Mutex<Instant>,
    log: SimLog,
}

/// What the simulated device was asked to do, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SimRecord {
    /// Copy `id` of `bytes` started (its device memory is allocated).
    Copy {
        /// The copy's number, from 0.
        id: u64,
        /// Its size.
        bytes: usize,
    },
    /// The consumer's `stream` was made to wait for copy `id` (no host blocking);
    /// `complete`: whether the copy had completed then.
    StreamWait {
        /// The copy.
        id: u64,
        /// The consumer's stream.
        stream: StreamHandle,
        /// Whether the copy had completed when the wait was queued.
        complete: bool,
    },
    /// A thread (named `thread`, if it has a name) blocked until copy `id` completed.
    HostWait {
        /// The copy.
        id: u64,
        /// The blocked thread's name (`fg-upload-0` for the uploader's ring).
        thread: Option<String>,
    },
    /// Copy `id`'s device memory was freed, after the work queued on `streams`.
    Free {
        /// The copy.
        id: u64,
        /// Its size.
        bytes: usize,
        /// The consumer streams the free waited for.
        streams: Vec<StreamHandle>,
    },
}

#[derive(Debug, Default)]
struct LogInner {
    records: Vec<SimRecord>,
    next_id: u64,
    live: u64,
    peak: u64,
}

/// The [`Simulated`] backend's record (a handle: clones share it).
#[derive(Clone, Debug, Default)]
pub struct SimLog(Arc<Mutex<LogInner>>);

impl SimLog {
    /// Everything recorded so far, in order.
    pub fn records(&self) -> Vec<SimRecord> {
        self.0.lock().records.clone()
    }

    /// Device bytes allocated by copies and not freed yet.
    pub fn live_bytes(&self) -> u64 {
        self.0.lock().live
    }

    /// The most device bytes live at once.
    pub fn peak_live_bytes(&self) -> u64 {
        self.0.lock().peak
    }

    fn copy(&self, bytes: usize) -> u64 {
        let mut l = self.0.lock();
        let id = l.next_id;
        l.next_id += 1;
        l.live += bytes as u64;
        l.peak = l.peak.max(l.live);
        l.records.push(SimRecord::Copy { id, bytes });
        id
    }

    fn push(&self, r: SimRecord) {
        let mut l = self.0.lock();
        if let SimRecord::Free { bytes, .. } = &r {
            l.live = l.live.saturating_sub(*bytes as u64);
        }
        l.records.push(r);
    }
}

impl Simulated {
    /// A link of `bandwidth` bytes per second with a fixed `latency` per copy.
    pub fn new(bandwidth: f64, latency: Duration) -> Self {
        Self {
            bandwidth: bandwidth.max(1.0),
            latency,
            free_at: Mutex::new(Instant::now()),
            log: SimLog::default(),
        }
    }

    /// How long one copy of `bytes` takes on this link.
    pub fn copy_time(&self, bytes: usize) -> Duration {
        self.latency + Duration::from_secs_f64(bytes as f64 / self.bandwidth)
    }

    /// The record of what this device was asked to do (shared: keep it before handing the
    /// backend to an [`Uploader`](super::Uploader)).
    pub fn log(&self) -> SimLog {
        self.log.clone()
    }
}

/// A copy event that completes at a given instant (the simulated link's copies).
#[derive(Debug)]
pub struct CompletesAt(pub Instant);

impl CopyEvent for CompletesAt {
    fn is_complete(&self) -> bool {
        Instant::now() >= self.0
    }
    fn wait(&self) -> Result<(), DeviceError> {
        let now = Instant::now();
        if self.0 > now {
            std::thread::sleep(self.0 - now);
        }
        Ok(())
    }
}

/// A simulated copy: completes at an instant, and records what is asked of it.
#[derive(Debug)]
struct SimCopy {
    at: CompletesAt,
    id: u64,
    log: SimLog,
}

impl CopyEvent for SimCopy {
    fn is_complete(&self) -> bool {
        self.at.is_complete()
    }
    fn wait(&self) -> Result<(), DeviceError> {
        if !self.at.is_complete() {
            self.log.push(SimRecord::HostWait {
                id: self.id,
                thread: std::thread::current().name().map(str::to_owned),
            });
        }
        self.at.wait()
    }
    fn wait_on_stream(&self, stream: StreamHandle) -> Result<(), DeviceError> {
        self.log.push(SimRecord::StreamWait {
            id: self.id,
            stream,
            complete: self.at.is_complete(),
        });
        Ok(())
    }
    fn before_free(&self, bytes: usize, streams: &[StreamHandle]) -> Result<(), DeviceError> {
        self.log.push(SimRecord::Free {
            id: self.id,
            bytes,
            streams: streams.to_vec(),
        });
        Ok(())
    }
}

impl Backend for Simulated {
    fn name(&self) -> String {
        "simulated".into()
    }
    fn staging(&self, bytes: usize) -> Result<Staging, DeviceError> {
        Cpu.staging(bytes)
    }
    fn copy(
        &self,
        src: &Staging,
        len: usize,
    ) -> Result<(DeviceMemory, Arc<dyn CopyEvent>), DeviceError> {
        // The bytes move at once; the event says when the link would have carried them.
        let (memory, _) = Cpu.copy(src, len)?;
        let mut free = self.free_at.lock();
        let done = (*free).max(Instant::now()) + self.copy_time(len);
        *free = done;
        let id = self.log.copy(len);
        Ok((
            memory,
            Arc::new(SimCopy {
                at: CompletesAt(done),
                id,
                log: self.log.clone(),
            }),
        ))
    }
}
