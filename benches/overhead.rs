//! Criterion benches of the engine's per-item overhead.
//!
//! - `pipeline/*`: a 3-stage no-op pipeline over 100k `u64`s (completion and input order,
//!   with and without `aggregate(32)`); throughput in items.
//! - `handoff/*`: moving 100k items between two threads through a budgeted chunked channel
//!   versus a plain bounded `flume` channel carrying one item per operation.

#![allow(missing_docs)] // criterion's macros generate undocumented items

use std::sync::Arc;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use flowgate::actors::channel::{Channel, Envelope};
use flowgate::{Order, Pipeline};

const ITEMS: u64 = 100_000;

fn noop(x: u64) -> Result<u64, std::convert::Infallible> {
    Ok(x)
}

fn pipeline(c: &mut Criterion) {
    let mut g = c.benchmark_group("pipeline");
    g.throughput(Throughput::Elements(ITEMS));
    for (name, order, batch) in [
        ("noop3-completion", Order::Completion, false),
        ("noop3-input", Order::Input, false),
        ("noop3-aggregate32", Order::Completion, true),
    ] {
        g.bench_function(BenchmarkId::from_parameter(name), |b| {
            b.iter(|| {
                let builder = Pipeline::builder()
                    .source(0..ITEMS)
                    .autotune_off()
                    .output_order(order)
                    .pipe("s1", noop, 1)
                    .pipe("s2", noop, 1)
                    .pipe("s3", noop, 1);
                if batch {
                    let mut p = builder.aggregate(32, false).build().unwrap();
                    p.iter().map(|r| r.unwrap().len() as u64).sum::<u64>()
                } else {
                    let mut p = builder.build().unwrap();
                    p.iter().map(|r| r.unwrap()).sum::<u64>()
                }
            });
        });
    }
    g.finish();
}

fn handoff(c: &mut Criterion) {
    let mut g = c.benchmark_group("handoff");
    g.throughput(Throughput::Elements(ITEMS));
    for chunk in [1usize, 64] {
        g.bench_function(BenchmarkId::new("budgeted-chunks", chunk), |b| {
            b.iter(|| {
                let ch = Arc::new(Channel::<u64>::new(4 * chunk, u64::MAX));
                let tx = Arc::clone(&ch);
                let producer = std::thread::spawn(move || {
                    let mut next = 0;
                    while next < ITEMS {
                        let want = chunk.min((ITEMS - next) as usize);
                        let n = tx
                            .budget()
                            .acquire(std::iter::repeat_n(8u64, want))
                            .unwrap()
                            .items;
                        let items = (next..next + n as u64)
                            .map(|x| Envelope {
                                seq: x,
                                bytes: 8,
                                reserved: 0,
                                item: x,
                                origin: Default::default(),
                            })
                            .collect();
                        tx.send(items);
                        next += n as u64;
                    }
                });
                let mut seen = 0;
                while seen < ITEMS {
                    let listener = ch.budget().listen_data();
                    if let Some(chunk) = ch.try_recv() {
                        seen += chunk.len() as u64;
                        ch.budget().release(chunk.len(), 8 * chunk.len() as u64);
                        continue;
                    }
                    event_listener_wait(listener);
                }
                producer.join().unwrap();
            });
        });
    }
    g.bench_function("flume-bounded-per-item", |b| {
        b.iter(|| {
            let (tx, rx) = flume::bounded::<u64>(256);
            let producer = std::thread::spawn(move || {
                for x in 0..ITEMS {
                    tx.send(x).unwrap();
                }
            });
            let n = rx.iter().count() as u64;
            producer.join().unwrap();
            assert_eq!(n, ITEMS);
        });
    });
    g.finish();
}

fn event_listener_wait(l: event_listener::EventListener) {
    use event_listener::Listener;
    l.wait_timeout(Duration::from_millis(10));
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(10).measurement_time(Duration::from_secs(3));
    targets = pipeline, handoff
}
criterion_main!(benches);
