//! The last stage: batches to the accelerator.
//!
//! An [`Uploader`] owns a [`Backend`] and a ring of host *staging* slots. For each batch it
//! takes the next slot, waits until that slot's previous copy has completed (a slot is never
//! reused before its copy is done), copies the batch into it, starts an asynchronous
//! host-to-device copy, and hands the consumer a [`DeviceBatch`] (device memory, shape, dtype
//! and the copy's completion event) that stays valid while the consumer holds it.
//!
//! Backends, one per file:
//! 1. `cpu` — [`Cpu`]: pass-through; the "device" is host memory (runs everywhere).
//! 2. `simulated` — [`Simulated`]: a copy engine with a bandwidth and a latency, for tests and
//!    tuner experiments: copies complete in order, each `latency + bytes / bandwidth` after the
//!    later of its start and the previous copy's end.
//! 3. `cuda` — [`Cuda`] (feature `cuda`): pinned staging slots, copies on a dedicated stream,
//!    an event per batch. libcuda is loaded at run time: with no driver or no GPU,
//!    [`Cuda::new`] returns [`DeviceError::Unavailable`] (never a panic), and
//!    [`Uploader::cuda_or_cpu`] falls back. Without the feature, `cuda_unavailable.rs` stands
//!    in with the same names (its memory types are uninhabited, so no `cfg` is needed
//!    anywhere else).
//!
//! The [`Uploader`] (the staging ring, `uploader.rs`) works with any [`Backend`].
//!
//! The ring sizes itself: when the next slot's copy is still running and the ring is below its
//! byte ceiling, it adds a slot instead of waiting; so its depth settles at the number of
//! copies in flight that the consumer's pace needs. Batches already on the device and waiting
//! for the consumer are the sink's budget, which the tuner turns.
//!
//! ```
//! use flowgate::device::{Simulated, Uploader};
//! use flowgate::{DType, Tensor};
//!
//! let mut up = Uploader::new(Simulated::new(10e9, std::time::Duration::from_micros(20)));
//! let batch = up.upload(&Tensor::zeros(&[32, 3, 8, 8], DType::U8))?;
//! batch.wait()?; // the copy is done
//! assert_eq!(batch.shape(), [32, 3, 8, 8]);
//! assert_eq!(batch.host_bytes().map(<[u8]>::len), Some(32 * 3 * 8 * 8));
//! # Ok::<(), flowgate::device::DeviceError>(())
//! ```

use std::fmt;
use std::sync::Arc;

use crate::tensor::ExternalBuffer;

mod cpu;
#[cfg(feature = "cuda")]
mod cuda;
#[cfg(not(feature = "cuda"))]
#[path = "cuda_unavailable.rs"]
mod cuda;
mod simulated;
mod uploader;

pub use cpu::{Cpu, Ready};
pub use cuda::{Cuda, CudaEvent, DeviceSlice, GpuMonitor, PinnedSlice};
pub use simulated::{CompletesAt, SimLog, SimRecord, Simulated};
pub use uploader::{Delivered, DeviceBatch, HostAlloc, UploadStats, Uploader};

/// The CUDA bindings flowgate uses (feature `cuda`), for kernels and streams of your own.
#[cfg(feature = "cuda")]
pub use cudarc;

/// Why an upload failed.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    /// No usable device: no driver library, no GPU, or the feature is off.
    #[error("device unavailable: {0}")]
    Unavailable(String),
    /// The driver reported an error.
    #[error("device error: {0}")]
    Driver(String),
}

/// A consumer's stream, as DLPack's `__dlpack__(stream=...)` names it on CUDA: `1` the legacy
/// default stream, `2` the per-thread default stream, any other value a `CUstream` handle.
pub type StreamHandle = usize;

/// The legacy default stream ([`StreamHandle`] `1`), which DLPack assumes when a consumer
/// names none.
pub const LEGACY_DEFAULT_STREAM: StreamHandle = 1;

/// Completion of one copy.
pub trait CopyEvent: Send + Sync + fmt::Debug {
    /// Whether the copy has completed (never blocks).
    fn is_complete(&self) -> bool;
    /// Blocks until the copy has completed.
    fn wait(&self) -> Result<(), DeviceError>;

