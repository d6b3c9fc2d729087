//! Multimodal samples: named fields, batched field by field.
//!
//! A [`Sample`] carries several named [`Field`]s (a clip's frames and its audio track; an image,
//! its label and its caption). [`FieldBatch::collate`] stacks each tensor field into one batch
//! tensor, gathers labels into an `i64` tensor and keeps texts as strings; fields must agree
//! across the samples of a batch (same names, same kinds, same shapes), or collation fails
//! with an error naming the field.
//!
//! ```
//! use flowgate::sample::{FieldBatch, Sample};
//! use flowgate::{DType, Tensor};
//!
//! let samples: Vec<Sample> = (0..4)
//!     .map(|i| {
//!         Sample::new()
//!             .with("image", Tensor::zeros(&[3, 8, 8], DType::U8))
//!             .with("label", i as i64)
//!             .with("caption", format!("picture {i}"))
//!     })
//!     .collect();
//! let batch = FieldBatch::collate(samples).unwrap();
//! assert_eq!(batch.tensor("image").unwrap().shape(), [4, 3, 8, 8]);
//! assert_eq!(batch.tensor("label").unwrap().shape(), [4]);
//! assert_eq!(batch.texts("caption").unwrap()[3], "picture 3");
//! ```

mod fields;

pub use fields::FieldMap;

use crate::tensor::Tensor;

/// One field of a sample.
#[derive(Debug)]
pub enum Field {
    /// A tensor (frames, audio, an image).
    Tensor(Tensor),
    /// An integer label.
    Label(i64),
    /// Text (a caption, a transcript).
    Text(String),
}

impl From<Tensor> for Field {
    fn from(t: Tensor) -> Self {
        Field::Tensor(t)
    }
}

impl From<i64> for Field {
    fn from(v: i64) -> Self {
        Field::Label(v)
    }
}

impl From<String> for Field {
    fn from(s: String) -> Self {
        Field::Text(s)
    }
}

impl From<&str> for Field {
    fn from(s: &str) -> Self {
        Field::Text(s.to_owned())
    }
}

/// Named fields, in the order they were added.
#[derive(Debug, Default)]
pub struct Sample {
    fields: Vec<(String, Field)>,
}

impl Sample {
    /// An empty sample.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds (or replaces) the field `name`.
    pub fn with(mut self, name: &str, value: impl Into<Field>) -> Self {
        let value = value.into();
        match self.fields.iter_mut().find(|(n, _)| n == name) {
            Some((_, f)) => *f = value,
            None => self.fields.push((name.to_owned(), value)),
        }
        self
    }

    /// The field `name`.
    pub fn get(&self, name: &str) -> Option<&Field> {
        self.fields.iter().find(|(n, _)| n == name).map(|(_, f)| f)
    }

    /// The fields' names.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.fields.iter().map(|(n, _)| n.as_str())
    }

    /// Bytes of the tensor fields (for byte budgets: `.measure(Sample::nbytes)`).
    pub fn nbytes(&self) -> usize {
        self.fields
            .iter()
            .map(|(_, f)| match f {
                Field::Tensor(t) => t.nbytes(),
                Field::Label(_) => 8,
                Field::Text(s) => s.len(),
            })
            .sum()
    }
}

/// One batched field.
#[derive(Debug)]
pub enum Column {
    /// Tensors stacked along a new first axis; labels as a 1-D `i64` tensor.
    Tensor(Tensor),
    /// Texts, in sample order.
    Texts(Vec<String>),
}

/// Samples batched field by field.
#[derive(Debug)]
pub struct FieldBatch {
    len: usize,
    columns: Vec<(String, Column)>,
}

/// Why samples could not be batched.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CollateError {
    /// No samples.
    #[error("an empty batch")]
    Empty,
    /// A sample lacks a field the first one has, or has one it lacks.
    #[error("sample {index} has fields {found:?}, the batch's first has {expected:?}")]
    Fields {
        /// The sample's position in the batch.
        index: usize,
        /// The first sample's fields.
        expected: Vec<String>,
        /// This sample's fields.
        found: Vec<String>,
    },
    /// A field's kind, shape or dtype differs between samples.
    #[error("field `{field}` of sample {index} does not match the batch's first: {reason}")]
    Mismatch {
        /// The field.
        field: String,
        /// The sample's position in the batch.
        index: usize,
        /// What differs.
        reason: String,
    },
}

