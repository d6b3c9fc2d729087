//! The last stage: batches to the accelerator.
//!
//! An [`Uploader`] owns a [`Backend`] and a ring of host *staging* slots. For each batch it
//! takes the next slot, waits until that slot's previous copy has completed (a slot is never
//! reused before its copy is done), copies the batch into it, starts an asynchronous
//! host-to-device copy, and hands the consumer a [`DeviceBatch`] (device memory, shape, dtype
//! and the copy's completion event) that stays valid while the consumer holds it.
//!
//! Backends:
//! - [`Cpu`]: pass-through; the "device" is host memory (runs everywhere).
//! - [`Simulated`]: a copy engine with a bandwidth and a latency, for tests and tuner
//!   experiments: copies complete in order, each `latency + bytes / bandwidth` after the later
//!   of its start and the previous copy's end.
//! - `Cuda` (feature `cuda`): pinned staging slots, copies on a dedicated stream, an event per
//!   batch. libcuda is loaded at run time: with no driver or no GPU, [`Cuda::new`] returns
//!   [`DeviceError::Unavailable`] (never a panic), and [`Uploader::cuda_or_cpu`] falls back.
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
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::tensor::{DType, ExternalBuffer, Tensor};

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

/// Completion of one copy.
pub trait CopyEvent: Send + Sync + fmt::Debug {
    /// Whether the copy has completed (never blocks).
    fn is_complete(&self) -> bool;
    /// Blocks until the copy has completed.
    fn wait(&self) -> Result<(), DeviceError>;
}

/// Host memory a copy reads from: plain (CPU and simulated backends) or pinned (CUDA).
#[derive(Debug)]
pub enum Staging {
    /// Ordinary host memory.
    Host(Vec<u8>),
    /// Page-locked host memory (write-combined: written by the CPU, read by the copy engine).
    #[cfg(feature = "cuda")]
    Pinned(cudarc::driver::PinnedHostSlice<u8>),
}

impl Staging {
    /// Capacity in bytes.
    pub fn len(&self) -> usize {
        match self {
            Staging::Host(v) => v.len(),
            #[cfg(feature = "cuda")]
            Staging::Pinned(p) => p.len(),
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
            #[cfg(feature = "cuda")]
            Staging::Pinned(p) => p.as_mut_slice().map_err(cuda::driver_error),
        }
    }

    /// The bytes (waits for any copy still using them).
    pub fn as_bytes(&self) -> Result<&[u8], DeviceError> {
        match self {
            Staging::Host(v) => Ok(v),
            #[cfg(feature = "cuda")]
            Staging::Pinned(p) => p.as_slice().map_err(cuda::driver_error),
        }
    }
}

/// Device memory holding one batch.
#[derive(Debug)]
pub enum DeviceMemory {
    /// Host memory standing in for a device (CPU and simulated backends).
    Host(Vec<u8>),
    /// Memory on a CUDA device, and the event its copy records (make the compute stream wait
    /// on it: `stream.wait(&event.0)`).
    #[cfg(feature = "cuda")]
    Cuda(cudarc::driver::CudaSlice<u8>, Arc<CudaEvent>),
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

/// Makes batch tensors in the memory the uploader copies from directly (pinned memory for
/// CUDA, so the copy to the device needs no staging copy); ordinary memory for the other
/// backends. Use it in the collate stage: `alloc.stack(&items)`.
#[derive(Clone, Debug)]
pub struct HostAlloc {
    backend: Arc<dyn Backend>,
}

impl HostAlloc {
    /// A zero-initialised tensor (zeroed only when it is ordinary memory; pinned buffers come
    /// from a pool and are meant to be overwritten).
    pub fn tensor(&self, shape: &[usize], dtype: DType) -> Tensor {
        let n = shape.iter().product::<usize>() * dtype.size();
        match self.backend.host_buffer(n) {
            Ok(Some(buf)) => Tensor::from_external(shape, dtype, buf),
            Ok(None) => Tensor::zeros(shape, dtype),
            Err(e) => {
                tracing::warn!(error = %e, "pinned allocation failed; using ordinary memory");
                Tensor::zeros(shape, dtype)
            }
        }
    }

