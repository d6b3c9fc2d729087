//! Loaders: a [`Dataset`] and a media [`Recipe`] → labelled batches, epoch after epoch.
//!
//! This is the one loader every front end builds: the Rust API directly, pipeline files
//! (`flowgate::spec`) and the Python package (`flowgate.ImageLoader`, …) by translating their
//! arguments into a [`Dataset`] and a [`LoaderBuilder`]. A guarantee fixed here holds for all
//! three.
//!
//! # Epochs
//!
//! [`Loader::start_epoch`] starts the next epoch (or the resumed one); [`Loader::next_within`]
//! and [`Loader::epoch`] deliver its batches. An epoch left mid-way stops its pipeline at once
//! (its buffers freed); the next pipeline starts at the decode workers the last one's tuner
//! chose, so a cut-short epoch does not cost the next a cold start. What comes next:
//! - after a `break`, a dropped [`EpochBatches`], a peek at one batch or [`Loader::close`]
//!   (the epoch *abandoned*), the next [`start_epoch`](Loader::start_epoch) starts that same
//!   epoch again from where it started (its beginning, or the resumed position), in the same
//!   order — as PyTorch's `DistributedSampler` until `set_epoch`. A rank that peeks at a
//!   batch before its loop keeps the epoch every other rank runs;
//!   [`Loader::abandoned_epoch`] says when an epoch will be started again;
//! - after an epoch's end, or an error (the epoch is over), the next epoch;
//! - [`Loader::set_epoch`] names the next epoch.
//!
//! Every epoch keeps its own shuffle and augmentation (seeded by seed and epoch).
//!
//! # Checkpoints
//!
//! [`Loader::state`] records what the consumer has received; a new loader over the same
//! dataset [`resume`](Loader::resume)s it exactly (every item not yet delivered, once), and
//! [`PipelineState::merge`] combines the states of every rank of a world into one that a
//! world of any size resumes.
//!
//! Files:
//! 1. `builder` — [`LoaderBuilder`]: settings with named defaults, checked when the loader is
//!    built.
//! 2. `assemble` — the pipeline those settings make (source → decode → batch → collate →
//!    upload), and what one pipeline hands the next (its tuner's workers and buffers).
//! 3. `batch` — [`Batch`] and [`ItemMeta`], and collation (labels, length-aware batches).
//! 4. `decode` — an item's fields from the recipe (lengths, a video's audio track).
//! 5. `lengths` — length-aware batches.
//! 6. `device` — [`Device`]: where batches are uploaded.
//! 7. `failures` — [`SkippedFailure`]s, per epoch ([`FailureLog`]); `report` — what a loader
//!    says of them unasked (the first skip, [`EpochReport`] at an epoch's end); `watch` —
//!    [`LoaderWatch`], what other threads read while the loop waits.
//! 8. `units` — [`EpochPlan`]: an epoch cut into units other processes decode (remote
//!    workers), and the checkpoint the planning loader keeps.
//! 9. `fill` — batches lost to skipped items made up at the epoch's end
//!    ([`LoaderBuilder::fill_skipped`]); `makeup` — [`MakeUp`], the same made up at once
//!    from the rank's own share, for a loader over a user's map-style dataset under ranks.
//! 10. `regroup` — [`Regroup`]: units' batches regrouped into the planning loader's (where
//!     a skipped item left one short), for the consumer of the units.
//! 11. `media_fields` — fields decoded as media by recipes of their own (a sample's second
//!     image), and [`fields_and_media`], how every front end's `fields` mapping names them.
//! 12. `checkpoint` — [`Loader::state`] at each point of an epoch (running, abandoned,
//!     made up, as units) and [`Loader::resume`].
//! 13. `keys` — [`BatchKeys`]: the one rule for the names a batch is read by (its tensors,
//!     `label`, its fields), for every front end and a per-batch function's output.
//! 14. `checks` — what the settings must hold before a loader is built (units, media
//!     fields, the batch's keys, the memory and device budgets against a batch).
//! 15. `passes` — [`Passes`], the one epoch machine of every loader and front end: which
//!     epoch the next pass reads, where one left stopped ([`PassRule`]).
//!
//! # Readers
//!
//! [`LoaderBuilder::reader`] splits a rank's epoch among readers built alike (PyTorch
//! `DataLoader` workers): each reads whole batches of the rank's epoch — its part of the
//! [`EpochPlan`], as a resumed state — so the readers together give the rank's batches,
//! count and (taken in turn) order, resumed states and `fill_skipped` included.

