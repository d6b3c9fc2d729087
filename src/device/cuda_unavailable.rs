//! The CUDA backend's stand-in for builds without the `cuda` feature: the same names, always
//! [`DeviceError::Unavailable`], and memory types with no values.

use std::sync::Arc;

use super::{Backend, CopyEvent, DeviceError, DeviceMemory, Staging};

/// Page-locked host memory; none exists in this build.
#[derive(Debug)]
pub enum PinnedSlice {}

/// Memory on a CUDA device; none exists in this build.
#[derive(Debug)]
pub enum DeviceSlice {}

/// A CUDA copy event; none exists in this build.
#[derive(Debug)]
pub enum CudaEvent {}

pub(super) fn pinned_len(p: &PinnedSlice) -> usize {
    match *p {}
}

pub(super) fn pinned_bytes(p: &PinnedSlice) -> Result<&[u8], DeviceError> {
    match *p {}
}

pub(super) fn pinned_bytes_mut(p: &mut PinnedSlice) -> Result<&mut [u8], DeviceError> {
    match *p {}
}

pub(super) fn device_ptr(d: &DeviceSlice) -> usize {
    match *d {}
}

pub(super) fn device_ordinal(d: &DeviceSlice) -> usize {
    match *d {}
}

pub(super) fn device_to_host(d: &DeviceSlice, _n: usize) -> Result<Vec<u8>, DeviceError> {
    match *d {}
}

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
