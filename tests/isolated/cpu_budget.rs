//! A node CPU budget (`TunerSettings::cpu_budget`, `LoaderBuilder::cpu_budget`): two pipelines
//! in one process on a budget of one core never run two items at once, deliver everything,
//! and trace their share. One test in its own process: it joins a process-wide ledger.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use flowgate::{CpuBudget, Pipeline, TunerSettings, Workers};

#[test]
fn pipelines_on_a_one_core_budget_never_overlap_their_items() {
    isolate!();
    // A ledger of this test's own (the key names it), in /dev/shm like any other.
    std::env::set_var(
        "FLOWGATE_NODE_KEY",
        format!("test-cpu-budget-{}", std::process::id()),
    );
    let running = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let build = |n: u32| {
        let (running, most) = (Arc::clone(&running), Arc::clone(&most));
        Pipeline::builder()
            .source_epochs(move |_| 0..n)
            .pipe(
                "decode",
                move |x: u32| {
                    let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                    most.fetch_max(now, Ordering::SeqCst);
                    let t = Instant::now();
                    while t.elapsed() < Duration::from_micros(300) {
                        std::hint::spin_loop();
                    }
                    running.fetch_sub(1, Ordering::SeqCst);
                    Ok::<_, std::io::Error>(x)
                },
                Workers::fixed(3),
            )
            .autotune(TunerSettings {
                cpu_budget: Some(CpuBudget::Cores(1)),
                tick: Some(Duration::from_millis(20)),
                ..TunerSettings::default()
            })
            .build()
            .unwrap()
    };
    let mut a = build(1001);
    let mut b = build(777);
    let other = std::thread::spawn(move || {
        let n = b.iter().count();
        (n, b.tuner_trace())
    });
    let got = a.iter().count();
    let (got_b, trace_b) = other.join().unwrap();
    assert_eq!((got, got_b), (1001, 777), "every item delivered");
    assert_eq!(
        most.load(Ordering::SeqCst),
        1,
        "six workers on a one-core budget ran two items at once"
    );
    let node = flowgate::actors::node::current().expect("joined");
    assert_eq!(node.cores(), 1);
    assert_eq!(node.in_use(), 0, "every core given back");
    let cpu: Vec<_> = a
        .tuner_trace()
        .into_iter()
        .chain(trace_b)
        .filter_map(|r| r.cpu)
        .collect();
    assert!(
        cpu.len() >= 4,
        "ticks with the budget's figures: {}",
        cpu.len()
    );
    for c in &cpu {
        assert_eq!(c.budget, 1);
        assert!(c.node_busy <= 1 && c.held <= 1, "{c:?}");
        assert!(c.share <= 1.0 + 0.2, "a share past the budget: {c:?}");
    }
    assert!(
        cpu.iter().any(|c| c.share > 0.1),
        "the shares were measured: {cpu:?}"
    );
    drop(a); // its workers' tokens back to the process's cap
             // A pipeline of the same process without the budget is not held to it (it keeps its
             // share of the node): its items overlap.
    let (running, most) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let (r, m) = (Arc::clone(&running), Arc::clone(&most));
    let mut free = Pipeline::builder()
        .source_epochs(|_| 0..200u32)
        .pipe(
            "decode",
            move |x: u32| {
                let now = r.fetch_add(1, Ordering::SeqCst) + 1;
                m.fetch_max(now, Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(2));
                r.fetch_sub(1, Ordering::SeqCst);
                Ok::<_, std::io::Error>(x)
            },
            Workers::fixed(2),
        )
        .build()
        .unwrap();
    assert_eq!(free.iter().count(), 200);
    assert!(
        most.load(Ordering::SeqCst) >= 2,
        "an unbudgeted pipeline was held to the process's budget of one core"
    );
    // One budget per process: another size is refused, naming both (a budget is at most the
    // node's cores: on a one-core node 2 is 1, the same).
    if flowgate::actors::node::node_cores() < 2 {
        let _ = std::fs::remove_file(node.path());
        return;
    }
    let e = flowgate::actors::node::join(CpuBudget::Cores(2)).unwrap_err();
    assert!(
        e.to_string()
            .contains("already shares a node CPU budget of 1"),
        "{e}"
    );
    let e = Pipeline::builder()
        .source_epochs(|_| 0..3u32)
        .pipe("p", Ok::<u32, std::io::Error>, 1)
        .autotune(TunerSettings {
            cpu_budget: Some(CpuBudget::Cores(2)),
            ..TunerSettings::default()
        })
        .build()
        .unwrap_err();
    assert!(
        e.to_string().contains("cpu_budget") || e.to_string().contains("CPU budget"),
        "{e}"
    );
    let _ = std::fs::remove_file(node.path());
}