mod assemble;
mod batch;
mod builder;
mod checkpoint;
mod checks;
mod decode;
mod device;
mod failures;
mod fill;
mod keys;
mod lengths;
mod makeup;
mod media_fields;
mod passes;
mod pool;
mod regroup;
mod report;
mod settings;
mod units;
mod watch;

use std::sync::{Arc, Mutex};
use std::time::Duration;

pub use batch::{Batch, ItemMeta, MapBatches, MapItems, Sample};
pub use builder::{
    default_batch_size, LoaderBuilder, DEFAULT_BATCH_SIZE, DEFAULT_ORDER, DEFAULT_VIDEO_BATCH_SIZE,
};
pub use device::{
    Device, DeviceName, DEFAULT_DEVICE_BYTES, DEFAULT_SIM_BANDWIDTH, DEFAULT_SIM_LATENCY,
    DEFAULT_STAGING_BYTES,
};
pub use failures::{first_skip_message, FailureLog, SkippedFailure, KEEP_FAILURES};
pub use keys::BatchKeys;
pub use lengths::{DEFAULT_BUCKETS, MAX_BUCKETS};
pub use makeup::{largest_batch, MakeUp};
pub use media_fields::{fields_and_media, MediaFieldArgs};
pub use passes::{AfterLeft, PassRule, Passes, SetEpoch};
pub use pool::{
    Cluster, PoolSettings, Workers, DEFAULT_BATCHES_PER_UNIT, DEFAULT_MAX_CPUS_PER_WORKER,
    DEFAULT_MAX_WORKERS, DEFAULT_START_TIMEOUT,
};
pub use regroup::{Regroup, Rows};
pub use report::{batches_due, EpochReport};
pub use settings::{LoaderSettings, OrderName, SettingsError};
pub use units::{batches_of, EpochPlan, Unit};
pub use watch::LoaderWatch;

use flowgate_actors::error::PipelineError;

use crate::dataset::Dataset;
use crate::device::SimLog;
use crate::engine::checkpoint::PipelineState;
use crate::engine::pipeline::{Pipeline, Within};
use crate::engine::stats::{Monitor, PipelineStats};
use crate::media::Recipe;
pub use assemble::batching_fingerprint;
use assemble::{Learned, Make};
use lengths::LengthPlan;

/// What a loader's pipeline reads: the dataset's items, or its files planned into
/// length-aware batches.
// Made once per loader and cloned once per pipeline it builds: its size does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug)]
enum Plan {
    Items(Dataset),
    Batches(LengthPlan),
}

/// A loader: batches of a dataset decoded by a recipe, epoch after epoch, with exact resume.
/// See the [module docs](self) and [`LoaderBuilder`].
pub struct Loader {
    make: Make,
    /// [`tensor_names`](Self::tensor_names) and [`field_names`](Self::field_names).
    names: batch::Names,
    plan: Plan,
    pipeline: Option<Pipeline<Batch>>,
    /// Its passes over the epochs: which the next starts, where one left stopped.
    passes: Passes,
    /// The current pipeline's monitor, for readers on other threads (see [`LoaderWatch`]).
    monitor: Arc<Mutex<Option<Monitor>>>,
    failures: FailureLog,
    /// The decode workers the last dropped pipeline had (its tuner's choice).
    learned: Option<Learned>,
    batches_per_epoch: usize,
    sim_log: Option<SimLog>,
    /// The statistics of the last pipeline closed (an epoch abandoned, or an error).
    last_stats: Option<PipelineStats>,
    /// How an epoch's positions fall into batches, and whether this loader decodes units.
    batching: units::Batching,
    /// Batches lost to skipped items, and making them up (`fill_skipped`).
    fill: fill::Fill,
    /// `(r, n)`: a reader that runs its rank's whole epoch and keeps batches `r`, `r + n`, …
    /// (a rank's `fill_skipped` state resumed: see [`Loader::start_epoch`]), and the rank's
    /// batches seen so far.
    keep_every: Option<((usize, usize), usize)>,
    /// The epoch being iterated as units decoded elsewhere ([`Loader::start_units`]).
    units: Option<units::UnitsEpoch>,
    /// What the last epoch that ended had to say (items skipped, batches short of `len()`),
    /// until a front end takes it.
    report: Option<EpochReport>,
    /// The first skipped item, said once the pipeline went on past it, until a front end
    /// takes it.
    first_skip: Option<(SkippedFailure, String)>,
}

