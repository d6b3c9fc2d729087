//! The tuner on simulated scenarios (files in `tests/scenarios/`), from a cold start: one worker
//! per stage, a budget of one item. For each scenario the best static configuration is found
//! by a grid search over workers × prefetch in the same simulator, and the model-based policy
//! must reach 95% of its throughput within 10 simulated seconds, never exceed the memory budget,
//! and reverse direction at most twice per stage per minute in steady state.

use flowgate_tuner::policy::{HillClimb, ModelBased, Static};
use flowgate_tuner::scenario::{Scenario, SimKind};
use flowgate_tuner::sim::{best_static, Run, Simulator, StaticConfig};
use flowgate_tuner::Policy;

fn load(file: &str) -> Scenario {
    let path = format!("{}/tests/scenarios/{file}", env!("CARGO_MANIFEST_DIR"));
    let mut sc: Scenario = toml::from_str(&std::fs::read_to_string(&path).unwrap())
        .unwrap_or_else(|e| panic!("{path}: {e}"));
    // Another seed for every scenario: SEED_OFFSET=1 cargo test -p flowgate-tuner --test sim
    if let Some(k) = std::env::var("SEED_OFFSET")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
    {
        sc.seed += 1000 * k;
    }
    sc
}

fn base(w: usize) -> usize {
    (2 * w).max(w + 2)
}

/// Workers × prefetch: CPU stages 1..=cores+1 workers, I/O stages 4..=128 in flight; budgets of
/// 1× or 4× the base, and a sink of 2 or 8.
fn grid(sc: &Scenario) -> Vec<StaticConfig> {
    let options: Vec<Vec<usize>> = sc
        .stages
        .iter()
        .map(|s| match s.kind {
            SimKind::Cpu => (1..=sc.cores + 1).collect(),
            SimKind::Io => vec![4, 8, 16, 32, 48, 64, 96, 128],
        })
        .collect();
    let mut combos: Vec<Vec<usize>> = vec![vec![]];
    for opts in &options {
        combos = combos
            .iter()
            .flat_map(|c| opts.iter().map(move |&w| [c.clone(), vec![w]].concat()))
            .collect();
    }
    // Only what the process's CPU tokens allow (one worker per stage, plus the extras).
    let cpu: Vec<bool> = sc.stages.iter().map(|s| s.kind == SimKind::Cpu).collect();
    combos.retain(|w| {
        let extra: usize = w
            .iter()
            .zip(&cpu)
            .filter(|(_, &c)| c)
            .map(|(&w, _)| w - 1)
            .sum();
        sc.extra_workers.is_none_or(|cap| extra <= cap)
    });
    combos
        .into_iter()
        .flat_map(|workers| {
            [1, 4].map(|p| StaticConfig {
                budgets: workers.iter().map(|&w| base(w) * p).collect(),
                workers: workers.clone(),
                sink: 2 * p,
            })
        })
        .collect()
}

/// The scenario with its changes up to `t` applied from the start (a regime to grid-search).
fn regime(sc: &Scenario, t: f64) -> Scenario {
    let mut r = sc.clone();
    for c in sc.changes.iter().filter(|c| c.at_s <= t) {
        if let (Some(name), Some(f)) = (&c.stage, c.cost_factor) {
            let s = r.stages.iter_mut().find(|s| &s.name == name).unwrap();
            s.cost = scale(s.cost, f);
        }
        if let Some(f) = c.consumer_factor {
            r.consumer_step_ms *= f;
        }
    }
    r.changes.clear();
    r
}

fn scale(c: flowgate_tuner::scenario::Cost, f: f64) -> flowgate_tuner::scenario::Cost {
    use flowgate_tuner::scenario::Cost;
    match c {
        Cost::Constant { ms } => Cost::Constant { ms: ms * f },
        Cost::Lognormal { mean_ms, sigma } => Cost::Lognormal {
            mean_ms: mean_ms * f,
            sigma,
        },
        Cost::Pareto { mean_ms, alpha } => Cost::Pareto {
            mean_ms: mean_ms * f,
            alpha,
        },
    }
}

