//! A scheduling policy of your own, run in the simulator and then on a real pipeline.
//!
//! ```text
//! cargo run --release --example custom_policy
//! ```
//!
//! `TargetUtilization` keeps every resizable stage's workers busy about 70% of the time while
//! the consumer waits, and never grows a stage that waits for input: the
//! kind of rule a researcher might want to compare with flowgate's model-based policy. A policy
//! is any type implementing [`Policy`]: it gets an [`Observation`] every tick (per stage: items,
//! busy time, blocked time, queue and budget; the consumer's wait) and returns [`Decision`]s.
//! The same code runs on the deterministic simulator (60 simulated seconds in milliseconds) and,
//! through `autotune_with`, on a real pipeline.

use std::time::{Duration, Instant};

use flowgate::tuner::policy::ModelBased;
use flowgate::tuner::scenario::Scenario;
use flowgate::tuner::sim::Simulator;
use flowgate::tuner::{Action, Decision, Observation, Policy};
use flowgate::Pipeline;

/// Resizes each stage so its workers are busy `target` of the time.
struct TargetUtilization {
    target: f64,
}

impl Policy for TargetUtilization {
    fn name(&self) -> &str {
        "target-utilization"
    }

    fn decide(&mut self, obs: &Observation) -> Vec<Decision> {
        let window = obs.window.as_secs_f64();
        let mut out = Vec::new();
        for (i, s) in obs.stages.iter().enumerate() {
            if !s.resizable() || s.items == 0 {
                continue;
            }
            // Workers this stage keeps busy now, and what it would take to be at the target.
            let busy_workers = s.busy.as_secs_f64() / window;
            // Only a stage that has work waiting can use more workers.
            let starved = s.blocked_get.as_secs_f64() / window > 0.1 * s.workers as f64;
            let mut want = (busy_workers / self.target).ceil().max(1.0) as usize;
            // Grow only while the consumer waits (more is pointless otherwise), at most 2x a
            // tick, and never a stage that is itself waiting for input.
            if starved || obs.wait_fraction() < 0.05 {
                want = want.min(s.workers);
            }
            want = want.min(2 * s.workers);
            if want != s.workers {
                out.push(Decision {
                    action: Action::SetWorkers {
                        stage: i,
                        workers: want,
                    },
                    reason: format!(
                        "{busy_workers:.1} workers busy; target {:.0}%",
                        self.target * 100.0
                    ),
                });
                // Keep the budget in step so the new workers have items to hold.
                out.push(Decision {
                    action: Action::SetPrefetch {
                        stage: i,
                        items: 2 * want + 2,
                        bytes: s.budget_bytes,
                    },
                    reason: "budget follows workers".into(),
                });
            }
        }
        out
    }
}

const SCENARIO: &str = r#"
name = "two CPU stages and a slow fetch"
cores = 4
consumer_step_ms = 0.0
[[stage]]
name = "fetch"
kind = "io"
cost = { dist = "lognormal", mean_ms = 20.0, sigma = 0.5 }
[[stage]]
name = "decode"
kind = "cpu"
cost = { dist = "lognormal", mean_ms = 1.5, sigma = 0.3 }
[[stage]]
name = "augment"
kind = "cpu"
cost = { dist = "constant", ms = 0.5 }
"#;

fn simulate(policy: &mut dyn Policy, sc: &Scenario) {
    let t0 = Instant::now();
    let run = Simulator::new(sc).run(policy, 60.0);
    let last = run.ticks.last().expect("ticks");
    println!(
        "{{\"where\":\"simulator\",\"policy\":\"{}\",\"items_per_s_10_60s\":{:.0},\"final_workers\":{:?},\"decisions\":{},\"wall_ms\":{}}}",
        policy.name(),
        run.rate(10.0, 60.0),
        last.workers,
        run.decisions.len(),
        t0.elapsed().as_millis()
    );
}

fn main() -> Result<(), flowgate::PipelineError> {
    let sc: Scenario = toml::from_str(SCENARIO).expect("a valid scenario");
    simulate(&mut TargetUtilization { target: 0.7 }, &sc);
    simulate(&mut ModelBased::default(), &sc);

    // The same policy on a real pipeline: fetch sleeps 5 ms, decode spins 200 µs.
    let mut p = Pipeline::builder()
        .source_epochs(|_| 0..20_000u64)
        .pipe_async(
            "fetch",
            |x| async move {
                tokio::time::sleep(Duration::from_millis(5)).await;
                Ok::<_, std::io::Error>(x)
            },
            1,
        )
        .pipe(
            "decode",
            |x| {
                let t0 = Instant::now();
                while t0.elapsed() < Duration::from_micros(200) {
                    std::hint::spin_loop();
                }
                Ok::<_, std::io::Error>(x)
            },
            1,
        )
        .autotune_with(TargetUtilization { target: 0.7 })
        .build()?;
    let t0 = Instant::now();
    let n = p.iter().count();
    let secs = t0.elapsed().as_secs_f64();
    let trace = p.tuner_trace();
    println!(
        "{{\"where\":\"pipeline\",\"policy\":\"target-utilization\",\"items\":{n},\"items_per_s\":{:.0},\"final_workers\":{:?},\"decisions\":{}}}",
        n as f64 / secs,
        trace.last().map(|r| r.workers.clone()).unwrap_or_default(),
        trace.iter().map(|r| r.decisions.len()).sum::<usize>()
    );
    Ok(())
}