impl std::fmt::Debug for Loader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loader")
            .field("plan", &self.plan)
            .field("passes", &self.passes)
            .field("batches_per_epoch", &self.batches_per_epoch)
            .finish_non_exhaustive()
    }
}

impl Loader {
    /// A loader of `dataset`, each item decoded by `recipe`; see [`LoaderBuilder`].
    pub fn builder(dataset: Dataset, recipe: Recipe) -> LoaderBuilder {
        LoaderBuilder::new(dataset, recipe)
    }

    fn from_parts(
        make: Make,
        plan: Plan,
        batches_per_epoch: usize,
        failures: FailureLog,
        sim_log: Option<SimLog>,
        batching: units::Batching,
        names: batch::Names,
    ) -> Self {
        Self {
            names,
            make,
            plan,
            pipeline: None,
            passes: Passes::new(PassRule::LOADER),
            monitor: Arc::default(),
            failures,
            learned: None,
            batches_per_epoch,
            sim_log,
            last_stats: None,
            batching,
            fill: fill::Fill::default(),
            keep_every: None,
            units: None,
            report: None,
            first_skip: None,
        }
    }

    /// Batches per epoch: this rank's, or with a [reader split](LoaderBuilder::reader) this
    /// reader's part of them (the readers' parts add up to the rank's).
    pub fn len(&self) -> usize {
        self.batching.mine(self.batches_per_epoch)
    }

    /// Whether an epoch has no batches.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The dataset it reads (in length-aware batches: the dataset whose clips it plans).
    pub fn dataset(&self) -> &Dataset {
        match &self.plan {
            Plan::Items(d) => d,
            Plan::Batches(b) => b.dataset(),
        }
    }

    /// The class names (index = label) of folder labels.
    pub fn classes(&self) -> Option<&[String]> {
        self.dataset().classes()
    }

    /// An item's path (or `SHARD:KEY`), for logs and `return_paths`.
    pub fn path_of(&self, item: &ItemMeta) -> String {
        self.dataset().name(item.index, item.epoch)
    }

    /// The fields besides the media each item carries (the source's
    /// [`extra_fields`](crate::dataset::Source::extra_fields)), in order.
    pub fn extra_fields(&self) -> &[crate::dataset::FieldSpec] {
        self.dataset().extra_fields()
    }

    /// The names of every batch's fields besides the media ([`Batch::field`]): the
    /// dataset's, then those a per-item function adds
    /// ([`map_fields`](LoaderBuilder::map_fields)).
    pub fn field_names(&self) -> &[String] {
        &self.names.fields
    }

    /// The names of every batch's tensors as collated ([`Batch::names`]): the media's kind
    /// (`"image"`, `"audio"`, `"video"`), `"lengths"` where the loader gives them, `"audio"`
    /// for a video's audio track. A per-batch function
    /// ([`map_batches`](LoaderBuilder::map_batches)) may change them.
    pub fn tensor_names(&self) -> &[String] {
        &self.names.tensors
    }

    /// A handle for other threads: statistics and failures while this one waits.
    pub fn watch(&self) -> LoaderWatch {
        LoaderWatch {
            monitor: Arc::clone(&self.monitor),
            failures: self.failures.clone(),
            filled: self.fill.filled.clone(),
        }
    }

    /// The simulated device's record (with [`Device::simulated`]).
    pub fn sim_log(&self) -> Option<&SimLog> {
        self.sim_log.as_ref()
    }

    /// The decode workers a rebuilt pipeline starts with: what the last one ended with, or
    /// `None` (its share of the cores) before any rebuild.
    pub fn learned_workers(&self) -> Option<usize> {
        self.learned.as_ref().map(|l| l.workers)
    }

    /// Whether an epoch is being iterated.
    pub fn in_epoch(&self) -> bool {
        self.passes.in_epoch()
    }

