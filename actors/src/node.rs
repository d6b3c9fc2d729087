//! A node's CPU budget, shared by the ranks on one host.
//!
//! `torchrun --nproc_per_node=8` starts eight loaders on one node. Without a shared budget each
//! takes a fixed share of the cores ([`cap`](crate::cap)); with one, the ranks draw from one
//! pool of cores: a rank whose consumer waits uses the cores a step-bound rank leaves idle,
//! and the node never runs more decode work at once than the budget.
//!
//! # The ledger
//!
//! The budget is a file (`/dev/shm/flowgate-cpu-<key>-<cores>`) whose first `cores` bytes are
//! the cores. A pool worker holds a core for each item it runs: an exclusive open-file-
//! description lock (`F_OFD_SETLK`) on one of those bytes, taken before the stage's function
//! and released right after it. The kernel is the ledger: a worker that blocks (on its input,
//! on a full output) holds nothing, so a step-bound rank gives its cores back by itself; at no
//! instant do more items run than the budget has cores; and a process that dies (SIGKILL
//! included) releases its locks with its file descriptors, at once, with no lease to expire.
//! The file outlives every rank, so a rank restarted by `torchrun` joins the same ledger.
//!
//! A worker that finds every core taken enters the *waiting room* (a shared lock on byte
//! `cores`) and sleeps on a futex in the file's first page (mapped by every process on the
//! ledger), which every release bumps and wakes: a freed core is taken within microseconds,
//! and a holder that died (no release) is noticed within 5 ms. A worker that releases a core
//! while someone waits pauses 200 µs before its next item, so the waiter takes the core: the
//! cores rotate between waiting workers item by item, whichever process they are in.
//!
//! Ranks join the same ledger when they share the key: `FLOWGATE_NODE_KEY` if set, else
//! `torchrun`'s `TORCHELASTIC_RUN_ID` and `MASTER_PORT`, else the user id (every flowgate
//! process of the user on the host). Ranks must ask for the same budget: a different number
//! of cores is a different ledger.
//!
//! Limits: a rank stopped with SIGSTOP while running an item keeps its core until it
//! continues; Linux only (elsewhere a budget is refused at construction).

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use parking_lot::RwLock;

mod budget;
mod file;

pub use budget::{node_cores, node_key, CpuBudget, MAX_CORES};
use file::{check_owner, getlk, open_ledger, setlk, Mapping};

/// Longest sleep of a worker waiting for a core between two looks (it is woken at the next
/// release; this covers a holder that died).
const POLL_MAX: Duration = Duration::from_millis(5);
/// How long a worker that released a core while others wait stays off the cores (a woken
/// waiter runs within tens of microseconds).
const YIELD: Duration = Duration::from_micros(200);

/// A joined ledger: see the module docs.
#[derive(Debug)]
pub struct NodeCores {
    dir: PathBuf,
    key: String,
    path: PathBuf,
    cores: usize,
    /// Distinguishes ledgers a process joined one after another (thread-local descriptors).
    id: u64,
    /// A descriptor that never holds a core: for counting the node's.
    query: File,
    /// The file's first page, shared by every process on the ledger: a word that counts
    /// releases, which waiting workers sleep on (a futex) to wake as soon as a core frees.
    wake: Mapping,
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);
static NODE: RwLock<Option<Arc<NodeCores>>> = RwLock::new(None);
/// Cores this process's workers hold now.
static HELD: AtomicUsize = AtomicUsize::new(0);
/// Nanoseconds of cores held by this process's workers, released holds only.
static HELD_NS: AtomicU64 = AtomicU64::new(0);
/// The sum of the open holds' starts ([`now_ns`], wrapping): with [`HELD`], the time they
/// have held so far, so that a tick counts what was held during it (counted at release, a
/// hold across ticks went whole to the one it ended in: 1.35 cores of a 1-core budget).
static OPEN_STARTS: AtomicU64 = AtomicU64::new(0);
/// A spin lock over the three (held for a few instructions): a reader sees them agree. Not a
/// `Mutex`: a forked child resets it, where a parent's thread may have held it.
static HOLDS: AtomicBool = AtomicBool::new(false);
/// Nanoseconds this process's workers waited for a core.
static WAIT_NS: AtomicU64 = AtomicU64::new(0);

