//! What a loader delivers: a [`Batch`] — named tensors, the labels, and where each item
//! came from ([`ItemMeta`]) — the collate step that makes one from decoded items (unstacking
//! a length-aware batch, which comes whole from its decoder), and the checks a batch passes
//! after the user's per-batch function ([`MapBatches`]).

use flowgate_actors::error::BoxError;

use crate::collate::{collate_fields_with, CollateError};
use crate::dataset::FieldValue;
use crate::device::{Delivered, DeviceError, HostAlloc, Uploader};
use crate::tensor::{DType, Tensor};

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
/// Fields ([`names`](Self::names)): the decoded media (`[B, ...]`, named by its kind:
/// `"image"`, `"audio"`, `"video"`); with lengths (audio, length-aware batches) a second
/// field, `"lengths"`, the real length of each item (`[B]`, `i64`); a video recipe with an
/// audio track gives the audio as the second field (`"audio"`); then any a per-batch
/// function adds.
#[derive(Debug)]
pub struct Batch {
    /// The tensors, in the recipe's order (then a per-batch function's).
    pub fields: Vec<Delivered>,
    /// Each tensor's name, in [`fields`](Self::fields)' order.
    pub names: std::sync::Arc<[String]>,
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

    /// The tensor named `name` ([`names`](Self::names)).
    pub fn tensor(&self, name: &str) -> Option<&Delivered> {
        let k = self.names.iter().position(|n| n == name)?;
        self.fields.get(k)
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
            names: self.names,
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
pub type MapItems = std::sync::Arc<dyn Fn(Sample) -> Result<Sample, BoxError> + Send + Sync>;

/// A per-batch function run on a stage of its own after collation (see
/// [`LoaderBuilder::map_batches`](super::LoaderBuilder::map_batches)).
pub type MapBatches = std::sync::Arc<dyn Fn(Batch) -> Result<Batch, BoxError> + Send + Sync>;

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
    names: &Names,
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
        names: std::sync::Arc::clone(&names.tensors),
        labels,
        items: metas,
        extra_names: std::sync::Arc::clone(&names.fields),
    })
}

/// The names a loader's batches carry as it collates them: its tensors' and its fields'
/// besides the media.
#[derive(Clone, Debug)]
pub(crate) struct Names {
    pub(crate) tensors: std::sync::Arc<[String]>,
    pub(crate) fields: std::sync::Arc<[String]>,
}

/// Checks the batch a per-batch function returned against the one it was given (`rows`:
/// each row's index and epoch; `labels`: whether the dataset has labels): the same rows in
/// the same order (a checkpoint counts them), a name per tensor and each name once, each
/// tensor's first dimension the rows, the labels kept (`[B]`, `i64`; the rows' labels are
/// set from them), a value per field in every row.
pub(crate) fn check_mapped(
    rows: &[(usize, u64)],
    labels: bool,
    b: &mut Batch,
) -> Result<(), BoxError> {
    let n = rows.len();
    let same = b.items.len() == n
        && b.items
            .iter()
            .zip(rows)
            .all(|(m, &(i, e))| m.index == i && m.epoch == e);
    if !same {
        return Err(format!(
            "the per-batch function changed the batch's rows ({} rows, or their order, for {n}): it maps their values; which rows a batch holds is the loader's (its checkpoints count them)",
            b.items.len()
        )
        .into());
    }
    if b.names.len() != b.fields.len() {
        return Err(format!(
            "the per-batch function left {} tensors and {} names for them",
            b.fields.len(),
            b.names.len()
        )
        .into());
    }
    super::keys::BatchKeys::new(b.names.iter(), labels)
        .check(&b.extra_names)
        .map_err(|e| format!("the per-batch function's output: {e}"))?;
    for (name, t) in b.names.iter().zip(&b.fields) {
        if t.shape().first() != Some(&n) {
            return Err(format!(
                "the per-batch function made {name:?} of shape {:?}: a batch's tensors have its {n} rows as their first dimension",
                t.shape()
            )
            .into());
        }
    }
    match (&b.labels, labels) {
        (None, false) => {}
        (Some(Delivered::Host(t)), true) if t.shape() == [n] && t.dtype() == DType::I64 => {
            for (m, v) in b.items.iter_mut().zip(t.bytes().chunks_exact(8)) {
                m.label = Some(i64::from_ne_bytes(v.try_into().expect("8 bytes")));
            }
        }
        (l, _) => {
            return Err(format!(
                "the per-batch function left the labels {}: the dataset {} labels, a batch's are [{n}] int64 in host memory",
                l.as_ref()
                    .map_or("out".into(), |t| format!("{:?} {:?}", t.shape(), t.dtype())),
                if labels { "has" } else { "has no" }
            )
            .into());
        }
    }
    let k = b.extra_names.len();
    if let Some(m) = b.items.iter().find(|m| m.extras.len() != k) {
        return Err(format!(
            "the per-batch function left item {} with {} fields besides the media; the batch names {k}",
            m.index,
            m.extras.len()
        )
        .into());
    }
    Ok(())
}
