//! Batches as tensors: a shape, a dtype and one contiguous, 64-byte-aligned buffer.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::borrow::Borrow;
use std::fmt;
use std::ptr::NonNull;

/// Alignment of every tensor buffer: a cache line, and enough for any SIMD load and for
/// DMA-friendly device copies.
pub const ALIGN: usize = 64;

/// Element type of a [`Tensor`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    /// Unsigned bytes (images).
    U8,
    /// 32-bit floats (audio, normalised images).
    F32,
    /// 64-bit signed integers (labels, lengths).
    I64,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::U8 => 1,
            DType::F32 => 4,
            DType::I64 => 8,
        }
    }

    /// The NumPy name (`uint8`, `float32`).
    pub fn numpy(self) -> &'static str {
        match self {
            DType::U8 => "uint8",
            DType::F32 => "float32",
            DType::I64 => "int64",
        }
    }

    /// The type NumPy names `name` (`uint8`, `float32`, `int64`).
    pub fn from_numpy(name: &str) -> Option<Self> {
        [DType::U8, DType::F32, DType::I64]
            .into_iter()
            .find(|d| d.numpy() == name)
    }

    /// NumPy's `__array_interface__` type string (`|u1`, `<f4`, `<i8`: little-endian).
    pub fn typestr(self) -> &'static str {
        match self {
            DType::U8 => "|u1",
            DType::F32 => "<f4",
            DType::I64 => "<i8",
        }
    }
}