    fn pipeline(&mut self) -> Result<&mut Pipeline<Batch>, PipelineError> {
        if self.pipeline.is_none() {
            let mut p = (self.make)(self.learned.as_ref())?;
            if self.passes.resume_at() > 0 {
                p.start_at_epoch(self.passes.resume_at())?;
            }
            *self.monitor.lock().expect("monitor") = Some(p.monitor());
            self.pipeline = Some(p);
        }
        Ok(self.pipeline.as_mut().expect("built"))
    }

    /// The running pipeline's monitor, building the pipeline if there is none yet.
    pub fn monitor(&mut self) -> Result<Monitor, PipelineError> {
        Ok(self.pipeline()?.monitor())
    }

    /// A handle that resizes the running pipeline's stages and sets their buffers by hand (an
    /// operator, a test), building the pipeline if there is none yet. What it sets lasts for
    /// the pipeline; the next one (after an abandoned epoch) starts where this one ended.
    pub fn control(&mut self) -> Result<crate::engine::control::ControlHandle, PipelineError> {
        Ok(self.pipeline()?.control())
    }

    /// Statistics of the running pipeline (every stage, the consumer's wait, failures), or
    /// of the last one if none runs now (after an error or [`close`](Self::close)).
    pub fn stats(&self) -> PipelineStats {
        match &self.pipeline {
            Some(p) => p.stats(),
            None => self.last_stats.clone().unwrap_or_default(),
        }
    }

    /// Stops the pipeline and joins its threads (also done when the loader is dropped); the
    /// next epoch starts on a new one. An epoch being iterated is abandoned: the next
    /// [`start_epoch`](Self::start_epoch) starts it again from where it started (see the
    /// [module docs](self)).
    pub fn close(&mut self) {
        self.stop(false);
    }

    /// The epoch abandoned mid-way that the next [`start_epoch`](Self::start_epoch) starts
    /// again from where it started, and the batches it had delivered: `None` while an epoch
    /// runs, after an epoch's end or error, and after [`set_epoch`](Self::set_epoch) named
    /// another epoch (`set_epoch` naming that same epoch counts its batches as 0: started
    /// again by choice). A front end warns with it when a loop that delivered more than a
    /// peek's one batch is about to read the same batches again.
    pub fn abandoned_epoch(&self) -> Option<(u64, usize)> {
        self.passes.abandoned_epoch()
    }

    /// An epoch being iterated ended by an error: over, the next start starts the next epoch.
    fn end_after_error(&mut self) {
        self.stop(true);
    }

    /// Stops the pipeline, telling the passes where it stood: the progress of an epoch being
    /// iterated (what a checkpoint taken now records), or of a resumed state not iterated yet,
    /// and its epoch; `over`: an error ended the epoch.
    fn stop(&mut self, over: bool) {
        let in_epoch = self.passes.in_epoch();
        // While batches are made up, the epoch's progress is the filling's (its own
        // pipeline has moved on to the next epoch already).
        let filling = self.fill.filling.take().map(|f| f.progress());
        *self.monitor.lock().expect("monitor") = None;
        // An epoch of units: its progress is what its consumer received.
        let units = self.units.take().map(|u| u.state());
        let mut progress = units.filter(|_| in_epoch).map(|s| self.with_owed(s));
        let mut epoch = None;
        if let Some(p) = self.pipeline.take() {
            if progress.is_none() && in_epoch {
                progress = Some(self.with_owed(filling.clone().unwrap_or_else(|| p.state())));
            } else if progress.is_none() && self.passes.resumed() {
                let mut s = p.state();
                s.owed_batches = self.fill.resumed_owed;
                progress = Some(s);
            }
            epoch = Some(filling.as_ref().map_or_else(|| p.epoch(), |s| s.epoch));
            let stats = p.stats();
            self.learned = Learned::of(&stats);
            self.last_stats = Some(stats);
        }
        self.passes.stopped(progress, epoch, over);
    }

