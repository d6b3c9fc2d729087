//! `Workers::auto()`: a pool stage starts at its share of the cores the tuner may use (split
//! among the `auto()` stages), before anything is measured; `initial(n)` and `fixed(n)` start
//! where they say. One test in its own process: it sets the process-wide worker cap.

use std::time::Duration;

use flowgate::{Pipeline, TunerSettings, Workers};

#[test]
fn auto_stages_start_at_their_share_of_the_cores() {
    isolate!();
    flowgate::set_cpu_worker_cap(Some(16));
    let start = |cores: usize| {
        let mut p = Pipeline::builder()
            .source_epochs(|_| 0..200u32)
            .pipe(
                "a",
                |x: u32| {
                    std::thread::sleep(Duration::from_millis(1));
                    Ok::<_, std::io::Error>(x)
                },
                Workers::auto(),
            )
            .pipe("b", |x: u32| Ok::<_, std::io::Error>(x), Workers::auto())
            .pipe(
                "c",
                |x: u32| Ok::<_, std::io::Error>(x),
                Workers::initial(3),
            )
            .pipe("d", |x: u32| Ok::<_, std::io::Error>(x), Workers::fixed(2))
            .autotune(TunerSettings {
                cores: Some(cores),
                tick: Some(Duration::from_secs(60)), // no tick: the start as built
                ..TunerSettings::default()
            })
            .build()
            .unwrap();
        let stats = p.stats();
        let w = |n: &str| stats.stage(n).unwrap().workers;
        let got = [w("a"), w("b"), w("c"), w("d")];
        assert_eq!(p.iter().count(), 200);
        got
    };
    assert_eq!(start(8), [4, 4, 3, 2], "8 cores shared by two auto stages");
    assert_eq!(start(1), [1, 1, 3, 2], "at least one each");
    flowgate::set_cpu_worker_cap(None);
}