impl NodeCores {
    /// Opens (creating it if needed) the ledger of `cores` cores under `key` in `dir`.
    pub fn open_in(dir: &Path, key: &str, cores: usize) -> std::io::Result<Self> {
        if !(1..=MAX_CORES).contains(&cores) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("a node CPU budget of {cores} cores (1 to {MAX_CORES})"),
            ));
        }
        // SAFETY: getuid cannot fail.
        let uid = unsafe { libc::getuid() };
        let path = dir.join(format!("flowgate-cpu-u{uid}-{key}-{cores}"));
        let query = open_ledger(&path)?;
        check_owner(&query, &path, uid)?;
        // Probe once: a file system without OFD locks fails here, not in a worker.
        getlk(&query, 0)?;
        Ok(Self {
            dir: dir.to_path_buf(),
            key: key.to_owned(),
            path,
            cores,
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            wake: Mapping::new(&query)?,
            query,
        })
    }

    /// Opens the ledger of `budget` for this node's ranks (see [`node_key`]), in `/dev/shm`
    /// (the temporary directory where there is none).
    pub fn open(budget: CpuBudget) -> std::io::Result<Self> {
        let shm = Path::new("/dev/shm");
        let dir = if shm.is_dir() {
            shm.to_path_buf()
        } else {
            std::env::temp_dir()
        };
        Self::open_in(&dir, &node_key(), budget.cores())
    }

    /// The budget's cores.
    pub fn cores(&self) -> usize {
        self.cores
    }

    /// The ledger file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Cores held now by every process on the ledger.
    pub fn in_use(&self) -> usize {
        (0..self.cores)
            .filter(|&k| getlk(&self.query, k as u64).unwrap_or(false))
            .count()
    }

    /// Whether some worker (of any process) waits for a core now.
    pub fn someone_waits(&self) -> bool {
        getlk(&self.query, self.cores as u64).unwrap_or(false)
    }

    /// Whether the ledger's file was removed or replaced since this process opened it (a
    /// cleanup of `/dev/shm`, say): ranks that open it now would start a new ledger.
    pub fn is_stale(&self) -> bool {
        use std::os::unix::fs::MetadataExt;
        match (std::fs::symlink_metadata(&self.path), self.query.metadata()) {
            (Ok(now), Ok(ours)) => now.ino() != ours.ino() || now.dev() != ours.dev(),
            _ => true,
        }
    }

    /// Holds a core on this ledger from the calling thread (its own descriptor), waiting for
    /// one while `stop()` is false. `Ok(None)` once `stop()` says so; an error when the
    /// thread cannot open its descriptor (out of file descriptors, say).
    pub fn hold(self: &Arc<Self>, stop: &dyn Fn() -> bool) -> std::io::Result<Option<CoreHeld>> {
        THREAD.with(|cell| {
            let mut slot = cell.borrow_mut();
            if slot.as_ref().is_none_or(|t| t.id != self.id) {
                let file = open_ledger(&self.path).map_err(|e| {
                    std::io::Error::new(
                        e.kind(),
                        format!("holding a core of the node's CPU budget: {e}"),
                    )
                })?;
                *slot = Some(ThreadLedger::new(self.id, file));
            }
            let t = slot.as_mut().expect("set above");
            let t0 = Instant::now();
            if let Some(until) = t.yield_until.take() {
                if let Some(d) = until.checked_duration_since(t0) {
                    std::thread::sleep(d);
                }
            }
            let got = self.acquire(t, stop);
            WAIT_NS.fetch_add(nanos(t0.elapsed()), Ordering::Relaxed);
            Ok(got.map(|core| {
                hold_began();
                HERE.set(Some(core));
                CoreHeld {
                    node: Arc::clone(self),
                }
            }))
        })
    }

    /// Locks a free core's byte on `t`'s descriptor, sleeping in the waiting room while
    /// none is free and `stop()` is false.
    fn acquire(&self, t: &mut ThreadLedger, stop: &dyn Fn() -> bool) -> Option<usize> {
        let mut in_room = false;
        loop {
            let seen = self.wake.releases().load(Ordering::Acquire);
            for j in 0..self.cores {
                let k = (t.start + j) % self.cores;
                if setlk(&t.file, k as u64, libc::F_WRLCK as i16).unwrap_or(false) {
                    if in_room {
                        let _ = setlk(&t.file, self.cores as u64, libc::F_UNLCK as i16);
                    }
                    t.start = k;
                    return Some(k);
                }
            }
            if !in_room {
                in_room = setlk(&t.file, self.cores as u64, libc::F_RDLCK as i16).unwrap_or(false);
            }
            if stop() {
                if in_room {
                    let _ = setlk(&t.file, self.cores as u64, libc::F_UNLCK as i16);
                }
                return None;
            }
            // Woken by the next release on the node; the timeout covers a holder that died
            // (its lock went without a release count).
            self.wake.wait(seen, POLL_MAX);
        }
    }
}