    /// Makes work queued on the consumer's `stream` from now on wait for the copy, without
    /// blocking the host where the device can do that (CUDA: `cuStreamWaitEvent`). The
    /// default, for backends whose "device" is host memory, waits on the host.
    fn wait_on_stream(&self, stream: StreamHandle) -> Result<(), DeviceError> {
        let _ = stream;
        self.wait()
    }

    /// Called when the batch's device memory (of `bytes`) is about to be freed: the free
    /// must come after the work the consumer queued on each of `streams` (those it was made
    /// ready on), since kernels may still read it (CUDA: an event recorded on each, which
    /// the copy stream, where the memory is freed, waits for). The default does nothing:
    /// host memory is read by the host, which is done with it.
    fn before_free(&self, bytes: usize, streams: &[StreamHandle]) -> Result<(), DeviceError> {
        let _ = (bytes, streams);
        Ok(())
    }
}

/// Host memory a copy reads from: plain (CPU and simulated backends) or pinned (CUDA).
#[derive(Debug)]
pub enum Staging {
    /// Ordinary host memory.
    Host(Vec<u8>),
    /// Page-locked host memory (CUDA; uninhabited in a build without the `cuda` feature).
    Pinned(PinnedSlice),
}

impl Staging {
    /// Capacity in bytes.
    pub fn len(&self) -> usize {
        match self {
            Staging::Host(v) => v.len(),
            Staging::Pinned(p) => cuda::pinned_len(p),
        }
    }

    /// Whether it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes, to fill (waits for any copy still reading them).
    pub fn as_mut_bytes(&mut self) -> Result<&mut [u8], DeviceError> {
        match self {
            Staging::Host(v) => Ok(v),
            Staging::Pinned(p) => cuda::pinned_bytes_mut(p),
        }
    }

    /// The bytes (waits for any copy still using them).
    pub fn as_bytes(&self) -> Result<&[u8], DeviceError> {
        match self {
            Staging::Host(v) => Ok(v),
            Staging::Pinned(p) => cuda::pinned_bytes(p),
        }
    }
}

/// Device memory holding one batch.
#[derive(Debug)]
pub enum DeviceMemory {
    /// Host memory standing in for a device (CPU and simulated backends).
    Host(Vec<u8>),
    /// Memory on a CUDA device, and the event its copy records (make the compute stream wait
    /// on it: `stream.wait(&event.0)`); uninhabited without the `cuda` feature.
    Cuda(DeviceSlice, Arc<CudaEvent>),
}

/// Where batches go; implement it to plug in another device (or a fake, in tests).
pub trait Backend: Send + Sync + fmt::Debug {
    /// A short name (`cpu`, `simulated`, `cuda:0`).
    fn name(&self) -> String;
    /// Staging memory of `bytes` bytes.
    fn staging(&self, bytes: usize) -> Result<Staging, DeviceError>;
    /// Starts copying the first `len` bytes of `src` to new device memory; the event completes
    /// when the copy has. `src` must not be written before then.
    fn copy(
        &self,
        src: &Staging,
        len: usize,
    ) -> Result<(DeviceMemory, Arc<dyn CopyEvent>), DeviceError>;

    /// Host memory for a batch of `bytes` that [`copy_direct`](Self::copy_direct) uploads
    /// without a staging copy (pinned memory from a pool); `None` (the default): ordinary
    /// memory does as well.
    fn host_buffer(&self, _bytes: usize) -> Result<Option<Box<dyn ExternalBuffer>>, DeviceError> {
        Ok(None)
    }

    /// Starts copying the first `len` bytes of `buf` straight from where they are, if `buf`
    /// is one of [`host_buffer`](Self::host_buffer)'s; `None` (the default): stage it.
    #[allow(clippy::type_complexity)]
    fn copy_direct(
        &self,
        _buf: &dyn ExternalBuffer,
        _len: usize,
    ) -> Result<Option<(DeviceMemory, Arc<dyn CopyEvent>)>, DeviceError> {
        Ok(None)
    }
}
