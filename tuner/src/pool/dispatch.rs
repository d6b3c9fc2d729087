//! Handing an epoch's units out to a pool of decode workers, without I/O.
//!
//! The training process cuts an epoch into units (`flowgate::loader::EpochPlan`) and takes
//! them back in plan order. A [`Dispatcher`] keeps the books of that hand-out: which worker
//! holds which unit, which workers have started, the units a dead worker took with it (issued
//! again, first), the workers to start in its place, the retired ones to stop once their units
//! are collected, the epoch that owns the units in hand (a new epoch cancels the last one's),
//! and the [`PoolSizer`]'s windows (the loop's wait, the units taken, the workers' measured
//! rates) with their trace (`windows`). It does nothing itself: each call answers with the
//! [`Command`]s its caller carries out (start a worker, hand it a unit, cancel one, stop a worker), and
//! the caller reports back what happened (a worker answered, a unit arrived, a worker died),
//! with the time. So the same books run Ray actors in the Python package and simulated
//! workers in this module's tests.
//!
//! The rules:
//! - Units are issued in plan order, each to the started worker (or the training process's
//!   own decoder, [`LOCAL`]) with the fewest in hand, while the units issued past the one the
//!   loop waits for are fewer than [`WINDOW_PER_WORKER`] per worker and that worker holds
//!   fewer than that.
//! - A dead worker's units are issued again before any new one; a pinned pool starts a
//!   worker in its place, a sized one keeps its floor (the sizer grows it). Workers that die
//!   before they answer [`STARTUP_DEATHS`] times in a row are a configuration error
//!   ([`DispatchError::StartupDeaths`]), not lost workers; so is a unit that
//!   [`UNIT_DEATHS`] workers died decoding (the first unit each held;
//!   [`DispatchError::UnitDeaths`]: decoding it kills them). Working workers killed from
//!   outside, several at once, are neither: their units are issued again and the pool goes
//!   on.
//! - A retired worker takes no new units and is stopped once the loop has its last one.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt;

use super::{PoolLimits, PoolSizer};

mod windows;
pub use windows::{TraceRecord, WindowRecord, TRACE_WINDOWS};

/// Units issued past the one the loop waits for, per worker, and units one worker holds, at
/// most: enough to keep a worker busy while its last result travels, few enough that a lost
/// worker costs little decoding again.
pub const WINDOW_PER_WORKER: usize = 2;
/// Seconds between the sizer's windows.
pub const WINDOW_SECONDS: f64 = 1.0;
/// Workers dying before they answer this many times in a row: their decoder cannot be built
/// where they run (an error to raise), not bad luck to retry.
pub const STARTUP_DEATHS: u32 = 3;
/// Workers that died decoding the same unit: it kills them (memory, a crashing
/// decoder), so issuing it again would kill the next one too.
pub const UNIT_DEATHS: u32 = 3;

/// A worker's name in commands and reports: [`LOCAL`] is the training process's own decoder,
/// remote workers count from 1 in the order they were started.
pub type WorkerId = u64;
/// The training process's own decoder.
pub const LOCAL: WorkerId = 0;

/// How many remote workers the pool has.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum PoolSize {
    /// Exactly this many (a dead one is replaced).
    Pinned(usize),
    /// Sized by a [`PoolSizer`] within these limits (their `local` is the settings').
    Auto(PoolLimits),
}

/// A [`Dispatcher`]'s settings.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DispatchSettings {
    /// The pool's size.
    pub size: PoolSize,
    /// Whether the training process decodes units too ([`LOCAL`]).
    pub local: bool,
    /// See [`WINDOW_PER_WORKER`].
    pub window_per_worker: usize,
    /// See [`WINDOW_SECONDS`].
    pub window_seconds: f64,
    /// Seconds the loop may wait with no worker to hand a unit to before
    /// [`Dispatcher::stalled`] says so.
    pub start_timeout: f64,
}

