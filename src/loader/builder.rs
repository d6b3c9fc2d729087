//! [`LoaderBuilder`]: a dataset, a recipe and the loader's settings with their defaults;
//! `assemble` checks them when the loader is built and folds them into the one function that
//! builds a loader's pipeline, which the [`Loader`](super::Loader) calls again whenever it starts a pipeline
//! afresh.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use flowgate_actors::emit::Order;
use flowgate_actors::error::{BoxError, ItemError};
use flowgate_actors::failure::FailureBudget;
use flowgate_actors::node::CpuBudget;
use flowgate_actors::tuner::{TraceRecord, TunerSettings};

use super::decode::Decoder;
use super::device::Device;
use super::lengths::LengthCap;
use crate::dataset::Dataset;
use crate::engine::stats::{MemoryBudget, PipelineStats};
use crate::media::Recipe;

/// Items per batch by default.
pub const DEFAULT_BATCH_SIZE: usize = 32;

/// Clips per batch by default for video: a clip is `frames` pictures, so 8 clips of 8 frames
/// hold twice the pixels of [`DEFAULT_BATCH_SIZE`] images at the default crops (112² against
/// 224²) — a training step's worth, not four.
pub const DEFAULT_VIDEO_BATCH_SIZE: usize = 8;

/// The default batch size for `media`: [`DEFAULT_VIDEO_BATCH_SIZE`] for video, else
/// [`DEFAULT_BATCH_SIZE`].
pub fn default_batch_size(media: &crate::media::MediaArgs) -> usize {
    match media {
        crate::media::MediaArgs::Video(_) => DEFAULT_VIDEO_BATCH_SIZE,
        _ => DEFAULT_BATCH_SIZE,
    }
}

/// The order of items by default: the dataset's epoch order, so the same seed gives the same
/// batches in the same order on every run (a slow or failed item holds back at most the
/// stages' reorder windows, which their budgets bound). [`Order::Completion`] is the
/// opt-in for the last few percent of throughput where repeatability does not matter.
pub const DEFAULT_ORDER: Order = Order::Input;

/// Called with every tuner tick that changed something (shared by every pipeline a loader
/// builds).
type DecisionHook = Arc<Mutex<dyn FnMut(&TraceRecord) + Send>>;
/// Called with statistics every interval.
type StatsHook = (Duration, Arc<Mutex<dyn FnMut(&PipelineStats) + Send>>);
/// Called with every failed item, skipped or not.
type FailureHook = Arc<dyn Fn(&ItemError) + Send + Sync>;

/// Builds a [`Loader`](super::Loader): [`Loader::builder`](super::Loader::builder). Every setting has a default.
///
/// # Examples
///
/// ```no_run
/// # #[cfg(feature = "image")] {
/// use flowgate::dataset::{Dataset, Labels, Source};
/// use flowgate::loader::Loader;
/// use flowgate::media::{image::ImageRecipe, Recipe};
///
/// let recipe = Recipe::image(ImageRecipe::train(224))?.with_seed(7);
/// let dataset = Dataset::builder(Source::dir("data/train").labels(Labels::Folder))
///     .extensions(recipe.extensions())
///     .shuffle(7)
///     .build()?;
/// let mut loader = Loader::builder(dataset, recipe).batch_size(64).build()?;
/// for batch in loader.epoch()? {
///     let batch = batch?; // batch.fields[0]: [64, 3, 224, 224] u8; batch.labels: [64] i64
/// #   let _ = batch;
/// }
/// # }
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct LoaderBuilder {
    pub(super) dataset: Dataset,
    pub(super) decoder: Decoder,
    pub(super) batch_size: usize,
    pub(super) drop_last: bool,
    /// `None`: on when the dataset is dealt to more than one rank.
    pub(super) fill_skipped: Option<bool>,
    /// Decodes units of another loader's plan: no batch is dropped here.
    pub(super) units: bool,
    /// Its epochs will be cut into units decoded elsewhere: what units cannot carry is
    /// refused when it is built.
    pub(super) plans_units: bool,
    /// `(r, n)`: reads reader `r`'s part of each epoch split among `n` readers.
    pub(super) reader: Option<(usize, usize)>,
    pub(super) workers: Option<usize>,
    pub(super) failures: FailureBudget,
    pub(super) memory_bytes: Option<u64>,
    pub(super) device: Option<Device>,
    pub(super) lengths: Option<LengthCap>,
    pub(super) tuner: Option<TunerSettings>,
    pub(super) on_decision: Option<DecisionHook>,
    pub(super) on_stats: Option<StatsHook>,
    pub(super) on_failure: Option<FailureHook>,
    pub(super) cache: Option<crate::byte_cache::ByteCache>,
    pub(super) order: Order,
    pub(super) checkpoint_fields: Vec<(String, String)>,
    pub(super) cpu_budget: Option<CpuBudget>,
    pub(super) map: Option<(String, super::MapItems)>,
    /// Fields the per-item function adds (after the dataset's).
    pub(super) map_fields: Vec<String>,
    pub(super) map_batches: Option<(String, super::MapBatches)>,
}

