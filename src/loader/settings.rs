//! [`LoaderSettings`]: a loader's settings as plain data, with their named defaults and their
//! one check, which every front end fills: the Python loaders deserialize their keywords into
//! it, a pipeline file's tables become it ([`PipelineSpec::loader_settings`](crate::spec)),
//! and a Rust program may deserialize or fill it. [`LoaderSettings::builder`] turns it, a
//! source and the media's arguments into a [`LoaderBuilder`], so the way settings become a
//! loader is written once.

use flowgate_actors::emit::Order;
use flowgate_actors::failure::FailureBudget;
use flowgate_actors::node::CpuBudget;
use serde::{Deserialize, Serialize};

use super::builder::LoaderBuilder;
#[cfg(doc)]
use super::builder::{DEFAULT_BATCH_SIZE, DEFAULT_VIDEO_BATCH_SIZE};
use super::lengths::DEFAULT_BUCKETS;
use crate::dataset::{Dataset, DatasetBuilder, EpochOrder, Ranks, Source};
use crate::media::{MediaArgs, Recipe, RecipeError};
use flowgate_actors::limits::{self, OutOfRange};

const fn default_true() -> bool {
    true
}
const fn default_buckets() -> usize {
    DEFAULT_BUCKETS
}

/// The order items are batched in (see [`LoaderBuilder::order`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OrderName {
    /// The epoch's order: the same seed gives the same batches on every run. The default.
    #[default]
    Input,
    /// As items finish decoding: the last few percent of throughput, not repeatable.
    Completion,
}

impl From<OrderName> for Order {
    fn from(o: OrderName) -> Self {
        match o {
            OrderName::Input => Order::Input,
            OrderName::Completion => Order::Completion,
        }
    }
}

/// A loader's settings: what to read of the dataset (shuffle, seed, ranks), how to batch it,
/// what failures do, and the budgets. Every field has a default (`{}` is a valid setting),
/// and unknown keys are refused.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoaderSettings {
    /// Items per batch, in 1..=65,536 ([`limits::BATCH_SIZE`]). Default (`None`): the media's,
    /// [`DEFAULT_BATCH_SIZE`], or [`DEFAULT_VIDEO_BATCH_SIZE`] clips for video (a clip holds
    /// many frames), as every front end has it. Length-aware batches are sized by their cap
    /// instead.
    #[serde(default, deserialize_with = "limits::whole::batch_size_or_none")]
    pub batch_size: Option<usize>,
    /// A new order every epoch, from `seed` (default on).
    #[serde(default = "default_true")]
    pub shuffle: bool,
    /// The seed of the order and of the augmentation (default 0).
    #[serde(default)]
    pub seed: u64,
    /// This process's rank; with `world_size`, or neither (then `RANK`/`WORLD_SIZE`).
    #[serde(default)]
    pub rank: Option<usize>,
    /// How many ranks share the dataset.
    #[serde(default)]
    pub world_size: Option<usize>,
    /// Drops each rank's last partial batch (and cuts ranks to equal whole batches).
    #[serde(default)]
    pub drop_last: bool,
    /// The order of items in batches.
    #[serde(default)]
    pub order: OrderName,
    /// Fixed decode workers, in 1..=1,024 ([`limits::WORKERS`]); default: tuned.
    #[serde(default, deserialize_with = "limits::whole::workers_or_none")]
    pub workers: Option<usize>,
    /// Skip and count unreadable items (default) or end the epoch at the first.
    #[serde(default = "default_true")]
    pub skip_errors: bool,
    /// Make up the batches skipped items cost; default: on under a world size above 1.
    #[serde(default)]
    pub fill_skipped: Option<bool>,
    /// A hard memory budget in MiB ([`limits::MEMORY_MB`]); default: half of what the host
    /// or the process's container leaves.
    #[serde(default, deserialize_with = "limits::float_or_name")]
    pub memory_mb: Option<f64>,
    /// Cores shared with the node's other loaders: a number, a fraction or `"40%"`.
    #[serde(default)]
    pub cpu_budget: Option<CpuBudget>,
    /// Length-aware audio batches of at most this many padded seconds each.
    #[serde(default, deserialize_with = "limits::float_or_name")]
    pub max_batch_seconds: Option<f64>,
    /// Length-aware video batches of at most this many padded frames each.
    #[serde(default)]
    pub max_batch_frames: Option<usize>,
    /// Length buckets of length-aware batches ([`limits::BUCKETS`]). Default [`DEFAULT_BUCKETS`].
    #[serde(
        default = "default_buckets",
        deserialize_with = "limits::whole::buckets"
    )]
    pub buckets: usize,
    /// Each clip's real length as a second field (audio and video).
    #[serde(default)]
    pub return_lengths: bool,
}