fn tuned(sc: &Scenario, policy: &mut dyn Policy, seconds: f64) -> Run {
    Simulator::new(sc).run(policy, seconds)
}

/// Seconds after `from` until the last second's throughput first reached `frac` of `target`.
fn time_to(run: &Run, from: f64, target: f64, frac: f64) -> Option<f64> {
    run.ticks
        .iter()
        .map(|t| t.t)
        .filter(|&t| t >= from + 1.0 - 1e-9)
        .find(|&t| run.rate(t - 1.0, t) >= frac * target)
        .map(|t| ((t - from) * 10.0).round() / 10.0)
}

fn check_common(name: &str, sc: &Scenario, run: &Run, steady: (f64, f64)) {
    let budget = sc.memory_bytes();
    for t in &run.ticks {
        assert!(
            t.buffered_bytes <= budget,
            "{name}: {} bytes buffered at {} s",
            t.buffered_bytes,
            t.t
        );
        assert!(
            t.committed_bytes <= budget,
            "{name}: {} bytes committed at {} s",
            t.committed_bytes,
            t.t
        );
    }
    let minutes = (steady.1 - steady.0) / 60.0;
    for i in 0..sc.stages.len() {
        let rev = run.reversals(i, steady.0, steady.1);
        assert!(
            rev as f64 <= (2.0 * minutes).ceil(),
            "{name}: stage {} reversed {rev} times in steady state",
            sc.stages[i].name
        );
    }
}

fn report(
    name: &str,
    best: &StaticConfig,
    best_rate: f64,
    runs: &[Run],
    from: f64,
    window: (f64, f64),
) -> f64 {
    let rate = mean_rate(runs, window);
    let run = &runs[0];
    let last = run.ticks.last().unwrap();
    let since =
        |frac| time_to(run, from, best_rate, frac).map_or("null".to_owned(), |t| t.to_string());
    println!(
        "{{\"scenario\":\"{name}\",\"best_static\":{best_rate:.0},\"best_workers\":{:?},\"tuned\":{rate:.0},\"ratio\":{:.3},\"t90_s\":{},\"t95_s\":{},\"final_workers\":{:?},\"decisions\":{}}}",
        best.workers,
        rate / best_rate,
        since(0.90),
        since(0.95),
        last.workers,
        run.decisions.len()
    );
    rate / best_rate
}

/// Seeds each comparison is averaged over. The grid's best is the maximum of many noisy
/// measurements (a winner's curse); re-measuring it on fresh seeds, next to the tuner on the
/// same seeds, keeps the comparison honest.
const SEEDS: u64 = 3;

fn with_seed(sc: &Scenario, k: u64) -> Scenario {
    let mut s = sc.clone();
    s.seed += 7919 * k;
    s
}

/// The static `cfg`'s mean rate over `window`, averaged over [`SEEDS`] fresh seeds.
fn static_rate(sc: &Scenario, cfg: &StaticConfig, window: (f64, f64)) -> f64 {
    (1..=SEEDS)
        .map(|k| {
            let run = Simulator::with_config(&with_seed(sc, k), cfg).run(&mut Static, window.1);
            run.rate(window.0, window.1)
        })
        .sum::<f64>()
        / SEEDS as f64
}

/// Tuned runs from a cold start on the same seeds as [`static_rate`].
fn tuned_runs(sc: &Scenario, seconds: f64) -> Vec<Run> {
    (1..=SEEDS)
        .map(|k| tuned(&with_seed(sc, k), &mut ModelBased::default(), seconds))
        .collect()
}

fn mean_rate(runs: &[Run], window: (f64, f64)) -> f64 {
    runs.iter().map(|r| r.rate(window.0, window.1)).sum::<f64>() / runs.len() as f64
}

