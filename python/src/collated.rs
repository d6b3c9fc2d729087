//! What a loader's batch carries: the collated fields and labels ([`Loaded`], in host memory
//! or uploaded), how labels are found ([`Labels`], [`Extras`]), and the collate step that makes
//! a batch from decoded items (unstacking length-aware batches).

use std::sync::Arc;

use flowgate::collate::{collate_fields_with, CollateError};
use flowgate::device::{DeviceError, HostAlloc, Uploader};
use flowgate::{DType, Tensor};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::batch::Mem;
use crate::dataset::{Dataset, Meta};

/// A collated batch (one tensor per field: frames, or frames and audio; the labels) and where
/// each of its items came from (for paths), in host memory or uploaded.
pub(crate) struct Loaded {
    pub(crate) fields: Vec<Mem>,
    pub(crate) labels: Option<Mem>,
    pub(crate) items: Vec<Meta>,
}

impl Loaded {
    /// Uploads every field (and the labels) with `up`: in order, on the uploader's stream.
    pub(crate) fn upload(self, up: &mut Uploader) -> Result<Self, DeviceError> {
        let mut one = |m: Mem| match m {
            Mem::Host(t) => up.upload_owned(t).map(Mem::Device),
            d => Ok(d),
        };
        Ok(Self {
            fields: self
                .fields
                .into_iter()
                .map(&mut one)
                .collect::<Result<_, _>>()?,
            labels: self.labels.map(one).transpose()?,
            ..self
        })
    }

    /// Bytes of its tensors (on the device once uploaded).
    pub(crate) fn nbytes(&self) -> usize {
        let size = |m: &Mem| match m {
            Mem::Host(t) => t.nbytes(),
            Mem::Device(b) => b.nbytes(),
        };
        self.fields.iter().chain(&self.labels).map(size).sum()
    }
}

/// What a loader's batches carry besides the tensor.
pub(crate) struct Extras {
    /// A label per dataset path, when batches carry labels given by path.
    pub(crate) labels: Option<Vec<i64>>,
    /// Whether batches carry the labels their samples carried (tar shards).
    pub(crate) sample_labels: bool,
    /// The class names, when the labels come from folders.
    pub(crate) classes: Option<Vec<String>>,
    /// Whether batches carry their files' paths.
    pub(crate) return_paths: bool,
}

impl Extras {
    /// How the batches' labels are found, if they carry any.
    pub(crate) fn batch_labels(&self) -> Option<Labels> {
        (self.labels.is_some() || self.sample_labels)
            .then(|| Labels(self.labels.clone().map(Arc::new)))
    }

    /// Reads the `labels` argument: `"folder"`, a sequence of ints (one per file, in dataset
    /// order) or a mapping from path to int; for tar shards, the extension of the field that
    /// holds each sample's label (already in `dataset`).
    pub(crate) fn new(
        labels: Option<&Bound<'_, PyAny>>,
        dataset: &Dataset,
        return_paths: bool,
    ) -> PyResult<Self> {
        let mut e = Self {
            labels: None,
            sample_labels: false,
            classes: None,
            return_paths,
        };
        let files = match dataset {
            Dataset::Files(f) | Dataset::Batches { files: f, .. } => f,
            Dataset::Records { .. } | Dataset::Mix { .. } => {
                e.sample_labels = dataset.has_label();
                return Ok(e);
            }
        };
        let Some(labels) = labels else {
            return Ok(e);
        };
        if let Ok(kind) = labels.extract::<String>() {
            if kind != "folder" {
                return Err(PyValueError::new_err(format!(
                    "labels must be \"folder\", a sequence of ints or a mapping from path to int, not {kind:?}"
                )));
            }
            let folders = files.folder_labels();
            e.labels = Some(
                files
                    .paths()
                    .iter()
                    .map(|p| {
                        folders
                            .label(p)
                            .expect("a dataset file's folder is a class")
                    })
                    .collect(),
            );
            e.classes = Some(folders.classes());
        } else if let Ok(map) = labels.downcast::<PyDict>() {
            let mut v = Vec::with_capacity(files.len());
            for p in files.paths() {
                let key = p.to_string_lossy();
                let label = map.get_item(key.as_ref())?.ok_or_else(|| {
                    PyValueError::new_err(format!("labels has no entry for {key:?}"))
                })?;
                v.push(label.extract::<i64>()?);
            }
            e.labels = Some(v);
        } else {
            let v: Vec<i64> = labels.extract()?;
            if v.len() != files.len() {
                return Err(PyValueError::new_err(format!(
                    "{} labels for {} files",
                    v.len(),
                    files.len()
                )));
            }
            e.labels = Some(v);
        }
        Ok(e)
    }
}

pub(crate) fn nbytes(fields: &[Tensor]) -> usize {
    fields.iter().map(Tensor::nbytes).sum()
}

/// How a batch's labels are found: each item's own (tar shards), else by dataset index.
#[derive(Clone)]
pub(crate) struct Labels(Option<Arc<Vec<i64>>>);

impl Labels {
    fn of(&self, items: &[Meta]) -> Vec<i64> {
        items
            .iter()
            .map(|m| match (&self.0, m.label) {
                (_, Some(l)) => l,
                (Some(by_index), None) => by_index[m.index],
                (None, None) => unreachable!("a sample without its label failed"),
            })
            .collect()
    }
}

/// Stacks each field of the items into one batch tensor (flowgate's collation; into memory
/// from `alloc`, pinned when the loader uploads), keeping where the items came from; adds the
/// labels if the loader has them. A length-aware batch is one item whose fields come stacked
/// as `[1, ...]` and whose rows are the files it kept: unstacked here.
pub(crate) fn collate(
    items: Vec<(Vec<Tensor>, Meta)>,
    alloc: Option<&HostAlloc>,
    labels: Option<&Labels>,
) -> Result<Loaded, CollateError> {
    let new = |shape: &[usize], dtype| match alloc {
        Some(a) => a.tensor(shape, dtype),
        None => Tensor::for_overwrite(shape, dtype),
    };
    let (fields, items): (Vec<Vec<Tensor>>, Vec<Meta>) = items.into_iter().unzip();
    let mut fields = collate_fields_with(&fields, new)?;
    let epoch = items.first().map_or(0, |m| m.epoch);
    let items = match items.as_slice() {
        [one] if one.rows.is_some() => {
            fields = fields
                .into_iter()
                .map(|t| {
                    let shape = t.shape()[1..].to_vec();
                    t.reshaped(&shape)
                })
                .collect();
            let rows = one.rows.clone().unwrap_or_default();
            rows.into_iter()
                .map(|index| Meta {
                    index,
                    epoch,
                    label: None,
                    rows: None,
                })
                .collect()
        }
        _ => items,
    };
    let labels = labels.map(|l| {
        let v = l.of(&items);
        let mut t = new(&[v.len()], DType::I64);
        t.bytes_mut().copy_from_slice(Tensor::from_i64(&v).bytes());
        Mem::Host(t)
    });
    Ok(Loaded {
        fields: fields.into_iter().map(Mem::Host).collect(),
        labels,
        items,
    })
}
