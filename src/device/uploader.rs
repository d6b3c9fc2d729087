//! The [`Uploader`]: a ring of staging slots in front of a [`Backend`], and the batches it
//! hands out. A slot is never reused before its copy has completed; the ring grows (up to a
//! byte ceiling) when the next slot is still busy, so its depth settles at the copies in
//! flight the consumer's pace needs.

use std::sync::Arc;

use parking_lot::Mutex;

use super::{
    Backend, CopyEvent, Cpu, Cuda, DeviceError, DeviceMemory, Staging, StreamHandle,
    LEGACY_DEFAULT_STREAM,
};
use crate::engine::builder::PipelineBuilder;
use crate::engine::config::Workers;
use crate::tensor::{DType, Tensor};

/// Makes batch tensors in the memory the uploader copies from directly (pinned memory for
/// CUDA, so the copy to the device needs no staging copy); ordinary memory for the other
/// backends. Use it in the collate stage: `alloc.collate(&items)`.
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

    /// Collates same-shaped tensors into one of [`tensor`](Self::tensor)'s (see
    /// [`collate`](crate::collate::collate)).
    pub fn collate<T: std::borrow::Borrow<Tensor>>(
        &self,
        items: &[T],
    ) -> Result<Tensor, crate::collate::CollateError> {
        crate::collate::collate_with(items, |shape, dtype| self.tensor(shape, dtype))
    }
}

/// A batch on the device: its memory, shape and dtype, and the copy's completion. Valid while
/// held; the device memory is freed when it is dropped, after the work queued on every stream
/// it was made [ready on](Self::ready_on_stream).
#[derive(Debug)]
pub struct DeviceBatch {
    memory: DeviceMemory,
    shape: Vec<usize>,
    dtype: DType,
    ready: Arc<dyn CopyEvent>,
    /// The consumer streams the batch was made ready on: its memory is freed after their
    /// work queued until then.
    streams: Mutex<Vec<StreamHandle>>,
    /// The host tensor a direct copy reads, kept until the batch is dropped.
    _source: Option<Tensor>,
}

impl Drop for DeviceBatch {
    fn drop(&mut self) {
        let streams = std::mem::take(self.streams.get_mut());
        if let Err(e) = self.ready.before_free(self.nbytes(), &streams) {
            tracing::warn!(error = %e, "ordering a batch's free after its consumer");
        }
    }
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

    /// Makes the consumer's `stream` wait for the copy (queued on the device: the host does
    /// not block where the backend can avoid it), and remembers it, so that the memory is
    /// freed only after the work queued on it before the batch is dropped. `None`: the
    /// legacy default stream, as DLPack assumes. This is what `__dlpack__(stream=...)` does.
    pub fn ready_on_stream(&self, stream: Option<StreamHandle>) -> Result<(), DeviceError> {
        let stream = stream.unwrap_or(LEGACY_DEFAULT_STREAM);
        self.ready.wait_on_stream(stream)?;
        let mut streams = self.streams.lock();
        if !streams.contains(&stream) {
            streams.push(stream);
        }
        Ok(())
    }

    /// Where the batch's first byte is: a device address on CUDA, a host address where the
    /// "device" is host memory.
    pub fn data_ptr(&self) -> usize {
        match &self.memory {
            DeviceMemory::Host(v) => v.as_ptr() as usize,
            DeviceMemory::Cuda(d, _) => super::cuda::device_ptr(d),
        }
    }

    /// The CUDA device the memory is on, or `None` for host memory.
    pub fn cuda_ordinal(&self) -> Option<usize> {
        match &self.memory {
            DeviceMemory::Host(_) => None,
            DeviceMemory::Cuda(d, _) => Some(super::cuda::device_ordinal(d)),
        }
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
            DeviceMemory::Cuda(d, _) => super::cuda::device_to_host(d, self.nbytes()),
        }
    }

    /// The bytes, where the "device" is host memory (CPU and simulated backends).
    pub fn host_bytes(&self) -> Option<&[u8]> {
        match &self.memory {
            DeviceMemory::Host(v) => Some(&v[..]),
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

/// Uploads batches through a ring of staging slots; see the [module docs](super).
#[derive(Debug)]
pub struct Uploader {
    backend: Arc<dyn Backend>,
    slots: Vec<Slot>,
    next: usize,
    max_bytes: usize,
    device_bytes: Option<u64>,
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
            device_bytes: None,
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

    /// The most bytes of uploaded batches that may wait for the consumer on the device (the
    /// pipeline's last buffer; the tuner may turn its item count, never past this). Unset:
    /// the buffer shares the host memory budget like any other. One batch larger than the
    /// whole limit still passes when nothing else waits.
    pub fn max_device_bytes(mut self, bytes: u64) -> Self {
        self.device_bytes = Some(bytes.max(1));
        self
    }

    /// See [`max_device_bytes`](Self::max_device_bytes).
    pub fn device_limit(&self) -> Option<u64> {
        self.device_bytes
    }

    /// The most staging memory the ring may hold (see
    /// [`max_staging_bytes`](Self::max_staging_bytes)).
    pub fn staging_limit(&self) -> usize {
        self.max_bytes
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
            streams: Mutex::default(),
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
                    streams: Mutex::default(),
                    _source: Some(t),
                });
            }
        }
        self.upload(&t)
    }
}

