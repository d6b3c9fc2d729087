//! Collation: stacking items into batch tensors, the one routine every path uses (the Rust
//! builder's [`batch`](crate::PipelineBuilder::batch), pipeline files, the Python loaders).

use std::borrow::Borrow;

use crate::tensor::{DType, Tensor};

/// Why items could not be stacked into one batch.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CollateError {
    /// No items (a batch is never empty; this is a caller's mistake).
    #[error("no items to collate")]
    Empty,
    /// An item differs from the first in shape or element type.
    #[error("item {index} of the batch is {found}, the first is {expected}")]
    Mismatch {
        /// Its position in the batch.
        index: usize,
        /// The first item's shape and type.
        expected: String,
        /// This item's.
        found: String,
    },
    /// Items carry different numbers of fields.
    #[error("item {index} of the batch has {found} fields, the first has {expected}")]
    Fields {
        /// Its position in the batch.
        index: usize,
        /// The first item's number of fields.
        expected: usize,
        /// This item's.
        found: usize,
    },
}

fn describe(t: &Tensor) -> String {
    format!("{:?} {:?}", t.dtype(), t.shape())
}

/// Stacks same-shaped tensors along a new first axis (one copy of each).
pub fn collate<T: Borrow<Tensor>>(items: &[T]) -> Result<Tensor, CollateError> {
    // Every byte is copied over.
    collate_with(items, Tensor::for_overwrite)
}

/// [`collate`] into a tensor made by `alloc(shape, dtype)` (pinned memory from
/// [`HostAlloc`](crate::device::HostAlloc), a pool).
pub fn collate_with<T: Borrow<Tensor>>(
    items: &[T],
    alloc: impl FnOnce(&[usize], DType) -> Tensor,
) -> Result<Tensor, CollateError> {
    let first = items.first().ok_or(CollateError::Empty)?.borrow();
    if let Some((index, t)) = items
        .iter()
        .map(Borrow::borrow)
        .enumerate()
        .find(|(_, t): &(usize, &Tensor)| t.shape() != first.shape() || t.dtype() != first.dtype())
    {
        return Err(CollateError::Mismatch {
            index,
            expected: describe(first),
            found: describe(t),
        });
    }
    Ok(Tensor::stack_with(items, alloc).expect("shapes checked"))
}

/// Collates items of several fields (frames and audio, say) field by field: one batch tensor
/// per field.
pub fn collate_fields<F: AsRef<[Tensor]>>(items: &[F]) -> Result<Vec<Tensor>, CollateError> {
    collate_fields_with(items, Tensor::for_overwrite)
}

/// [`collate_fields`] into tensors made by `alloc(shape, dtype)` (see [`collate_with`]).
pub fn collate_fields_with<F: AsRef<[Tensor]>>(
    items: &[F],
    alloc: impl Fn(&[usize], DType) -> Tensor,
) -> Result<Vec<Tensor>, CollateError> {
    let n = items.first().ok_or(CollateError::Empty)?.as_ref().len();
    if let Some((index, f)) = items
        .iter()
        .enumerate()
        .find(|(_, f)| f.as_ref().len() != n)
    {
        return Err(CollateError::Fields {
            index,
            expected: n,
            found: f.as_ref().len(),
        });
    }
    (0..n)
        .map(|k| {
            let column: Vec<&Tensor> = items.iter().map(|f| &f.as_ref()[k]).collect();
            collate_with(&column, &alloc)
        })
        .collect()
}

/// Stacks clips of different lengths into one batch padded with zeros to the longest: clip
/// `k` is `(tensor, len_k)`, of which the first `len_k` entries of the leading axis (audio
/// samples, video frames in NTHWC) are kept. Returns the batch, `[B, longest, ...]` of the
/// clips' dtype and trailing shape, and the lengths, `[B]` `i64`. Length-aware batches
/// ([`LengthBatches`](crate::sampler::LengthBatches)) are collated this way.
///
/// # Panics
/// If the clips differ in dtype or trailing shape, or a length exceeds its clip.
pub fn pad_longest(clips: &[(Tensor, usize)]) -> (Tensor, Tensor) {
    let longest = clips.iter().map(|(_, n)| *n).max().unwrap_or(0);
    let (dtype, rest) = clips.first().map_or((DType::F32, Vec::new()), |(t, _)| {
        (t.dtype(), t.shape().get(1..).unwrap_or(&[]).to_vec())
    });
    let row = rest.iter().product::<usize>() * dtype.size();
    let mut shape = vec![clips.len(), longest];
    shape.extend(&rest);
    let mut batch = Tensor::zeros(&shape, dtype);
    let mut lengths = Vec::with_capacity(clips.len());
    for (k, (clip, n)) in clips.iter().enumerate() {
        assert!(
            clip.dtype() == dtype && clip.shape().get(1..).unwrap_or(&[]) == rest,
            "clips of one batch share dtype and trailing shape"
        );
        let bytes = n * row;
        batch.item_mut(k)[..bytes].copy_from_slice(&clip.bytes()[..bytes]);
        lengths.push(*n as i64);
    }
    (batch, Tensor::from_i64(&lengths))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn collates_and_names_the_odd_item() {
        let z = |shape: &[usize]| Tensor::zeros(shape, DType::U8);
        let (a, b, c) = (z(&[2, 3]), z(&[2, 3]), z(&[3, 2]));
        assert_eq!(collate(&[&a, &b]).unwrap().shape(), [2, 2, 3]);
        let e = collate(&[&a, &b, &c]).unwrap_err();
        assert!(matches!(e, CollateError::Mismatch { index: 2, .. }), "{e}");
        assert_eq!(collate::<Tensor>(&[]).unwrap_err(), CollateError::Empty);
        let fields =
            collate_fields(&[vec![z(&[2, 3]), z(&[3, 2])], vec![z(&[2, 3]), z(&[3, 2])]]).unwrap();
        assert_eq!(fields[1].shape(), [2, 3, 2]);
        let e = collate_fields(&[vec![z(&[2, 3])], vec![b, c]]).unwrap_err();
        assert!(matches!(e, CollateError::Fields { index: 1, .. }), "{e}");
    }
}
