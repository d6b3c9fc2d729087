use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::budget::count_cpu_list;
use super::*;

fn ledger(dir: &Path, cores: usize) -> Arc<NodeCores> {
    Arc::new(NodeCores::open_in(dir, "test", cores).expect("ledger"))
}

/// A fresh directory under the temporary one (removed by the OS's cleaning, not here: a
/// ledger file is a few bytes).
/// Tests that hold cores take turns: the process's count of held cores
/// ([`process_cores`]) is one for the whole test binary.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn temp_dir() -> std::path::PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    let d = std::env::temp_dir().join(format!(
        "flowgate-node-test-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn spin(d: Duration) {
    let t = Instant::now();
    while t.elapsed() < d {
        std::hint::spin_loop();
    }
}

#[test]
fn budgets_parse_and_refuse() {
    assert_eq!("2".parse::<CpuBudget>(), Ok(CpuBudget::Cores(2)));
    assert_eq!("0.4".parse::<CpuBudget>(), Ok(CpuBudget::Fraction(0.4)));
    assert_eq!("40%".parse::<CpuBudget>(), Ok(CpuBudget::Fraction(0.4)));
    for bad in ["0", "-1", "1.5", "nan", "inf", "x", "0%", "101%", "5000"] {
        let e = bad.parse::<CpuBudget>().unwrap_err();
        assert!(
            e.starts_with("must be") && e.to_lowercase().contains(bad),
            "{bad}: {e}"
        );
    }
    assert_eq!(CpuBudget::Fraction(0.4).cores_of(16), 6);
    assert_eq!(CpuBudget::Fraction(0.01).cores_of(16), 1);
    assert_eq!(CpuBudget::Cores(3).cores_of(16), 3);
    let toml: CpuBudget = serde_json::from_str("0.25").unwrap();
    assert_eq!(toml, CpuBudget::Fraction(0.25));
    let text: CpuBudget = serde_json::from_str("\"2\"").unwrap();
    assert_eq!(text, CpuBudget::Cores(2));
    assert!(serde_json::from_str::<CpuBudget>("2.5").is_err());
    assert_eq!(count_cpu_list("0-3,8-11"), Some(8));
    assert_eq!(count_cpu_list("0"), Some(1));
    assert_eq!(count_cpu_list("x"), None);
    assert!(NodeCores::open_in(&std::env::temp_dir(), "t", 0).is_err());
}