fn scenario_reaches_best_static(file: &str) -> (Scenario, Vec<Run>, f64) {
    let sc = load(file);
    let window = (10.0, 22.0);
    let (best, _) = best_static(&sc, &grid(&sc), 3.0, 12.0);
    let best_rate = static_rate(&sc, &best, window);
    let runs = tuned_runs(&sc, 40.0);
    let ratio = report(&sc.name, &best, best_rate, &runs, 0.0, window);
    assert!(
        ratio >= 0.95,
        "{}: {ratio:.3} of the best static at 10 s",
        sc.name
    );
    for run in &runs {
        check_common(&sc.name, &sc, run, (20.0, 40.0));
    }
    (sc, runs, best_rate)
}

#[test]
fn a_cpu_bound() {
    scenario_reaches_best_static("a_cpu_bound.toml");
}

#[test]
fn b_io_bound() {
    let (_, runs, _) = scenario_reaches_best_static("b_io_bound.toml");
    for run in &runs {
        let fetch = run.ticks.last().unwrap().workers[0];
        assert!((32..=96).contains(&fetch), "{fetch} requests in flight");
    }
}

#[test]
fn c_heavy_tail() {
    scenario_reaches_best_static("c_heavy_tail.toml");
}

#[test]
fn d_consumer_bound_does_not_over_allocate() {
    let (sc, runs, best_rate) = scenario_reaches_best_static("d_consumer_bound.toml");
    // The fewest workers per stage that keep the consumer fed (98% of the best), plus one.
    let fed: Vec<StaticConfig> = grid(&sc)
        .into_iter()
        .filter(|c| {
            let r = Simulator::with_config(&sc, c).run(&mut Static, 8.0);
            r.rate(3.0, 8.0) >= 0.98 * best_rate
        })
        .collect();
    let min_total = fed
        .iter()
        .map(|c| c.workers.iter().sum::<usize>())
        .min()
        .unwrap();
    for t in runs.iter().flat_map(|r| &r.ticks).filter(|t| t.t > 10.0) {
        assert!(
            t.workers.iter().sum::<usize>() <= min_total + 1,
            "{:?} workers at {} s; {min_total} keep the consumer fed",
            t.workers,
            t.t
        );
    }
}

#[test]
fn f_steady_work_is_not_oversubscribed() {
    let (sc, runs, _) = scenario_reaches_best_static("f_steady_two_cores.toml");
    // Steady CPU work gains nothing from more workers than cores (headroom and staffing
    // would ask for three on two cores; on a real machine that costs ~5% in switching).
    for t in runs.iter().flat_map(|r| &r.ticks) {
        assert!(
            t.workers[0] <= sc.cores,
            "{} decode workers on {} cores at {} s",
            t.workers[0],
            sc.cores,
            t.t
        );
    }
}

/// The tuned runs' rate over `window` against the best static configuration of the regime
/// in force from `from` (measured from a warm start over as long a window), reported.
fn regime_ratio(sc: &Scenario, runs: &[Run], from: f64, window: (f64, f64), label: &str) -> f64 {
    let r = regime(sc, from);
    let (best, _) = best_static(&r, &grid(&r), 3.0, 12.0);
    let best_rate = static_rate(&r, &best, (3.0, 3.0 + window.1 - window.0));
    report(
        &format!("{} [{label}]", sc.name),
        &best,
        best_rate,
        runs,
        from,
        window,
    )
}

#[test]
fn e_shifts() {
    let sc = load("e_shift.toml");
    let runs = tuned_runs(&sc, 60.0);
    for (from, to, label) in [
        (0.0, 30.0, "start"),
        (30.0, 45.0, "cost x2"),
        (45.0, 60.0, "consumer /2"),
    ] {
        let (window, need) = if from == 0.0 {
            ((10.0, 30.0), 0.95)
        } else {
            ((from + 5.0, to), 0.90)
        };
        let ratio = regime_ratio(&sc, &runs, from, window, label);
        assert!(ratio >= need, "{label}: {ratio:.3} of the best static");
    }
    for run in &runs {
        check_common(&sc.name, &sc, run, (15.0, 30.0));
    }
}

#[test]
fn hill_climbing_also_improves_on_a_cold_start() {
    let sc = load("a_cpu_bound.toml");
    let cold = tuned(&sc, &mut Static, 20.0).rate(10.0, 20.0);
    let climbed = tuned(&sc, &mut HillClimb::default(), 20.0).rate(10.0, 20.0);
    assert!(
        climbed > 1.5 * cold,
        "hill climbing {climbed:.0}/s vs cold static {cold:.0}/s"
    );
}

