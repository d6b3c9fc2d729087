//! The CPU backend: the host is the device.

use std::sync::Arc;

use super::{Backend, CopyEvent, DeviceError, DeviceMemory, Staging};

/// A copy event that is complete from the start (the CPU backend's copies are done on return).
#[derive(Debug)]
pub struct Ready;

impl CopyEvent for Ready {
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
        Ok((DeviceMemory::Host(bytes), Arc::new(Ready)))
    }
}