    /// Stacks same-shaped tensors into one of [`tensor`](Self::tensor)'s.
    pub fn stack<T: std::borrow::Borrow<Tensor>>(&self, items: &[T]) -> Option<Tensor> {
        Tensor::stack_with(items, |shape, dtype| self.tensor(shape, dtype))
    }
}

/// An event that is complete from the start.
#[derive(Debug)]
pub struct Done;

impl CopyEvent for Done {
    fn is_complete(&self) -> bool {
        true
    }
    fn wait(&self) -> Result<(), DeviceError> {
        Ok(())
    }
}

/// The host as the device: copies are plain `memcpy`s, complete on return.
#[derive(Clone, Copy, Debug, Default)]
pub struct Cpu;

impl Backend for Cpu {
    fn name(&self) -> String {
        "cpu".into()
    }
    fn staging(&self, bytes: usize) -> Result<Staging, DeviceError> {
        Ok(Staging::Host(vec![0; bytes]))
    }
    fn copy(
        &self,
        src: &Staging,
        len: usize,
    ) -> Result<(DeviceMemory, Arc<dyn CopyEvent>), DeviceError> {
        let bytes = src.as_bytes()?[..len].to_vec();
        Ok((DeviceMemory::Host(bytes), Arc::new(Done)))
    }
}

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

/// Completes at a given instant.
#[derive(Debug)]
pub struct At(pub Instant);

impl CopyEvent for At {
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
        Ok((memory, Arc::new(At(done))))
    }
}

/// A batch on the device: its memory, shape and dtype, and the copy's completion. Valid while
/// held; the device memory is freed when it is dropped.
#[derive(Debug)]
pub struct DeviceBatch {
    memory: DeviceMemory,
    shape: Vec<usize>,
    dtype: DType,
    ready: Arc<dyn CopyEvent>,
    /// The host tensor a direct copy reads, kept until the batch is dropped.
    _source: Option<Tensor>,
}

impl DeviceBatch {
    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Size in bytes.
    pub fn nbytes(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dtype.size()
    }

    /// Whether the copy has completed.
    pub fn is_ready(&self) -> bool {
        self.ready.is_complete()
    }

    /// Blocks until the copy has completed. (On CUDA, prefer [`DeviceBatch::event`] and
    /// make the compute stream wait on it: the host need not block.)
    pub fn wait(&self) -> Result<(), DeviceError> {
        self.ready.wait()
    }

    /// The copy's completion event.
    pub fn event(&self) -> &Arc<dyn CopyEvent> {
        &self.ready
    }

    /// The memory.
    pub fn memory(&self) -> &DeviceMemory {
        &self.memory
    }

    /// A copy of the batch's bytes back on the host (waits for the upload).
    pub fn to_host(&self) -> Result<Vec<u8>, DeviceError> {
        self.wait()?;
        match &self.memory {
            DeviceMemory::Host(v) => Ok(v.clone()),
            #[cfg(feature = "cuda")]
            DeviceMemory::Cuda(d, _) => {
                // Device buffers are at least one byte long: cut to the batch's size.
                let mut v = d.stream().clone_dtoh(d).map_err(cuda::driver_error)?;
                v.truncate(self.nbytes());
                Ok(v)
            }
        }
    }

    /// The bytes, where the "device" is host memory (CPU and simulated backends).
    pub fn host_bytes(&self) -> Option<&[u8]> {
        match &self.memory {
            DeviceMemory::Host(v) => Some(&v[..]),
            #[cfg(feature = "cuda")]
            DeviceMemory::Cuda(..) => None,
        }
    }
}

