//! Failures: bad items are skipped and counted, budgets (per stage and pipeline-wide, counts
//! and rates) stop the pipeline with an error naming the stage, the item and the cause, panics
//! are caught, bad media files are named, and errors keep their cause.

use crate::common;

use std::collections::HashSet;

use common::{mix, quiet_injected_panics, Injected};
use flowgate::{FailureBudget, Pipeline, PipelineError};

#[test]
fn failures_are_skipped_and_counted_by_default() {
    quiet_injected_panics();
    let mut p = Pipeline::builder()
        .source(0..1000u64)
        .pipe(
            "flaky",
            |x| match x % 10 {
                3 => Err(Injected(x)),
                7 => panic!("injected panic on {x}"),
                _ => Ok(x),
            },
            2,
        )
        .build()
        .unwrap();
    let got: HashSet<u64> = p.iter().map(Result::unwrap).collect();
    assert_eq!(got.len(), 800);
    assert!(got.iter().all(|x| x % 10 != 3 && x % 10 != 7));
    let stats = p.stats();
    assert_eq!(stats.failures, 200);
    assert_eq!(stats.stage("flaky").unwrap().failures, 200);
    assert!(stats
        .recent_failures
        .iter()
        .all(|m| m.contains("stage `flaky`")));
}

#[test]
fn an_error_that_names_its_item_overrides_the_description() {
    // Sync and async stages: the failure record takes the `Described` item, not `input #N`
    // or the stage's `describe`.
    for use_async in [false, true] {
        let b = Pipeline::builder()
            .source(0..100u64)
            .describe(|x: &u64| format!("described-{x}"));
        let fail = |x: u64| {
            if x == 42 {
                Err(flowgate::Described::new(
                    format!("the answer ({x})"),
                    Injected(x),
                ))
            } else {
                Ok(x)
            }
        };
        let b = if use_async {
            b.pipe_async("check", move |x| async move { fail(x) }, 2)
        } else {
            b.pipe("check", fail, 2)
        };
        let mut p = b
            .stage_max_failures(FailureBudget::fail_fast())
            .build()
            .unwrap();
        let err = p.iter().find_map(Result::err).expect("the failure");
        assert_eq!(err.stage(), Some("check"));
        assert_eq!(err.item(), Some("the answer (42)"), "async: {use_async}");
        assert!(err.to_string().contains("the answer (42)"), "{err}");
    }
}

#[test]
fn a_panic_past_the_budget_is_reported_with_the_stage_and_item() {
    quiet_injected_panics();
    let mut p = Pipeline::builder()
        .source(0..10_000u64)
        .pipe("ok", Ok::<_, Injected>, 1)
        .describe(|x: &u64| format!("sample-{x}"))
        .pipe(
            "boom",
            |x| {
                if x == 4321 {
                    panic!("injected panic on {x}");
                }
                Ok::<_, Injected>(x)
            },
            2,
        )
        .stage_max_failures(FailureBudget::fail_fast())
        .build()
        .unwrap();
    let err = p
        .iter()
        .find_map(Result::err)
        .expect("the pipeline reports the panic");
    assert!(err.is_failure_budget(), "{err}");
    assert_eq!(err.stage(), Some("boom"));
    assert_eq!(err.item(), Some("sample-4321"));
    assert!(err.item_error().unwrap().is_panic());
    let chain = format!("{err} / {}", std::error::Error::source(&err).unwrap());
    assert!(chain.contains("injected panic on 4321"), "{chain}");
    assert!(
        p.iter().next().is_none(),
        "a stopped pipeline yields nothing more"
    );
}

#[test]
fn a_global_rate_budget_stops_the_pipeline() {
    let mut p = Pipeline::builder()
        .source(0..100_000u64)
        .pipe(
            "half-bad",
            |x| if x % 2 == 0 { Err(Injected(x)) } else { Ok(x) },
            1,
        )
        .max_failures(FailureBudget::rate(0.2).min_items(200))
        .build()
        .unwrap();
    let results: Vec<Result<u64, PipelineError>> = p.iter().collect();
    let err = results.last().unwrap().as_ref().unwrap_err();
    assert!(err.is_failure_budget());
    assert!(
        err.to_string()
            .contains("the pipeline exceeded its failure budget"),
        "{err}"
    );
    assert!(
        results.len() < 10_000,
        "stopped early, after {} results",
        results.len()
    );
}