/// Three "ranks" (separate ledger handles, as separate processes have) with eight threads
/// in all on a budget of two cores: never more than two items run at once.
#[test]
fn never_more_holds_than_cores() {
    let _serial = serial();
    let dir = temp_dir();
    let ranks: Vec<_> = (0..3).map(|_| ledger(&dir, 2)).collect();
    let running = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicBool::new(false));
    let monitor = {
        let (node, done) = (Arc::clone(&ranks[0]), Arc::clone(&done));
        std::thread::spawn(move || {
            let mut most_seen = 0;
            while !done.load(Ordering::Relaxed) {
                most_seen = most_seen.max(node.in_use());
            }
            most_seen
        })
    };
    let workers: Vec<_> = (0..8)
        .map(|i| {
            let node = Arc::clone(&ranks[i % 3]);
            let (running, most) = (Arc::clone(&running), Arc::clone(&most));
            std::thread::spawn(move || {
                for _ in 0..150 {
                    let held = node.hold(&|| false).unwrap().expect("a core");
                    let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                    most.fetch_max(now, Ordering::SeqCst);
                    spin(Duration::from_micros(200));
                    running.fetch_sub(1, Ordering::SeqCst);
                    drop(held);
                }
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    done.store(true, Ordering::Relaxed);
    let seen = monitor.join().unwrap();
    assert_eq!(
        most.load(Ordering::SeqCst),
        2,
        "two cores, both used, never three"
    );
    assert!(seen <= 2, "the ledger counted {seen} cores held");
    assert_eq!(ranks[1].in_use(), 0);
}

/// Two threads that hold the only core item after item, back to back, and a third that
/// wants it: the third gets a fair turn (without the pause after a release it got almost
/// none: the releaser takes the core again before a poller wakes).
#[test]
fn a_waiting_worker_gets_its_turn() {
    let _serial = serial();
    let dir = temp_dir();
    let counts: Vec<_> = (0..3).map(|_| Arc::new(AtomicUsize::new(0))).collect();
    let stop_at = Instant::now() + Duration::from_millis(1500);
    let threads: Vec<_> = (0..3)
        .map(|i| {
            let node = ledger(&dir, 1);
            let count = Arc::clone(&counts[i]);
            std::thread::spawn(move || {
                while Instant::now() < stop_at {
                    if let Some(h) = node.hold(&|| Instant::now() >= stop_at).unwrap() {
                        spin(Duration::from_millis(1));
                        count.fetch_add(1, Ordering::Relaxed);
                        drop(h);
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let got: Vec<usize> = counts.iter().map(|c| c.load(Ordering::Relaxed)).collect();
    let total: usize = got.iter().sum();
    assert!(total > 100, "{got:?}");
    for g in &got {
        assert!(
            *g * 6 >= total,
            "each of three should get a fair turn: {got:?}"
        );
    }
}

#[test]
fn stop_ends_a_wait() {
    let _serial = serial();
    let dir = temp_dir();
    let a = ledger(&dir, 1);
    let b = ledger(&dir, 1);
    // One thread per ledger handle, as in a pool (a thread holds one core at a time).
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let holder = std::thread::spawn(move || {
        let held = a.hold(&|| false).unwrap().unwrap();
        rx.recv().unwrap();
        drop(held);
    });
    while b.in_use() == 0 {
        std::thread::yield_now();
    }
    let t0 = Instant::now();
    let waiter = Arc::clone(&b);
    let gave_up = std::thread::spawn(move || {
        waiter
            .hold(&|| t0.elapsed() > Duration::from_millis(50))
            .unwrap()
            .is_none()
    });
    assert!(gave_up.join().unwrap(), "the wait ended when told to stop");
    assert!(
        !b.someone_waits(),
        "a worker that gave up left the waiting room"
    );
    tx.send(()).unwrap();
    holder.join().unwrap();
    assert_eq!(b.in_use(), 0);
    let taker = std::thread::spawn(move || b.hold(&|| false).unwrap().is_some());
    assert!(taker.join().unwrap());
}

/// The body of [`a_killed_rank_frees_its_cores`]'s child process: holds both cores of the
/// ledger in `FLOWGATE_TEST_HOLD_DIR` until killed. A no-op in a normal run.
#[test]
fn child_holds_cores() {
    let _serial = serial();
    let Ok(dir) = std::env::var("FLOWGATE_TEST_HOLD_DIR") else {
        return;
    };
    let node = ledger(Path::new(&dir), 2);
    let holders: Vec<_> = (0..2)
        .map(|_| {
            let node = Arc::clone(&node);
            std::thread::spawn(move || {
                let _held = node.hold(&|| false).unwrap().expect("a core");
                std::thread::sleep(Duration::from_secs(120));
            })
        })
        .collect();
    if let Ok(pids) = std::env::var("FLOWGATE_TEST_FORK_PIDS") {
        // Fork while both cores are held (a DataLoader worker started meanwhile): the
        // grandchild must not keep them once this process dies.
        while node.in_use() < 2 {
            std::thread::sleep(Duration::from_millis(5));
        }
        // SAFETY: the child only sleeps and exits (async-signal-safe calls).
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            unsafe {
                libc::sleep(60);
                libc::_exit(0);
            }
        }
        std::fs::write(pids, pid.to_string()).unwrap();
    }
    for h in holders {
        let _ = h.join();
    }
}

/// A rank killed with SIGKILL while it holds every core: the node has them back at once.
#[test]
fn a_killed_rank_frees_its_cores() {
    let _serial = serial();
    killed_rank_frees_its_cores(false);
}

/// The same with a child the rank forked while holding them (a DataLoader worker, say) still
/// alive: its copies of the workers' descriptors were closed at the fork.
#[test]
fn a_killed_rank_frees_its_cores_though_a_child_it_forked_lives() {
    let _serial = serial();
    killed_rank_frees_its_cores(true);
}

fn killed_rank_frees_its_cores(fork: bool) {
    let dir = temp_dir();
    let node = ledger(&dir, 2);
    let pids = dir.join("grandchild");
    let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "--exact",
        "node::tests::child_holds_cores",
        "--test-threads=1",
    ])
    .env("FLOWGATE_TEST_HOLD_DIR", &dir)
    .stdout(std::process::Stdio::null());
    if fork {
        cmd.env("FLOWGATE_TEST_FORK_PIDS", &pids);
    }
    let mut child = cmd.spawn().unwrap();
    let t0 = Instant::now();
    while node.in_use() < 2
        || (fork && std::fs::read_to_string(&pids).map_or(true, |p| p.is_empty()))
    {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "the child never held both cores"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let t1 = Instant::now();
    let waiter = Arc::clone(&node);
    let refused = std::thread::spawn(move || {
        waiter
            .hold(&|| t1.elapsed() > Duration::from_millis(100))
            .unwrap()
            .is_none()
    });
    assert!(refused.join().unwrap(), "both cores were held");
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    let t2 = Instant::now();
    let taker = Arc::clone(&node);
    let (got, took) = std::thread::spawn(move || {
        let held = taker
            .hold(&|| t2.elapsed() > Duration::from_secs(2))
            .unwrap();
        let took = t2.elapsed();
        let got = held.is_some();
        let in_use = taker.in_use();
        drop(held);
        ((got, in_use), took)
    })
    .join()
    .unwrap();
    assert!(got.0, "a killed rank's cores came back");
    assert!(took < Duration::from_millis(500), "{took:?}");
    assert_eq!(got.1, 1, "only this thread's hold: the rank's two are gone");
    assert_eq!(node.in_use(), 0);
    if fork {
        let pid: i32 = std::fs::read_to_string(&pids)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        // SAFETY: plain kills of the grandchild this test made.
        assert_eq!(
            unsafe { libc::kill(pid, 0) },
            0,
            "the grandchild was alive throughout"
        );
        unsafe {
            libc::kill(pid, libc::SIGKILL);
        }
    }
}

#[test]
fn a_ledger_another_user_could_lock_is_refused() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let dir = temp_dir();
    // SAFETY: getuid cannot fail.
    let uid = unsafe { libc::getuid() };
    let path = dir.join(format!("flowgate-cpu-u{uid}-test-2"));
    std::fs::write(&path, b"").unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
    let e = NodeCores::open_in(&dir, "test", 2).unwrap_err();
    assert!(e.to_string().contains("private"), "{e}");
    std::fs::remove_file(&path).unwrap();
    let fresh = NodeCores::open_in(&dir, "test", 2).unwrap();
    assert_eq!(
        std::fs::metadata(fresh.path()).unwrap().mode() & 0o777,
        0o600
    );
}

/// A stage's function that consumes another budgeted loader gives its core back while it
/// waits for results (on a one-core budget it would wait for ever otherwise); a removed
/// ledger file is opened anew by the next item's hold.
#[test]
fn a_waiting_consumer_gives_its_core_back_and_a_removed_ledger_is_reopened() {
    let _serial = serial();
    let dir = temp_dir();
    let outer = ledger(&dir, 1);
    let inner = ledger(&dir, 1);
    // The process's ledger (no other test of this binary sets it).
    assert!(set_node(Some(Arc::clone(&outer))).is_none());
    let held = outer.hold(&|| false).unwrap().unwrap();
    assert_eq!(inner.in_use(), 1);
    let produced = released_while(|| {
        // The inner loader's worker (another thread) gets the core meanwhile.
        let inner = Arc::clone(&inner);
        std::thread::spawn(move || {
            let h = inner
                .hold(&|| false)
                .unwrap()
                .expect("the core was given back");
            drop(h);
            7
        })
        .join()
        .unwrap()
    });
    assert_eq!(produced, 7);
    assert_eq!(inner.in_use(), 1, "held again after the wait");
    assert_eq!(process_cores().held, 1);
    drop(held);
    assert_eq!(inner.in_use(), 0);
    assert!(!outer.is_stale());
    std::fs::remove_file(outer.path()).unwrap();
    assert!(outer.is_stale());
    let t = std::thread::spawn(|| {
        std::thread::sleep(Duration::from_millis(120)); // past the check's interval
        matches!(hold_for_item(&|| false), Ok(Some(_)))
    });
    assert!(t.join().unwrap());
    let now = current().unwrap();
    assert!(
        !Arc::ptr_eq(&now, &outer),
        "the process moved to the new file"
    );
    assert!(now.path().exists() && !now.is_stale());
    set_node(None);
}

#[test]
fn the_time_held_counts_a_hold_while_it_is_open_and_not_after() {
    // Counted at release, a hold across the tuner's ticks went whole to the tick it ended in:
    // a share of 1.35 cores on a 1-core budget.
    let _serial = serial();
    let dir = temp_dir();
    let node = ledger(&dir, 1);
    let before = process_cores();
    assert_eq!(before.held, 0);
    let held = node.hold(&|| false).unwrap().unwrap();
    std::thread::sleep(Duration::from_millis(150));
    let open = process_cores();
    assert_eq!(open.held, 1);
    assert!(
        open.held_ns - before.held_ns >= 150_000_000,
        "an open hold's time so far counts: {open:?}"
    );
    drop(held);
    let closed = process_cores();
    std::thread::sleep(Duration::from_millis(100));
    let later = process_cores();
    assert_eq!((closed.held, later.held), (0, 0));
    assert!(closed.held_ns >= open.held_ns);
    assert_eq!(
        later.held_ns, closed.held_ns,
        "a released hold's time stops"
    );
}