#[test]
fn sixty_simulated_seconds_take_well_under_a_second() {
    let sc = load("a_cpu_bound.toml");
    let t0 = std::time::Instant::now();
    let run = tuned(&sc, &mut ModelBased::default(), 60.0);
    assert_eq!(run.ticks.len(), 600);
    // A loose bound, for a shared machine: the point is milliseconds, not minutes.
    assert!(t0.elapsed().as_secs_f64() < 5.0, "{:?}", t0.elapsed());
}

#[test]
#[ignore = "a debugging aid: prints the decisions of a run"]
fn print_decisions() {
    let file = std::env::var("SCENARIO").unwrap_or_else(|_| "b_io_bound.toml".into());
    let sc = load(&file);
    for run in tuned_runs(&sc, 40.0) {
        println!("--");
        for (t, d) in &run.decisions {
            println!("{t:6.1} {:?} {}", d.action, d.reason);
        }
    }
}

/// Bytes a static configuration's buffers hold when they fill (what the guard commits).
fn committed(sc: &Scenario, cfg: &StaticConfig) -> u64 {
    let held: u64 = sc
        .stages
        .iter()
        .zip(&cfg.budgets)
        .map(|(s, &b)| b as u64 * s.bytes)
        .sum();
    held + cfg.sink as u64 * sc.stages.last().map_or(1, |s| s.bytes)
}

#[test]
fn g_memory_binds() {
    let sc = load("g_memory_binds.toml");
    let budget = sc.memory_bytes();
    let window = (10.0, 22.0);
    // The unconstrained best does not fit: the budget binds.
    let all = grid(&sc);
    let (unconstrained, _) = best_static(&sc, &all, 3.0, 12.0);
    assert!(committed(&sc, &unconstrained) > budget, "{unconstrained:?}");
    // The best static configuration that fits, against the tuner from cold. The general grid
    // ties budgets to workers (2w); under a memory budget what matters is the bytes each
    // buffer holds, so this grid sets them apart: fetches in flight, the fetch buffer just
    // above them, decode workers and the sink.
    let mut fits = Vec::new();
    for fetch in (4..=64).step_by(2) {
        for extra in [0, 2, 4] {
            for decode in 1..=3 {
                for sink in [1, 2, 4] {
                    let cfg = StaticConfig {
                        workers: vec![fetch, decode],
                        budgets: vec![fetch + extra, base(decode)],
                        sink,
                    };
                    if committed(&sc, &cfg) <= budget {
                        fits.push(cfg);
                    }
                }
            }
        }
    }
    let (best, _) = best_static(&sc, &fits, 3.0, 12.0);
    let best_rate = static_rate(&sc, &best, window);
    let runs = tuned_runs(&sc, 70.0);
    let ratio = report(&sc.name, &best, best_rate, &runs, 0.0, window);
    for run in &runs {
        check_common(&sc.name, &sc, run, (10.0, 70.0));
    }
    assert!(
        ratio >= 0.90,
        "{}: {ratio:.3} of the best static configuration that fits",
        sc.name
    );
}

/// Scenario H's two decode workers (and one collate worker), one thread per clip: what the
/// stage does without the threads knob.
fn one_thread_per_clip() -> StaticConfig {
    StaticConfig {
        workers: vec![2, 1],
        budgets: vec![base(2), base(1)],
        sink: 2,
    }
}