impl DispatchSettings {
    /// A pool of `size`, with the default windows and a start timeout of 300 s.
    pub fn new(size: PoolSize, local: bool) -> Self {
        Self {
            size,
            local,
            window_per_worker: WINDOW_PER_WORKER,
            window_seconds: WINDOW_SECONDS,
            start_timeout: 300.0,
        }
    }
}

/// What the caller does for the dispatcher.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Command {
    /// Start a worker; it reports [`Dispatcher::ready`] once it answers, or
    /// [`Dispatcher::died`].
    Start(WorkerId),
    /// Hand unit `unit` of the current epoch to `worker`.
    Issue {
        /// Who decodes it.
        worker: WorkerId,
        /// The unit.
        unit: usize,
    },
    /// Drop `unit` in `worker`'s hands: its epoch ended; cancel it where it has not started,
    /// and never read its result.
    Cancel {
        /// Who holds it.
        worker: WorkerId,
        /// The unit.
        unit: usize,
    },
    /// Stop the worker: it holds nothing the loop still wants.
    Kill(WorkerId),
}

/// A call the dispatcher refuses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DispatchError {
    /// [`STARTUP_DEATHS`] workers in a row died before they answered.
    StartupDeaths {
        /// How many.
        deaths: u32,
        /// The last one's error (its last line).
        last: String,
    },
    /// [`UNIT_DEATHS`] workers died decoding `unit` (the first unit each held).
    UnitDeaths {
        /// The unit.
        unit: usize,
        /// How many workers died decoding it.
        deaths: u32,
        /// The last one's error (its last line).
        last: String,
    },
    /// A unit reported arrived that no worker holds in this epoch.
    NotInHand(usize),
}

impl fmt::Display for DispatchError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::StartupDeaths { deaths, last } => write!(
                f,
                "{deaths} workers in a row died before they answered, the last with: {last}"
            ),
            Self::UnitDeaths { unit, deaths, last } => write!(
                f,
                "{deaths} workers died decoding unit {unit} (it kills them: memory, \
                 or a crashing decoder), the last with: {last}"
            ),
            Self::NotInHand(unit) => write!(f, "unit {unit} is in no worker's hands"),
        }
    }
}

impl std::error::Error for DispatchError {}

#[derive(Debug)]
struct Worker {
    id: WorkerId,
    /// Units in hand, oldest first.
    units: VecDeque<usize>,
    finished: u64,
    busy_seconds: f64,
    ready: bool,
    retiring: bool,
}

impl Worker {
    fn new(id: WorkerId) -> Self {
        Self {
            id,
            units: VecDeque::new(),
            finished: 0,
            busy_seconds: 0.0,
            // The local decoder is there from the start.
            ready: id == LOCAL,
            retiring: false,
        }
    }
}

/// The hand-out's books; see the [module docs](self).
#[derive(Debug)]
pub struct Dispatcher {
    settings: DispatchSettings,
    sizer: Option<PoolSizer>,
    /// Remote workers, in the order started.
    workers: Vec<Worker>,
    local: Option<Worker>,
    started: u64,
    /// The epoch owning the units in hand (0: none).
    token: u64,
    tokens: u64,
    units: usize,
    issued: usize,
    /// The unit the loop waits for next.
    at: usize,
    /// Units lost with a dead worker, to issue again.
    lost: BTreeSet<usize>,
    waiting_since: Option<f64>,
    no_hands_since: Option<f64>,
    t0: f64,
    window_start: f64,
    waited: f64,
    consumed: u64,
    deaths_before_ready: u32,
    /// Workers that died decoding each unit of this epoch (the first unit each held).
    unit_deaths: BTreeMap<usize, u32>,
    reissued: u64,
    units_by_workers: u64,
    trace: VecDeque<TraceRecord>,
}