impl std::fmt::Debug for LoaderBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoaderBuilder")
            .field("dataset", &self.dataset)
            .field("batch_size", &self.batch_size)
            .field("drop_last", &self.drop_last)
            .field("fill_skipped", &self.fill_skipped)
            .field("workers", &self.workers)
            .field("memory_bytes", &self.memory_bytes)
            .field("device", &self.device)
            .field("order", &self.order)
            .finish_non_exhaustive()
    }
}

impl LoaderBuilder {
    pub(super) fn new(dataset: Dataset, recipe: Recipe) -> Self {
        // The media's batch size, as every front end's default: fewer clips of video.
        #[cfg(feature = "video")]
        let batch_size = match recipe.as_video() {
            Some(_) => DEFAULT_VIDEO_BATCH_SIZE,
            None => DEFAULT_BATCH_SIZE,
        };
        #[cfg(not(feature = "video"))]
        let batch_size = DEFAULT_BATCH_SIZE;
        Self {
            dataset,
            decoder: Decoder {
                recipe,
                lengths: false,
                #[cfg(all(feature = "video", feature = "audio"))]
                audio_track: None,
                media_fields: Vec::new(),
            },
            batch_size,
            drop_last: false,
            fill_skipped: None,
            units: false,
            plans_units: false,
            reader: None,
            workers: None,
            failures: FailureBudget::unlimited(),
            memory_bytes: None,
            device: None,
            lengths: None,
            tuner: Some(TunerSettings::default()),
            on_decision: None,
            on_stats: None,
            on_failure: None,
            cache: None,
            order: DEFAULT_ORDER,
            checkpoint_fields: Vec::new(),
            cpu_budget: None,
            map: None,
            map_fields: Vec::new(),
            map_batches: None,
        }
    }

    /// Items per batch (default [`DEFAULT_BATCH_SIZE`], [`DEFAULT_VIDEO_BATCH_SIZE`] clips for
    /// video; at least 1). With length-aware
    /// batches the cap decides instead.
    pub fn batch_size(mut self, n: usize) -> Self {
        self.batch_size = n;
        self
    }

    /// The order items are batched and delivered in (default [`DEFAULT_ORDER`]: the epoch's
    /// order, repeatable run after run).
    pub fn order(mut self, order: Order) -> Self {
        self.order = order;
        self
    }

    /// Drops the last batch of an epoch when it is short (default: delivered short).
    pub fn drop_last(mut self, drop: bool) -> Self {
        self.drop_last = drop;
        self
    }