#[test]
fn h_capped_workers_get_threads_per_item_within_the_cores() {
    let sc = load("h_threads_per_item.toml");
    let window = (10.0, 40.0);
    let one = one_thread_per_clip();
    let one_rate = static_rate(&sc, &one, window);
    let runs = tuned_runs(&sc, 40.0);
    let tuned_rate = mean_rate(&runs, window);
    for run in &runs {
        check_common(&sc.name, &sc, run, (10.0, 40.0));
        for t in &run.ticks {
            // The decode stage's threads never exceed the cores; the collate stage (busy
            // ~3% of one core) adds at most one thread for moments.
            assert!(
                t.workers[0] * t.threads[0] <= sc.cores && t.busy_threads <= sc.cores + 1,
                "{} × {} decode threads ({} busy) on {} cores at {} s",
                t.workers[0],
                t.threads[0],
                t.busy_threads,
                sc.cores,
                t.t
            );
        }
        // Settled: the same threads from 10 s on, four for each of two workers.
        let settled: Vec<usize> = run
            .ticks
            .iter()
            .filter(|t| t.t > 10.0)
            .map(|t| t.threads[0])
            .collect();
        assert!(settled.iter().all(|&n| n == 4), "{settled:?}");
        assert!(run
            .decisions
            .iter()
            .any(|(_, d)| d.reason.contains("more threads per item")));
    }
    // 1 + 3 × 0.8 = 3.4 times the one-thread rate, less the ramp.
    assert!(
        tuned_rate >= 3.0 * one_rate,
        "tuned {tuned_rate:.1}/s vs one thread per clip {one_rate:.1}/s"
    );
}

#[test]
fn threads_per_item_stay_at_one_where_workers_can_grow() {
    let mut sc = load("a_cpu_bound.toml");
    sc.stages[1].threads = Some(flowgate_tuner::scenario::SimThreads {
        max: 8,
        efficiency: 0.8,
    });
    for run in tuned_runs(&sc, 30.0) {
        assert!(run.ticks.iter().all(|t| t.threads[1] == 1));
    }
}

#[test]
fn threads_per_item_that_do_not_pay_are_undone_and_rarely_retried() {
    let mut sc = load("h_threads_per_item.toml");
    sc.stages[0].threads = Some(flowgate_tuner::scenario::SimThreads {
        max: 8,
        efficiency: 0.0,
    });
    let one = one_thread_per_clip();
    let window = (0.0, 60.0);
    let one_rate = static_rate(&sc, &one, window);
    let runs = tuned_runs(&sc, 60.0);
    for run in &runs {
        check_common(&sc.name, &sc, run, window);
        let raised = run.ticks.iter().filter(|t| t.threads[0] > 1).count();
        // Trials at ~1 s, ~32 s (after a 30 s bar); the second bar is 60 s.
        assert!(
            raised * 10 <= run.ticks.len(),
            "more threads in {raised} of {} ticks",
            run.ticks.len()
        );
        let undone = run
            .decisions
            .iter()
            .filter(|(_, d)| d.reason.contains("did not pay"))
            .count();
        assert!((1..=2).contains(&undone), "{undone} trials undone");
    }
    let tuned_rate = mean_rate(&runs, window);
    assert!(
        tuned_rate >= 0.9 * one_rate,
        "tuned {tuned_rate:.1}/s vs one thread per clip {one_rate:.1}/s"
    );
}

/// Buffers sized by need: while the consumer is the bottleneck the tuner keeps only what
/// keeps each stage's workers busy ahead of it (a few items a stage, where a cold start held
/// more), at the best static rate; when the consumer speeds up twenty-fold the buffers grow
/// again and the pipeline reaches the new regime's best static rate.
#[test]
fn i_buffers_shrink_while_step_bound_and_grow_back() {
    let sc = load("i_step_bound_then_not.toml");
    // Started as the engine starts a loader: two chunks of 64 items a stage, a sink of four.
    let start = StaticConfig {
        workers: vec![2, 2],
        budgets: vec![128, 128],
        sink: 4,
    };
    let runs: Vec<Run> = (1..=SEEDS)
        .map(|k| {
            Simulator::with_config(&with_seed(&sc, k), &start).run(&mut ModelBased::default(), 40.0)
        })
        .collect();
    for run in &runs {
        let early: usize = run.ticks[5].budgets.iter().sum();
        for t in run.ticks.iter().filter(|t| t.t > 12.0 && t.t < 20.0) {
            // What keeps each stage's workers busy (2w or w + 2), and two results ahead of
            // the consumer.
            let floor: usize = t.workers.iter().map(|&w| (2 * w).max(w + 2)).sum::<usize>() + 2;
            let held: usize = t.budgets.iter().sum();
            assert!(
                held <= floor + 2,
                "{:?} items of budget at {:.1} s with {:?} workers (floor {floor})",
                t.budgets,
                t.t,
                t.workers
            );
            assert!(
                held < early,
                "nothing shrank: {held} at {:.1} s, {early} at 0.6 s",
                t.t
            );
        }
    }
    for (from, to, label, need) in [
        (0.0, 20.0, "step-bound", 0.95),
        (20.0, 40.0, "fast step", 0.90),
    ] {
        let window = if from == 0.0 {
            (10.0, 20.0)
        } else {
            (from + 8.0, to)
        };
        let ratio = regime_ratio(&sc, &runs, from, window, label);
        assert!(ratio >= need, "{label}: {ratio:.3} of the best static");
    }
}

