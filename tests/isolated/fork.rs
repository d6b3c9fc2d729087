//! A process forked while threads are parked (a DataLoader worker forked from a training
//! process whose loader and S3 client have idle threads) can use every lock in its own threads.
//!
//! `parking_lot`'s global table of parked threads is copied by `fork` with the parked threads'
//! entries in it; the child's threads reuse those threads' stacks, and the child's next park or
//! unpark on a shared bucket followed the stale entries: about one forked DataLoader worker
//! of a loader on S3 in five crashed (SIGSEGV in `Condvar::notify_one_slow`) in the fault
//! harness. The vendored `parking_lot_core` (vendor/README.md) gives the child an empty table.

#![cfg(unix)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

/// Threads parked on condition variables until `release` is called.
struct Parked {
    gates: Vec<Arc<(Mutex<bool>, Condvar)>>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Parked {
    /// `n` threads, each parked on a condition variable of its own (so that the parked
    /// threads sit in many buckets of the table).
    fn start(n: usize) -> Self {
        let gates: Vec<_> = (0..n)
            .map(|_| Arc::new((Mutex::new(false), Condvar::new())))
            .collect();
        let waiting = Arc::new(AtomicUsize::new(0));
        let threads = gates
            .iter()
            .map(|gate| {
                let (gate, waiting) = (gate.clone(), waiting.clone());
                std::thread::spawn(move || {
                    let mut open = gate.0.lock();
                    waiting.fetch_add(1, Ordering::SeqCst);
                    while !*open {
                        gate.1.wait(&mut open);
                    }
                })
            })
            .collect();
        let deadline = Instant::now() + Duration::from_secs(10);
        while waiting.load(Ordering::SeqCst) < n {
            assert!(Instant::now() < deadline, "the threads did not start");
            std::thread::sleep(Duration::from_millis(5));
        }
        // A thread counts itself holding its lock and releases it only once it is queued on
        // the condition variable: taking each lock after the last count means all are parked.
        for gate in &gates {
            drop(gate.0.lock());
        }
        Self { gates, threads }
    }

    fn release(self) {
        for gate in &self.gates {
            *gate.0.lock() = true;
            gate.1.notify_all();
        }
        for t in self.threads {
            t.join().unwrap();
        }
    }
}

/// What the child does: threads contending on many locks and condition variables, so that
/// they park and unpark on every bucket of the table (including those holding the parent's
/// parked threads).
fn contend() {
    let locks: Arc<Vec<(Mutex<u64>, Condvar)>> =
        Arc::new((0..4096).map(|_| (Mutex::new(0), Condvar::new())).collect());
    let threads: Vec<_> = (0..32)
        .map(|t| {
            let locks = locks.clone();
            std::thread::spawn(move || {
                for i in 0..5_000usize {
                    let (m, c) = &locks[(i * 7 + t * 131) % locks.len()];
                    let mut v = m.lock();
                    *v += 1;
                    if i % 3 == 0 {
                        // A short timed wait parks this thread on the condition variable.
                        c.wait_for(&mut v, Duration::from_micros(1));
                    }
                    c.notify_one();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
}

/// Forks; the child runs `contend` and exits 0 (a crash is a signal, a hang is killed).
fn run_in_child() -> Result<(), String> {
    // SAFETY: the child runs only `contend` (its own threads and locks) and `_exit`.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        let ok = std::panic::catch_unwind(contend).is_ok();
        // SAFETY: ends the child without running the parent's destructors or atexit hooks.
        unsafe { libc::_exit(if ok { 0 } else { 3 }) };
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let mut status = 0;
        // SAFETY: waits for our own child.
        let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if r == pid {
            if libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0 {
                return Ok(());
            }
            if libc::WIFSIGNALED(status) {
                return Err(format!(
                    "the child died of signal {}",
                    libc::WTERMSIG(status)
                ));
            }
            return Err(format!("the child exited with status {status}"));
        }
        if Instant::now() > deadline {
            // SAFETY: kills our own child.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            return Err("the child hung (killed after 20 s)".into());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn a_child_forked_while_threads_are_parked_parks_and_unparks_its_own() {
    isolate!();
    let parked = Parked::start(64);
    let results: Vec<_> = (0..4).map(|_| run_in_child()).collect();
    parked.release();
    for r in results {
        r.unwrap();
    }
}