impl FieldBatch {
    /// Batches `samples` field by field (see the module docs).
    pub fn collate(samples: Vec<Sample>) -> Result<FieldBatch, CollateError> {
        let first = samples.first().ok_or(CollateError::Empty)?;
        let names: Vec<String> = first.names().map(str::to_owned).collect();
        for (index, s) in samples.iter().enumerate() {
            if s.fields.len() != names.len() || names.iter().any(|n| s.get(n).is_none()) {
                return Err(CollateError::Fields {
                    index,
                    expected: names,
                    found: s.names().map(str::to_owned).collect(),
                });
            }
        }
        let len = samples.len();
        let mut columns = Vec::with_capacity(names.len());
        for name in &names {
            let mismatch = |index: usize, reason: String| CollateError::Mismatch {
                field: name.clone(),
                index,
                reason,
            };
            let column = match first.get(name).expect("checked above") {
                Field::Tensor(t0) => {
                    let mut items = Vec::with_capacity(len);
                    for (i, s) in samples.iter().enumerate() {
                        match s.get(name) {
                            Some(Field::Tensor(t))
                                if t.shape() == t0.shape() && t.dtype() == t0.dtype() =>
                            {
                                items.push(t)
                            }
                            Some(Field::Tensor(t)) => {
                                return Err(mismatch(
                                    i,
                                    format!(
                                        "{:?} {:?}, not {:?} {:?}",
                                        t.dtype(),
                                        t.shape(),
                                        t0.dtype(),
                                        t0.shape()
                                    ),
                                ))
                            }
                            _ => return Err(mismatch(i, "not a tensor".into())),
                        }
                    }
                    Column::Tensor(
                        crate::collate::collate(&items).expect("shapes and dtypes checked above"),
                    )
                }
                Field::Label(_) => {
                    let mut v = Vec::with_capacity(len);
                    for (i, s) in samples.iter().enumerate() {
                        match s.get(name) {
                            Some(Field::Label(x)) => v.push(*x),
                            _ => return Err(mismatch(i, "not a label".into())),
                        }
                    }
                    Column::Tensor(Tensor::from_i64(&v))
                }
                Field::Text(_) => {
                    let mut v = Vec::with_capacity(len);
                    for (i, s) in samples.iter().enumerate() {
                        match s.get(name) {
                            Some(Field::Text(x)) => v.push(x.clone()),
                            _ => return Err(mismatch(i, "not text".into())),
                        }
                    }
                    Column::Texts(v)
                }
            };
            columns.push((name.clone(), column));
        }
        Ok(FieldBatch { len, columns })
    }

    /// Samples in the batch.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the batch is empty (never, for a collated batch).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The column `name`.
    pub fn get(&self, name: &str) -> Option<&Column> {
        self.columns.iter().find(|(n, _)| n == name).map(|(_, c)| c)
    }

    /// The batched tensor (or labels) of field `name`.
    pub fn tensor(&self, name: &str) -> Option<&Tensor> {
        match self.get(name)? {
            Column::Tensor(t) => Some(t),
            Column::Texts(_) => None,
        }
    }

    /// The texts of field `name`.
    pub fn texts(&self, name: &str) -> Option<&[String]> {
        match self.get(name)? {
            Column::Texts(v) => Some(v),
            Column::Tensor(_) => None,
        }
    }

    /// Bytes of the batch's tensors (for byte budgets: `.measure(FieldBatch::nbytes)`).
    pub fn nbytes(&self) -> usize {
        self.columns
            .iter()
            .map(|(_, c)| match c {
                Column::Tensor(t) => t.nbytes(),
                Column::Texts(v) => v.iter().map(String::len).sum(),
            })
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::DType;

    #[test]
    fn mismatches_name_the_field_and_sample() {
        let ok = || {
            Sample::new()
                .with("x", Tensor::zeros(&[2], DType::F32))
                .with("y", 1)
        };
        let bad_shape = Sample::new()
            .with("x", Tensor::zeros(&[3], DType::F32))
            .with("y", 1);
        let e = FieldBatch::collate(vec![ok(), bad_shape]).unwrap_err();
        assert!(e.to_string().contains("field `x` of sample 1"), "{e}");
        let missing = Sample::new().with("x", Tensor::zeros(&[2], DType::F32));
        assert!(matches!(
            FieldBatch::collate(vec![ok(), missing]),
            Err(CollateError::Fields { index: 1, .. })
        ));
        let b = FieldBatch::collate(vec![ok(), ok().with("y", 7)]).unwrap();
        let y = b.tensor("y").unwrap();
        assert_eq!((y.dtype(), y.shape()), (DType::I64, &[2usize][..]));
        assert_eq!(&y.bytes()[8..], &7i64.to_ne_bytes());
        assert!(matches!(
            FieldBatch::collate(Vec::new()),
            Err(CollateError::Empty)
        ));
    }
}