/// A batch where a pipeline delivered it: in host memory, or uploaded to a device. What a
/// pipeline file's pipeline yields (`[device] kind`).
#[derive(Debug)]
pub enum Delivered {
    /// In host memory (`kind = "cpu"`).
    Host(Tensor),
    /// On the device (`kind = "cuda"` or `"simulated"`).
    Device(DeviceBatch),
}

impl Delivered {
    /// The shape.
    pub fn shape(&self) -> &[usize] {
        match self {
            Delivered::Host(t) => t.shape(),
            Delivered::Device(b) => b.shape(),
        }
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        match self {
            Delivered::Host(t) => t.dtype(),
            Delivered::Device(b) => b.dtype(),
        }
    }

    /// Size in bytes.
    pub fn nbytes(&self) -> usize {
        match self {
            Delivered::Host(t) => t.nbytes(),
            Delivered::Device(b) => b.nbytes(),
        }
    }

    /// The bytes, where the host can read them (host memory, or the simulated device's).
    pub fn host_bytes(&self) -> Option<&[u8]> {
        match self {
            Delivered::Host(t) => Some(t.bytes()),
            Delivered::Device(b) => b.host_bytes(),
        }
    }

    /// The CUDA device the batch is on, or `None` for host memory (the simulated device's
    /// too).
    pub fn cuda_ordinal(&self) -> Option<usize> {
        match self {
            Delivered::Host(_) => None,
            Delivered::Device(b) => b.cuda_ordinal(),
        }
    }

    /// A copy of the batch in host memory (after its upload, for a device batch).
    pub fn to_host(&self) -> Result<Tensor, DeviceError> {
        let mut t = Tensor::zeros(self.shape(), self.dtype());
        match self {
            Delivered::Host(h) => t.bytes_mut().copy_from_slice(h.bytes()),
            Delivered::Device(b) => t.bytes_mut().copy_from_slice(&b.to_host()?),
        }
        Ok(t)
    }

    /// The batch as a NumPy `.npy` file (copied back from the device first).
    pub fn to_npy(&self) -> Result<Vec<u8>, DeviceError> {
        match self {
            Delivered::Host(t) => Ok(t.to_npy()),
            Delivered::Device(_) => Ok(self.to_host()?.to_npy()),
        }
    }

    /// The batch in host memory (a copy back from the device, after its upload).
    pub fn into_host(self) -> Result<Tensor, DeviceError> {
        match self {
            Delivered::Host(t) => Ok(t),
            Delivered::Device(_) => self.to_host(),
        }
    }
}

impl<T: Send + 'static> PipelineBuilder<T> {
    /// Adds the uploader as the last stage for items of any kind: `f` uploads an item's
    /// tensors with the uploader (e.g. each field of a batch, with
    /// [`Uploader::upload_owned`]) and returns what the consumer gets; `device_bytes` says
    /// how many device bytes a result holds. One worker: copies go out in order on one
    /// stream. An upload error fails that item (counted by the failure budget, like any
    /// stage). See [`upload`](crate::PipelineBuilder::upload) for the memory it reserves.
    pub fn upload_with<U: Send + 'static>(
        self,
        uploader: Uploader,
        f: impl Fn(&mut Uploader, T) -> Result<U, DeviceError> + Send + Sync + 'static,
        device_bytes: impl Fn(&U) -> usize + Send + Sync + 'static,
    ) -> PipelineBuilder<U> {
        let ring = uploader.staging_limit() as u64;
        let limit = uploader.device_limit();
        let up = Mutex::new(uploader);
        let b = self
            .reserve_memory(
                "the uploader's staging ring (Uploader::max_staging_bytes)",
                ring,
            )
            .pipe_each(
                "upload",
                move |t: T| f(&mut up.lock(), t),
                Workers::fixed(1),
            )
            .measure(device_bytes);
        match limit {
            Some(bytes) => b.sink_bytes(bytes),
            None => b,
        }
    }
}

impl PipelineBuilder<Tensor> {
    /// Adds the uploader as the last stage (`upload`, one worker: copies go out in order on
    /// one stream). The consumer gets [`DeviceBatch`]es; an upload error fails that batch
    /// (counted by the failure budget, like any stage). Collate with
    /// [`Uploader::host_alloc`] so batches are born in pinned memory.
    ///
    /// The staging ring's limit ([`Uploader::max_staging_bytes`], 1 GiB unless set) is
    /// reserved in the pipeline's memory budget (see
    /// [`reserve_memory`](crate::PipelineBuilder::reserve_memory)): the buffers share what it
    /// leaves, and a budget smaller than the ring is an error at build naming it.
    pub fn upload(self, uploader: Uploader) -> PipelineBuilder<DeviceBatch> {
        self.upload_with(uploader, Uploader::upload_owned, DeviceBatch::nbytes)
    }
}
