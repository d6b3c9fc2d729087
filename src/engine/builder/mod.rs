//! The typed pipeline builder: [`SourceBuilder`] picks a source, [`PipelineBuilder`] adds
//! stages and options, and [`build`](PipelineBuilder::build) hands the collected
//! [`Plan`](plan::Plan) to `assemble`, which starts everything and makes the [`Pipeline`]
//! from the finished parts.

use std::future::Future;
use std::sync::Arc;

use flowgate_actors::aggregate::AggregateStage;
use flowgate_actors::async_stage::{AsyncSpec, AsyncStage, BoxFuture};
use flowgate_actors::channel::Channel;
use flowgate_actors::error::{BoxError, PipelineError};
use flowgate_actors::failure::FailureBudget;
use flowgate_actors::op::{Describe, FilterMap, Flatten, Map, Op, Sizer};
use flowgate_actors::pool::{PoolSpec, PoolStage};
use flowgate_actors::source::{IterFactory, SourceSpec, SourceStage, StreamFactory};
use flowgate_actors::stage::{StageControl, StageCore};
use flowgate_tuner::StageKind;
use futures::{FutureExt, Stream};
use parking_lot::Mutex;

use crate::engine::config::{AttachedCache, Config, StageOpts, Workers};
use crate::engine::pipeline::Pipeline;
use crate::engine::running::{HasBudget, SourceControl};

mod assemble;
pub(crate) use assemble::memory_budget;
mod plan;
mod settings;

use plan::{Autotune, BuildCtx, Pending, Plan, SpawnSource};

impl Pipeline {
    /// Starts building a pipeline.
    pub fn builder() -> SourceBuilder {
        SourceBuilder::default()
    }
}

/// Starts a pipeline: choose a source. Returned by [`Pipeline::builder`].
#[must_use = "a builder does nothing until a source is added and `build` is called"]
#[derive(Debug, Default)]
pub struct SourceBuilder {
    cfg: Config,
}

/// Adds stages to a pipeline whose items are currently of type `T`, then builds it.
#[must_use = "a builder does nothing until `build` is called"]
pub struct PipelineBuilder<T> {
    c: Plan,
    tail: Arc<Channel<T>>,
    /// Sizer of the items on `tail`, shared with the stage that produces them.
    tail_sizer: Arc<Mutex<Sizer<T>>>,
    tail_describe: Option<Describe<T>>,
    tail_scale: usize,
}

impl<T> std::fmt::Debug for PipelineBuilder<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<_> = self.c.stages.iter().map(|s| s.name.as_str()).collect();
        f.debug_struct("PipelineBuilder")
            .field("config", &self.c.cfg)
            .field("stages", &names)
            .finish_non_exhaustive()
    }
}

