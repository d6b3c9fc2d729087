//! The simulated backend: a copy engine with a bandwidth and a latency, for tests and tuner
//! experiments. Bytes move at once; each copy's event completes when the link would have
//! carried them, one copy at a time.

use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::{Backend, CopyEvent, Cpu, DeviceError, DeviceMemory, Staging};

/// A simulated copy engine: one copy at a time, `latency + bytes / bandwidth` each.
#[derive(Debug)]
pub struct Simulated {
    bandwidth: f64,
    latency: Duration,
    /// When the copy engine is free again.
    free_at: Mutex<Instant>,
}

impl Simulated {
    /// A link of `bandwidth` bytes per second with a fixed `latency` per copy.
    pub fn new(bandwidth: f64, latency: Duration) -> Self {
        Self {
            bandwidth: bandwidth.max(1.0),
            latency,
            free_at: Mutex::new(Instant::now()),
        }
    }

    /// How long one copy of `bytes` takes on this link.
    pub fn copy_time(&self, bytes: usize) -> Duration {
        self.latency + Duration::from_secs_f64(bytes as f64 / self.bandwidth)
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
        Ok((memory, Arc::new(CompletesAt(done))))
    }
}
