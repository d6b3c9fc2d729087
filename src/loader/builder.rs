//! [`LoaderBuilder`]: a dataset, a recipe and the loader's settings, folded into the one
//! function that builds a loader's pipeline — source (the dataset's sampler) → decode (a
//! work-stealing pool, the recipe) → batch → collate (→ upload) — which the [`Loader`] calls
//! again whenever it starts a pipeline afresh.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::batch::{collate, Batch, Decoded, ItemMeta};
use super::decode::Decoder;
use super::device::Device;
use super::failures::FailureLog;
use super::lengths::{LengthCap, LengthPlan};
use super::{Loader, Plan};
use crate::dataset::Dataset;
use crate::device::Uploader;
use crate::media::Recipe;
use crate::{
    BoxError, FailureBudget, Order, Pipeline, PipelineError, PipelineStats, TraceRecord,
    TunerSettings, Workers,
};

/// Items per batch by default.
pub const DEFAULT_BATCH_SIZE: usize = 32;

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
type FailureHook = Arc<dyn Fn(&crate::ItemError) + Send + Sync>;

/// Builds a [`Loader`]: [`Loader::builder`]. Every setting has a default.
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
    dataset: Dataset,
    decoder: Decoder,
    batch_size: usize,
    drop_last: bool,
    fill_skipped: bool,
    /// Decodes units of another loader's plan: no batch is dropped here.
    units: bool,
    workers: Option<usize>,
    failures: FailureBudget,
    memory_bytes: Option<u64>,
    device: Option<Device>,
    lengths: Option<LengthCap>,
    tuner: Option<TunerSettings>,
    on_decision: Option<DecisionHook>,
    on_stats: Option<StatsHook>,
    on_failure: Option<FailureHook>,
    cache: Option<crate::cache::ByteCache>,
    order: Order,
    checkpoint_fields: Vec<(String, String)>,
    cpu_budget: Option<crate::CpuBudget>,
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
        Self {
            dataset,
            decoder: Decoder {
                recipe,
                lengths: false,
                #[cfg(all(feature = "video", feature = "audio"))]
                audio_track: None,
            },
            batch_size: DEFAULT_BATCH_SIZE,
            drop_last: false,
            fill_skipped: false,
            units: false,
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
        }
    }

    /// Items per batch (default [`DEFAULT_BATCH_SIZE`]; at least 1). With length-aware
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

    /// Keeps the epoch's batch count when items are skipped as unreadable (default: off, a
    /// rank with skipped items makes fewer batches when they cut into its last one): after
    /// the epoch's last batch, the batches the skips cost are made up from the epoch's items
    /// read again, the first delivered ones first (as ranks' uneven shares are padded), so
    /// every rank of a world makes [`Loader::len`] batches and a training loop with a
    /// collective per step (DDP) never waits on a rank that ended early. The items read
    /// again are counted ([`Loader::filled`]). A checkpoint records the batches still owed
    /// ([`PipelineState::owed_batches`](crate::PipelineState::owed_batches)), so a resume
    /// makes the uninterrupted epoch's count and batches. Length-aware batches keep their
    /// count anyway (a skipped clip leaves its batch short), and a loader decoding units
    /// fills nothing (its consumer regroups the rows).
    pub fn fill_skipped(mut self, fill: bool) -> Self {
        self.fill_skipped = fill;
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

    /// Decode workers, fixed: the tuner does not change them (default: tuned, starting at
    /// this process's share of the cores).
    pub fn workers(mut self, n: usize) -> Self {
        self.workers = Some(n);
        self
    }

    /// What failing items do (default [`FailureBudget::unlimited`]: skipped, counted and
    /// listed by [`Loader::failures`]; [`FailureBudget::fail_fast`]: the first ends the
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

    /// Length-aware batches: the dataset's files (local files only) planned by the lengths
    /// their containers declare into batches of similar lengths, each at most `cap` padded
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
    pub fn cpu_budget(mut self, budget: crate::CpuBudget) -> Self {
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
    pub fn on_failure(mut self, f: impl Fn(&crate::ItemError) + Send + Sync + 'static) -> Self {
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
    pub fn cache(mut self, cache: crate::cache::ByteCache) -> Self {
        self.cache = Some(cache);
        self
    }

    /// Checks the settings and plans the epochs (length-aware batches read the files'
    /// declared lengths here); no thread starts until the first epoch.
    pub fn build(self) -> Result<Loader, PipelineError> {
        if self.batch_size == 0 {
            return Err(PipelineError::config("batch_size must be at least 1"));
        }
        if let Some(budget) = self.cpu_budget {
            // Joined here too, not only by the pipeline's tuner: the budget holds with the
            // tuner off.
            crate::actors::node::join(budget).map_err(|e| {
                PipelineError::config(format!("joining the node's CPU budget ({budget:?}): {e}"))
            })?;
        }
        if self.decoder.lengths && !self.decoder.recipe.has_length() {
            return Err(PipelineError::config(
                "lengths are for audio and video recipes",
            ));
        }
        let batch_bytes = self.batch_bytes();
        if let (Some(memory), Some(batch)) = (self.memory_limit(), batch_bytes) {
            // A batch is held twice at most while it is made: its items while the aggregate
            // waits for the last one (they are admitted whatever the byte budgets say, or a
            // budget could keep a batch from ever filling), then the collated batch beside
            // them. A budget that cannot hold that cannot be kept.
            let needed = 2 * batch;
            if needed > memory {
                let mib = |b: u64| format!("{:.1} MiB", b as f64 / 1048576.0);
                return Err(PipelineError::config(format!(
                    "a memory budget of {} cannot hold a batch in flight: a batch of {} bytes \
                     ({}) is held as its items while it is assembled and again once collated \
                     ({} at once); raise the budget above that, or make batches or items \
                     smaller",
                    mib(memory),
                    batch,
                    mib(batch),
                    mib(needed)
                )));
            }
        }
        let plan = match self.lengths {
            Some(cap) => Plan::Batches(LengthPlan::new(&self.dataset, &self.decoder.recipe, cap)?),
            None => Plan::Items(self.dataset.clone()),
        };
        // A length-aware batch is one item of the pipeline.
        let batch_size = if self.lengths.is_some() {
            1
        } else {
            self.batch_size
        };
        let n = plan.sampler().len();
        let batches_per_epoch = if self.drop_last {
            n / batch_size
        } else {
            n.div_ceil(batch_size)
        };
        let failures = FailureLog::default();
        let sim_log = self.device.as_ref().and_then(|d| d.log().cloned());
        let batching = super::units::Batching {
            per_batch: batch_size,
            drop_last: self.drop_last,
            decodes_units: self.units,
            fill: self.fill_skipped && self.lengths.is_none() && !self.units,
        };
        let make = make(self, plan.clone(), batch_size, failures.clone());
        Ok(Loader::from_parts(
            make,
            plan,
            batches_per_epoch,
            failures,
            sim_log,
            batching,
        ))
    }
}

impl LoaderBuilder {
    /// The bytes of one batch at most, when the recipe fixes its items' size: what the
    /// pipeline reserves for a batch in flight. Length-aware batches: the cap in the recipe's
    /// units (seconds of mono audio, frames).
    fn batch_bytes(&self) -> Option<u64> {
        let item = self.decoder.recipe.item_bytes()?;
        let lengths = u64::from(self.decoder.lengths) * 8;
        match self.lengths {
            // An item is one clip window; the cap in clips of that window bounds a batch.
            Some(_) => None,
            None => Some((item + lengths).saturating_mul(self.batch_size as u64)),
        }
    }

    /// The memory budget the pipeline will have, if one is set (the loader's, or the
    /// tuner's; the smaller).
    fn memory_limit(&self) -> Option<u64> {
        let tuner = self.tuner.as_ref().and_then(|t| t.memory_bytes);
        match (self.memory_bytes, tuner) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }
}

/// Builds the loader's pipeline; given what the last pipeline's tuner ended with, the new one
/// starts there instead of at its share of the cores and the default buffers.
pub(super) type Make =
    Box<dyn Fn(Option<&Learned>) -> Result<Pipeline<Batch>, PipelineError> + Send + Sync>;

/// What a loader's last pipeline ended with (its tuner's choices): the next epoch's pipeline
/// starts there. The buffers too: a step-bound loop's lean buffers are not refilled to the
/// defaults at every epoch's start (the refill set the process's peak RSS), and a
/// loader-bound one's grown buffers are not lost.
#[derive(Clone, Debug)]
pub(super) struct Learned {
    /// Decode workers.
    pub(super) workers: usize,
    /// The input buffers (items) of the decode, aggregate and collate stages, and the
    /// results waiting for the consumer.
    buffers: [Option<usize>; 4],
}

/// The stages whose buffers carry over, in [`Learned::buffers`]' order.
const CARRIED: [&str; 4] = ["decode", "aggregate", "collate", "sink"];

impl Learned {
    pub(super) fn of(stats: &crate::PipelineStats) -> Option<Self> {
        let workers = stats.stage("decode")?.workers;
        let buffers = CARRIED.map(|name| stats.stage(name).map(|s| s.budget_items.max(1)));
        Some(Self { workers, buffers })
    }
}

/// The function that builds a pipeline of `b`'s settings over `plan`.
fn make(b: LoaderBuilder, plan: Plan, batch_size: usize, failures: FailureLog) -> Make {
    let labels = b.dataset.has_labels();
    let batch_bytes = b.batch_bytes();
    let decoder = Arc::new(b.decoder);
    let threads = decoder.recipe.item_threads();
    let fingerprint = plan.fingerprint();
    let reserved = b.dataset.reserved_bytes();
    let read_ahead = b.dataset.read_ahead();
    Box::new(move |learned: Option<&Learned>| {
        let uploader = b.device.as_ref().map(Device::uploader);
        let alloc = uploader.as_ref().map(Uploader::host_alloc);
        let workers = match (b.workers, learned) {
            (Some(n), _) => Workers::fixed(n),
            (None, Some(l)) => Workers::initial(l.workers),
            (None, None) => Workers::auto(),
        };
        let buffer = |k: usize| learned.and_then(|l| l.buffers[k]);
        let p = decode_stage(&plan, Arc::clone(&decoder), workers, b.cache.as_ref())
            .measure(Decoded::nbytes);
        // Items in the decode stage (waiting, in hand, decoded and waiting to leave in input
        // order) start at one batch's worth too, at least what keeps its workers busy.
        let decoding = b
            .workers
            .or(learned.map(|l| l.workers))
            .unwrap_or_else(flowgate_actors::cap::cores);
        let mut p = p.budget_start(buffer(0).unwrap_or(batch_size.max(2 * decoding + 2)));
        // The decode stage reads what the shards' prefetch fetches: the tuner deepens it.
        if let Some(r) = read_ahead.clone() {
            p = p.read_ahead(r);
        }
        // And decodes with the recipe's threads per item, which the tuner sets there.
        if let Some(t) = threads.clone() {
            p = p.item_threads(t);
        }
        // The decoded items waiting to be batched start at one batch's worth (the engine's
        // default is four): the aggregate takes each at once, and a buffer the consumer waits
        // for is doubled by the tuner.
        let p = p
            .aggregate(batch_size, b.drop_last && !b.units)
            .budget_start(buffer(1).unwrap_or(batch_size));
        let mut p = p
            .pipe(
                "collate",
                move |items| collate(items, alloc.as_ref(), labels),
                1,
            )
            .measure(Batch::nbytes)
            // Batch lists wait for the collate stage one at a time and batches for the
            // training loop two (one being taken, one ready): the tuner doubles a buffer the
            // consumer waits for, and a step-bound loop never pays for more (the first
            // second's fill sets peak RSS).
            .budget_start(buffer(2).unwrap_or(1))
            .sink_start(buffer(3).unwrap_or(2));
        if let Some(up) = uploader {
            p = p.upload_with(up, |up, batch: Batch| batch.upload(up), Batch::nbytes);
        }
        p = match &b.tuner {
            Some(settings) => p.autotune(settings.clone()),
            None => p.autotune_off(),
        };
        if let Some(m) = b.device.as_ref().and_then(Device::monitor) {
            p = p.gpu_utilization(move || m.utilization());
        }
        if let Some(f) = b.on_decision.clone() {
            p = p.on_tuner_decision(move |r| (f.lock().expect("decision hook"))(r));
        }
        if let Some((interval, f)) = b.on_stats.clone() {
            p = p.on_stats(interval, move |s| (f.lock().expect("stats hook"))(s));
        }
        let (seen, hook) = (failures.clone(), b.on_failure.clone());
        p = p.max_failures(b.failures).on_failure(move |e| {
            seen.record(e);
            if let Some(h) = &hook {
                h(e);
            }
        });
        // A Parquet row-group cache is memory the stages do not count.
        if reserved > 0 {
            p = p.reserve_memory("the Parquet row-group caches", reserved);
        }
        // A batch's items are admitted to the aggregate whatever their bytes, and the
        // collated batch sits beside them a moment: reserved, so the buffers' budgets leave
        // room for both and the total stays within the memory budget.
        if let Some(batch) = batch_bytes {
            p = p.reserve_memory("a batch assembled and collated", 2 * batch);
        }
        // What a state of this loader is valid for.
        p = p
            .checkpoint_fields(fingerprint.iter().cloned())
            .checkpoint_fields([
                ("batch_size", batch_size.to_string()),
                ("drop_last", b.drop_last.to_string()),
            ])
            .checkpoint_fields(b.checkpoint_fields.iter().cloned());
        if let Some(m) = b.memory_bytes {
            p = p.memory_budget(m);
        }
        if let Some(c) = b.cpu_budget {
            p = p.cpu_budget(c);
        }
        p.output_order(b.order).build()
    })
}

/// The source and the decode stage: items read and decoded on the decode stage's pool, or
/// S3 objects fetched on an I/O stage (through the cache) and decoded after it.
#[cfg_attr(not(feature = "s3"), allow(unused_variables))]
fn decode_stage(
    plan: &Plan,
    decoder: Arc<Decoder>,
    workers: Workers,
    cache: Option<&crate::cache::ByteCache>,
) -> crate::PipelineBuilder<Decoded> {
    #[cfg(feature = "s3")]
    if let Plan::Items(d) = plan {
        if let Some((s3, keys, concurrency)) = d.objects() {
            return fetch_stage(s3, keys, concurrency, cache).pipe(
                "decode",
                move |(blob, index, epoch): (crate::Blob, usize, u64)| {
                    Ok::<_, BoxError>(Decoded {
                        fields: decoder.fields(crate::dataset::Input::Bytes(blob), epoch)?,
                        meta: ItemMeta {
                            index,
                            epoch,
                            label: None,
                        },
                        rows: None,
                    })
                },
                workers,
            );
        }
    }
    let (named, read, reads) = (plan.clone(), plan.clone(), plan.clone());
    Pipeline::builder()
        .source_sampled_planned(
            plan.sampler().clone(),
            |e, i| (i, e),
            move |epoch, indices| {
                if let Plan::Items(d) = &reads {
                    d.plan_reads(epoch, indices);
                }
            },
        )
        .describe(move |&(i, e): &(usize, u64)| named.name(i, e))
        .pipe(
            "decode",
            move |(i, epoch): (usize, u64)| read.load(i, epoch, &decoder),
            workers,
        )
}

/// The source of S3 objects and the stage fetching them (`fetch`: `concurrency` GETs in
/// flight, tuned; through `cache` if given): each object's bytes, index and epoch.
#[cfg(feature = "s3")]
fn fetch_stage(
    s3: &crate::s3::S3,
    keys: &crate::dataset::Files,
    concurrency: usize,
    cache: Option<&crate::cache::ByteCache>,
) -> crate::PipelineBuilder<(crate::Blob, usize, u64)> {
    use crate::cache::CacheFuture;
    use crate::s3::S3Error;
    use std::path::PathBuf;
    type Fetch = Box<dyn Fn(PathBuf) -> CacheFuture<S3Error> + Send + Sync>;
    let paths: Arc<[PathBuf]> = keys.paths().into();
    let b = Pipeline::builder()
        .source_sampled(keys.sampler().clone(), move |epoch, i| {
            (paths[i].clone(), i, epoch)
        })
        .describe(|(key, _, _): &(PathBuf, usize, u64)| key.display().to_string());
    // The index and epoch ride along the fetch, for the decoder's per-epoch augmentation.
    let with_place = |f: Fetch| {
        move |(key, index, epoch): (PathBuf, usize, u64)| {
            let fetched = f(key);
            async move { fetched.await.map(|blob| (blob, index, epoch)) }
        }
    };
    let fetch = s3.fetcher::<PathBuf>();
    let b = match cache {
        Some(c) => b
            .pipe_async(
                "fetch",
                with_place(Box::new(c.through(fetch))),
                Workers::initial(concurrency),
            )
            .cache(c),
        None => b.pipe_async(
            "fetch",
            with_place(Box::new(fetch)),
            Workers::initial(concurrency),
        ),
    };
    b.measure(|(blob, _, _): &(crate::Blob, usize, u64)| blob.len())
}

impl Plan {
    pub(super) fn sampler(&self) -> &crate::sampler::Sampler {
        match self {
            Plan::Items(d) => d.sampler(),
            Plan::Batches(b) => b.sampler(),
        }
    }

    fn fingerprint(&self) -> Vec<(&'static str, String)> {
        match self {
            Plan::Items(d) => d.fingerprint(),
            Plan::Batches(b) => b.fingerprint(),
        }
    }

    /// Item (or slot) `i`'s name in failures.
    fn name(&self, i: usize, epoch: u64) -> String {
        match self {
            Plan::Items(d) => d.name(i, epoch),
            Plan::Batches(b) => b.name(i, epoch),
        }
    }

    /// Reads and decodes item (or slot) `i` of `epoch`.
    fn load(&self, i: usize, epoch: u64, decoder: &Decoder) -> Result<Decoded, BoxError> {
        match self {
            Plan::Items(d) => {
                let item = d.read(i, epoch)?;
                Ok(Decoded {
                    fields: decoder.fields(item.input, epoch)?,
                    meta: ItemMeta {
                        index: i,
                        epoch,
                        label: item.label,
                    },
                    rows: None,
                })
            }
            Plan::Batches(b) => b.load(i, epoch, decoder),
        }
    }
}
