//! Per-item overhead of the engine: a 3-stage no-op pipeline over `u64`s.
//!
//! ```text
//! cargo run --release -p flowgate-tools --bin overhead [-- --items N]
//! ```
//!
//! Prints one JSON line per configuration (1 and 2 workers per stage, completion and input
//! order, with and without `aggregate(32)`), then the headline figure, the 3-stage no-op
//! pipeline in completion order with one worker per stage, as
//! `{"pipeline":"noop3","items":..,"seconds":..,"items_per_s":..}`.

use std::time::Instant;

use flowgate::{Order, Pipeline, PipelineError};

#[derive(Clone, Copy)]
struct Case {
    workers: usize,
    order: Order,
    batch: Option<usize>,
}

fn noop(x: u64) -> Result<u64, std::convert::Infallible> {
    Ok(x)
}

/// Runs one epoch of `items` through the case's pipeline; returns (items seen, seconds).
fn run(case: Case, items: u64) -> Result<(u64, f64), PipelineError> {
    let b = Pipeline::builder()
        .source(0..items)
        .autotune_off() // this measures the engine, at fixed concurrency
        .output_order(case.order)
        .pipe("s1", noop, case.workers)
        .pipe("s2", noop, case.workers)
        .pipe("s3", noop, case.workers);
    let t0 = Instant::now();
    let (n, checksum) = match case.batch {
        None => {
            let mut p = b.build()?;
            p.iter().try_fold((0u64, 0u64), |(n, s), r| {
                r.map(|x| (n + 1, s.wrapping_add(x)))
            })?
        }
        Some(size) => {
            let mut p = b.aggregate(size, false).build()?;
            p.iter().try_fold((0u64, 0u64), |(n, s), r| {
                r.map(|v| {
                    (
                        n + v.len() as u64,
                        v.iter().fold(s, |a, x| a.wrapping_add(*x)),
                    )
                })
            })?
        }
    };
    let secs = t0.elapsed().as_secs_f64();
    assert_eq!(n, items, "every item arrives");
    assert_eq!(
        checksum,
        items * (items.saturating_sub(1)) / 2,
        "and arrives once"
    );
    Ok((n, secs))
}

fn main() -> Result<(), PipelineError> {
    let mut items = 5_000_000u64;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--items" => items = args.next().and_then(|v| v.parse().ok()).expect("--items N"),
            other => panic!("unknown argument {other}; usage: overhead [--items N]"),
        }
    }
    flowgate::set_cpu_worker_cap(Some(8));
    let cases = [
        Case {
            workers: 1,
            order: Order::Completion,
            batch: None,
        },
        Case {
            workers: 2,
            order: Order::Completion,
            batch: None,
        },
        Case {
            workers: 1,
            order: Order::Input,
            batch: None,
        },
        Case {
            workers: 2,
            order: Order::Input,
            batch: None,
        },
        Case {
            workers: 1,
            order: Order::Completion,
            batch: Some(32),
        },
        Case {
            workers: 2,
            order: Order::Completion,
            batch: Some(32),
        },
    ];
    run(cases[0], items / 10)?; // warm up
    for c in cases {
        let (n, secs) = run(c, items)?;
        println!(
            "{{\"pipeline\":\"noop3\",\"workers_per_stage\":{},\"order\":\"{}\",\"aggregate\":{},\"items\":{n},\"seconds\":{secs:.4},\"items_per_s\":{:.0}}}",
            c.workers,
            if c.order == Order::Input { "input" } else { "completion" },
            c.batch.map_or("null".to_owned(), |b| b.to_string()),
            n as f64 / secs
        );
    }
    let (n, secs) = run(cases[0], items)?;
    println!(
        "{{\"pipeline\":\"noop3\",\"items\":{n},\"seconds\":{secs:.4},\"items_per_s\":{:.0}}}",
        n as f64 / secs
    );
    Ok(())
}