impl SourceBuilder {
    fn with_source<T: Send + 'static>(
        self,
        source: SpawnSource,
        sizer: Arc<Mutex<Sizer<T>>>,
        tail: Arc<Channel<T>>,
        needs_runtime: bool,
    ) -> PipelineBuilder<T> {
        PipelineBuilder {
            c: Plan {
                cfg: self.cfg,
                autotune: Some(Autotune::default()),
                source,
                stages: Vec::new(),
                channels: vec![tail.clone() as Arc<dyn HasBudget>],
                needs_runtime,
                on_stats: None,
                on_failure: None,
            },
            tail,
            tail_sizer: sizer,
            tail_describe: None,
            tail_scale: 1,
        }
    }

    /// Items from an iterator, pulled on a dedicated thread. The iterator is used once: the
    /// first epoch yields its items and later epochs are empty. For several epochs use
    /// [`source_epochs`](Self::source_epochs).
    pub fn source<I>(self, iter: I) -> PipelineBuilder<I::Item>
    where
        I: IntoIterator,
        I::IntoIter: Send + 'static,
        I::Item: Send + 'static,
    {
        let mut once = Some(iter.into_iter());
        self.source_epochs(move |_| -> Box<dyn Iterator<Item = I::Item> + Send> {
            match once.take() {
                Some(it) => Box::new(it),
                None => Box::new(std::iter::empty()),
            }
        })
    }

    /// Items of each epoch from `make(epoch)`: re-iterated every epoch (a seeded shuffle can
    /// use the epoch number).
    pub fn source_epochs<F, I>(self, mut make: F) -> PipelineBuilder<I::Item>
    where
        F: FnMut(u64) -> I + Send + 'static,
        I: IntoIterator,
        I::IntoIter: Send + 'static,
        I::Item: Send + 'static,
    {
        let factory: IterFactory<I::Item> = Box::new(move |e| Box::new(make(e).into_iter()));
        let tail = Arc::new(Channel::new(1, u64::MAX));
        let sizer = Arc::new(Mutex::new(crate::measure::auto_sizer()));
        let (out, sz) = (Arc::clone(&tail), Arc::clone(&sizer));
        let spawn: SpawnSource = Box::new(move |ctx, core| {
            let spec = source_spec(ctx, core, out, sz.lock().clone());
            Ok(SourceStage::start_iter(spec, factory)? as Arc<dyn SourceControl>)
        });
        self.with_source(spawn, sizer, tail, false)
    }

    /// Items of each epoch from a [`Sampler`](crate::sampler::Sampler): `make(epoch, index)`
    /// for each dataset index of this rank's share, in the sampler's order.
    ///
    /// Checkpoints of such a pipeline know where its items lie in the epoch's global order,
    /// so the states of every rank can be merged with [`PipelineState::merge`] and resumed
    /// at another world size: the rest of the epoch is dealt out evenly to the new ranks
    /// (see [`Layout`](crate::sampler::Layout)). The sampler's settings (seed, shard
    /// lengths, weights) are added to the [checkpoint fields](PipelineBuilder::checkpoint_fields).
    ///
    /// [`PipelineState::merge`]: crate::PipelineState::merge
    pub fn source_sampled<F, U>(
        self,
        sampler: crate::sampler::Sampler,
        make: F,
    ) -> PipelineBuilder<U>
    where
        F: Fn(u64, usize) -> U + Send + Sync + 'static,
        U: Send + 'static,
    {
        self.source_sampled_planned(sampler, make, |_, _| {})
    }

    /// [`source_sampled`](Self::source_sampled), telling `plan` at the start of each epoch
    /// which dataset indices the source will read in it, in order (this rank's share, less
    /// what a resume skips): what a prefetcher plans from (the shard cache of
    /// [`Shards`](crate::dataset::shards::Shards) on S3).
    pub fn source_sampled_planned<F, U, P>(
        mut self,
        sampler: crate::sampler::Sampler,
        make: F,
        plan: P,
    ) -> PipelineBuilder<U>
    where
        F: Fn(u64, usize) -> U + Send + Sync + 'static,
        U: Send + 'static,
        P: Fn(u64, &[usize]) + Send + Sync + 'static,
    {
        let sharding = crate::engine::sharding::Sharding::new(sampler.clone());
        let shared = sharding.clone();
        let make = Arc::new(make);
        self.cfg.fingerprint.extend(
            sampler
                .fingerprint()
                .into_iter()
                .map(|(k, v)| (k.to_owned(), v)),
        );
        self.cfg.sharding = Some(sharding);
        self.source_epochs(move |epoch| {
            let make = Arc::clone(&make);
            let order = shared.sampler.epoch_after(epoch, shared.base(epoch));
            plan(epoch, &shared.reads(epoch, &order));
            order.into_iter().map(move |i| make(epoch, i))
        })
    }

    /// Items from an async stream, polled on the pipeline's tokio runtime; used once, like
    /// [`source`](Self::source).
    pub fn source_stream<S>(self, stream: S) -> PipelineBuilder<S::Item>
    where
        S: Stream + Send + 'static,
        S::Item: Send + 'static,
    {
        let mut once = Some(stream);
        self.source_stream_epochs(move |_| {
            let s: std::pin::Pin<Box<dyn Stream<Item = S::Item> + Send>> = match once.take() {
                Some(s) => Box::pin(s),
                None => Box::pin(futures::stream::empty()),
            };
            s
        })
    }

    /// Items of each epoch from the stream `make(epoch)`.
    pub fn source_stream_epochs<F, S>(self, mut make: F) -> PipelineBuilder<S::Item>
    where
        F: FnMut(u64) -> S + Send + 'static,
        S: Stream + Send + 'static,
        S::Item: Send + 'static,
    {
        let factory: StreamFactory<S::Item> = Box::new(move |e| Box::pin(make(e)));
        let tail = Arc::new(Channel::new(1, u64::MAX));
        let sizer = Arc::new(Mutex::new(crate::measure::auto_sizer()));
        let (out, sz) = (Arc::clone(&tail), Arc::clone(&sizer));
        let spawn: SpawnSource = Box::new(move |ctx, core| {
            let spec = source_spec(ctx, core, out, sz.lock().clone());
            let rt = ctx
                .runtime
                .as_ref()
                .expect("a stream source requests a runtime");
            Ok(SourceStage::start_stream(spec, factory, rt)? as Arc<dyn SourceControl>)
        });
        self.with_source(spawn, sizer, tail, true)
    }
}