impl Default for LoaderSettings {
    fn default() -> Self {
        Self {
            batch_size: None,
            shuffle: true,
            seed: 0,
            rank: None,
            world_size: None,
            drop_last: false,
            order: OrderName::Input,
            workers: None,
            skip_errors: true,
            fill_skipped: None,
            memory_mb: None,
            cpu_budget: None,
            max_batch_seconds: None,
            max_batch_frames: None,
            buckets: DEFAULT_BUCKETS,
            return_lengths: false,
        }
    }
}

/// Settings no loader can be built with: a number out of its range, a recipe that cannot
/// decode, or settings that contradict each other; each names the key.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SettingsError {
    /// A number out of its range.
    #[error(transparent)]
    Range(#[from] OutOfRange),
    /// The media's arguments.
    #[error(transparent)]
    Recipe(#[from] RecipeError),
    /// Settings that do not go together.
    #[error("{0}")]
    Conflict(String),
}

impl LoaderSettings {
    /// Settings from JSON-like data (a Python dict, a JSON object), every key checked: an
    /// error names the key (`batch_size: must be in 1..=65536, not "x"`).
    pub fn from_value(v: serde_json::Value) -> Result<Self, String> {
        crate::media::args::keyed(v)
    }

    /// Checks every number against its limit and the settings against each other: what a
    /// loader built from them would refuse, in the same words in every front end.
    pub fn check(&self) -> Result<(), SettingsError> {
        if let Some(b) = self.batch_size {
            limits::BATCH_SIZE.check_usize(b)?;
        }
        if let Some(w) = self.workers {
            limits::WORKERS.check_usize(w)?;
        }
        if let Some(m) = self.memory_mb {
            limits::MEMORY_MB.bytes(m)?;
        }
        limits::BUCKETS.check_usize(self.buckets)?;
        self.ranks()?;
        if let Some(s) = self.max_batch_seconds {
            limits::batch_seconds(s)?;
        }
        if self.max_batch_seconds.is_some() && self.max_batch_frames.is_some() {
            return Err(SettingsError::Conflict(
                "max_batch_seconds (audio) and max_batch_frames (video): give one".into(),
            ));
        }
        Ok(())
    }

    /// The ranks the settings name: both `rank` and `world_size`, or neither (the
    /// environment's).
    pub fn ranks(&self) -> Result<Ranks, SettingsError> {
        match (self.rank, self.world_size) {
            (Some(_), Some(0)) => Err(OutOfRange {
                key: "world_size",
                message: "must be at least 1, not 0".into(),
            }
            .into()),
            (Some(rank), Some(world)) if rank >= world => Err(OutOfRange {
                key: "rank",
                message: format!("must be in 0..{world} (below world_size={world}), not {rank}"),
            }
            .into()),
            (Some(rank), Some(world)) => Ok(Ranks::Fixed { rank, world }),
            (None, None) => Ok(Ranks::FromEnv),
            _ => Err(SettingsError::Conflict(
                "give both rank and world_size, or neither".into(),
            )),
        }
    }

    /// The cap of length-aware batches, when the settings ask for them: padded seconds of
    /// audio or padded frames of video.
    pub fn length_cap(&self) -> Option<f64> {
        self.max_batch_seconds
            .or(self.max_batch_frames.map(|f| f as f64))
    }

    /// The recipe `media` asks for under these settings (their length cap; seeded with
    /// `media`'s seed, else the settings').
    pub fn recipe(&self, media: &MediaArgs) -> Result<Recipe, SettingsError> {
        self.check()?;
        Ok(media.recipe(self.length_cap(), self.seed)?)
    }

    /// The recipe of a field decoded as media ([`fields_and_media`](super::fields_and_media)),
    /// seeded as the media's; refused with length-aware batches (a batch is planned by its
    /// media's lengths alone), before its own arguments are read.
    pub fn field_recipe(&self, field: &super::MediaFieldArgs) -> Result<Recipe, SettingsError> {
        self.check()?;
        if self.length_cap().is_some() {
            return Err(SettingsError::Conflict(format!(
                "fields: {:?}: media fields are not for length-aware batches (a batch is \
                 planned by its media's lengths alone)",
                field.name
            )));
        }
        field
            .media
            .recipe(None, self.seed)
            .map_err(|e| SettingsError::Conflict(format!("fields: {:?}: {e}", field.name)))
    }

    /// The order these settings give a dataset's epochs: the shuffle, the ranks, equal counts.
    pub fn epoch_order(&self) -> Result<EpochOrder, SettingsError> {
        self.check()?;
        Ok(EpochOrder {
            seed: self.shuffle.then_some(self.seed),
            ranks: self.ranks()?,
            drop_last: self.drop_last,
            split: None,
        })
    }

    /// The dataset of `source` these settings read with `recipe`: its extensions, the shuffle
    /// and the ranks (build it, off the caller's locks: opening reads listings and footers).
    pub fn dataset(
        &self,
        source: Source,
        recipe: &Recipe,
    ) -> Result<DatasetBuilder, SettingsError> {
        // Refused before the source is opened (on S3: listed, its manifests read).
        if self.length_cap().is_some() && source.reads_from_s3() {
            return Err(SettingsError::Conflict(
                "length-aware batches read each clip's declared length before the first \
                 epoch: local files, tar shards or Parquet, not S3 nor a mixture"
                    .into(),
            ));
        }
        Ok(Dataset::builder(source)
            .extensions(recipe.extensions())
            .shuffle_seed(self.shuffle.then_some(self.seed))
            .ranks_from(self.ranks()?)
            .drop_last(self.drop_last))
    }

    /// A loader of `dataset` decoded by `recipe` (both from these settings, see
    /// [`recipe`](Self::recipe) and [`dataset`](Self::dataset)), with every setting applied;
    /// `media`'s extras (a video's audio track) too.
    pub fn builder(
        &self,
        dataset: Dataset,
        recipe: Recipe,
        media: &MediaArgs,
    ) -> Result<LoaderBuilder, SettingsError> {
        self.check()?;
        let mut b = crate::loader::Loader::builder(dataset, recipe)
            .batch_size(
                self.batch_size
                    .unwrap_or_else(|| super::builder::default_batch_size(media)),
            )
            .drop_last(self.drop_last)
            .order(self.order.into())
            .max_failures(FailureBudget::skip_errors(self.skip_errors));
        if let Some(n) = self.workers {
            b = b.workers(n);
        }
        // Not given: the library's default (on under a world size above 1).
        if let Some(f) = self.fill_skipped {
            b = b.fill_skipped(f);
        }
        if let Some(m) = self.memory_mb {
            b = b.memory_budget(limits::MEMORY_MB.bytes(m)?);
        }
        if let Some(c) = self.cpu_budget {
            b = b.cpu_budget(c);
        }
        b = match self.length_cap() {
            Some(cap) => b.length_batches(cap, self.buckets),
            None => b.lengths(self.return_lengths),
        };
        #[cfg(all(feature = "video", feature = "audio"))]
        if let Some(track) = media.audio_track()? {
            b = b.audio_track(track);
        }
        #[cfg(not(all(feature = "video", feature = "audio")))]
        let _ = media;
        Ok(b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[cfg(feature = "image")]
    #[test]
    fn a_media_field_is_refused_with_length_batches_before_its_arguments_are_read() {
        let (_, media) = crate::loader::fields_and_media(json!({
            "depth": {"from": "depth.png", "kind": "image", "crop": 8, "resize": 16}
        }))
        .unwrap();
        let plain = LoaderSettings::from_value(json!({})).unwrap();
        plain.field_recipe(&media[0]).unwrap();
        for cap in [
            json!({"max_batch_seconds": 10}),
            json!({"max_batch_frames": 64}),
        ] {
            let s = LoaderSettings::from_value(cap).unwrap();
            let e = s.field_recipe(&media[0]).unwrap_err().to_string();
            assert!(
                e.contains("\"depth\": media fields are not for length-aware"),
                "{e}"
            );
        }
        let (_, bad) = crate::loader::fields_and_media(json!({
            "depth": {"from": "depth.png", "kind": "image", "crop": 0}
        }))
        .unwrap();
        let e = plain.field_recipe(&bad[0]).unwrap_err().to_string();
        assert!(
            e.starts_with("fields: \"depth\": ") && e.contains("crop"),
            "{e}"
        );
    }

    #[test]
    fn a_map_style_datasets_positions_are_dealt_as_the_settings_say() {
        let shares = |drop_last: bool| -> Vec<Vec<usize>> {
            (0..3)
                .map(|rank| {
                    let s = LoaderSettings::from_value(json!({
                        "rank": rank, "world_size": 3, "seed": 9, "drop_last": drop_last
                    }))
                    .unwrap();
                    let sampler = s.epoch_order().unwrap().sampler(10).unwrap();
                    sampler.epoch(0)
                })
                .collect()
        };
        let padded = shares(false);
        assert!(padded.iter().all(|s| s.len() == 4), "{padded:?}");
        let all: std::collections::BTreeSet<usize> = padded.iter().flatten().copied().collect();
        assert_eq!(
            all.len(),
            10,
            "every position, padded by repeats: {padded:?}"
        );
        let dropped = shares(true);
        assert!(dropped.iter().all(|s| s.len() == 3), "{dropped:?}");
        let once: Vec<usize> = dropped.iter().flatten().copied().collect();
        let unique: std::collections::BTreeSet<usize> = once.iter().copied().collect();
        assert_eq!(once.len(), unique.len(), "nothing twice");
        let e = LoaderSettings::from_value(json!({"rank": 0, "world_size": 0}))
            .unwrap()
            .epoch_order()
            .unwrap_err();
        assert_eq!(e.to_string(), "world_size: must be at least 1, not 0");
    }

    #[test]
    fn an_empty_setting_is_every_default() {
        let s = LoaderSettings::from_value(json!({})).unwrap();
        assert_eq!(s, LoaderSettings::default());
        assert!(s.check().is_ok());
    }

    #[test]
    fn errors_name_the_key() {
        let e = LoaderSettings::from_value(json!({"batch_size": "many"})).unwrap_err();
        assert_eq!(e, "batch_size: must be in 1..=65536, not \"many\"");
        let e = LoaderSettings::from_value(json!({"batch_sise": 3})).unwrap_err();
        assert!(e.contains("unknown field `batch_sise`"), "{e}");
        let e = LoaderSettings::from_value(json!({"cpu_budget": true})).unwrap_err();
        assert!(e.starts_with("cpu_budget:"), "{e}");
        let s = LoaderSettings::from_value(json!({"batch_size": 65537})).unwrap();
        assert_eq!(
            s.check().unwrap_err().to_string(),
            "batch_size: must be in 1..=65536, not 65537"
        );
        let s = LoaderSettings::from_value(json!({"workers": 1025, "buckets": 2})).unwrap();
        assert_eq!(
            s.check().unwrap_err().to_string(),
            "workers: must be in 1..=1024, not 1025"
        );
        let s = LoaderSettings::from_value(json!({"rank": 3, "world_size": 3})).unwrap();
        assert_eq!(
            s.check().unwrap_err().to_string(),
            "rank: must be in 0..3 (below world_size=3), not 3"
        );
        let s = LoaderSettings::from_value(json!({"rank": 2, "world_size": 3})).unwrap();
        assert!(s.check().is_ok(), "the last rank");
        let s = LoaderSettings::from_value(json!({"memory_mb": "inf"})).unwrap();
        assert_eq!(
            s.check().unwrap_err().to_string(),
            "memory_mb: must be in (0, 16777216] (MiB), not inf"
        );
        let e = LoaderSettings::from_value(json!({"memory_mb": "lots"})).unwrap_err();
        assert!(e.starts_with("memory_mb: "), "{e}");
        let s = LoaderSettings::from_value(json!({"memory_mb": 0.0})).unwrap();
        assert!(s
            .check()
            .unwrap_err()
            .to_string()
            .starts_with("memory_mb: must be in"));
        let s = LoaderSettings::from_value(json!({"buckets": 0})).unwrap();
        assert_eq!(
            s.check().unwrap_err().to_string(),
            "buckets: must be in 1..=1000, not 0"
        );
        let s = LoaderSettings::from_value(json!({"rank": 1})).unwrap();
        assert!(s.check().unwrap_err().to_string().contains("world_size"));
        let s = LoaderSettings::from_value(json!({"max_batch_seconds": -1.0})).unwrap();
        assert!(s
            .check()
            .unwrap_err()
            .to_string()
            .starts_with("max_batch_seconds"));
    }

    #[test]
    fn cpu_budgets_read_as_in_pipeline_files() {
        let s = |v| LoaderSettings::from_value(json!({ "cpu_budget": v })).map(|s| s.cpu_budget);
        assert_eq!(s(json!(2)), Ok(Some(CpuBudget::Cores(2))));
        assert_eq!(s(json!(0.5)), Ok(Some(CpuBudget::Fraction(0.5))));
        assert_eq!(s(json!("50%")), Ok(Some(CpuBudget::Fraction(0.5))));
        assert!(s(json!(-1)).is_err());
    }

    #[cfg(feature = "audio")]
    #[test]
    fn the_length_cap_is_the_audio_window() {
        let s = LoaderSettings {
            max_batch_seconds: Some(3.0),
            ..LoaderSettings::default()
        };
        let media = MediaArgs::Audio(crate::media::args::AudioArgs::default());
        let r = s.recipe(&media).unwrap();
        assert_eq!(r.as_audio().unwrap().samples, 48_000);
    }
}