/// Counters of an [`Uploader`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UploadStats {
    /// Batches uploaded.
    pub batches: u64,
    /// Bytes uploaded.
    pub bytes: u64,
    /// Batches copied straight from their own (pinned) memory, without staging.
    pub direct: u64,
    /// Times the next slot's copy was still running and the ring waited for it.
    pub slot_waits: u64,
    /// Slots added because every slot was busy.
    pub slots_added: u64,
    /// Slots in the ring now.
    pub depth: usize,
}

#[derive(Debug)]
struct Slot {
    staging: Staging,
    in_flight: Option<Arc<dyn CopyEvent>>,
}

/// Uploads batches through a ring of staging slots; see the [module docs](self).
#[derive(Debug)]
pub struct Uploader {
    backend: Arc<dyn Backend>,
    slots: Vec<Slot>,
    next: usize,
    max_bytes: usize,
    stats: UploadStats,
}

impl Uploader {
    /// An uploader to `backend`; the ring grows on demand up to 1 GiB of staging memory.
    pub fn new(backend: impl Backend + 'static) -> Self {
        Self::with_backend(Arc::new(backend))
    }

    /// An uploader to a shared backend.
    pub fn with_backend(backend: Arc<dyn Backend>) -> Self {
        Self {
            backend,
            slots: Vec::new(),
            next: 0,
            max_bytes: 1 << 30,
            stats: UploadStats::default(),
        }
    }

    /// The CUDA device `ordinal` if there is one, else the CPU backend (with the reason).
    pub fn cuda_or_cpu(ordinal: usize) -> (Self, Option<DeviceError>) {
        match Cuda::new(ordinal) {
            Ok(c) => (Self::new(c), None),
            Err(e) => (Self::new(Cpu), Some(e)),
        }
    }

    /// The most staging memory the ring may hold (it still holds at least one slot).
    pub fn max_staging_bytes(mut self, bytes: usize) -> Self {
        self.max_bytes = bytes;
        self
    }

    /// Allocates batch tensors the backend uploads without a staging copy.
    pub fn host_alloc(&self) -> HostAlloc {
        HostAlloc {
            backend: Arc::clone(&self.backend),
        }
    }

    /// The backend's name.
    pub fn backend_name(&self) -> String {
        self.backend.name()
    }

    /// Counters so far.
    pub fn stats(&self) -> UploadStats {
        UploadStats {
            depth: self.slots.len(),
            ..self.stats
        }
    }

    fn staging_bytes(&self) -> usize {
        self.slots.iter().map(|s| s.staging.len()).sum()
    }

    /// Picks the slot for a batch of `n` bytes: the next one once its copy is done, or a new
    /// one if it is busy and the ring may grow.
    fn slot_for(&mut self, n: usize) -> Result<usize, DeviceError> {
        let busy = |s: &Slot| s.in_flight.as_ref().is_some_and(|e| !e.is_complete());
        let can_grow = self.slots.is_empty()
            || self.staging_bytes() + n <= self.max_bytes && busy(&self.slots[self.next]);
        let i = if can_grow {
            let staging = self.backend.staging(n)?;
            let at = if self.slots.is_empty() { 0 } else { self.next };
            self.slots.insert(
                at,
                Slot {
                    staging,
                    in_flight: None,
                },
            );
            if self.slots.len() > 1 {
                self.stats.slots_added += 1;
            }
            at
        } else {
            self.next
        };
        self.next = (i + 1) % self.slots.len();
        let slot = &mut self.slots[i];
        if let Some(ev) = slot.in_flight.take() {
            if !ev.is_complete() {
                self.stats.slot_waits += 1;
            }
            ev.wait()?;
        }
        if slot.staging.len() != n {
            // A batch of another size (the last of an epoch): a slot of exactly its size.
            slot.staging = self.backend.staging(n)?;
        }
        Ok(i)
    }

    /// Uploads one batch.
    pub fn upload(&mut self, t: &Tensor) -> Result<DeviceBatch, DeviceError> {
        let n = t.nbytes();
        let i = self.slot_for(n)?;
        let slot = &mut self.slots[i];
        slot.staging.as_mut_bytes()?[..n].copy_from_slice(t.bytes());
        let (memory, ready) = self.backend.copy(&slot.staging, n)?;
        slot.in_flight = Some(Arc::clone(&ready));
        self.stats.batches += 1;
        self.stats.bytes += n as u64;
        Ok(DeviceBatch {
            memory,
            shape: t.shape().to_vec(),
            dtype: t.dtype(),
            ready,
            _source: None,
        })
    }

