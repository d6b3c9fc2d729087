//! The control plane: one actix actor per stage, on a dedicated control thread.
//!
//! Data never travels through actor mailboxes; actors only carry control messages
//! ([`Resize`], [`SetBudget`], [`SetCacheBytes`], [`SetReadAhead`], [`SetItemThreads`], [`Snapshot`], [`Shutdown`]) to the [`StageControl`] of their
//! stage. The control thread runs an actix `System`; [`ControlPlane`] starts it, hands out the
//! actors' addresses, runs periodic jobs (a stats callback, later the tuner) as actors on it, and
//! stops and joins it on shutdown.

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use actix::prelude::*;
use flowgate_tuner::StageStats;

use crate::error::PipelineError;
use crate::stage::StageControl;

/// Sets a stage's active workers (or async concurrency). Answers the number granted.
#[derive(Debug, Clone, Copy, Message)]
#[rtype(result = "usize")]
pub struct Resize {
    /// Workers wanted.
    pub workers: usize,
}

/// Sets the budget of items and bytes a stage may hold.
#[derive(Debug, Clone, Copy, Message)]
#[rtype(result = "()")]
pub struct SetBudget {
    /// Item limit.
    pub items: usize,
    /// Byte limit.
    pub bytes: u64,
}

/// Sets the byte capacity of a stage's cache.
#[derive(Debug, Clone, Copy, Message)]
#[rtype(result = "()")]
pub struct SetCacheBytes {
    /// Byte capacity.
    pub bytes: u64,
}

/// Sets the depth of a stage's read-ahead.
#[derive(Debug, Clone, Copy, Message)]
#[rtype(result = "()")]
pub struct SetReadAhead {
    /// Objects fetched ahead of the readers.
    pub depth: usize,
}

/// Sets the threads per item of a stage.
#[derive(Debug, Clone, Copy, Message)]
#[rtype(result = "()")]
pub struct SetItemThreads {
    /// Threads each item started from now on may use.
    pub threads: usize,
}

/// Asks a stage for its statistics.
#[derive(Debug, Clone, Copy, Message)]
#[rtype(result = "StageStats")]
pub struct Snapshot;

/// Asks a stage to stop its workers (the pipeline closes the channels and joins threads).
#[derive(Debug, Clone, Copy, Message)]
#[rtype(result = "()")]
pub struct Shutdown;

/// The actor of one stage.
pub struct StageActor {
    control: Arc<dyn StageControl>,
}

impl std::fmt::Debug for StageActor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StageActor")
            .field("stage", &self.control.name())
            .finish()
    }
}

impl Actor for StageActor {
    type Context = Context<Self>;
}

impl Handler<Resize> for StageActor {
    type Result = usize;
    fn handle(&mut self, msg: Resize, _: &mut Context<Self>) -> usize {
        self.control.resize(msg.workers)
    }
}

impl Handler<SetBudget> for StageActor {
    type Result = ();
    fn handle(&mut self, msg: SetBudget, _: &mut Context<Self>) {
        self.control.set_budget(msg.items, msg.bytes);
    }
}

impl Handler<SetCacheBytes> for StageActor {
    type Result = ();
    fn handle(&mut self, msg: SetCacheBytes, _: &mut Context<Self>) {
        self.control.set_cache_bytes(msg.bytes);
    }
}

impl Handler<SetReadAhead> for StageActor {
    type Result = ();
    fn handle(&mut self, msg: SetReadAhead, _: &mut Context<Self>) {
        self.control.set_read_ahead(msg.depth);
    }
}

impl Handler<SetItemThreads> for StageActor {
    type Result = ();
    fn handle(&mut self, msg: SetItemThreads, _: &mut Context<Self>) {
        self.control.set_item_threads(msg.threads);
    }
}

impl Handler<Snapshot> for StageActor {
    type Result = MessageResult<Snapshot>;
    fn handle(&mut self, _: Snapshot, _: &mut Context<Self>) -> Self::Result {
        MessageResult(self.control.snapshot())
    }
}