/// A per-item function heavier than the decoding before it, on two cores whose one extra
/// worker token the decoding took first: the decoding must give it back (it held it on
/// staffing for variable work, and the function waited on one worker: 0.70 of the best).
#[test]
fn j_a_user_function_heavier_than_decoding_gets_the_token() {
    let (_, runs, _) = scenario_reaches_best_static("j_user_function_two_cores.toml");
    for run in &runs {
        assert_eq!(
            run.ticks.last().unwrap().workers[..2],
            [1, 2],
            "decode 1, map 2"
        );
    }
}

/// A consumer that goes away (a validation loader between evaluations) and comes back: while
/// it is away the parked policy holds one worker per CPU stage, so the process's other
/// pipelines can have the cores' tokens; when it is back, the workers are as they were at
/// once and the throughput is what it was. Unparked, the model keeps every worker through
/// the pause (the bug: a consumer neither taking nor waiting looked well fed).
#[test]
fn a_consumer_away_parks_the_pipeline_and_finds_it_as_it_left() {
    use flowgate_tuner::policy::{Park, IDLE_SECS};
    let sc = load("a_cpu_bound.toml");
    for parked in [true, false] {
        let mut sim = Simulator::new(&sc);
        let mut policy: Box<dyn Policy> = if parked {
            Box::new(Park::new(ModelBased::default()))
        } else {
            Box::new(ModelBased::default())
        };
        let before = sim.run(&mut *policy, 10.0);
        let tuned = before.ticks.last().unwrap().workers.clone();
        assert!(tuned.iter().sum::<usize>() > 3, "tuned up first: {tuned:?}");
        let rate_before = before.rate(8.0, 10.0);
        sim.set_consumer_cap(Some(sim.delivered()));
        let away = sim.run(&mut *policy, 10.0);
        let during = &away.ticks.last().unwrap().workers;
        if !parked {
            assert_eq!(
                during, &tuned,
                "unparked, the workers stay through the pause"
            );
            continue;
        }
        assert_eq!(
            during,
            &vec![1; tuned.len()],
            "parked: one worker per stage"
        );
        let parked_at = away
            .decisions
            .iter()
            .find(|(_, d)| d.reason.starts_with("park"))
            .map(|(t, _)| t - 10.0)
            .expect("a park decision");
        assert!(
            (IDLE_SECS..IDLE_SECS + 0.5).contains(&parked_at),
            "parked {parked_at:.1} s after the consumer stopped"
        );
        assert_eq!(
            away.decisions
                .iter()
                .filter(|(_, d)| d.reason.starts_with("park"))
                .count(),
            tuned.iter().filter(|&&w| w > 1).count(),
            "parked once, and nothing else decided while parked: {:?}",
            away.decisions
        );
        sim.set_consumer_cap(None);
        let back = sim.run(&mut *policy, 5.0);
        assert_eq!(
            back.ticks[1].workers, tuned,
            "the workers of before the pause, on the first tick back"
        );
        let rate_after = back.rate(21.0, 25.0);
        assert!(
            rate_after >= 0.95 * rate_before,
            "{rate_after:.0} results/s back, {rate_before:.0} before"
        );
    }
}