    /// Uploads one batch it may keep: straight from its memory if that is the backend's own
    /// (see [`host_alloc`](Self::host_alloc)), else through a staging slot.
    pub fn upload_owned(&mut self, t: Tensor) -> Result<DeviceBatch, DeviceError> {
        if let Some(buf) = t.external() {
            if let Some((memory, ready)) = self.backend.copy_direct(buf, t.nbytes())? {
                self.stats.batches += 1;
                self.stats.direct += 1;
                self.stats.bytes += t.nbytes() as u64;
                return Ok(DeviceBatch {
                    memory,
                    shape: t.shape().to_vec(),
                    dtype: t.dtype(),
                    ready,
                    _source: Some(t),
                });
            }
        }
        self.upload(&t)
    }
}

impl crate::PipelineBuilder<Tensor> {
    /// Adds the uploader as the last stage (`upload`, one worker: copies go out in order on
    /// one stream). The consumer gets [`DeviceBatch`]es; an upload error fails that batch
    /// (counted by the failure budget, like any stage). Collate with
    /// [`Uploader::host_alloc`] so batches are born in pinned memory.
    pub fn upload(self, uploader: Uploader) -> crate::PipelineBuilder<DeviceBatch> {
        let up = Mutex::new(uploader);
        self.pipe(
            "upload",
            move |t: Tensor| up.lock().upload_owned(t),
            crate::Workers::fixed(1),
        )
        .measure(DeviceBatch::nbytes)
    }
}

#[cfg(feature = "cuda")]
pub use cuda::{Cuda, CudaEvent, GpuMonitor};
/// The CUDA bindings flowgate uses (feature `cuda`), for kernels and streams of your own.
#[cfg(feature = "cuda")]
pub use cudarc;

#[cfg(not(feature = "cuda"))]
pub use no_cuda::{Cuda, GpuMonitor};

#[cfg(not(feature = "cuda"))]
mod no_cuda {
    use super::*;

    /// The CUDA backend; this build has no `cuda` feature, so it is always unavailable.
    #[derive(Debug)]
    pub struct Cuda(());

    impl Cuda {
        /// Always [`DeviceError::Unavailable`]: build with `--features cuda`.
        pub fn new(_ordinal: usize) -> Result<Self, DeviceError> {
            Err(DeviceError::Unavailable(
                "flowgate was built without the `cuda` feature".into(),
            ))
        }
    }

    impl Backend for Cuda {
        fn name(&self) -> String {
            "cuda (not built)".into()
        }
        fn staging(&self, _bytes: usize) -> Result<Staging, DeviceError> {
            Err(Cuda::new(0).unwrap_err())
        }
        fn copy(
            &self,
            _src: &Staging,
            _len: usize,
        ) -> Result<(DeviceMemory, Arc<dyn CopyEvent>), DeviceError> {
            Err(Cuda::new(0).unwrap_err())
        }
    }

    /// GPU utilisation through NVML; this build has no `cuda` feature.
    #[derive(Debug)]
    pub struct GpuMonitor(());

    impl GpuMonitor {
        /// Always [`DeviceError::Unavailable`]: build with `--features cuda`.
        pub fn new(_index: u32) -> Result<Self, DeviceError> {
            Err(DeviceError::Unavailable(
                "flowgate was built without the `cuda` feature (NVML)".into(),
            ))
        }

        /// Never called: there is no monitor.
        pub fn utilization(&self) -> Option<f64> {
            None
        }
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use std::sync::Arc;

    use cudarc::driver::{CudaContext, CudaStream, DriverError, PinnedHostSlice};
    use parking_lot::Mutex;