impl Dispatcher {
    /// A pool at `now` (seconds, any monotonic origin), and the workers to start first: a
    /// pinned pool's size, a sized one's floor (at least one unless the training process
    /// decodes too).
    pub fn new(settings: DispatchSettings, now: f64) -> (Self, Vec<Command>) {
        let (sizer, initial) = match settings.size {
            PoolSize::Pinned(n) => (None, n),
            PoolSize::Auto(limits) => {
                let sizer = PoolSizer::new(PoolLimits {
                    local: settings.local,
                    ..limits
                });
                let l = sizer.limits();
                (Some(sizer), l.min_workers.min(l.max_workers))
            }
        };
        let mut d = Self {
            settings,
            sizer,
            workers: Vec::new(),
            local: settings.local.then(|| Worker::new(LOCAL)),
            started: 0,
            token: 0,
            tokens: 0,
            units: 0,
            issued: 0,
            at: 0,
            lost: BTreeSet::new(),
            waiting_since: None,
            no_hands_since: None,
            t0: now,
            window_start: now,
            waited: 0.0,
            consumed: 0,
            deaths_before_ready: 0,
            unit_deaths: BTreeMap::new(),
            reissued: 0,
            units_by_workers: 0,
            trace: VecDeque::new(),
        };
        let out = (0..initial).map(|_| d.start()).collect();
        (d, out)
    }

    /// A new epoch of `units` units takes the pool; the units of any other are cancelled.
    /// Returns its token (see [`token`](Self::token)).
    pub fn begin(&mut self, units: usize) -> (u64, Vec<Command>) {
        let mut out = self.abandon();
        // A death the last epoch ended on (an error) left the pool under its floor.
        while self.workers() < self.floor() {
            out.push(self.start());
        }
        self.tokens += 1;
        self.token = self.tokens;
        self.units = units;
        (self.token, out)
    }

    /// The epoch owning the pool (0: none): an epoch whose token this is not was abandoned.
    pub fn token(&self) -> u64 {
        self.token
    }

    /// No epoch owns the pool: the units in hand are cancelled, retired workers stopped.
    pub fn abandon(&mut self) -> Vec<Command> {
        self.token = 0;
        self.units = 0;
        self.issued = 0;
        self.at = 0;
        self.lost.clear();
        self.unit_deaths.clear();
        self.waiting_since = None;
        self.no_hands_since = None;
        let mut out = Vec::new();
        for w in self.workers.iter_mut().chain(self.local.as_mut()) {
            out.extend(
                w.units
                    .drain(..)
                    .map(|unit| Command::Cancel { worker: w.id, unit }),
            );
        }
        self.reap(&mut out);
        out
    }

    /// Everything stops: the units in hand are cancelled and every worker stopped.
    pub fn close(&mut self) -> Vec<Command> {
        let mut out = self.abandon();
        out.extend(self.workers.drain(..).map(|w| Command::Kill(w.id)));
        out
    }

    /// Worker `worker` answered: it takes units from now on.
    pub fn ready(&mut self, worker: WorkerId) {
        if let Some(w) = self.workers.iter_mut().find(|w| w.id == worker) {
            w.ready = true;
            self.deaths_before_ready = 0;
        }
    }

    /// The workers that take units: the started, not retiring remote ones in the order they
    /// started, then the local decoder.
    pub fn hands(&self) -> Vec<WorkerId> {
        self.remote()
            .filter(|w| w.ready)
            .map(|w| w.id)
            .chain(self.local.as_ref().map(|w| w.id))
            .collect()
    }

    /// Remote workers that count (started or starting, not retiring).
    pub fn workers(&self) -> usize {
        self.remote().count()
    }

    /// The fewest remote workers the pool keeps: a pinned pool's size, a sized one's floor,
    /// and one at least where the training process does not decode.
    fn floor(&self) -> usize {
        let floor = match (&self.sizer, self.settings.size) {
            (Some(s), _) => s.limits().min_workers,
            (None, PoolSize::Pinned(n)) => n,
            (None, PoolSize::Auto(l)) => l.min_workers,
        };
        floor.max(usize::from(self.local.is_none()))
    }

