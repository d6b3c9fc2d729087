//! How a [`LoaderBuilder`]'s settings become a [`Loader`] (`build`: checked, the epochs
//! planned, the finished parts handed over) and how its pipeline is assembled from them — source (the
//! dataset's sampler) → decode (a work-stealing pool, the recipe) → batch → collate (→
//! upload) — and what one pipeline hands the next ([`Learned`]: its tuner's workers and
//! buffers), so that a pipeline started afresh (a new epoch after a `break`, a fill round)
//! starts where the last one ended.

use std::sync::Arc;

use flowgate_actors::error::{BoxError, PipelineError};

use super::batch::{check_mapped, collate, Batch, Decoded, ItemMeta, Names};
use super::builder::LoaderBuilder;
use super::decode::Decoder;
use super::device::Device;
use super::failures::FailureLog;
use super::lengths::LengthPlan;
use super::{Loader, Plan};
use crate::device::Uploader;
use crate::engine::builder::PipelineBuilder;
use crate::engine::config::Workers;
use crate::engine::pipeline::Pipeline;
use crate::engine::stats::PipelineStats;

impl LoaderBuilder {
    /// Checks the settings and plans the epochs (length-aware batches read the files'
    /// declared lengths here); no thread starts until the first epoch.
    pub fn build(mut self) -> Result<Loader, PipelineError> {
        let limit = |e: flowgate_actors::limits::OutOfRange| PipelineError::config(e.to_string());
        flowgate_actors::limits::BATCH_SIZE
            .check_usize(self.batch_size)
            .map_err(limit)?;
        let mem = flowgate_tuner::available_memory();
        let positions = self.dataset.sampler().global_len();
        crate::sampler::check_order_fits(positions, mem.bytes, &mem.source)
            .map_err(PipelineError::config)?;
        if let Some(n) = self.workers {
            flowgate_actors::limits::WORKERS
                .check_usize(n)
                .map_err(limit)?;
        }
        if let Some((r, n)) = self.reader {
            if n == 0 || r >= n {
                return Err(PipelineError::config(format!(
                    "reader {r} of {n}: the reader must be in 0..readers"
                )));
            }
            if self.units {
                return Err(PipelineError::config(
                    "a loader that decodes units reads what its units name, not a reader's part",
                ));
            }
        }
        // One reader is the whole epoch.
        self.reader = self.reader.filter(|&(_, n)| n > 1);
        if let Some(budget) = self.cpu_budget {
            // Joined here too, not only by the pipeline's tuner: the budget holds with the
            // tuner off.
            flowgate_actors::node::join(budget).map_err(|e| {
                PipelineError::config(format!("joining the node's CPU budget ({budget:?}): {e}"))
            })?;
        }
        if let (Some((stage, _)), Some(_)) = (&self.map, self.lengths) {
            return Err(PipelineError::config(format!(
                "{stage}: a per-item function is not for length-aware batches (their items are \
                 whole batches)"
            )));
        }
        if !self.map_fields.is_empty() && self.map.is_none() {
            return Err(PipelineError::config(
                "map_fields: fields added by a per-item function, without one (map_items)",
            ));
        }
        const OWN: [&str; 7] = [
            "source",
            "decode",
            "aggregate",
            "collate",
            "upload",
            "sink",
            "fetch",
        ];
        let stages = [
            ("map_items", self.map.as_ref().map(|(s, _)| s)),
            ("map_batches", self.map_batches.as_ref().map(|(s, _)| s)),
        ];
        for (what, stage) in stages {
            if let Some(stage) = stage.filter(|s| OWN.contains(&s.as_str()) || s.is_empty()) {
                return Err(PipelineError::config(format!(
                    "{what}: {stage:?} names one of the loader's own stages; name the \
                     function's stage otherwise"
                )));
            }
        }
        if let [(_, Some(a)), (_, Some(b))] = stages {
            if a == b {
                return Err(PipelineError::config(format!(
                    "map_batches: {b:?} is the per-item function's stage too; name each its own"
                )));
            }
        }
        let units_refusal = self.units_refusal();
        if let (true, Some(why)) = (self.units || self.plans_units, units_refusal) {
            return Err(PipelineError::config(why));
        }
        self.place_media_fields()?;
        self.check_keys()?;
        if self.decoder.lengths && !self.decoder.recipe.has_length() {
            return Err(PipelineError::config(
                "lengths are for audio and video recipes",
            ));
        }
        let plan = match self.lengths {
            Some(cap) => Plan::Batches(LengthPlan::new(&self.dataset, &self.decoder.recipe, cap)?),
            None => Plan::Items(self.dataset.clone()),
        };
        self.check_floor(&plan)?;
        // A length-aware batch is one item of the pipeline.
        let batch_size = if self.lengths.is_some() {
            1
        } else {
            self.batch_size
        };
        let n = plan.sampler().len();
        let batches_per_epoch = super::units::batches_of(n, batch_size, self.drop_last);
        // A fail-fast loader skips nothing: its failure is never said to be skipped (a batch
        // decoded before it may still come out after it was recorded).
        let failures = match self.failures == flowgate_actors::failure::FailureBudget::fail_fast() {
            true => FailureLog::fail_fast(),
            false => FailureLog::default(),
        };
        let sim_log = self.device.as_ref().and_then(|d| d.log().cloned());
        let batching = super::units::Batching {
            per_batch: batch_size,
            drop_last: self.drop_last,
            decodes_units: self.units,
            units_refusal,
            fill: self
                .fill_skipped
                .unwrap_or(self.dataset.sampler().world() > 1)
                && self.lengths.is_none()
                && !self.units,
            reader: self.reader,
        };
        // The fields besides the media each batch names: the dataset's, then the function's.
        // Fields decoded as media are tensors, not fields.
        let decoded_as_media = |n: &str| self.decoder.media_fields.iter().any(|f| f.name == n);
        let names = Names {
            tensors: self.tensor_names().into(),
            fields: self
                .dataset
                .extra_fields()
                .iter()
                .filter(|f| !decoded_as_media(&f.name))
                .map(|f| f.name.clone())
                .chain(self.map_fields.iter().cloned())
                .collect(),
        };
        let make = make(
            self,
            plan.clone(),
            batch_size,
            failures.clone(),
            names.clone(),
        );
        Ok(Loader::from_parts(
            make,
            plan,
            batches_per_epoch,
            failures,
            sim_log,
            batching,
            names,
        ))
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
    pub(super) fn of(stats: &PipelineStats) -> Option<Self> {
        let workers = stats.stage("decode")?.workers;
        let buffers = CARRIED.map(|name| stats.stage(name).map(|s| s.budget_items.max(1)));
        Some(Self { workers, buffers })
    }
}

/// The function that builds a pipeline of `b`'s settings over `plan`; `names`: the tensors
/// and fields besides the media its batches carry.
pub(super) fn make(
    b: LoaderBuilder,
    plan: Plan,
    batch_size: usize,
    failures: FailureLog,
    names: Names,
) -> Make {
    let labels = b.dataset.has_labels();
    let batch_bound = b.batch_bound(&plan);
    let function_stages = b.function_stages();
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
        // The user's per-item function: a stage of its own, sized by the tuner.
        if let Some((stage, f)) = &b.map {
            let f = Arc::clone(f);
            let (added, fields) = (b.map_fields.len(), names.fields.len());
            let named = plan.clone();
            p = p
                // A failed item is named by its path (or `SHARD:KEY`), as in the decode stage.
                .describe(move |d: &Decoded| named.name(d.meta.index, d.meta.epoch))
                .pipe(
                    stage,
                    move |d: Decoded| {
                        let Decoded {
                            fields: tensors,
                            mut meta,
                            rows,
                        } = d;
                        meta.extras.extend(std::iter::repeat_n(
                            crate::dataset::FieldValue::Missing,
                            added,
                        ));
                        let out = f(super::Sample {
                            fields: tensors,
                            meta,
                        })?;
                        if labels && out.meta.label.is_none() {
                            return Err("the per-item function left the item without its label \
                                        (the dataset has labels)"
                                .into());
                        }
                        if out.meta.extras.len() != fields {
                            return Err(format!(
                                "the per-item function left {} fields besides the media; the \
                                 loader names {fields}",
                                out.meta.extras.len()
                            )
                            .into());
                        }
                        Ok::<_, BoxError>(Decoded {
                            fields: out.fields,
                            meta: out.meta,
                            rows,
                        })
                    },
                    Workers::auto(),
                )
                .measure(Decoded::nbytes);
        }
        // The decoded items waiting to be batched start at one batch's worth (the engine's
        // default is four): the aggregate takes each at once, and a buffer the consumer waits
        // for is doubled by the tuner.
        let p = p
            .aggregate(batch_size, b.drop_last && !b.units && b.reader.is_none())
            .budget_start(buffer(1).unwrap_or(batch_size));
        let names = names.clone();
        let named = plan.clone();
        let mut p = p
            // A batch that does not collate is named by its first item.
            .describe(move |items: &Vec<Decoded>| match items.first() {
                Some(d) => format!(
                    "the batch of {} from {}",
                    items.len(),
                    named.name(d.meta.index, d.meta.epoch)
                ),
                None => "an empty batch".to_owned(),
            })
            .pipe(
                "collate",
                move |items| collate(items, alloc.as_ref(), labels, &names),
                1,
            )
            .measure(Batch::nbytes)
            // Batch lists wait for the collate stage one at a time and batches for the
            // training loop two (one being taken, one ready): the tuner doubles a buffer the
            // consumer waits for, and a step-bound loop never pays for more (the first
            // second's fill sets peak RSS).
            .budget_start(buffer(2).unwrap_or(1))
            .sink_start(buffer(3).unwrap_or(2));
        // The user's per-batch function: a stage of its own between collation and the
        // upload, sized by the tuner; a batch waits for it one at a time.
        if let Some((stage, f)) = &b.map_batches {
            let f = Arc::clone(f);
            let named = plan.clone();
            p = p
                // A failed batch is named by its first item and its size.
                .describe(move |b: &Batch| match b.items.first() {
                    Some(m) => format!(
                        "the batch of {} from {}",
                        b.len(),
                        named.name(m.index, m.epoch)
                    ),
                    None => "an empty batch".to_owned(),
                })
                .pipe(
                    stage,
                    move |batch: Batch| {
                        let rows: Vec<(usize, u64)> =
                            batch.items.iter().map(|m| (m.index, m.epoch)).collect();
                        let mut out = f(batch)?;
                        check_mapped(&rows, labels, &mut out)?;
                        Ok::<_, BoxError>(out)
                    },
                    Workers::auto(),
                )
                .measure(Batch::nbytes)
                .budget_start(1);
        }
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
        // What the stages hold whatever their byte budgets (see `stage_floors`): reserved, so
        // the buffers' budgets share only the rest and the total stays within the budget.
        if let Some((batch, per_batch)) = batch_bound {
            let floor = super::builder::stage_floors(batch, per_batch, decoding, &function_stages);
            p = p.reserve_memory("the stages' floors (batches in flight)", floor);
        }
        // What a state of this loader is valid for.
        p = p
            .checkpoint_fields(fingerprint.iter().cloned())
            .checkpoint_fields(batching_fingerprint(batch_size, b.drop_last))
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
    cache: Option<&crate::byte_cache::ByteCache>,
) -> PipelineBuilder<Decoded> {
    #[cfg(feature = "s3")]
    if let Plan::Items(d) = plan {
        if let Some((s3, keys, concurrency)) = d.objects() {
            return fetch_stage(s3, keys, concurrency, cache).pipe(
                "decode",
                move |(blob, index, epoch): (crate::blob::Blob, usize, u64)| {
                    Ok::<_, BoxError>(Decoded {
                        fields: decoder.fields(crate::dataset::Input::Bytes(blob), epoch)?,
                        meta: ItemMeta {
                            index,
                            epoch,
                            label: None,
                            extras: Vec::new(),
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
    cache: Option<&crate::byte_cache::ByteCache>,
) -> PipelineBuilder<(crate::blob::Blob, usize, u64)> {
    use crate::byte_cache::CacheFuture;
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
    b.measure(|(blob, _, _): &(crate::blob::Blob, usize, u64)| blob.len())
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
                let (mut fields, mut extras) = (decoder.fields(item.input, epoch)?, item.extras);
                if !decoder.media_fields.is_empty() {
                    let name = d.name(i, epoch);
                    super::media_fields::decode(
                        &decoder.media_fields,
                        &name,
                        &mut extras,
                        epoch,
                        &mut fields,
                    )?;
                }
                Ok(Decoded {
                    fields,
                    meta: ItemMeta {
                        index: i,
                        epoch,
                        label: item.label,
                        extras,
                    },
                    rows: None,
                })
            }
            Plan::Batches(b) => b.load(i, epoch, decoder),
        }
    }
}

/// What a checkpoint records of a loader's batching, checked when it is resumed (a state of
/// another batch size or `drop_last` is refused, naming the setting): the same fields for every
/// route, the Python `DataLoader` and `Pipeline` included.
pub fn batching_fingerprint(batch_size: usize, drop_last: bool) -> [(&'static str, String); 2] {
    [
        ("batch_size", batch_size.to_string()),
        ("drop_last", drop_last.to_string()),
    ]
}