/// Runs `wait` with the calling thread's core given back, if it holds one, and holds one
/// again after (waiting for it): for a stage's function that consumes another budgeted
/// loader (a loader inside a pipeline's map). Without it, the function would wait for
/// results while holding a core the inner loader's workers need: on a budget of one core,
/// for ever. The sink's blocking waits call it.
pub fn released_while<R>(wait: impl FnOnce() -> R) -> R {
    let Some(core) = HERE.take() else {
        return wait();
    };
    let node = THREAD.with(|cell| {
        let slot = cell.borrow();
        let t = slot.as_ref()?;
        let _ = setlk(&t.file, core as u64, libc::F_UNLCK as i16);
        if let Some(n) = current().filter(|n| n.id == t.id) {
            n.wake
                .released(getlk(&t.file, n.cores as u64).unwrap_or(false));
        }
        Some(t.id)
    });
    hold_ended();
    let r = wait();
    let again = THREAD.with(|cell| {
        let mut slot = cell.borrow_mut();
        let t = slot.as_mut().filter(|t| Some(t.id) == node)?;
        let n = current().filter(|n| n.id == t.id)?;
        n.acquire(t, &|| false)
    });
    if let Some(k) = again {
        hold_began();
        HERE.set(Some(k));
    }
    r
}

/// A core held by the calling thread; released when dropped (on the same thread).
#[derive(Debug)]
pub struct CoreHeld {
    node: Arc<NodeCores>,
}

impl Drop for CoreHeld {
    fn drop(&mut self) {
        // (Given back while the thread waited and not held again: already ended.)
        hold_ended();
        THREAD.with(|cell| {
            let mut slot = cell.borrow_mut();
            let Some(t) = slot.as_mut().filter(|t| t.id == self.node.id) else {
                return; // that descriptor is closed: the lock went with it
            };
            let Some(core) = HERE.take() else {
                return; // given back while the thread waited, and not held again
            };
            let _ = setlk(&t.file, core as u64, libc::F_UNLCK as i16);
            // Someone waits: wake them, and stay off the cores a moment so they take this one.
            let waits = getlk(&t.file, self.node.cores as u64).unwrap_or(false);
            self.node.wake.released(waits);
            if waits {
                t.yield_until = Some(Instant::now() + YIELD);
            }
        });
    }
}

struct ThreadLedger {
    id: u64,
    file: File,
    /// The core tried first (the last one held: spreads threads over the bytes).
    start: usize,
    yield_until: Option<Instant>,
    /// This descriptor's slot in [`THREAD_FDS`].
    registered: Option<usize>,
}

impl ThreadLedger {
    fn new(id: u64, file: File) -> Self {
        use std::os::fd::AsRawFd;
        let fd = file.as_raw_fd();
        let registered = THREAD_FDS.iter().position(|s| {
            s.compare_exchange(0, fd, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
        });
        ensure_fork_handler();
        Self {
            id,
            file,
            start: NEXT_START.fetch_add(1, Ordering::Relaxed),
            yield_until: None,
            registered,
        }
    }
}

impl Drop for ThreadLedger {
    fn drop(&mut self) {
        if let Some(i) = self.registered {
            THREAD_FDS[i].store(0, Ordering::Release);
        }
    }
}

static NEXT_START: AtomicUsize = AtomicUsize::new(0);

/// Every worker thread's ledger descriptor (0: a free slot): a forked child closes its copies
/// at once. Each copy refers to the parent's open file description, whose locks would
/// otherwise outlive the parent (a rank killed with SIGKILL would keep its cores while a
/// child it forked — a DataLoader worker — lives).
static THREAD_FDS: [std::sync::atomic::AtomicI32; 1024] =
    [const { std::sync::atomic::AtomicI32::new(0) }; 1024];

/// Registers [`reset_after_fork`] to run in every child this process forks (`pthread_atfork`),
/// once.
fn ensure_fork_handler() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    extern "C" fn in_child() {
        reset_after_fork();
    }
    ONCE.call_once(|| {
        // SAFETY: registers a handler with no prepare or parent part; `in_child` only
        // closes descriptors and stores atomics (and touches this thread's slot).
        unsafe {
            libc::pthread_atfork(None, None, Some(in_child));
        }
    });
}