    /// Keeps the epoch's batch count when items are skipped as unreadable. Default: on when
    /// the dataset is dealt to more than one rank (a world size above 1: a rank that ended
    /// its epoch a batch short would leave its peers waiting at their last collective), off
    /// for one process (where a skipped item simply makes the epoch shorter). After
    /// the epoch's last batch, the batches the skips cost are made up from the epoch's items
    /// read again, the first delivered ones first (as ranks' uneven shares are padded), so
    /// every rank of a world makes [`Loader::len`](super::Loader::len) batches and a training loop with a
    /// collective per step (DDP) never waits on a rank that ended early. The items read
    /// again are counted ([`Loader::filled`](super::Loader::filled)). A checkpoint records the batches still owed
    /// ([`PipelineState::owed_batches`](crate::PipelineState::owed_batches)), so a resume
    /// makes the uninterrupted epoch's count and batches. Length-aware batches keep their
    /// count anyway (a skipped clip leaves its batch short), and a loader decoding units
    /// fills nothing (its consumer regroups the rows).
    pub fn fill_skipped(mut self, fill: bool) -> Self {
        self.fill_skipped = Some(fill);
        self
    }

    /// Makes a loader that decodes units of another loader's
    /// [`EpochPlan`](super::EpochPlan) (resuming [`unit_state`](super::EpochPlan::unit_state)s):
    /// with [`drop_last`](Self::drop_last) a unit's batch left short by a skipped item is
    /// delivered, not dropped (the plan has cut the epoch's tail already). Every other
    /// setting, and the checkpoint's fingerprint, stay the planning loader's. A unit whose
    /// items all fail ends without batches, not with the error an epoch that delivered nothing
    /// ends with (the consumer of the units decides that for the epoch).
    pub fn decodes_units(mut self) -> Self {
        self.units = true;
        self
    }

    /// Says that this loader's epochs will be cut into units decoded elsewhere
    /// ([`Loader::plan_units`](super::Loader::plan_units), Python's `remote=`), so what units
    /// cannot carry (a sample's other fields, a per-item or per-batch function, a device) is
    /// refused when it is built, not at its first epoch. `plan_units` refuses them anyway.
    pub fn plans_units(mut self) -> Self {
        self.plans_units = true;
        self
    }

    /// Reads one part of each epoch of this rank, split among `readers` loaders built alike
    /// (PyTorch `DataLoader` workers): reader `reader` gets the rank's batches `reader`,
    /// `reader + readers`, … — the same items, augmentation and (in input order) batches as
    /// the whole loader gives under those numbers, so readers taken in turn give the whole
    /// loader's batches in its order, and their [`len`](super::Loader::len)s add up to its. A
    /// resumed state ([`Loader::resume`](super::Loader::resume) with the rank's state) is split the same way: the
    /// readers read the rank's rest. An item skipped as unreadable leaves its reader's last
    /// batch short, and the reader keeps it, also with `drop_last` (which drops the rank's
    /// partial last batch from the plan): a reader's part may hold fewer readable items than a
    /// batch while its rank has plenty. A reader ends short of its part's batches only when
    /// its readable items fill fewer; with [`fill_skipped`](Self::fill_skipped) it makes them
    /// up (from its own items, or if all of them failed from the rank's others), and a rank's
    /// `fill_skipped` state is resumed with the rank's
    /// count (each reader runs the rank's rest and keeps its own batches: the decoding of that
    /// rest in every reader, for that one epoch; the rank's batches too, but where the rank
    /// would drop a short batch and make up a whole one, the reader keeps the short one). A
    /// reader's own checkpoint covers only its part. Default: the whole epoch (one reader).
    pub fn reader(mut self, reader: usize, readers: usize) -> Self {
        self.reader = Some((reader, readers));
        self
    }

    /// Decode workers, fixed: the tuner does not change them (default: tuned, starting at
    /// this process's share of the cores).
    pub fn workers(mut self, n: usize) -> Self {
        self.workers = Some(n);
        self
    }

    /// What failing items do (default [`FailureBudget::unlimited`]: skipped, counted and
    /// listed by [`Loader::failures`](super::Loader::failures); [`FailureBudget::fail_fast`]: the first ends the
    /// epoch with its error).
    pub fn max_failures(mut self, budget: FailureBudget) -> Self {
        self.failures = budget;
        self
    }

