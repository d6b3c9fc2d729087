//! The CUDA backend (feature `cuda`, cudarc with libcuda and libnvidia-ml loaded at run time):
//! pinned staging, copies on a dedicated stream, an event per copy, pinned batch buffers from
//! a pool for direct uploads, and GPU utilisation through NVML.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream, DevicePtr, DriverError, PinnedHostSlice};
use parking_lot::Mutex;

use super::{Backend, CopyEvent, DeviceError, DeviceMemory, ExternalBuffer, Staging, StreamHandle};

/// Page-locked host memory (a staging slot).
pub type PinnedSlice = PinnedHostSlice<u8>;
/// Memory on the device.
pub type DeviceSlice = cudarc::driver::CudaSlice<u8>;

pub(super) fn pinned_len(p: &PinnedSlice) -> usize {
    p.len()
}

pub(super) fn pinned_bytes(p: &PinnedSlice) -> Result<&[u8], DeviceError> {
    p.as_slice().map_err(driver_error)
}

pub(super) fn pinned_bytes_mut(p: &mut PinnedSlice) -> Result<&mut [u8], DeviceError> {
    p.as_mut_slice().map_err(driver_error)
}

/// The device address of `d`'s first byte.
pub(super) fn device_ptr(d: &DeviceSlice) -> usize {
    let (ptr, _read) = d.device_ptr(d.stream());
    ptr as usize
}

/// The device `d` is on.
pub(super) fn device_ordinal(d: &DeviceSlice) -> usize {
    d.context().ordinal()
}

/// The first `n` bytes of `d`, copied back to the host (device buffers are at least one
/// byte long: cut to the batch's size).
pub(super) fn device_to_host(d: &DeviceSlice, n: usize) -> Result<Vec<u8>, DeviceError> {
    let mut v = d.stream().clone_dtoh(d).map_err(driver_error)?;
    v.truncate(n);
    Ok(v)
}

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
        let ctx = CudaContext::new(ordinal)
            .map_err(|e| DeviceError::Unavailable(format!("opening CUDA device {ordinal}: {e}")))?;
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

/// A CUDA event recorded after a copy on the copy stream (which also frees the batch's
/// memory, asynchronously, when the batch is dropped).
#[derive(Debug)]
pub struct CudaEvent {
    /// The event.
    pub event: cudarc::driver::CudaEvent,
    stream: Arc<CudaStream>,
}

impl CudaEvent {
    fn record(stream: &Arc<CudaStream>) -> Result<Self, DeviceError> {
        Ok(Self {
            event: stream.record_event(None).map_err(driver_error)?,
            stream: Arc::clone(stream),
        })
    }
}

impl CopyEvent for CudaEvent {
    fn is_complete(&self) -> bool {
        self.event.is_complete()
    }
    fn wait(&self) -> Result<(), DeviceError> {
        self.event.synchronize().map_err(driver_error)
    }
    fn wait_on_stream(&self, stream: StreamHandle) -> Result<(), DeviceError> {
        self.stream
            .context()
            .bind_to_thread()
            .map_err(driver_error)?;
        // SAFETY: `stream` is the consumer's live stream (or 1/2, the default streams, which
        // are valid CUstream values); the event lives as long as `self`.
        unsafe {
            cudarc::driver::result::stream::wait_event(
                stream as cudarc::driver::sys::CUstream,
                self.event.cu_event(),
                cudarc::driver::sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        }
        .map_err(driver_error)
    }
    fn before_free(&self, _bytes: usize, streams: &[StreamHandle]) -> Result<(), DeviceError> {
        // The memory is freed on the copy stream: it waits for what each consumer stream
        // had queued (kernels may still read the batch).
        if !streams.is_empty() {
            self.stream
                .context()
                .bind_to_thread()
                .map_err(driver_error)?;
        }
        for &s in streams {
            let done = self
                .stream
                .context()
                .new_event(None)
                .map_err(driver_error)?;
            // SAFETY: as in `wait_on_stream`.
            unsafe {
                cudarc::driver::result::event::record(
                    done.cu_event(),
                    s as cudarc::driver::sys::CUstream,
                )
            }
            .map_err(driver_error)?;
            self.stream.wait(&done).map_err(driver_error)?;
        }
        Ok(())
    }
}

impl Backend for Cuda {
    fn name(&self) -> String {
        format!("cuda:{}", self.ordinal)
    }

    fn staging(&self, bytes: usize) -> Result<Staging, DeviceError> {
        Ok(Staging::Pinned(self.pinned(bytes)?))
    }

    fn host_buffer(&self, bytes: usize) -> Result<Option<Box<dyn ExternalBuffer>>, DeviceError> {
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
        let ev = Arc::new(CudaEvent::record(&self.stream)?);
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
        let ev = Arc::new(CudaEvent::record(&self.stream)?);
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