    use super::{Backend, CopyEvent, DeviceError, DeviceMemory, ExternalBuffer, Staging};

    /// Pinned buffers kept for reuse (pinning memory costs far more than a copy).
    const POOL_MAX: usize = 16;

    type Pool = Arc<Mutex<Vec<PinnedHostSlice<u8>>>>;

    /// A pinned batch buffer that goes back to its pool when dropped. Writing waits for any
    /// copy still reading it (cudarc records an event on the buffer with every copy).
    #[derive(Debug)]
    struct Pooled {
        slice: Option<PinnedHostSlice<u8>>,
        pool: Pool,
    }

    impl ExternalBuffer for Pooled {
        fn as_slice(&self) -> &[u8] {
            self.slice
                .as_ref()
                .expect("a pooled buffer until dropped")
                .as_slice()
                .expect("pinned memory: a CUDA error")
        }
        fn as_mut_slice(&mut self) -> &mut [u8] {
            self.slice
                .as_mut()
                .expect("a pooled buffer until dropped")
                .as_mut_slice()
                .expect("pinned memory: a CUDA error")
        }
        fn as_any(&self) -> &dyn std::any::Any {
            self
        }
    }

    impl Drop for Pooled {
        fn drop(&mut self) {
            if let Some(s) = self.slice.take() {
                let mut pool = self.pool.lock();
                if pool.len() < POOL_MAX {
                    pool.push(s);
                }
            }
        }
    }

    pub(super) fn driver_error(e: DriverError) -> DeviceError {
        DeviceError::Driver(e.to_string())
    }

    /// Whether libcuda can be loaded (cudarc panics on first use otherwise).
    fn driver_present() -> bool {
        // SAFETY: only tries to open the library.
        unsafe { cudarc::driver::sys::is_culib_present() }
    }

    /// A CUDA device: pinned staging, copies on a dedicated stream, an event per copy.
    #[derive(Debug)]
    pub struct Cuda {
        ctx: Arc<CudaContext>,
        stream: Arc<CudaStream>,
        ordinal: usize,
        pool: Pool,
    }

    impl Cuda {
        /// Opens device `ordinal`. Without the driver library or the device: `Unavailable`.
        pub fn new(ordinal: usize) -> Result<Self, DeviceError> {
            if !driver_present() {
                return Err(DeviceError::Unavailable(
                    "libcuda was not found (no NVIDIA driver on this machine)".into(),
                ));
            }
            let count = CudaContext::device_count().map_err(|e| {
                DeviceError::Unavailable(format!("the CUDA driver found no device: {e}"))
            })?;
            if ordinal >= count.max(0) as usize {
                return Err(DeviceError::Unavailable(format!(
                    "CUDA device {ordinal} asked, {count} present"
                )));
            }
            let ctx = CudaContext::new(ordinal).map_err(|e| {
                DeviceError::Unavailable(format!("opening CUDA device {ordinal}: {e}"))
            })?;
            let stream = ctx.new_stream().map_err(driver_error)?;
            Ok(Self {
                ctx,
                stream,
                ordinal,
                pool: Arc::default(),
            })
        }

        /// The context (for kernels, other streams).
        pub fn context(&self) -> &Arc<CudaContext> {
            &self.ctx
        }

        /// The copy stream.
        pub fn stream(&self) -> &Arc<CudaStream> {
            &self.stream
        }

        /// Plain (not write-combined) page-locked memory, like `cudaMallocHost`.
        fn pinned(&self, bytes: usize) -> Result<PinnedHostSlice<u8>, DeviceError> {
            // SAFETY: the memory is uninitialised until a batch is written into it, and
            // nothing reads it before.
            unsafe { self.ctx.alloc_pinned_with_flags::<u8>(bytes.max(1), 0) }.map_err(driver_error)
        }
    }

    /// A CUDA event recorded after a copy.
    #[derive(Debug)]
    pub struct CudaEvent(pub cudarc::driver::CudaEvent);