    /// A hard memory budget for everything the pipeline holds (default: half the available
    /// memory; see [`PipelineBuilder::memory_budget`](crate::PipelineBuilder::memory_budget)).
    pub fn memory_budget(mut self, bytes: u64) -> Self {
        self.memory_bytes = Some(bytes);
        self
    }

    /// Uploads every batch to `device` (default: batches stay in host memory).
    pub fn device(mut self, device: Device) -> Self {
        self.device = Some(device);
        self
    }

    /// Gives each item's real length as a second field (`[B]`, `i64`): audio samples before
    /// padding, video frames taken. Audio and video recipes only.
    pub fn lengths(mut self, on: bool) -> Self {
        self.decoder.lengths = on;
        self
    }

    /// Runs `f` on every decoded item, on a stage of its own named `stage` after the decode
    /// stage (tokenizing a caption, an augmentation the recipe lacks, a feature computed
    /// from the media): its workers are sized by the tuner like the decode stage's, it
    /// appears in [`stats`](super::Loader::stats) under its name, and the memory budget
    /// counts the items it holds. An error (or a panic) is that item's failure in the stage:
    /// skipped and counted, or fatal, as the failure budget says. For a checkpoint to resume
    /// to the same items, `f` must be a pure function of the sample: what it draws at random
    /// seeded by the sample's index and epoch (`sample.meta`). Not with length-aware batches
    /// (their items are whole batches).
    pub fn map_items(
        mut self,
        stage: &str,
        f: impl Fn(super::Sample) -> Result<super::Sample, BoxError> + Send + Sync + 'static,
    ) -> Self {
        self.map = Some((stage.to_owned(), Arc::new(f)));
        self
    }

    /// Fields the per-item function adds to each item, after the dataset's
    /// ([`Batch::field`](super::Batch::field) gives them by name): each item reaches the
    /// function with them [`Missing`](crate::dataset::FieldValue::Missing) at the end of
    /// `sample.meta.extras`, for it to set (tokenizing a caption into a field of its own).
    pub fn map_fields(mut self, names: impl IntoIterator<Item = impl Into<String>>) -> Self {
        self.map_fields = names.into_iter().map(Into::into).collect();
        self
    }

    /// [`map_items`](Self::map_items) with a function already shared (`None`: no stage).
    pub fn map_items_shared(mut self, stage: &str, f: Option<super::MapItems>) -> Self {
        self.map = f.map(|f| (stage.to_owned(), f));
        self
    }

    /// Runs `f` on every collated batch, on a stage of its own named `stage` after collation
    /// (and before the upload to a device): tokenizing a batch's captions at once and padding
    /// them to its longest, a mixup, a feature computed over the batch. Like
    /// [`map_items`](Self::map_items)' stage, its workers are sized by the tuner, it appears
    /// in [`stats`](super::Loader::stats) under its name, the memory budget counts the
    /// batches it holds, and an error (or a panic) is the failure of the batch's items
    /// (skipped and counted, or fatal). `f` may replace, add and rename tensors
    /// ([`Batch::names`]; each has the batch's rows as its first dimension) and fields
    /// ([`Batch::extra_names`]; a value per row), and change the labels; the rows stay the
    /// loader's: the same items in the same order (a checkpoint counts them). For a resume to
    /// give the same batches, `f` must be a pure function of the batch, what it draws seeded
    /// by its rows' indices and epoch.
    pub fn map_batches(
        mut self,
        stage: &str,
        f: impl Fn(super::Batch) -> Result<super::Batch, BoxError> + Send + Sync + 'static,
    ) -> Self {
        self.map_batches = Some((stage.to_owned(), Arc::new(f)));
        self
    }