/// An owned, initialised, [`ALIGN`]-aligned byte buffer.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the buffer is uniquely owned plain memory, like a `Vec<u8>`.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access only reads.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// `len` zero bytes.
    pub fn zeroed(len: usize) -> Self {
        if let Some(mut b) = pool::take(len) {
            b.as_mut_slice().fill(0);
            return b;
        }
        Self::fresh(len)
    }

    /// `len` bytes of unspecified contents (a recycled buffer's old bytes, or zeros): for a
    /// writer that sets every byte. Reusing a freed buffer spares the zeroing and the page
    /// faults of fresh memory (measured: ~5% of an image decode's CPU time).
    pub fn for_overwrite(len: usize) -> Self {
        pool::take(len).unwrap_or_else(|| Self::fresh(len))
    }

    fn fresh(len: usize) -> Self {
        if len == 0 {
            return Self {
                ptr: NonNull::<[u8; ALIGN]>::dangling().cast(),
                len: 0,
            };
        }
        let layout = Layout::from_size_align(len, ALIGN).expect("a valid layout");
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(ptr) else {
            std::alloc::handle_alloc_error(layout)
        };
        Self { ptr, len }
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` points to `len` initialised bytes owned by `self` (or is dangling with
        // `len == 0`, which is allowed for slices when well aligned).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and `&mut self` makes the access unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if self.len > 0 && !pool::keep(self.ptr, self.len) {
            let layout =
                Layout::from_size_align(self.len, ALIGN).expect("the layout it was made with");
            // SAFETY: allocated in `zeroed` with this layout.
            unsafe { dealloc(self.ptr.as_ptr(), layout) };
        }
    }
}

/// Freed tensor buffers kept for reuse, by exact length: pipelines allocate the same sizes over
/// and over (an image, a batch), and fresh memory costs zeroing and a page fault per 4 KiB.
/// Bounded: at most [`POOL_BYTES`](pool::POOL_BYTES) in all, only buffers between
/// [`MIN_LEN`](pool::MIN_LEN) and [`MAX_LEN`](pool::MAX_LEN); a dropped pipeline empties it.
pub(crate) mod pool {
    use super::{AlignedBuf, Layout, ALIGN};
    use parking_lot::Mutex;
    use std::ptr::NonNull;

    /// Most bytes the pool holds.
    pub(crate) const POOL_BYTES: usize = 32 << 20;
    /// Smaller buffers are left to the allocator (cheap to make).
    pub(crate) const MIN_LEN: usize = 16 << 10;
    /// Larger buffers are returned to the system.
    pub(crate) const MAX_LEN: usize = 16 << 20;

    struct Free {
        bufs: Vec<(usize, NonNull<u8>)>,
        bytes: usize,
    }

    // SAFETY: the pointers are owned, unaliased allocations (what `AlignedBuf` gave up).
    unsafe impl Send for Free {}

    static POOL: Mutex<Free> = Mutex::new(Free {
        bufs: Vec::new(),
        bytes: 0,
    });

    /// A pooled buffer of exactly `len` bytes, if there is one.
    pub(super) fn take(len: usize) -> Option<AlignedBuf> {
        if !(MIN_LEN..=MAX_LEN).contains(&len) {
            return None;
        }
        let mut p = POOL.lock();
        let i = p.bufs.iter().rposition(|&(l, _)| l == len)?;
        let (_, ptr) = p.bufs.swap_remove(i);
        p.bytes -= len;
        Some(AlignedBuf { ptr, len })
    }

    /// Keeps a buffer being dropped, if it fits; `false` means free it.
    pub(super) fn keep(ptr: NonNull<u8>, len: usize) -> bool {
        if !(MIN_LEN..=MAX_LEN).contains(&len) {
            return false;
        }
        let mut p = POOL.lock();
        if p.bytes + len > POOL_BYTES {
            return false;
        }
        p.bufs.push((len, ptr));
        p.bytes += len;
        true
    }

    /// Frees every pooled buffer (a pipeline was dropped: give the memory back).
    pub(crate) fn release() {
        let bufs = {
            let mut p = POOL.lock();
            p.bytes = 0;
            std::mem::take(&mut p.bufs)
        };
        for (len, ptr) in bufs {
            let layout = Layout::from_size_align(len, ALIGN).expect("the layout it was made with");
            // SAFETY: allocated by `AlignedBuf::fresh` with this layout; the pool owned it.
            unsafe { std::alloc::dealloc(ptr.as_ptr(), layout) };
        }
    }

    /// Forgets the pool without touching its buffers or waiting for its lock: for a process
    /// forked while another thread may have held the lock (that thread does not exist in the
    /// child, so the lock would never be released). The pooled buffers leak (a copy of the
    /// parent's, at most [`POOL_BYTES`]).
    pub(crate) fn forget_after_fork() {
        // SAFETY: called in a freshly forked child before it starts threads, so nothing else
        // touches the pool. The old contents may be mid-update, so they are overwritten
        // without being dropped, and a lock held by a thread that no longer exists is
        // released.
        unsafe {
            std::ptr::write(
                POOL.data_ptr(),
                Free {
                    bufs: Vec::new(),
                    bytes: 0,
                },
            );
            if POOL.is_locked() {
                POOL.force_unlock();
            }
        }
    }

    /// Bytes held now.
    #[cfg(test)]
    pub(crate) fn bytes() -> usize {
        POOL.lock().bytes
    }
}

impl fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AlignedBuf")
            .field("len", &self.len)
            .finish()
    }
}

/// Memory a tensor can live in besides its own aligned buffer: pinned host memory for
/// uploads (see [`device::HostAlloc`](crate::device::HostAlloc)), a foreign array.
pub trait ExternalBuffer: Send + Sync + fmt::Debug + std::any::Any {
    /// The bytes.
    fn as_slice(&self) -> &[u8];
    /// The bytes, mutably.
    fn as_mut_slice(&mut self) -> &mut [u8];
    /// For downcasting (a backend recognising its own memory).
    fn as_any(&self) -> &dyn std::any::Any;
}

#[derive(Debug)]
enum Storage {
    Aligned(AlignedBuf),
    External(Box<dyn ExternalBuffer>),
}

impl Storage {
    fn as_slice(&self) -> &[u8] {
        match self {
            Storage::Aligned(b) => b.as_slice(),
            Storage::External(b) => b.as_slice(),
        }
    }
    fn as_mut_slice(&mut self) -> &mut [u8] {
        match self {
            Storage::Aligned(b) => b.as_mut_slice(),
            Storage::External(b) => b.as_mut_slice(),
        }
    }
}

/// A dense tensor: `shape`, `dtype` and one contiguous row-major buffer.
#[derive(Debug)]
pub struct Tensor {
    shape: Vec<usize>,
    dtype: DType,
    data: Storage,
}

impl Tensor {
    /// A zero tensor.
    pub fn zeros(shape: &[usize], dtype: DType) -> Self {
        Self::aligned(shape, dtype, AlignedBuf::zeroed)
    }

    /// A tensor whose contents are unspecified (zeros, or the old bytes of a recycled buffer):
    /// for a writer that sets every element, such as a decoder filling its output. Cheaper
    /// than [`zeros`](Self::zeros) for large tensors made over and over.
    pub fn for_overwrite(shape: &[usize], dtype: DType) -> Self {
        Self::aligned(shape, dtype, AlignedBuf::for_overwrite)
    }

    /// A tensor in its own aligned buffer of the right length, made by `buf`.
    fn aligned(shape: &[usize], dtype: DType, buf: fn(usize) -> AlignedBuf) -> Self {
        let n: usize = shape.iter().product();
        Self {
            shape: shape.to_vec(),
            dtype,
            data: Storage::Aligned(buf(n * dtype.size())),
        }
    }

    /// A tensor over `buf` (its contents are the elements).
    ///
    /// # Panics
    /// If `buf` does not hold exactly `shape`'s elements of `dtype`.
    pub fn from_external(shape: &[usize], dtype: DType, buf: Box<dyn ExternalBuffer>) -> Self {
        let n: usize = shape.iter().product::<usize>() * dtype.size();
        assert_eq!(
            buf.as_slice().len(),
            n,
            "the buffer must hold the tensor exactly"
        );
        Self {
            shape: shape.to_vec(),
            dtype,
            data: Storage::External(buf),
        }
    }

    /// The external buffer the tensor lives in, if it does.
    pub fn external(&self) -> Option<&dyn ExternalBuffer> {
        match &self.data {
            Storage::External(b) => Some(&**b),
            Storage::Aligned(_) => None,
        }
    }

    /// The same buffer with another shape of as many elements (no copy).
    ///
    /// # Panics
    /// If the element counts differ.
    pub fn reshaped(mut self, shape: &[usize]) -> Self {
        assert_eq!(
            shape.iter().product::<usize>(),
            self.shape.iter().product::<usize>(),
            "reshape must keep the number of elements"
        );
        self.shape = shape.to_vec();
        self
    }

    /// The dimensions.
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

    /// The raw bytes.
    pub fn bytes(&self) -> &[u8] {
        self.data.as_slice()
    }

    /// The raw bytes, mutably.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        self.data.as_mut_slice()
    }

    /// The bytes of item `i` along the first axis (a zero-copy view of one sample of a batch).
    pub fn item(&self, i: usize) -> &[u8] {
        let per = self.nbytes() / self.shape.first().copied().unwrap_or(1).max(1);
        &self.bytes()[i * per..(i + 1) * per]
    }

    /// The mutable bytes of item `i` along the first axis: the slot a decoder writes into.
    pub fn item_mut(&mut self, i: usize) -> &mut [u8] {
        let per = self.nbytes() / self.shape.first().copied().unwrap_or(1).max(1);
        &mut self.bytes_mut()[i * per..(i + 1) * per]
    }

    /// A 1-D `i64` tensor of `values` (labels, lengths).
    pub fn from_i64(values: &[i64]) -> Self {
        let mut t = Tensor::zeros(&[values.len()], DType::I64);
        for (d, v) in t.bytes_mut().chunks_exact_mut(8).zip(values) {
            d.copy_from_slice(&v.to_ne_bytes());
        }
        t
    }

    /// Stacks same-shaped tensors along a new first axis (one copy of each).
    /// Takes tensors or references to them.
    pub fn stack<T: Borrow<Tensor>>(items: &[T]) -> Option<Tensor> {
        // Every byte is copied over.
        Self::stack_with(items, Tensor::for_overwrite)
    }

    /// [`stack`](Self::stack) into a tensor made by `alloc(shape, dtype)` (pinned memory, a
    /// pool).
    pub fn stack_with<T: Borrow<Tensor>>(
        items: &[T],
        alloc: impl FnOnce(&[usize], DType) -> Tensor,
    ) -> Option<Tensor> {
        let first = items.first()?.borrow();
        if items
            .iter()
            .map(Borrow::borrow)
            .any(|t: &Tensor| t.shape != first.shape || t.dtype != first.dtype)
        {
            return None;
        }
        let mut shape = vec![items.len()];
        shape.extend_from_slice(&first.shape);
        let mut out = alloc(&shape, first.dtype);
        assert_eq!(
            out.shape(),
            &shape[..],
            "the allocator must make the asked shape"
        );
        for (i, t) in items.iter().enumerate() {
            out.item_mut(i).copy_from_slice(t.borrow().bytes());
        }
        Some(out)
    }

    /// The tensor as a NumPy `.npy` file (version 1.0, little-endian, C order).
    pub fn to_npy(&self) -> Vec<u8> {
        let shape: Vec<String> = self.shape.iter().map(ToString::to_string).collect();
        let shape = if shape.len() == 1 {
            format!("{},", shape[0])
        } else {
            shape.join(", ")
        };
        let descr = match self.dtype {
            DType::U8 => "|u1",
            DType::F32 => "<f4",
            DType::I64 => "<i8",
        };
        let mut header =
            format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': ({shape}), }}");
        // Magic (6) + version (2) + header length (2) + header + '\n', padded to 64 bytes.
        let unpadded = 10 + header.len() + 1;
        header.push_str(&" ".repeat(unpadded.next_multiple_of(64) - unpadded));
        header.push('\n');
        let mut out = Vec::with_capacity(10 + header.len() + self.nbytes());
        out.extend_from_slice(b"\x93NUMPY\x01\x00");
        out.extend_from_slice(&(header.len() as u16).to_le_bytes());
        out.extend_from_slice(header.as_bytes());
        out.extend_from_slice(self.bytes());
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn freed_buffers_are_reused_zeroed_on_request_and_bounded() {
        let len = 200_000;
        // Other tests run in parallel and may take it first or empty the pool (a dropped
        // pipeline does): try a few times.
        let seen = (0..50).any(|_| {
            let mut a = Tensor::zeros(&[len], DType::U8);
            a.bytes_mut().fill(9);
            let ptr = a.bytes().as_ptr();
            drop(a);
            let z = Tensor::zeros(&[len], DType::U8);
            assert!(
                z.bytes().iter().all(|&v| v == 0),
                "zeros are zeros, pooled or not"
            );
            assert_eq!(z.bytes().as_ptr() as usize % ALIGN, 0);
            z.bytes().as_ptr() == ptr
        });
        assert!(seen, "a freed buffer of the same length is reused");
        // The cap: dropping far more than POOL_BYTES keeps at most POOL_BYTES.
        let many: Vec<Tensor> = (0..40)
            .map(|_| Tensor::for_overwrite(&[1 << 20], DType::U8))
            .collect();
        drop(many);
        assert!(pool::bytes() <= pool::POOL_BYTES);
        // Too small or too large buffers never enter it.
        assert!(pool::take(100).is_none());
        pool::release();
    }

    #[test]
    fn buffers_are_aligned_zeroed_and_sliced_per_item() {
        let mut t = Tensor::zeros(&[4, 3, 2], DType::U8);
        assert_eq!(t.bytes().as_ptr() as usize % ALIGN, 0);
        assert!(t.bytes().iter().all(|&b| b == 0));
        t.item_mut(2).fill(7);
        assert_eq!(t.item(2), &[7; 6]);
        assert_eq!(t.item(1), &[0; 6]);
        let empty = Tensor::zeros(&[0, 3], DType::F32);
        assert_eq!(empty.nbytes(), 0);
    }

    #[test]
    fn stack_and_npy() {
        let mut a = Tensor::zeros(&[2, 2], DType::U8);
        a.bytes_mut().copy_from_slice(&[1, 2, 3, 4]);
        let b = Tensor::zeros(&[2, 2], DType::U8);
        let s = Tensor::stack(&[a, b]).unwrap();
        assert_eq!(s.shape(), &[2, 2, 2]);
        assert_eq!(s.bytes(), &[1, 2, 3, 4, 0, 0, 0, 0]);
        let npy = s.to_npy();
        assert_eq!(&npy[..6], b"\x93NUMPY");
        let header_len = u16::from_le_bytes([npy[8], npy[9]]) as usize;
        assert_eq!((10 + header_len) % 64, 0);
        let header = std::str::from_utf8(&npy[10..10 + header_len]).unwrap();
        assert!(header.contains("'shape': (2, 2, 2)"), "{header}");
        assert_eq!(&npy[10 + header_len..], s.bytes());
        assert!(Tensor::stack(&[
            Tensor::zeros(&[1], DType::U8),
            Tensor::zeros(&[2], DType::U8)
        ])
        .is_none());
    }
}
