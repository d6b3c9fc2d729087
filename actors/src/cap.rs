//! The process-wide cap on active CPU workers.
//!
//! Every pool stage always keeps one worker (a stage with none would stall its pipeline); each
//! worker beyond the first needs a token from this cap. The cap defaults to the process's cores
//! (its share of the node's when `LOCAL_WORLD_SIZE` ranks share it) less one — the core the
//! busiest stage's first worker runs on — so a stage never runs more workers than the
//! process's share of cores, however many pipelines and stages a process runs: the ranks of a
//! node together never run more decode workers than it has cores (tested under `torchrun`
//! with `LOCAL_WORLD_SIZE=2`). Tokens are returned when a stage shrinks or shuts down.

use std::sync::atomic::{AtomicUsize, Ordering};

static CAP: AtomicUsize = AtomicUsize::new(0);
static IN_USE: AtomicUsize = AtomicUsize::new(0);

/// The number of cores this process may use: the machine's, divided among the
/// `LOCAL_WORLD_SIZE` ranks of a node; on a node CPU budget ([`crate::node`]), at least the
/// whole budget (a budgeted pipeline may borrow every core the other ranks leave idle; the
/// ledger keeps the sum, and pipelines without the budget keep their share).
pub fn cores() -> usize {
    let share = flowgate_tuner::process_cores();
    crate::node::current().map_or(share, |n| n.cores().max(share))
}

/// The cap on extra (beyond one per stage) active CPU workers in this process.
pub fn cpu_worker_cap() -> usize {
    match CAP.load(Ordering::Relaxed) {
        0 => cores().saturating_sub(1),
        n => n,
    }
}

/// Sets the cap on extra workers (`None`: the process's cores less one). Tokens already
/// granted stay granted.
pub fn set_cpu_worker_cap(cap: Option<usize>) {
    CAP.store(cap.unwrap_or(0), Ordering::Relaxed);
}

/// Extra workers granted now, process-wide.
pub fn cpu_workers_in_use() -> usize {
    IN_USE.load(Ordering::Relaxed)
}

/// Grants up to `want` tokens; returns how many were granted.
pub(crate) fn acquire(want: usize) -> usize {
    let cap = cpu_worker_cap();
    let mut cur = IN_USE.load(Ordering::Relaxed);
    loop {
        let grant = want.min(cap.saturating_sub(cur));
        if grant == 0 {
            return 0;
        }
        match IN_USE.compare_exchange_weak(cur, cur + grant, Ordering::AcqRel, Ordering::Relaxed) {
            Ok(_) => return grant,
            Err(now) => cur = now,
        }
    }
}

/// Returns `n` tokens.
pub(crate) fn release(n: usize) {
    if n > 0 {
        IN_USE.fetch_sub(n, Ordering::AcqRel);
    }
}

/// Forgets every granted token: for a process forked from one whose pipelines held tokens
/// (their workers do not exist in the child, so they never return them). Only for a child
/// right after `fork`, before it starts pipelines.
pub fn reset_after_fork() {
    IN_USE.store(0, Ordering::Relaxed);
}