    /// [`map_batches`](Self::map_batches) with a function already shared (`None`: no stage).
    pub fn map_batches_shared(mut self, stage: &str, f: Option<super::MapBatches>) -> Self {
        self.map_batches = f.map(|f| (stage.to_owned(), f));
        self
    }

    /// Length-aware batches: the dataset's clips (local files, tar shards or Parquet) planned by the lengths
    /// their containers declare (read once, when the loader is built) into batches of similar
    /// lengths, each at most `cap` padded
    /// units (audio: seconds, video: frames), over `buckets` length buckets; each batch padded
    /// to its longest clip, with the lengths as a second field. A clip longer than the
    /// recipe's window is cropped to it (give an audio recipe a window of `cap` seconds).
    pub fn length_batches(mut self, cap: f64, buckets: usize) -> Self {
        self.lengths = Some(LengthCap {
            cap,
            buckets: buckets.max(1),
        });
        self
    }

    /// A video recipe's audio track, decoded from the same file as a second field.
    #[cfg(all(feature = "video", feature = "audio"))]
    pub fn audio_track(mut self, recipe: crate::media::audio::AudioRecipe) -> Self {
        self.decoder.audio_track = Some(recipe);
        self
    }

    /// Decodes the dataset's field `name` (a required [`Bytes`](crate::dataset::FieldKind::Bytes)
    /// field: a tar member, a file beside a loose file, a column) with `recipe` into a tensor
    /// of its own named `name`, after the media's ([`Batch::names`](super::Batch::names)): a
    /// sample's second image, a clip's own audio file. Its augmentation draws for itself (a
    /// random crop of its own). A sample whose field does not decode is a failed item. Not
    /// with length-aware batches. See [`fields_and_media`](super::fields_and_media) for the
    /// front ends' spelling.
    pub fn media_field(mut self, name: &str, recipe: Recipe) -> Self {
        self.decoder
            .media_fields
            .push(super::media_fields::MediaField {
                name: name.to_owned(),
                recipe,
                at: usize::MAX,
            });
        self
    }

    /// Tunes with these settings (default: tuned with [`TunerSettings::default`]).
    pub fn autotune(mut self, settings: TunerSettings) -> Self {
        self.tuner = Some(settings);
        self
    }

    /// Shares a CPU budget with the other ranks on this node (see
    /// [`node`](crate::actors::node)): at no instant do the node's ranks run more decode items
    /// than the budget has cores, and a rank whose consumer waits uses the cores the others
    /// leave idle. `CpuBudget::Cores(2)`, or `CpuBudget::Fraction(0.4)` of the node's cores.
    /// Default: none (each rank tunes within its share of the node's cores).
    pub fn cpu_budget(mut self, budget: CpuBudget) -> Self {
        self.cpu_budget = Some(budget);
        if let Some(t) = self.tuner.as_mut() {
            t.cpu_budget = Some(budget);
        }
        self
    }

    /// Turns the tuner off: the decode workers stay where they start.
    pub fn autotune_off(mut self) -> Self {
        self.tuner = None;
        self
    }

    /// Calls `f` for every tuner tick that changed something.
    pub fn on_tuner_decision(mut self, f: impl FnMut(&TraceRecord) + Send + 'static) -> Self {
        self.on_decision = Some(Arc::new(Mutex::new(f)));
        self
    }

    /// Calls `f` with the pipeline's statistics every `interval`.
    pub fn on_stats(
        mut self,
        interval: Duration,
        f: impl FnMut(&PipelineStats) + Send + 'static,
    ) -> Self {
        self.on_stats = Some((interval, Arc::new(Mutex::new(f))));
        self
    }

    /// Calls `f` with every failed item, skipped or not, as it happens.
    pub fn on_failure(mut self, f: impl Fn(&ItemError) + Send + Sync + 'static) -> Self {
        self.on_failure = Some(Arc::new(f));
        self
    }