impl Handler<Shutdown> for StageActor {
    type Result = ();
    fn handle(&mut self, _: Shutdown, ctx: &mut Context<Self>) {
        self.control.stop();
        ctx.stop();
    }
}

/// Runs a closure at a fixed interval on the control thread.
struct Ticker {
    every: Duration,
    tick: Box<dyn FnMut() + Send>,
}

impl Actor for Ticker {
    type Context = Context<Self>;
    fn started(&mut self, ctx: &mut Context<Self>) {
        ctx.run_interval(self.every, |this, _| (this.tick)());
    }
}

type Job = Box<dyn FnOnce() + Send>;

/// The control thread and the stage actors on it.
pub struct ControlPlane {
    system: Option<actix_rt::System>,
    thread: Option<JoinHandle<()>>,
    stages: Vec<(String, Addr<StageActor>)>,
    spawner: Option<actix_rt::ArbiterHandle>,
}

impl std::fmt::Debug for ControlPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<_> = self.stages.iter().map(|(n, _)| n).collect();
        f.debug_struct("ControlPlane")
            .field("stages", &names)
            .finish()
    }
}

impl ControlPlane {
    /// Starts the control thread with one actor per stage, in order.
    pub fn start(controls: Vec<Arc<dyn StageControl>>) -> Result<Self, PipelineError> {
        let (tx, rx) = std::sync::mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("fg-control".to_owned())
            .spawn(move || {
                let runner = actix_rt::System::new();
                let addrs: Vec<_> = runner.block_on(async {
                    controls
                        .into_iter()
                        .map(|control| {
                            let name = control.name().to_owned();
                            (name, StageActor { control }.start())
                        })
                        .collect()
                });
                let system = actix_rt::System::current();
                let arbiter = system.arbiter().clone();
                if tx.send((system, arbiter, addrs)).is_ok() {
                    let _ = runner.run();
                }
            })
            .map_err(|e| PipelineError::runtime_from("spawning the control thread", e))?;
        let (system, arbiter, stages) = rx
            .recv()
            .map_err(|_| PipelineError::runtime("the control thread failed to start"))?;
        Ok(Self {
            system: Some(system),
            thread: Some(thread),
            stages,
            spawner: Some(arbiter),
        })
    }

    /// The stages' names and actor addresses, in pipeline order.
    pub fn stages(&self) -> &[(String, Addr<StageActor>)] {
        &self.stages
    }

    /// Runs `tick` every `every` on the control thread until shutdown.
    pub fn every(&self, every: Duration, tick: impl FnMut() + Send + 'static) {
        self.on_control_thread(Box::new(move || {
            Ticker {
                every,
                tick: Box::new(tick),
            }
            .start();
        }));
    }

    /// Runs `job` on the control thread (to start an actor there).
    pub fn on_control_thread(&self, job: Job) {
        if let Some(a) = &self.spawner {
            a.spawn_fn(job);
        }
    }

    /// Sends `msg` to stage `i` and waits for the answer.
    pub fn ask<M>(&self, i: usize, msg: M) -> Option<M::Result>
    where
        M: Message + Send + 'static,
        M::Result: Send,
        StageActor: Handler<M>,
    {
        let addr = &self.stages.get(i)?.1;
        futures::executor::block_on(addr.send(msg)).ok()
    }

    /// Snapshots of every stage, in order (stages that cannot answer are skipped).
    pub fn snapshot_all(&self) -> Vec<StageStats> {
        let pending: Vec<_> = self.stages.iter().map(|(_, a)| a.send(Snapshot)).collect();
        pending
            .into_iter()
            .filter_map(|f| futures::executor::block_on(f).ok())
            .collect()
    }

    /// Stops every stage actor and the control thread, and joins it. Idempotent.
    pub fn shutdown(&mut self) {
        for (_, addr) in &self.stages {
            let _ = futures::executor::block_on(addr.send(Shutdown));
        }
        self.spawner = None;
        if let Some(system) = self.system.take() {
            system.stop();
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        self.shutdown();
    }
}
