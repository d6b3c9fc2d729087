use super::*;
use crate::policy::ModelBased;

fn rank(decode_ms: f64, seed: u64) -> Scenario {
    toml::from_str(&format!(
        r#"
name = "rank"
cores = 2
consumer_step_ms = 2.5
memory_mb = 256
seed = {seed}

[[stage]]
name = "decode"
kind = "cpu"
cost = {{ dist = "lognormal", mean_ms = {decode_ms}, sigma = 0.2 }}
bytes = 150000

[[stage]]
name = "collate"
kind = "cpu"
cost = {{ dist = "constant", ms = 0.02 }}
bytes = 150000
"#
    ))
    .unwrap()
}

fn model() -> Box<dyn Policy> {
    Box::new(ModelBased::default())
}

#[test]
fn water_fill_is_max_min_fair_and_within_the_budget() {
    assert_eq!(water_fill(2.0, &[0.2, 5.0, 5.0]), vec![0.2, 0.9, 0.9]);
    assert_eq!(water_fill(2.0, &[0.5, 0.5, 0.5]), vec![0.5, 0.5, 0.5]);
    assert_eq!(water_fill(3.0, &[4.0, 0.0, 1.0]), vec![2.0, 0.0, 1.0]);
    assert_eq!(compositions(4, 3).len(), 3);
    assert!(compositions(4, 3)
        .iter()
        .all(|c| c.iter().sum::<usize>() == 4));
}

/// Three ranks in lockstep on a 2-core budget, one decoding three times slower: the shared
/// budget beats the equal static split and comes near the best static split (found by a
/// search over every split in quarter cores, which no rank could know in advance), and never
/// gives out more than the budget.
#[test]
fn a_shared_budget_beats_the_equal_split_for_a_heavy_rank() {
    let ranks = [rank(6.0, 1), rank(2.0, 2), rank(2.0, 3)];
    let (secs, warm, slack) = (30.0, 10.0, Some(32));
    let equal = run_node(
        &ranks,
        2.0,
        &Split::Static(vec![2.0 / 3.0; 3]),
        &model,
        secs,
        warm,
        slack,
    );
    let shared = run_node(&ranks, 2.0, &Split::Shared, &model, secs, warm, slack);
    let (best_split, best) = best_static_split(&ranks, 2.0, 0.25, &model, secs, warm, slack);
    for alloc in &shared.cores {
        assert!(alloc.iter().sum::<f64>() <= 2.0 + 1e-9, "{alloc:?}");
    }
    let mean_heavy: f64 =
        shared.cores.iter().map(|a| a[0]).sum::<f64>() / shared.cores.len() as f64;
    println!("| split (3 ranks in lockstep, 2 cores) | slowest rank results/s | rank 0's cores |");
    println!("|---|---|---|");
    println!(
        "| equal static (2/3 each) | {:.0} | 0.67 |",
        equal.slowest()
    );
    println!(
        "| best static ({:?}, searched) | {:.0} | {:.2} |",
        best_split,
        best.slowest(),
        best_split[0]
    );
    println!(
        "| shared budget | {:.0} | {mean_heavy:.2} (mean) |",
        shared.slowest()
    );
    println!(
        "rates: equal {:?}, best {:?}, shared {:?}",
        equal.rates, best.rates, shared.rates
    );
    assert!(
        shared.slowest() >= 1.2 * equal.slowest(),
        "shared {:.0}/s against the equal split's {:.0}/s",
        shared.slowest(),
        equal.slowest()
    );
    assert!(
        shared.slowest() >= 0.85 * best.slowest(),
        "shared {:.0}/s against the best static split's {:.0}/s",
        shared.slowest(),
        best.slowest()
    );
    assert!(
        best_split[0] > best_split[1],
        "the best split favours the heavy rank: {best_split:?}"
    );
}
