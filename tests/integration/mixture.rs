//! A mixture of three sources (weights 0.5 / 0.3 / 0.2) through a pipeline: each rank's
//! share of the draws, exact resume mid-epoch, and a merged checkpoint resumed at another
//! world size (items repeat across passes, so draws are compared as multisets).

use std::collections::BTreeMap;

use flowgate::sampler::{MixStop, Sampler};
use flowgate::{Order, Pipeline, PipelineState, Workers};

fn mixture() -> Sampler {
    Sampler::mixture(&[500, 300, 200], &[0.5, 0.3, 0.2], MixStop::Draws(3000))
        .unwrap()
        .shuffle(11)
}

fn build(sampler: Sampler) -> Pipeline<u64> {
    Pipeline::builder()
        .source_sampled(sampler, |_, i| i as u64)
        .pipe(
            "work",
            |x: u64| Ok::<_, std::convert::Infallible>(x),
            Workers::fixed(2),
        )
        .budget(8, u64::MAX)
        .output_order(Order::Input)
        .build()
        .unwrap()
}

fn multiset(v: &[u64]) -> BTreeMap<u64, usize> {
    let mut m = BTreeMap::new();
    for &x in v {
        *m.entry(x).or_insert(0) += 1;
    }
    m
}

#[test]
fn a_mixture_resumes_exactly_at_its_rank_and_at_another_world_size() {
    let whole: Vec<u64> = mixture().epoch(0).into_iter().map(|i| i as u64).collect();
    assert_eq!(whole.len(), 3000);

    // Same rank: stop, resume, stop, resume: the draws in order.
    let mut got = Vec::new();
    let mut state: Option<PipelineState> = None;
    for stop in [400usize, 1100, usize::MAX] {
        let mut p = build(mixture());
        if let Some(s) = &state {
            p.resume(s).unwrap();
        }
        got.extend(p.iter().take(stop).map(Result::unwrap));
        state = Some(p.state());
    }
    assert!(
        got == whole,
        "chained resumes give the epoch's draws in order"
    );

    // Two ranks stop at different places; merged, three ranks finish the epoch.
    let mut before = Vec::new();
    let mut states = Vec::new();
    for (rank, k) in [(0, 300usize), (1, 900)] {
        let mut p = build(mixture().shard(rank, 2).unwrap());
        before.extend(p.iter().take(k).map(Result::unwrap));
        states.push(p.state());
    }
    let merged = PipelineState::merge(&states).unwrap();
    for rank in 0..3 {
        let mut p = build(mixture().shard(rank, 3).unwrap());
        p.resume(&merged).unwrap();
        before.extend(p.iter().map(Result::unwrap));
    }
    assert!(
        multiset(&before) == multiset(&whole),
        "every draw once: {} delivered for {}",
        before.len(),
        whole.len()
    );
}