    /// Workers not ready yet: the caller asks these whether they answered.
    pub fn starting(&self) -> Vec<WorkerId> {
        self.workers
            .iter()
            .filter(|w| !w.ready)
            .map(|w| w.id)
            .collect()
    }

    /// Hands out units: first those lost with a dead worker, then new ones within the
    /// window, each to the hand with the fewest in hand.
    pub fn fill(&mut self) -> Vec<Command> {
        let mut out = Vec::new();
        if self.token == 0 {
            return out;
        }
        let hands = self.hands();
        if hands.is_empty() {
            return out;
        }
        self.no_hands_since = None;
        while let Some(unit) = self.lost.pop_first() {
            let worker = self.least_busy(&hands);
            self.hand(worker, unit, &mut out);
        }
        let window = self.settings.window_per_worker.max(1);
        while self.issued < self.units && self.issued - self.at < window * hands.len() {
            let worker = self.least_busy(&hands);
            if self.held(worker) >= window {
                break;
            }
            let unit = self.issued;
            self.hand(worker, unit, &mut out);
            self.issued += 1;
        }
        out
    }

    /// The unit the loop takes next, or None at the epoch's end (or with no epoch).
    pub fn next_unit(&self) -> Option<usize> {
        (self.token != 0 && self.at < self.units).then_some(self.at)
    }

    /// Who holds `unit` of the current epoch.
    pub fn holder(&self, unit: usize) -> Option<WorkerId> {
        self.all().find(|w| w.units.contains(&unit)).map(|w| w.id)
    }

    /// The current epoch's units in the hands of the workers that count (remote ones not
    /// retiring, and the local decoder): the caller counts those decoded for
    /// [`resize`](Self::resize).
    pub fn in_hand(&self) -> Vec<(WorkerId, usize)> {
        self.remote()
            .chain(self.local.as_ref())
            .flat_map(|w| w.units.iter().map(|&u| (w.id, u)))
            .collect()
    }

    /// The loop waits for the next unit from `now` (a wait already running goes on).
    pub fn waiting(&mut self, now: f64) {
        self.waiting_since.get_or_insert(now);
    }

    /// With no worker to hand units to, the seconds the loop has waited for one, once that
    /// is more than the start timeout; None otherwise.
    pub fn stalled(&mut self, now: f64) -> Option<f64> {
        if !self.hands().is_empty() {
            self.no_hands_since = None;
            return None;
        }
        let since = *self
            .no_hands_since
            .get_or_insert(self.waiting_since.unwrap_or(now));
        (now - since > self.settings.start_timeout).then_some(now - since)
    }

    /// The next unit arrived (the loop has it) from whoever held it, decoded in `seconds`:
    /// the loop's wait ends, retired workers with nothing more in hand are stopped.
    pub fn done(
        &mut self,
        unit: usize,
        seconds: f64,
        now: f64,
    ) -> Result<Vec<Command>, DispatchError> {
        if self.next_unit() != Some(unit) {
            return Err(DispatchError::NotInHand(unit));
        }
        let w = self
            .workers
            .iter_mut()
            .chain(self.local.as_mut())
            .find(|w| w.units.contains(&unit))
            .ok_or(DispatchError::NotInHand(unit))?;
        w.units.retain(|&u| u != unit);
        w.finished += 1;
        w.busy_seconds += seconds.max(0.0);
        if w.id != LOCAL {
            self.units_by_workers += 1;
        }
        self.unit_deaths.remove(&unit);
        self.at += 1;
        self.consumed += 1;
        if let Some(since) = self.waiting_since.take() {
            self.waited += (now - since).max(0.0);
        }
        let mut out = Vec::new();
        self.reap(&mut out);
        Ok(out)
    }