thread_local! {
    static THREAD: std::cell::RefCell<Option<ThreadLedger>> =
        const { std::cell::RefCell::new(None) };
    /// The core the calling thread holds, if any.
    static HERE: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
    /// When the calling thread's hold began ([`now_ns`]), while it holds one.
    static SINCE: std::cell::Cell<Option<u64>> = const { std::cell::Cell::new(None) };
}

/// Nanoseconds since the process's first hold.
fn now_ns() -> u64 {
    static BASE: OnceLock<Instant> = OnceLock::new();
    nanos(BASE.get_or_init(Instant::now).elapsed())
}

/// Runs `f` holding [`HOLDS`].
fn with_holds<R>(f: impl FnOnce() -> R) -> R {
    while HOLDS
        .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
        .is_err()
    {
        std::thread::yield_now();
    }
    let r = f();
    HOLDS.store(false, Ordering::Release);
    r
}

/// The calling thread holds a core from now.
fn hold_began() {
    let t = now_ns();
    SINCE.set(Some(t));
    with_holds(|| {
        HELD.fetch_add(1, Ordering::Relaxed);
        OPEN_STARTS.fetch_add(t, Ordering::Relaxed);
    });
}

/// The calling thread's hold, if it has one, ends now.
fn hold_ended() {
    let Some(since) = SINCE.take() else {
        return;
    };
    let t = now_ns();
    with_holds(|| {
        HELD.fetch_sub(1, Ordering::Relaxed);
        OPEN_STARTS.fetch_sub(since, Ordering::Relaxed);
        HELD_NS.fetch_add(t.saturating_sub(since), Ordering::Relaxed);
    });
}

fn nanos(d: Duration) -> u64 {
    d.as_nanos().min(u64::MAX as u128) as u64
}

/// Makes `node` the ledger this process's pool workers hold cores on (`None`: no node
/// budget, each process within its own share). Returns the one it replaces.
pub fn set_node(node: Option<Arc<NodeCores>>) -> Option<Arc<NodeCores>> {
    std::mem::replace(&mut *NODE.write(), node)
}

/// The ledger this process's pool workers hold cores on, if any.
pub fn current() -> Option<Arc<NodeCores>> {
    NODE.read().clone()
}

/// Joins the ledger of `budget` (see [`NodeCores::open`]) unless this process is on it
/// already; returns it. A process is on one budget at most: another size is an error (leave
/// the first with [`set_node`]`(None)`).
pub fn join(budget: CpuBudget) -> std::io::Result<Arc<NodeCores>> {
    let cores = budget.cores();
    let mut g = NODE.write();
    match g.as_ref() {
        Some(n) if n.cores == cores => Ok(Arc::clone(n)),
        Some(n) => Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!(
                "this process already shares a node CPU budget of {} cores; every loader of a \
                 process shares the same one (asked for {cores})",
                n.cores
            ),
        )),
        None => {
            let node = Arc::new(NodeCores::open(budget)?);
            *g = Some(Arc::clone(&node));
            Ok(node)
        }
    }
}

/// What this process's workers did on the node's ledger, since it started.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ProcessCores {
    /// Cores held now.
    pub held: usize,
    /// Core-nanoseconds held, up to now (the holds still open too).
    pub held_ns: u64,
    /// Nanoseconds workers waited for a core.
    pub wait_ns: u64,
}

