//! What a loader delivers: a [`Batch`] — one tensor per field, the labels, and where each
//! item came from ([`ItemMeta`]) — and the collate step that makes one from decoded items
//! (unstacking a length-aware batch, which comes whole from its decoder).

use crate::collate::{collate_fields_with, CollateError};
use crate::dataset::FieldValue;
use crate::device::{Delivered, DeviceError, HostAlloc, Uploader};
use crate::{DType, Tensor};

/// Where one item of a batch came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ItemMeta {
    /// Its position in the dataset.
    pub index: usize,
    /// The epoch it was read in.
    pub epoch: u64,
    /// Its label, when the dataset has labels.
    pub label: Option<i64>,
    /// Its fields besides the media ([`Batch::field`] gathers a batch's), in the order the
    /// source names them.
    pub extras: Vec<FieldValue>,
}

/// A batch: each field stacked along a new first axis (in host memory, or uploaded to the
/// loader's device), the labels as an `i64` tensor when the dataset has them, and each
/// item's origin.
///
/// Fields: the decoded media (`[B, ...]`); with lengths (audio, length-aware batches) a
/// second field, the real length of each item (`[B]`, `i64`); a video recipe with an audio
/// track gives the audio as the second field.
#[derive(Debug)]
pub struct Batch {
    /// The fields, in the recipe's order.
    pub fields: Vec<Delivered>,
    /// The labels (`[B]`, `i64`).
    pub labels: Option<Delivered>,
    /// Each item's origin, in batch order.
    pub items: Vec<ItemMeta>,
    /// The names of the items' fields besides the media ([`ItemMeta::extras`]), in order.
    pub extra_names: std::sync::Arc<[String]>,
}

impl Batch {
    /// Items in the batch.
    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// Whether the batch is empty (never, for a delivered batch).
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// Bytes of its tensors (on the device once uploaded).
    pub fn nbytes(&self) -> usize {
        self.fields
            .iter()
            .chain(&self.labels)
            .map(Delivered::nbytes)
            .sum()
    }

    /// Field `name`'s values (one of the source's
    /// [`extra_fields`](crate::dataset::Source::extra_fields)), in the batch's order: a
    /// caption per image, a record per sample; `None` if the loader reads no such field.
    pub fn field(&self, name: &str) -> Option<Vec<&FieldValue>> {
        const MISSING: &FieldValue = &FieldValue::Missing;
        let k = self.extra_names.iter().position(|n| n == name)?;
        Some(
            self.items
                .iter()
                .map(|m| m.extras.get(k).unwrap_or(MISSING))
                .collect(),
        )
    }

    /// The labels as integers (copied back from the device if uploaded).
    pub fn label_values(&self) -> Option<Vec<i64>> {
        self.items.iter().map(|m| m.label).collect()
    }

    /// Uploads every field (and the labels) with `up`: in order, on the uploader's stream.
    pub(crate) fn upload(self, up: &mut Uploader) -> Result<Self, DeviceError> {
        let mut one = |m: Delivered| match m {
            Delivered::Host(t) => up.upload_owned(t).map(Delivered::Device),
            d => Ok(d),
        };
        Ok(Self {
            fields: self
                .fields
                .into_iter()
                .map(&mut one)
                .collect::<Result<_, _>>()?,
            labels: self.labels.map(one).transpose()?,
            items: self.items,
            extra_names: self.extra_names,
        })
    }
}

/// One decoded item as a loader's per-item function sees it
/// ([`LoaderBuilder::map_items`](super::LoaderBuilder::map_items)): its tensors (the media,
/// and its length or audio track where the loader gives them), and where it came from, with
/// its label and fields besides the media. The function may replace any of them; the
/// tensors of a batch's items must keep one shape and dtype per field, to be stacked.
#[derive(Debug)]
pub struct Sample {
    /// Its tensors, in the recipe's order ([`Batch::fields`]).
    pub fields: Vec<Tensor>,
    /// Its origin, label and fields besides the media (the index and epoch seed what a
    /// function draws at random, for a resume to give the same items).
    pub meta: ItemMeta,
}

/// A per-item function run on a stage of its own after decoding (see
/// [`LoaderBuilder::map_items`](super::LoaderBuilder::map_items)).
pub type MapItems = std::sync::Arc<dyn Fn(Sample) -> Result<Sample, crate::BoxError> + Send + Sync>;

/// One decoded item on its way to a batch: its fields, its origin, and for a length-aware
/// batch (an item that is a whole batch) the origin of each of its rows.
#[derive(Debug)]
pub(crate) struct Decoded {
    pub(crate) fields: Vec<Tensor>,
    pub(crate) meta: ItemMeta,
    pub(crate) rows: Option<Vec<ItemMeta>>,
}

impl Decoded {
    pub(crate) fn nbytes(&self) -> usize {
        self.fields.iter().map(Tensor::nbytes).sum()
    }
}

/// Stacks each field of the items into one batch tensor (into memory from `alloc`, pinned
/// when the loader uploads), keeping where the items came from; adds the labels when
/// `labels`. A length-aware batch is one item whose fields come stacked as `[1, ...]` and
/// whose rows are the clips it kept: unstacked here, one origin per row.
pub(crate) fn collate(
    items: Vec<Decoded>,
    alloc: Option<&HostAlloc>,
    labels: bool,
) -> Result<Batch, CollateError> {
    let new = |shape: &[usize], dtype| match alloc {
        Some(a) => a.tensor(shape, dtype),
        None => Tensor::for_overwrite(shape, dtype),
    };
    let mut fields = Vec::with_capacity(items.len());
    let mut metas = Vec::with_capacity(items.len());
    let mut whole = None;
    for d in items {
        fields.push(d.fields);
        if let Some(rows) = d.rows {
            whole = Some(rows);
        }
        metas.push(d.meta);
    }
    let mut fields = collate_fields_with(&fields, new)?;
    if let (Some(rows), 1) = (whole, metas.len()) {
        fields = fields
            .into_iter()
            .map(|t| {
                let shape = t.shape()[1..].to_vec();
                t.reshaped(&shape)
            })
            .collect();
        metas = rows;
    }
    let labels = labels.then(|| {
        let v: Vec<i64> = metas
            .iter()
            .map(|m| {
                m.label
                    .expect("an item of a labelled dataset has its label")
            })
            .collect();
        let mut t = new(&[v.len()], DType::I64);
        t.bytes_mut().copy_from_slice(Tensor::from_i64(&v).bytes());
        Delivered::Host(t)
    });
    Ok(Batch {
        fields: fields.into_iter().map(Delivered::Host).collect(),
        labels,
        items: metas,
        extra_names: std::sync::Arc::from([]),
    })
}