    /// Worker `worker` died (or its start failed) with `error`: its units are issued again
    /// (by the next [`fill`](Self::fill)), and a worker is started in its place where the
    /// pool is under its size.
    pub fn died(
        &mut self,
        worker: WorkerId,
        error: &str,
        now: f64,
    ) -> Result<Vec<Command>, DispatchError> {
        let Some(i) = self.workers.iter().position(|w| w.id == worker) else {
            return Ok(Vec::new());
        };
        let w = self.workers.remove(i);
        let lost = w.units.len();
        self.lost.extend(w.units.iter().copied());
        self.reissued += lost as u64;
        let last = || {
            let last = error.trim().lines().last().unwrap_or_default();
            let last: String = last.chars().take(500).collect();
            if last.is_empty() {
                "no message".into()
            } else {
                last
            }
        };
        if !w.ready {
            self.deaths_before_ready += 1;
            if self.deaths_before_ready >= STARTUP_DEATHS {
                return Err(DispatchError::StartupDeaths {
                    deaths: self.deaths_before_ready,
                    last: last(),
                });
            }
        }
        // Blamed on the unit it was decoding, the first it held: the ones queued behind it
        // did not kill it (a unit issued again to a worker already dead but not yet
        // reported would otherwise count that death too).
        if let Some(&unit) = w.units.front() {
            let deaths = self.unit_deaths.entry(unit).or_default();
            *deaths += 1;
            if *deaths >= UNIT_DEATHS {
                return Err(DispatchError::UnitDeaths {
                    unit,
                    deaths: *deaths,
                    last: last(),
                });
            }
        }
        let mut out = Vec::new();
        if !w.retiring && self.workers() < self.floor() {
            out.push(self.start());
        }
        if self.hands().is_empty() {
            // The loop's wait for a worker counts from here.
            self.no_hands_since = Some(now);
        }
        self.record(
            now,
            None,
            vec![format!(
                "worker {worker} died with {lost} units in hand: issued again"
            )],
        );
        Ok(out)
    }

    /// Remote workers started so far (replacements included).
    pub fn started(&self) -> u64 {
        self.started
    }

    /// Units issued again after their worker died.
    pub fn reissued(&self) -> u64 {
        self.reissued
    }

    /// Units remote workers decoded (as the loop took them).
    pub fn units_by_workers(&self) -> u64 {
        self.units_by_workers
    }

    /// Units the training process decoded.
    pub fn units_local(&self) -> u64 {
        self.local.as_ref().map_or(0, |w| w.finished)
    }

    fn start(&mut self) -> Command {
        self.started += 1;
        self.workers.push(Worker::new(self.started));
        Command::Start(self.started)
    }

    fn remote(&self) -> impl Iterator<Item = &Worker> {
        self.workers.iter().filter(|w| !w.retiring)
    }

    fn all(&self) -> impl Iterator<Item = &Worker> {
        self.workers.iter().chain(self.local.as_ref())
    }

    fn held(&self, worker: WorkerId) -> usize {
        self.all()
            .find(|w| w.id == worker)
            .map_or(0, |w| w.units.len())
    }

    /// Of `hands`, the first with the fewest units in hand.
    fn least_busy(&self, hands: &[WorkerId]) -> WorkerId {
        *hands
            .iter()
            .min_by_key(|&&id| self.held(id))
            .expect("hands to choose from")
    }

    fn hand(&mut self, worker: WorkerId, unit: usize, out: &mut Vec<Command>) {
        if let Some(w) = self
            .workers
            .iter_mut()
            .chain(self.local.as_mut())
            .find(|w| w.id == worker)
        {
            w.units.push_back(unit);
            out.push(Command::Issue { worker, unit });
        }
    }

    fn retire_idlest(&mut self, out: &mut Vec<Command>) {
        if let Some(w) = self
            .workers
            .iter_mut()
            .filter(|w| !w.retiring)
            .min_by_key(|w| w.units.len())
        {
            w.retiring = true;
        }
        self.reap(out);
    }

    /// Stops retired workers with nothing in hand.
    fn reap(&mut self, out: &mut Vec<Command>) {
        self.workers.retain(|w| {
            let gone = w.retiring && w.units.is_empty();
            if gone {
                out.push(Command::Kill(w.id));
            }
            !gone
        });
    }
}

#[cfg(test)]
mod tests;