/// This process's counters (see [`ProcessCores`]).
pub fn process_cores() -> ProcessCores {
    let (held, held_ns) = with_holds(|| {
        let held = HELD.load(Ordering::Relaxed);
        // The open holds' time so far: each one's `now - start`, in wrapping arithmetic (the
        // starts' sum may wrap; the time held does not).
        let open = (held as u64)
            .wrapping_mul(now_ns())
            .wrapping_sub(OPEN_STARTS.load(Ordering::Relaxed));
        (held, HELD_NS.load(Ordering::Relaxed).saturating_add(open))
    });
    ProcessCores {
        held,
        held_ns,
        wait_ns: WAIT_NS.load(Ordering::Relaxed),
    }
}

/// Why a pool worker runs no item now.
#[derive(Debug)]
pub(crate) enum NoCore {
    /// The stage stops.
    Stopped,
    /// The ledger could not be used: the item fails with this.
    Failed(std::io::Error),
}

/// Milliseconds (since [`checked_epoch`]) of the last check that the ledger file is still
/// the one this process uses.
static LAST_CHECK_MS: AtomicU64 = AtomicU64::new(0);

fn checked_epoch() -> Instant {
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    *START.get_or_init(Instant::now)
}

/// Holds a core for one item of a pool worker when the process is on a node ledger:
/// `Ok(None)` without one. Every 100 ms or so it checks that the ledger's file is still
/// there: a removed or replaced file (a cleanup of `/dev/shm`) is opened anew, so that this
/// process and the ranks that join later count on the same one.
pub(crate) fn hold_for_item(stop: &dyn Fn() -> bool) -> Result<Option<CoreHeld>, NoCore> {
    let Some(mut node) = current() else {
        return Ok(None);
    };
    // Offset by the interval: the first hold of the process checks too.
    let now = checked_epoch().elapsed().as_millis() as u64 + 100;
    let last = LAST_CHECK_MS.load(Ordering::Relaxed);
    if now >= last + 100
        && LAST_CHECK_MS
            .compare_exchange(last, now, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        && node.is_stale()
    {
        tracing::warn!(path = %node.path.display(), "the node CPU budget's ledger file was removed or replaced: opening it anew");
        let reopened = Some(NodeCores::open_in(&node.dir, &node.key, node.cores));
        match reopened {
            Some(Ok(fresh)) => {
                let fresh = Arc::new(fresh);
                let mut g = NODE.write();
                if g.as_ref().is_some_and(|n| Arc::ptr_eq(n, &node)) {
                    *g = Some(Arc::clone(&fresh));
                }
                node = g.clone().unwrap_or(fresh);
            }
            Some(Err(e)) => return Err(NoCore::Failed(e)),
            None => {}
        }
    }
    match node.hold(stop) {
        Ok(Some(held)) => Ok(Some(held)),
        Ok(None) => Err(NoCore::Stopped),
        Err(e) => Err(NoCore::Failed(e)),
    }
}

/// Forgets the holds of a parent's threads (they do not exist in a forked child; their
/// descriptors' locks are the parent's) and closes the child's copies of every worker's
/// descriptor, so that the parent's locks go with the parent. Runs by itself in every forked
/// child (`pthread_atfork`) once a worker held a core; calling it again is harmless.
pub fn reset_after_fork() {
    // The lock too: a parent's thread may have held it at the fork.
    HOLDS.store(false, Ordering::Release);
    HELD.store(0, Ordering::Relaxed);
    OPEN_STARTS.store(0, Ordering::Relaxed);
    let _ = SINCE.try_with(|s| s.set(None));
    // The forking thread's own descriptor is among the registered ones: forget its `File`
    // (closed below) so that dropping it cannot close a reused descriptor number.
    let _ = THREAD.try_with(|c| {
        if let Ok(mut slot) = c.try_borrow_mut() {
            if let Some(mut t) = slot.take() {
                t.registered = None;
                std::mem::forget(t);
            }
        }
    });
    for s in &THREAD_FDS {
        let fd = s.swap(0, Ordering::AcqRel);
        if fd > 0 {
            // SAFETY: a descriptor this process registered and nothing else closes (the
            // child has no worker threads left to use it).
            unsafe {
                libc::close(fd);
            }
        }
    }
}

#[cfg(test)]
mod tests;