    impl CopyEvent for CudaEvent {
        fn is_complete(&self) -> bool {
            self.0.is_complete()
        }
        fn wait(&self) -> Result<(), DeviceError> {
            self.0.synchronize().map_err(driver_error)
        }
    }

    impl Backend for Cuda {
        fn name(&self) -> String {
            format!("cuda:{}", self.ordinal)
        }

        fn staging(&self, bytes: usize) -> Result<Staging, DeviceError> {
            Ok(Staging::Pinned(self.pinned(bytes)?))
        }

        fn host_buffer(
            &self,
            bytes: usize,
        ) -> Result<Option<Box<dyn ExternalBuffer>>, DeviceError> {
            let reused = {
                let mut pool = self.pool.lock();
                pool.iter()
                    .position(|s| s.len() == bytes)
                    .map(|i| pool.swap_remove(i))
            };
            let slice = match reused {
                Some(s) => s,
                None => self.pinned(bytes)?,
            };
            Ok(Some(Box::new(Pooled {
                slice: Some(slice),
                pool: Arc::clone(&self.pool),
            })))
        }

        fn copy_direct(
            &self,
            buf: &dyn ExternalBuffer,
            len: usize,
        ) -> Result<Option<(DeviceMemory, Arc<dyn CopyEvent>)>, DeviceError> {
            let Some(Pooled {
                slice: Some(src), ..
            }) = buf.as_any().downcast_ref::<Pooled>()
            else {
                return Ok(None);
            };
            if src.len() != len || !Arc::ptr_eq(src.context(), &self.ctx) {
                return Ok(None);
            }
            // SAFETY: every byte is written by the copy below before anyone reads it.
            let mut dst = unsafe { self.stream.alloc::<u8>(len.max(1)) }.map_err(driver_error)?;
            self.stream
                .memcpy_htod(src, &mut dst)
                .map_err(driver_error)?;
            let ev = Arc::new(CudaEvent(
                self.stream.record_event(None).map_err(driver_error)?,
            ));
            Ok(Some((DeviceMemory::Cuda(dst, Arc::clone(&ev)), ev)))
        }

        fn copy(
            &self,
            src: &Staging,
            len: usize,
        ) -> Result<(DeviceMemory, Arc<dyn CopyEvent>), DeviceError> {
            // SAFETY: every byte is written by the copy below before anyone reads it.
            let mut dst = unsafe { self.stream.alloc::<u8>(len.max(1)) }.map_err(driver_error)?;
            match src {
                Staging::Pinned(p) if p.len() == len => {
                    self.stream.memcpy_htod(p, &mut dst).map_err(driver_error)?
                }
                other => {
                    let bytes = &other.as_bytes()?[..len];
                    self.stream
                        .memcpy_htod(bytes, &mut dst)
                        .map_err(driver_error)?
                }
            }
            let ev = Arc::new(CudaEvent(
                self.stream.record_event(None).map_err(driver_error)?,
            ));
            Ok((DeviceMemory::Cuda(dst, Arc::clone(&ev)), ev))
        }
    }

    /// GPU utilisation through NVML (libnvidia-ml, loaded at run time).
    #[derive(Debug)]
    pub struct GpuMonitor {
        nvml: nvml_wrapper::Nvml,
        index: u32,
    }

    impl GpuMonitor {
        /// NVML for GPU `index`; `Unavailable` without the library or the GPU.
        pub fn new(index: u32) -> Result<Self, DeviceError> {
            let nvml = nvml_wrapper::Nvml::init()
                .map_err(|e| DeviceError::Unavailable(format!("NVML: {e}")))?;
            nvml.device_by_index(index)
                .map_err(|e| DeviceError::Unavailable(format!("NVML device {index}: {e}")))?;
            Ok(Self { nvml, index })
        }

        /// The fraction of the last sample period the GPU was busy (0..=1).
        pub fn utilization(&self) -> Option<f64> {
            let d = self.nvml.device_by_index(self.index).ok()?;
            d.utilization_rates().ok().map(|u| f64::from(u.gpu) / 100.0)
        }
    }
}