fn source_spec<T>(
    ctx: &BuildCtx,
    core: StageCore,
    output: Arc<Channel<T>>,
    sizer: Sizer<T>,
) -> SourceSpec<T> {
    SourceSpec {
        core,
        output,
        sizer,
        chunk: ctx.cfg.chunk,
        linger: ctx.cfg.linger,
    }
}

impl<T: Send + 'static> PipelineBuilder<T> {
    /// Adds a stage and moves the builder to its output type.
    fn push_stage<U: Send + 'static>(
        mut self,
        name: &str,
        kind: StageKind,
        workers: Workers,
        out_scale: usize,
        spawn: impl FnOnce(
                &BuildCtx,
                StageCore,
                usize,
                Arc<Channel<T>>,
                Arc<Channel<U>>,
                Sizer<U>,
                Option<Describe<T>>,
            ) -> Result<Arc<dyn StageControl>, PipelineError>
            + 'static,
    ) -> PipelineBuilder<U> {
        let output = Arc::new(Channel::<U>::new(1, u64::MAX));
        let sizer: Arc<Mutex<Sizer<U>>> = Arc::new(Mutex::new(crate::measure::auto_sizer()));
        let (input, out, sz, describe) = (
            Arc::clone(&self.tail),
            Arc::clone(&output),
            Arc::clone(&sizer),
            self.tail_describe.take(),
        );
        self.c.stages.push(Pending {
            name: name.to_owned(),
            kind,
            workers,
            in_scale: self.tail_scale,
            input: self.tail.clone(),
            opts: StageOpts::default(),
            spawn: Box::new(move |ctx, core, n| {
                let sizer = sz.lock().clone();
                spawn(ctx, core, n, input, out, sizer, describe)
            }),
        });
        self.c.channels.push(output.clone());
        PipelineBuilder {
            c: self.c,
            tail: output,
            tail_sizer: sizer,
            tail_describe: None,
            tail_scale: out_scale,
        }
    }

    /// A pool stage; `emit_each`: each result goes downstream as soon as it is done, not in
    /// chunks (the uploader: a device batch must not wait in the stage for its chunk).
    fn pool<U: Send + 'static>(
        self,
        name: &str,
        op: Box<dyn Op<T, U>>,
        workers: Workers,
        emit_each: bool,
    ) -> PipelineBuilder<U> {
        let scale = self.tail_scale;
        self.push_stage(
            name,
            StageKind::Pool,
            workers,
            scale,
            move |ctx, core, n, input, output, sizer, describe| {
                let spec = PoolSpec {
                    core,
                    input,
                    output,
                    op,
                    sizer,
                    describe,
                    order: ctx.cfg.order,
                    chunk: if emit_each { 1 } else { ctx.cfg.chunk },
                    max_workers: ctx.cfg.max_workers.max(n),
                    budgeted: ctx.cfg.cpu_budget.is_some(),
                };
                Ok(PoolStage::start(spec, n)? as Arc<dyn StageControl>)
            },
        )
    }

    /// Adds a synchronous stage that maps each item with `f` on a pool of `workers` threads.
    /// An `Err` (or a panic) skips the item and counts it as a failure of this stage.
    pub fn pipe<U, E, F>(self, name: &str, f: F, workers: impl Into<Workers>) -> PipelineBuilder<U>
    where
        F: Fn(T) -> Result<U, E> + Send + Sync + 'static,
        E: Into<BoxError>,
        U: Send + 'static,
    {
        self.pool(name, Box::new(Map(f)), workers.into(), false)
    }

    /// [`pipe`](Self::pipe) whose results go downstream one at a time, as soon as each is
    /// done.
    pub(crate) fn pipe_each<U, E, F>(
        self,
        name: &str,
        f: F,
        workers: impl Into<Workers>,
    ) -> PipelineBuilder<U>
    where
        F: Fn(T) -> Result<U, E> + Send + Sync + 'static,
        E: Into<BoxError>,
        U: Send + 'static,
    {
        self.pool(name, Box::new(Map(f)), workers.into(), true)
    }

    /// Like [`pipe`](Self::pipe), but `Ok(None)` drops the item (a filter).
    pub fn filter_map<U, E, F>(
        self,
        name: &str,
        f: F,
        workers: impl Into<Workers>,
    ) -> PipelineBuilder<U>
    where
        F: Fn(T) -> Result<Option<U>, E> + Send + Sync + 'static,
        E: Into<BoxError>,
        U: Send + 'static,
    {
        self.pool(name, Box::new(FilterMap(f)), workers.into(), false)
    }

    /// Adds an asynchronous stage: `f(item)` runs on the pipeline's tokio runtime with at most
    /// `concurrency` items in flight. For I/O (network reads, object stores).
    pub fn pipe_async<U, E, F, Fut>(
        self,
        name: &str,
        f: F,
        concurrency: impl Into<Workers>,
    ) -> PipelineBuilder<U>
    where
        F: Fn(T) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<U, E>> + Send + 'static,
        E: Into<BoxError> + 'static,
        U: Send + 'static,
    {
        let scale = self.tail_scale;
        let f =
            Arc::new(move |t: T| -> BoxFuture<U> { Box::pin(f(t).map(|r| r.map_err(Into::into))) });
        let mut b = self.push_stage(
            name,
            StageKind::Async,
            concurrency.into(),
            scale,
            move |ctx, core, n, input, output, sizer, describe| {
                let spec = AsyncSpec {
                    core,
                    input,
                    output,
                    f,
                    sizer,
                    describe,
                    order: ctx.cfg.order,
                    max_concurrency: ctx.cfg.max_concurrency.max(n),
                };
                let rt = ctx
                    .runtime
                    .clone()
                    .expect("an async stage requests a runtime");
                Ok(AsyncStage::start(spec, n, rt)? as Arc<dyn StageControl>)
            },
        );
        b.c.needs_runtime = true;
        b
    }

    /// Groups every `size` consecutive items into a `Vec` (a batch). At the end of an epoch a
    /// partial batch is emitted, or dropped if `drop_last`. A batch counts for the bytes of its
    /// items.
    pub fn aggregate(self, size: usize, drop_last: bool) -> PipelineBuilder<Vec<T>> {
        let name = self.unique_name("aggregate");
        let size = size.max(1);
        let scale = self.tail_scale * size;
        self.push_stage(
            &name,
            StageKind::Serial,
            Workers::fixed(1),
            scale,
            move |_ctx, core, _n, input, output, _sizer, _describe| {
                Ok(AggregateStage::start(core, input, output, size, drop_last)?
                    as Arc<dyn StageControl>)
            },
        )
    }

    /// Splits each item (a collection) into its elements.
    pub fn disaggregate(self) -> PipelineBuilder<T::Item>
    where
        T: IntoIterator,
        T::Item: Send + 'static,
    {
        let name = self.unique_name("disaggregate");
        let b = self.pool(&name, Box::new(Flatten), Workers::fixed(1), false);
        PipelineBuilder { tail_scale: 1, ..b }
    }

    fn unique_name(&self, base: &str) -> String {
        let taken = |n: &str| self.c.stages.iter().any(|s| s.name == n);
        if !taken(base) {
            return base.to_owned();
        }
        (2..)
            .map(|i| format!("{base}{i}"))
            .find(|n| !taken(n))
            .expect("an unused name")
    }

    /// How many bytes an item of the current type counts for in budgets (default: its inline
    /// size, `size_of::<T>()`). Measure items that own heap memory (buffers, tensors) so that
    /// byte budgets mean something. Batches from [`aggregate`](Self::aggregate) always count
    /// for the bytes of their items.
    pub fn measure(self, f: impl Fn(&T) -> usize + Send + Sync + 'static) -> Self {
        *self.tail_sizer.lock() = Arc::new(move |t| f(t) as u64);
        self
    }

    /// How the next stage describes a failed item in errors (default: its position, `input #N`).
    /// Called for every item, before the stage's function, so keep it cheap.
    pub fn describe(mut self, f: impl Fn(&T) -> String + Send + Sync + 'static) -> Self {
        self.tail_describe = Some(Arc::new(f));
        self
    }

    /// Sets the budget of the stage added last: how many items, and bytes, it may hold (queued,
    /// in work, and finished but waiting for room downstream).
    pub fn budget(mut self, items: usize, bytes: u64) -> Self {
        if let Some(s) = self.c.stages.last_mut() {
            s.opts.budget_items = Some(items);
            s.opts.budget_bytes = Some(bytes);
        }
        self
    }

    /// Starts the stage added last at an item budget of `items`, which the tuner may change
    /// (where [`budget`](Self::budget) pins it): for a buffer that should start small and
    /// grow only if the consumer waits for it.
    pub fn budget_start(mut self, items: usize) -> Self {
        if let Some(s) = self.c.stages.last_mut() {
            s.opts.start_items = Some(items.max(1));
        }
        self
    }

    /// Attaches `read_ahead` to the stage added last (the one that reads what it fetches):
    /// its depth, reads and waits appear in that stage's statistics, and the tuner deepens it
    /// when readers wait for fetches (see [`Shards::read_ahead`](crate::dataset::shards::Shards::read_ahead)).
    pub fn read_ahead(
        mut self,
        read_ahead: std::sync::Arc<dyn flowgate_actors::attached::ReadAheadControl>,
    ) -> Self {
        if let Some(s) = self.c.stages.last_mut() {
            s.opts.read_ahead = Some(crate::engine::config::AttachedReadAhead(read_ahead));
        }
        self
    }

    /// Attaches `threads` to the stage added last (whose work reads it when it starts an item,
    /// as [`Recipe::item_threads`](crate::media::Recipe::item_threads) does for video): the
    /// tuner gives each item more threads where the stage's workers cannot grow and cores sit
    /// idle, and records it in the trace (see
    /// [`ItemThreadTrials`](crate::tuner::policy::ItemThreadTrials)).
    pub fn item_threads(
        mut self,
        threads: std::sync::Arc<flowgate_actors::attached::ItemThreads>,
    ) -> Self {
        if let Some(s) = self.c.stages.last_mut() {
            s.opts.item_threads = Some(threads);
        }
        self
    }

    /// Attaches `cache` to the stage added last (the one that fetches through it): the cache's
    /// hits, misses and evictions appear in that stage's statistics, and the tuner resizes it
    /// (see [`ByteCache`](crate::byte_cache::ByteCache)).
    pub fn cache(mut self, cache: &crate::byte_cache::ByteCache) -> Self {
        if let Some(s) = self.c.stages.last_mut() {
            s.opts.cache = Some(AttachedCache(Arc::new(cache.clone())));
        }
        self
    }

    /// Sets the failure budget of the stage added last (default: unlimited, skip and count).
    pub fn stage_max_failures(mut self, budget: FailureBudget) -> Self {
        if let Some(s) = self.c.stages.last_mut() {
            s.opts.failures = Some(budget);
        }
        self
    }

    /// Checks the configuration, starts every stage, and returns the pipeline (idle until the
    /// first [`Pipeline::iter`]).
    pub fn build(self) -> Result<Pipeline<T>, PipelineError> {
        assemble::assemble(self.c, self.tail, self.tail_scale)
    }
}

impl PipelineBuilder<crate::tensor::Tensor> {
    /// Batches of `size` items, collated into one tensor (a new first axis) by a `collate`
    /// stage ([`crate::collate::collate`]); a partial batch at the end of an epoch is kept, or
    /// dropped if `drop_last`. Items and batches count for their bytes in budgets.
    pub fn batch(self, size: usize, drop_last: bool) -> PipelineBuilder<crate::tensor::Tensor> {
        use crate::tensor::Tensor;
        self.measure(Tensor::nbytes)
            .aggregate(size, drop_last)
            .pipe(
                "collate",
                |items: Vec<Tensor>| crate::collate::collate(&items),
                1,
            )
            .measure(Tensor::nbytes)
    }
}
