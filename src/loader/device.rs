//! The device a loader uploads its batches to ([`Device`]): a CUDA GPU, the simulated device
//! (a copy engine in host memory that records what a GPU would be asked to do: for tests and
//! tuner experiments), or none (batches stay in host memory).

use std::sync::Arc;
use std::time::Duration;

use crate::device::{Backend, Cuda, DeviceError, GpuMonitor, SimLog, Simulated, Uploader};

/// Pinned staging an uploader may hold by default; batches are collated into pinned memory
/// and copied from there, so staging is rarely used.
pub const DEFAULT_STAGING_BYTES: usize = 64 << 20;

/// Device memory uploaded batches may hold by default while they wait for the consumer.
pub const DEFAULT_DEVICE_BYTES: u64 = 1 << 30;

/// The simulated device's copy rate by default, bytes/s: what a PCIe 4.0 x16 link moves from
/// pinned memory.
pub const DEFAULT_SIM_BANDWIDTH: f64 = 25e9;

/// The simulated device's fixed cost of one copy by default.
pub const DEFAULT_SIM_LATENCY: Duration = Duration::from_micros(10);

/// A device as a front end names it: `"cpu"`, `"cuda"`, `"cuda:N"` or `"simulated"`
/// (`str::parse`), the one reading of those names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceName {
    /// No device: batches stay in host memory.
    Cpu,
    /// CUDA GPU `N` (`"cuda"` is 0).
    Cuda(usize),
    /// The simulated device, at [`DEFAULT_SIM_BANDWIDTH`] and [`DEFAULT_SIM_LATENCY`].
    Simulated,
}

impl std::str::FromStr for DeviceName {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cpu" => Ok(Self::Cpu),
            "cuda" => Ok(Self::Cuda(0)),
            "simulated" => Ok(Self::Simulated),
            _ => match s.strip_prefix("cuda:") {
                Some(n) => n.parse().map(Self::Cuda).map_err(|_| {
                    format!("device {s:?}: the GPU's number after `cuda:` (\"cuda:0\")")
                }),
                None => Err(format!(
                    "device must be \"cpu\", \"cuda\", \"cuda:N\" or \"simulated\", not {s:?}"
                )),
            },
        }
    }
}

impl DeviceName {
    /// The device this names (`None` for `cpu`), with the defaults; an unusable GPU is an
    /// error here, at construction, not at the first batch.
    pub fn open(self) -> Result<Option<Device>, DeviceError> {
        Ok(match self {
            Self::Cpu => None,
            Self::Cuda(n) => Some(Device::cuda(n)?),
            Self::Simulated => Some(Device::simulated(
                DEFAULT_SIM_BANDWIDTH,
                DEFAULT_SIM_LATENCY,
            )),
        })
    }
}

/// A device to upload batches to; cheap to clone (a loader makes one uploader from it per
/// pipeline it builds).
#[derive(Clone)]
pub struct Device {
    backend: Arc<dyn Backend>,
    log: Option<SimLog>,
    monitor: Option<Arc<GpuMonitor>>,
    device_bytes: u64,
    staging_bytes: usize,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device")
            .field("simulated", &self.log.is_some())
            .field("device_bytes", &self.device_bytes)
            .field("staging_bytes", &self.staging_bytes)
            .finish()
    }
}

impl Device {
    fn with(backend: Arc<dyn Backend>) -> Self {
        Self {
            backend,
            log: None,
            monitor: None,
            device_bytes: DEFAULT_DEVICE_BYTES,
            staging_bytes: DEFAULT_STAGING_BYTES,
        }
    }

    /// CUDA GPU `ordinal` (feature `cuda`); an unusable GPU is an error here, at
    /// construction, not at the first batch. The tuner reads its utilisation (NVML) where it
    /// can: the consumer counts as starved only while the GPU idles.
    pub fn cuda(ordinal: usize) -> Result<Self, DeviceError> {
        let cuda = Cuda::new(ordinal)?;
        let mut d = Self::with(Arc::new(cuda));
        d.monitor = GpuMonitor::new(ordinal as u32).ok().map(Arc::new);
        Ok(d)
    }

    /// The simulated device: copies at `bandwidth` bytes/s after `latency`, recording each
    /// copy, wait and free ([`log`](Self::log)).
    pub fn simulated(bandwidth: f64, latency: Duration) -> Self {
        let s = Simulated::new(bandwidth, latency);
        let log = s.log();
        let mut d = Self::with(Arc::new(s));
        d.log = Some(log);
        d
    }

    /// Device memory uploaded batches may hold while they wait for the consumer (default
    /// [`DEFAULT_DEVICE_BYTES`]).
    pub fn max_device_bytes(mut self, bytes: u64) -> Self {
        self.device_bytes = bytes;
        self
    }

    /// The device memory uploaded batches may hold ([`max_device_bytes`](Self::max_device_bytes)).
    pub(crate) fn device_limit(&self) -> u64 {
        self.device_bytes
    }

    /// Pinned staging the uploader may hold (default [`DEFAULT_STAGING_BYTES`]).
    pub fn max_staging_bytes(mut self, bytes: usize) -> Self {
        self.staging_bytes = bytes;
        self
    }

    /// The simulated device's record.
    pub fn log(&self) -> Option<&SimLog> {
        self.log.as_ref()
    }

    /// A new uploader to this device.
    pub fn uploader(&self) -> Uploader {
        Uploader::with_backend(Arc::clone(&self.backend))
            .max_staging_bytes(self.staging_bytes)
            .max_device_bytes(self.device_bytes)
    }

    /// The GPU's utilisation, where NVML reports it.
    pub(crate) fn monitor(&self) -> Option<Arc<GpuMonitor>> {
        self.monitor.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_names_are_read_once() {
        for (name, want) in [
            ("cpu", DeviceName::Cpu),
            ("cuda", DeviceName::Cuda(0)),
            ("cuda:3", DeviceName::Cuda(3)),
            ("simulated", DeviceName::Simulated),
        ] {
            assert_eq!(name.parse::<DeviceName>(), Ok(want), "{name}");
        }
        for (name, says) in [
            ("cuda:x", "the GPU's number after `cuda:`"),
            ("cuda:-1", "the GPU's number after `cuda:`"),
            (
                "gpu",
                "device must be \"cpu\", \"cuda\", \"cuda:N\" or \"simulated\", not \"gpu\"",
            ),
            ("CUDA", "not \"CUDA\""),
        ] {
            let e = name.parse::<DeviceName>().unwrap_err();
            assert!(e.contains(says), "{name}: {e}");
        }
        assert!(DeviceName::Cpu.open().unwrap().is_none());
        let sim = DeviceName::Simulated.open().unwrap().unwrap();
        assert!(sim.log().is_some());
    }
}
