//! How many bytes an item holds, for the memory budget, without a `measure` call.
//!
//! Every buffer charges each item by a *sizer*. [`PipelineBuilder::measure`] sets one; without
//! it, an item of one of the types below is measured by what it owns ([`HeapSize`]): tensors,
//! blobs, samples and batches, byte and number vectors, strings and paths, vectors, options and
//! pairs of them, and pairs of one with a plain value (an index, an epoch). Any other type is
//! charged its inline size (`size_of`), which is exact for plain values and an under-count for
//! a type that owns heap memory: give such a type a `measure` (its [`HeapSize`], if you
//! implement it) or the budget cannot see its bytes.
//!
//! [`PipelineBuilder::measure`]: crate::PipelineBuilder::measure

use std::any::{Any, TypeId};
use std::path::PathBuf;
use std::sync::Arc;

use flowgate_actors::op::Sizer;

use crate::blob::Blob;
use crate::sample::{FieldBatch, Sample};
use crate::tensor::Tensor;

/// The heap bytes a value owns (beyond its inline `size_of`).
pub trait HeapSize {
    /// Bytes owned on the heap.
    fn heap_size(&self) -> usize;

    /// Inline and heap bytes: what a buffer holding the value holds.
    fn total_size(&self) -> usize
    where
        Self: Sized,
    {
        std::mem::size_of::<Self>() + self.heap_size()
    }
}

impl HeapSize for Tensor {
    fn heap_size(&self) -> usize {
        self.nbytes()
    }
}

impl HeapSize for Blob {
    fn heap_size(&self) -> usize {
        self.bytes.capacity() + self.path.as_os_str().len()
    }
}

impl HeapSize for Sample {
    fn heap_size(&self) -> usize {
        self.nbytes()
    }
}

impl HeapSize for FieldBatch {
    fn heap_size(&self) -> usize {
        self.nbytes()
    }
}

impl HeapSize for String {
    fn heap_size(&self) -> usize {
        self.capacity()
    }
}

impl HeapSize for PathBuf {
    fn heap_size(&self) -> usize {
        self.as_os_str().len()
    }
}

macro_rules! plain {
    ($($t:ty),*) => { $(impl HeapSize for $t { fn heap_size(&self) -> usize { 0 } })* };
}
plain!(u8, u16, u32, u64, usize, i8, i16, i32, i64, isize, f32, f64, bool);

impl<T: HeapSize> HeapSize for Vec<T> {
    fn heap_size(&self) -> usize {
        self.capacity() * std::mem::size_of::<T>() + self.iter().map(T::heap_size).sum::<usize>()
    }
}

impl<T: HeapSize> HeapSize for Option<T> {
    fn heap_size(&self) -> usize {
        self.as_ref().map_or(0, T::heap_size)
    }
}

impl<A: HeapSize, B: HeapSize> HeapSize for (A, B) {
    fn heap_size(&self) -> usize {
        self.0.heap_size() + self.1.heap_size()
    }
}

/// The sizer of items of type `T`: by [`HeapSize`] for the types the module docs list, else
/// the inline size. Decided once per stage, from `T`'s type id.
pub(crate) fn auto_sizer<T: Send + 'static>() -> Sizer<T> {
    macro_rules! known {
        ($($t:ty),* $(,)?) => {
            $(
                if TypeId::of::<T>() == TypeId::of::<$t>() {
                    return Arc::new(|x: &T| {
                        let x = (x as &dyn Any).downcast_ref::<$t>().expect("the type checked");
                        x.total_size() as u64
                    });
                }
            )*
        };
    }
    macro_rules! with_plain {
        ($($t:ty),* $(,)?) => {
            $( known!($t, Vec<$t>, Option<$t>, ($t, u64), ($t, usize), (u64, $t), (usize, $t),
                      (Vec<$t>, u64), (Vec<$t>, usize), (PathBuf, $t), (String, $t)); )*
        };
    }
    with_plain!(
        Tensor,
        Blob,
        Sample,
        FieldBatch,
        String,
        PathBuf,
        Vec<u8>,
        Vec<f32>,
        Vec<i64>
    );
    known!(
        Vec<Vec<Tensor>>,
        (Tensor, Tensor),
        (Tensor, i64),
        (Vec<Tensor>, Vec<usize>)
    );
    flowgate_actors::op::inline_size()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::DType;

    #[test]
    fn the_library_types_are_measured_by_what_they_own() {
        let t = Tensor::zeros(&[4, 1024], DType::F32);
        assert!(auto_sizer::<Tensor>()(&t) >= 16 * 1024);
        let two = || Tensor::zeros(&[4, 1024], DType::F32);
        let pair = (vec![two(), two()], 7usize);
        assert!(auto_sizer::<(Vec<Tensor>, usize)>()(&pair) >= 32 * 1024);
        let bytes = vec![1u8; 1 << 20];
        assert!(auto_sizer::<Vec<u8>>()(&bytes) >= 1 << 20);
        let blob = (
            Blob {
                path: "a".into(),
                bytes: vec![0; 5000],
            },
            3u64,
        );
        assert!(auto_sizer::<(Blob, u64)>()(&blob) >= 5000);
        // A type it does not know: its inline size.
        #[allow(dead_code)]
        struct Mine(Vec<u8>);
        let mine = Mine(vec![0; 1 << 20]);
        assert_eq!(
            auto_sizer::<Mine>()(&mine),
            std::mem::size_of::<Mine>() as u64
        );
    }
}
