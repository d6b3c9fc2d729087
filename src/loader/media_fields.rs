//! Fields decoded as media: a sample's second image (a depth map, the other view of a pair), a
//! clip's own audio file, beside the media the loader's recipe decodes. The dataset reads
//! such a field as bytes (it knows no decoder); the loader decodes it with the field's own
//! recipe into a tensor of its own, named by the field, stacked like the media.
//!
//! Every front end names them alike, in the `fields` mapping: a table whose `kind` is
//! `"image"`, `"audio"` or `"video"` holds `from` (the member's extension, the file beside a
//! loose file, the column) and the modality's arguments (`crop`, `rate`, ...), which
//! [`fields_and_media`] splits from the other fields.

use crate::blob::Blob;
use crate::dataset::{FieldKind, FieldSpec, FieldValue};
use crate::media::args::MediaArgs;
use crate::media::{MediaError, Recipe};
use crate::tensor::Tensor;

/// A field decoded as media, as a front end names it: its name, where it is read from, and
/// its recipe's arguments.
#[derive(Clone, Debug)]
pub struct MediaFieldArgs {
    /// The field's name: its tensor's in a batch.
    pub name: String,
    /// Extensions of a sample's members (or of the files beside a loose file), or columns.
    pub from: Vec<String>,
    /// Its recipe's arguments.
    pub media: MediaArgs,
}

impl MediaFieldArgs {
    /// The dataset's field that reads its bytes.
    pub fn spec(&self) -> FieldSpec {
        let mut spec = FieldSpec::new(self.name.clone(), String::new()).kind(FieldKind::Bytes);
        spec.from = self.from.clone();
        spec
    }
}

/// Splits a `fields` mapping into the dataset's fields (as
/// [`fields_from_value`](crate::dataset::fields_from_value) reads them, media fields
/// included as the bytes they are read from) and the fields decoded as media: a table whose
/// `kind` is `"image"`, `"audio"` or `"video"`, with `from` and its modality's arguments
/// (`{"from": "depth.png", "kind": "image", "crop": 224}`). Such a field is required (a
/// sample without it is a failed item): `optional` is refused, as a batch cannot stack a
/// missing tensor.
pub fn fields_and_media(
    v: serde_json::Value,
) -> Result<(Vec<FieldSpec>, Vec<MediaFieldArgs>), String> {
    use serde_json::Value;
    let Value::Object(map) = v else {
        return crate::dataset::fields_from_value(v).map(|f| (f, Vec::new()));
    };
    let mut rest = serde_json::Map::new();
    let mut media = Vec::new();
    for (name, v) in map {
        let kind = v.get("kind").and_then(Value::as_str).map(str::to_owned);
        if !matches!(kind.as_deref(), Some("image" | "audio" | "video")) {
            rest.insert(name, v);
            continue;
        }
        let Value::Object(mut t) = v else {
            unreachable!("a value with a kind is a table")
        };
        if t.remove("optional")
            .is_some_and(|o| o != Value::Bool(false))
        {
            return Err(format!(
                "fields: {name:?}: a media field is required (a batch cannot stack a missing \
                 {}): leave out `optional`",
                kind.unwrap_or_default()
            ));
        }
        let from = t
            .remove("from")
            .ok_or_else(|| format!("fields: {name:?} needs \"from\""))?;
        // `from` as the other fields read it.
        let probe = serde_json::json!({ name.clone(): from });
        let from = crate::dataset::fields_from_value(probe)?
            .pop()
            .expect("one field")
            .from;
        let args = MediaArgs::from_value(Value::Object(t))
            .map_err(|e| format!("fields: {name:?}: {e}"))?;
        media.push(MediaFieldArgs {
            name,
            from,
            media: args,
        });
    }
    let mut specs = crate::dataset::fields_from_value(Value::Object(rest))?;
    specs.extend(media.iter().map(MediaFieldArgs::spec));
    Ok((specs, media))
}

/// A field the loader decodes as media: its name, its recipe, and its place among the
/// dataset's fields (set when the loader is built).
#[derive(Clone, Debug)]
pub(crate) struct MediaField {
    pub(crate) name: String,
    pub(crate) recipe: Recipe,
    pub(crate) at: usize,
}

/// Decodes each media field of an item (`item`: its name, for errors) out of `extras` (the
/// dataset's fields, in order) into a tensor appended to `tensors`; the media fields are
/// taken out of `extras`.
pub(crate) fn decode(
    fields: &[MediaField],
    item: &str,
    extras: &mut Vec<FieldValue>,
    epoch: u64,
    tensors: &mut Vec<Tensor>,
) -> Result<(), MediaError> {
    for f in fields {
        let bytes = match std::mem::replace(&mut extras[f.at], FieldValue::Missing) {
            FieldValue::Bytes(b) => b,
            v => unreachable!("a media field is read as bytes, not {v:?}"),
        };
        let path = format!("{item} (field {:?})", f.name).into();
        tensors.push(f.recipe.for_epoch(epoch).decode(Blob { path, bytes })?);
    }
    let mut at: Vec<usize> = fields.iter().map(|f| f.at).collect();
    at.sort_unstable_by(|a, b| b.cmp(a));
    for k in at {
        extras.remove(k);
    }
    Ok(())
}