#[cfg(feature = "image")]
#[test]
fn bad_image_files_are_skipped_counted_and_named() {
    use flowgate::dataset::Files;
    use flowgate::media::image::ImageRecipe;
    let dir = std::env::temp_dir().join(format!("flowgate-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let img = image::RgbImage::from_fn(320, 240, |x, y| image::Rgb([x as u8, y as u8, 7]));
    let mut jpg = std::io::Cursor::new(Vec::new());
    img.write_to(&mut jpg, image::ImageFormat::Jpeg).unwrap();
    let jpg = jpg.into_inner();
    for i in 0..5 {
        std::fs::write(dir.join(format!("good{i}.jpg")), &jpg).unwrap();
    }
    std::fs::write(dir.join("empty.jpg"), b"").unwrap();
    std::fs::write(
        dir.join("random.jpg"),
        (0..5000u32)
            .map(|i| mix(i as u64, 3) as u8)
            .collect::<Vec<_>>(),
    )
    .unwrap();
    std::fs::write(dir.join("truncated.jpg"), &jpg[..jpg.len() / 3]).unwrap();
    std::fs::write(dir.join("notes.txt"), b"not listed: wrong extension").unwrap();
    let files = Files::dir(&dir, &["jpg"]).unwrap();
    assert_eq!(files.len(), 8);
    let recipe = ImageRecipe::default();
    let mut p = Pipeline::builder()
        .source(files.epoch(0))
        .pipe(
            "decode",
            move |path: std::path::PathBuf| recipe.load(&path),
            2,
        )
        .aggregate(4, false)
        .build()
        .unwrap();
    let batches: Vec<Vec<flowgate::Tensor>> = p.iter().map(Result::unwrap).collect();
    assert_eq!(batches.iter().map(Vec::len).sum::<usize>(), 5);
    let stats = p.stats();
    assert_eq!(stats.failures, 3);
    for name in ["empty.jpg", "random.jpg", "truncated.jpg"] {
        assert!(
            stats.recent_failures.iter().any(|m| m.contains(name)),
            "{name}: {:?}",
            stats.recent_failures
        );
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn errors_keep_their_cause() {
    use std::error::Error as _;
    let missing = std::env::temp_dir().join(format!("flowgate-no-such-{}", std::process::id()));
    for e in [
        flowgate::dataset::Files::list(&missing).unwrap_err(),
        flowgate::dataset::Files::dir(&missing, &["jpg"]).unwrap_err(),
    ] {
        assert!(e.is_io() && !e.is_config(), "{e}");
        assert!(e.to_string().contains(&*missing.to_string_lossy()), "{e}");
        let io = e
            .source()
            .and_then(|c| c.downcast_ref::<std::io::Error>())
            .expect("the io::Error is the source");
        assert_eq!(io.kind(), std::io::ErrorKind::NotFound);
    }
}

/// A stage that makes one item of several parts (a batch of clips) and leaves a failed part
/// out: the part is a counted failure, named, and fatal past the budget, where the item it
/// was left out of is not delivered. Pool and async stages alike.
#[test]
fn parts_left_out_of_an_item_are_counted_failures() {
    // Item x is made of parts 10x..10x+10; parts ending in 7 of items divisible by 5 fail.
    let make = |x: u64| -> Result<Vec<u64>, flowgate::BoxError> {
        let mut kept = Vec::new();
        for part in 10 * x..10 * x + 10 {
            if x % 5 == 0 && part % 10 == 7 {
                flowgate::skip_part(format!("part {part}"), Injected(part))?;
            } else {
                kept.push(part);
            }
        }
        Ok(kept)
    };
    let build = |use_async: bool, workers: usize, budget: FailureBudget| {
        let b = Pipeline::builder().source(0..100u64);
        let b = if use_async {
            b.pipe_async("parts", move |x| async move { make(x) }, workers)
        } else {
            b.pipe("parts", make, workers)
        };
        b.max_failures(budget).build().unwrap()
    };
    for use_async in [false, true] {
        let mut p = build(use_async, 2, FailureBudget::unlimited());
        let got: Vec<Vec<u64>> = p.iter().map(Result::unwrap).collect();
        assert_eq!(got.len(), 100, "every item delivered, less its failed part");
        assert_eq!(got.iter().map(Vec::len).sum::<usize>(), 1000 - 20);
        let stats = p.stats();
        assert_eq!(stats.failures, 20, "async: {use_async}");
        assert_eq!(stats.stage("parts").unwrap().failures, 20);
        assert!(
            stats.recent_failures.iter().any(|m| m.contains("part 957")),
            "{:?}",
            stats.recent_failures
        );

        // Fail-fast: the first failed part stops the pipeline with it as the error, and the
        // item it was left out of never arrives.
        let mut p = build(use_async, 1, FailureBudget::fail_fast());
        let mut delivered = Vec::new();
        let err = loop {
            match p.iter().next().expect("an error before the end") {
                Ok(v) => delivered.push(v[0] / 10),
                Err(e) => break e,
            }
        };
        assert!(err.is_failure_budget(), "{err}");
        assert_eq!(err.stage(), Some("parts"));
        assert_eq!(err.item(), Some("part 7"), "{err}");
        assert!(
            !delivered.contains(&0),
            "item 0 lost a part past the budget: {delivered:?}"
        );
    }

    // Outside a stage (here, on the test's thread) the cause is handed back, not dropped.
    assert!(make(0).is_err());
}