    /// More settings a checkpoint of this loader is valid for (beside the dataset's and the
    /// batching's): a state taken with other values is refused on resume. Pipeline files
    /// record their augmentation seed this way.
    pub fn checkpoint_fields<K: Into<String>, V: ToString>(
        mut self,
        fields: impl IntoIterator<Item = (K, V)>,
    ) -> Self {
        self.checkpoint_fields
            .extend(fields.into_iter().map(|(k, v)| (k.into(), v.to_string())));
        self
    }

    /// Fetches S3 objects ([`Source::s3`](crate::dataset::Source::s3)) through `cache`: a
    /// later epoch reads what it holds instead of fetching again; the tuner resizes it
    /// within its bounds.
    pub fn cache(mut self, cache: crate::byte_cache::ByteCache) -> Self {
        self.cache = Some(cache);
        self
    }
}

impl LoaderBuilder {
    /// The bytes of one batch at most, when the recipe fixes its items' size: what the
    /// pipeline reserves for a batch in flight. Length-aware batches: the cap in the recipe's
    /// units (seconds of mono audio, frames).
    pub(super) fn batch_bytes(&self) -> Option<u64> {
        let mut item = self.decoder.recipe.item_bytes()?;
        for f in &self.decoder.media_fields {
            item += f.recipe.item_bytes()?;
        }
        let lengths = u64::from(self.decoder.lengths) * 8;
        match self.lengths {
            // An item is one clip window; the cap in clips of that window bounds a batch.
            Some(_) => None,
            None => Some((item + lengths).saturating_mul(self.batch_size as u64)),
        }
    }

    /// The names its batches' tensors will have as collated ([`Loader::tensor_names`](
    /// super::Loader::tensor_names)), before the loader is built (a front end names the
    /// keys of a per-item function's dict with them).
    pub fn tensor_names(&self) -> Vec<String> {
        self.decoder.tensor_names(self.lengths.is_some())
    }

    pub(super) fn function_stages(&self) -> FunctionStages {
        FunctionStages {
            items: self.map.is_some(),
            batches: self.map_batches.is_some(),
        }
    }

    /// The decode workers the loader may run: those set, else the cores it may use.
    pub(super) fn decoding(&self) -> usize {
        self.workers.unwrap_or_else(flowgate_actors::cap::cores)
    }

    /// The memory budget the pipeline will have, and where it comes from: the one set (the
    /// loader's, or the tuner's; the smaller), or with the tuner on the default (half of what
    /// the host or the process's cgroup leaves); none with the tuner off and none set.
    pub(super) fn memory_limit(&self) -> Option<MemoryBudget> {
        crate::engine::builder::memory_budget(self.memory_bytes, self.tuner.as_ref())
    }
}

/// What a loader's stages hold whatever their byte budgets, for batches of `batch` bytes
/// (`batch_size` items) and `decoding` decode workers: each stage admits one entry while it
/// has none and holds what its workers have in hand, so at least an item per decode worker
/// and one waiting, a batch's items while the aggregate assembles it, a batch list in the
/// collate stage's hand and one waiting, and a collated batch ready for the loop — four
/// batches and the decode stage's items (measured: `python/tests/test_flowgate.py::
/// test_memory_mb_binds_with_items_large_against_it` held 4 batches and an item under a
/// budget that reserved two). The budget reserves it, and one smaller is refused.
pub(super) fn stage_floors(
    batch: u64,
    batch_size: usize,
    decoding: usize,
    stages: &FunctionStages,
) -> u64 {
    let item = batch.div_ceil(batch_size.max(1) as u64);
    // A per-item function's stage admits an item while it has none and holds one in hand; a
    // per-batch function's, a batch waiting and one in hand (as the batches it was given:
    // what it makes of them is its own).
    let items = 2 * u64::from(stages.items);
    let batches = 2 * u64::from(stages.batches);
    (4 + batches) * batch + (decoding as u64 + 1 + items) * item
}

/// The user's function stages a loader runs (their floors in [`stage_floors`]).
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct FunctionStages {
    pub(super) items: bool,
    pub(super) batches: bool,
}