    /// Starts an epoch — the next one, or the resumed one after [`resume`](Self::resume) —
    /// and returns its number. An epoch being iterated is abandoned first.
    pub fn start_epoch(&mut self) -> Result<u64, PipelineError> {
        if self.passes.in_epoch() {
            self.close();
        }
        if let Some(epoch) = self.passes.take_named() {
            self.close();
            self.passes.set_next(epoch);
        }
        if let Some(again) = self.passes.take_restart() {
            // An abandoned epoch, again from where it started.
            self.resume(&again)?;
        }
        let start = self.next_state()?;
        // A reader reads its part of the rank's epoch; but what a rank's `fill_skipped` state
        // owes depends on which of its items fail (retried on resume), which no split of
        // positions can know: then the reader runs the rank's resumed epoch as the rank's
        // loader would and keeps its own batches of it (the rank's batches and count, for the
        // decoding of the whole rest in each reader, in that one epoch).
        let (from, part) = match self.batching.reader {
            Some(split) if start.owed_batches.is_some() => {
                self.keep_every = Some((split, 0));
                (start.clone(), false)
            }
            Some(split) => {
                self.keep_every = None;
                (self.read_part(&start, split)?, true)
            }
            None => (start.clone(), false),
        };
        let due = fill::Owed::of(&start, self.batching.per_batch, self.batching.drop_last);
        let due = match self.batching.reader {
            Some((r, n)) if part => due.reader(r, n),
            _ => due,
        }
        .batches;
        self.fill.start_epoch(&start, from, &self.batching, part);
        let epoch = self.pipeline()?.epoch();
        self.started(start, due, epoch);
        Ok(epoch)
    }

    /// The batches an epoch that starts at `start` makes with nothing skipped.
    fn due_from(&self, start: &PipelineState) -> usize {
        fill::Owed::of(start, self.batching.per_batch, self.batching.drop_last).batches
    }

    /// `epoch` is being iterated from `start`, owing `due` batches: from now on a stop
    /// abandons it, and its delivered batches and failures are counted afresh.
    fn started(&mut self, start: PipelineState, due: usize, epoch: u64) {
        self.failures.set_epoch(epoch);
        self.report = None;
        self.passes.started(start, due);
    }

    /// Makes the pipeline read reader `r`'s part (of `n`) of the epoch its rank starts at
    /// `start` (see [`LoaderBuilder::reader`]) and returns that part's state.
    fn read_part(
        &mut self,
        start: &PipelineState,
        (r, n): (usize, usize),
    ) -> Result<PipelineState, PipelineError> {
        let state = units::EpochPlan::new(start.clone(), &self.batching, 1)?.reader_state(r, n);
        self.pipeline()?.resume(&state)?;
        Ok(state)
    }

    /// The epoch the next [`start_epoch`](Self::start_epoch) starts (an abandoned one
    /// again), or the one being iterated; builds nothing.
    pub fn next_epoch(&self) -> u64 {
        self.passes
            .next_epoch(self.pipeline.as_ref().map(Pipeline::epoch))
    }

    /// Makes `epoch` the next one started (as PyTorch's `DistributedSampler.set_epoch`): its
    /// order and augmentation follow from the seed and the epoch. A no-op when it already is
    /// the next (a resumed position, or an abandoned epoch's start, is kept); an epoch being
    /// iterated is abandoned.
    pub fn set_epoch(&mut self, epoch: u64) {
        let here = self.pipeline.as_ref().map(Pipeline::epoch);
        if self.passes.set_epoch(epoch, here) == passes::SetEpoch::Restart {
            self.close();
            self.passes.set_next(epoch);
        }
    }

    /// The epoch's next batch, waiting at most `timeout`: [`Within::EpochEnd`] at its end (or
    /// when no epoch was started), [`Within::TimedOut`] if none came in time. After an error
    /// the epoch is over (the pipeline is rebuilt for the next one). An epoch that ends
    /// without a batch because every item failed ends with an error
    /// ([`PipelineError::is_nothing_delivered`]), not empty — unless it was resumed after
    /// some of it was delivered (then what is left may fail, or be nothing at all).
    pub fn next_within(&mut self, timeout: Duration) -> Within<Batch> {
        let got = self.next_kept(timeout);
        self.note_first_skip(&got);
        got
    }

