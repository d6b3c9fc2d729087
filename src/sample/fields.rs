//! [`FieldMap`]: which extensions of a tar sample (or columns of a Parquet row) become which
//! fields of a [`Sample`]: where what a dataset reads (bytes) meets what media decodes.

use super::Sample;
use crate::dataset::shards::{RawSample, SampleRef, ShardError};
use crate::media::{MediaError, Recipe};

impl From<MediaError> for ShardError {
    fn from(e: MediaError) -> Self {
        ShardError::Media(Box::new(e))
    }
}

#[derive(Clone, Debug)]
enum Kind {
    Decode(Recipe),
    Label,
    Text,
}

#[derive(Clone, Debug)]
struct Rule {
    name: String,
    exts: Vec<String>,
    kind: Kind,
    optional: bool,
}

/// Which extensions of a sample become which fields of a [`Sample`], and how.
///
/// Each rule names the sample field, the extensions it is read from (the first present wins:
/// `["jpg", "png", "webp"]`), and what it becomes. Rules are required by default: a sample
/// without any of a rule's extensions fails with [`ShardError::Missing`]; extensions no rule
/// names are ignored.
#[derive(Clone, Debug, Default)]
pub struct FieldMap {
    rules: Vec<Rule>,
}

impl FieldMap {
    /// No fields.
    pub fn new() -> Self {
        Self::default()
    }

    fn rule(mut self, name: &str, exts: &[&str], kind: Kind) -> Self {
        self.rules.push(Rule {
            name: name.to_owned(),
            exts: exts.iter().map(|e| e.to_ascii_lowercase()).collect(),
            kind,
            optional: false,
        });
        self
    }

    /// `name` decoded from the first of `exts` by `recipe` (an image, audio or video recipe;
    /// its augmentation seeded per epoch and by `SHARD/KEY.EXT`).
    pub fn decode(self, name: &str, exts: &[&str], recipe: Recipe) -> Self {
        self.rule(name, exts, Kind::Decode(recipe))
    }

    /// `name` as an integer label read from `ext`'s text (WebDataset's `cls`).
    pub fn label(self, name: &str, ext: &str) -> Self {
        self.rule(name, &[ext], Kind::Label)
    }

    /// `name` as the UTF-8 text of `ext` (`txt`, `json`: kept as text).
    pub fn text(self, name: &str, ext: &str) -> Self {
        self.rule(name, &[ext], Kind::Text)
    }

    /// Makes the rule added last optional: a sample without it has no such field.
    pub fn optional(mut self) -> Self {
        if let Some(r) = self.rules.last_mut() {
            r.optional = true;
        }
        self
    }

    /// Reads the sample at `r` and makes it a [`Sample`].
    pub fn read(&self, r: &SampleRef) -> Result<Sample, ShardError> {
        self.apply(r.read()?)
    }

    /// Makes the fields of `raw` a [`Sample`].
    pub fn apply(&self, mut raw: RawSample) -> Result<Sample, ShardError> {
        let has = raw.extensions().join(", ");
        let mut sample = Sample::new();
        for rule in &self.rules {
            let (ext, bytes) = match raw.take_required(&rule.exts) {
                Ok(f) => f,
                Err(_) if rule.optional => continue,
                Err(ShardError::Missing {
                    shard, key, wanted, ..
                }) => {
                    // Name every field the sample came with, not only those left.
                    return Err(ShardError::Missing {
                        shard,
                        key,
                        wanted,
                        has: if has.is_empty() {
                            "nothing".into()
                        } else {
                            has
                        },
                    });
                }
                Err(e) => return Err(e),
            };
            sample = match &rule.kind {
                Kind::Decode(recipe) => {
                    let path = raw.field_path(&ext);
                    let t = recipe
                        .for_epoch(raw.epoch)
                        .decode(crate::blob::Blob { path, bytes })?;
                    sample.with(&rule.name, t)
                }
                Kind::Label => {
                    let v = raw.parse_label(ext, &bytes)?;
                    sample.with(&rule.name, v)
                }
                Kind::Text => {
                    let text = String::from_utf8(bytes).map_err(|e| ShardError::Field {
                        shard: raw.shard.clone(),
                        key: raw.key.clone(),
                        ext: ext.clone(),
                        reason: format!("not UTF-8 text ({e})"),
                    })?;
                    sample.with(&rule.name, text)
                }
            };
        }
        Ok(sample)
    }
}