    /// The epoch's next batch of this loader's own (see [`next_within`](Self::next_within)).
    fn next_kept(&mut self, timeout: Duration) -> Within<Batch> {
        loop {
            let got = self.next_of_rank(timeout);
            if matches!(got, Within::Next(Ok(_)))
                && self.batching.fill
                && self.passes.taken() > self.fill.owed.batches
            {
                // Filling, an epoch makes exactly what it owes: a reader running its rank's
                // rest keeps a short batch the rank drops (and makes up), so it could end one
                // over.
                self.passes.took_back();
                continue;
            }
            if let (Within::Next(Ok(_)), Some(((r, n), seen))) = (&got, &mut self.keep_every) {
                let k = *seen;
                *seen += 1;
                if k % *n != *r {
                    continue; // another reader's batch
                }
            }
            return got;
        }
    }

    /// The next batch of the epoch this loader runs (with `keep_every`, its rank's).
    fn next_of_rank(&mut self, timeout: Duration) -> Within<Batch> {
        if !self.passes.in_epoch() {
            return Within::EpochEnd;
        }
        if self.units.is_some() {
            return Within::Next(Err(PipelineError::config(
                "this epoch is decoded as units elsewhere (start_units): its consumer takes \
                 the batches",
            )));
        }
        if self.fill.filling.is_some() {
            return self.next_filler(timeout);
        }
        let pipeline = match self.pipeline() {
            Ok(p) => p,
            Err(e) => return Within::Next(Err(e)),
        };
        match pipeline.next_within(timeout) {
            Within::Next(Err(e)) => {
                self.end_after_error();
                Within::Next(Err(e))
            }
            Within::EpochEnd => {
                // Batches lost to skipped items made up first (from what the epoch, or the
                // run it resumes, delivered).
                if self.owes_batches() {
                    if let Err(e) = self.start_filling() {
                        self.end_after_error();
                        return Within::Next(Err(e));
                    }
                    if self.fill.filling.is_some() {
                        return self.next_filler(timeout);
                    }
                }
                self.passes.ended();
                self.report_epoch();
                let (failures, last) = self.failures.in_epoch();
                // A unit whose items all failed is not an epoch: its consumer decides.
                let whole = self.passes.whole() && !self.batching.decodes_units;
                let epoch = self.failures.epoch();
                if let Some(e) = PipelineError::if_nothing_delivered(
                    epoch,
                    whole,
                    self.passes.taken() > 0,
                    failures,
                    last,
                ) {
                    return Within::Next(Err(e));
                }
                Within::EpochEnd
            }
            Within::Next(Ok(b)) => {
                self.passes.took();
                self.note_delivered();
                Within::Next(Ok(b))
            }
            other => other,
        }
    }

    /// The epoch's next batch, `None` at its end.
    pub fn next_batch(&mut self) -> Option<Result<Batch, PipelineError>> {
        loop {
            match self.next_within(Duration::from_secs(3600)) {
                Within::Next(b) => return Some(b),
                Within::EpochEnd => return None,
                Within::TimedOut => {}
            }
        }
    }

    /// Starts an epoch and iterates its batches; dropping the iterator before the end
    /// abandons the epoch (the next [`start_epoch`](Self::start_epoch) starts it again from
    /// where it started; see the [module docs](self)).
    pub fn epoch(&mut self) -> Result<EpochBatches<'_>, PipelineError> {
        self.start_epoch()?;
        Ok(EpochBatches { loader: self })
    }
}

impl Drop for Loader {
    fn drop(&mut self) {
        *self.monitor.lock().expect("monitor") = None;
    }
}

/// The batches of one epoch ([`Loader::epoch`]).
#[derive(Debug)]
pub struct EpochBatches<'a> {
    loader: &'a mut Loader,
}

impl EpochBatches<'_> {
    /// A checkpoint of the consumer's progress so far (see [`Loader::state`]).
    pub fn state(&mut self) -> Result<PipelineState, PipelineError> {
        self.loader.state()
    }

    /// The loader's statistics so far.
    pub fn stats(&self) -> PipelineStats {
        self.loader.stats()
    }
}

impl Iterator for EpochBatches<'_> {
    type Item = Result<Batch, PipelineError>;

    fn next(&mut self) -> Option<Self::Item> {
        self.loader.next_batch()
    }
}

impl Drop for EpochBatches<'_> {
    fn drop(&mut self) {
        if self.loader.passes.in_epoch() {
            self.loader.close();
        }
    }
}
