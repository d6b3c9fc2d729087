//! A loader's per-item function (`LoaderBuilder::map_items`): a stage of its own after
//! decoding, whose output is what the batches hold (tensors and fields replaced, each item's
//! own, in order); its errors and panics are that item's failures in the stage, counted or
//! fatal; a seeded function resumes to exactly the same items; it shows in the statistics
//! under its name; what it cannot do is refused when the loader is built.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use flowgate::dataset::{Dataset, FieldSpec, FieldValue, Source};
use flowgate::device::Delivered;
use flowgate::loader::{Batch, Sample};
use flowgate::{BoxError, FailureBudget, Loader};

use crate::common;
use common::small_recipe as recipe;

/// Images (29: divisible by no batch size or rank count used) with a caption beside each.
const FILES: usize = 29;

fn data() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("map-items");
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        for i in 0..FILES {
            std::fs::write(dir.join(format!("{i:03}.jpg")), common::tiny_jpeg(i)).unwrap();
            std::fs::write(
                dir.join(format!("{i:03}.txt")),
                format!("photo {i} of {FILES}"),
            )
            .unwrap();
        }
        dir
    })
}

fn loader(
    map: Option<fn(Sample) -> Result<Sample, BoxError>>,
    rank: usize,
    world: usize,
    failures: FailureBudget,
) -> Loader {
    let source = Source::dir(data())
        .extensions(["jpg"])
        .extra_fields([FieldSpec::new("caption", "txt")]);
    let dataset = Dataset::builder(source)
        .shuffle(9)
        .ranks(rank, world)
        .build()
        .unwrap();
    let mut b = Loader::builder(dataset, recipe())
        .batch_size(4)
        .workers(2)
        .max_failures(failures);
    if let Some(f) = map {
        b = b.map_items("tokenize", f).map_fields(["draw"]);
    }
    b.build().unwrap()
}

/// Each caption becomes its words' lengths (a token list, as JSON), each image its negative,
/// and every item draws a number seeded by its index and epoch.
fn tokenize(mut s: Sample) -> Result<Sample, BoxError> {
    let FieldValue::Text(c) = &s.meta.extras[0] else {
        return Err("a caption".into());
    };
    let tokens: Vec<usize> = c.split(' ').map(str::len).collect();
    s.meta.extras[0] = FieldValue::Json(serde_json::json!(tokens));
    let draw = (s.meta.index as u64 * 31 + s.meta.epoch * 7) % 1000;
    assert_eq!(
        s.meta.extras[1],
        FieldValue::Missing,
        "an added field, for it to set"
    );
    s.meta.extras[1] = FieldValue::Int(draw as i64);
    let t = &mut s.fields[0];
    for b in t.bytes_mut() {
        *b = 255 - *b;
    }
    Ok(s)
}

fn failing(s: Sample) -> Result<Sample, BoxError> {
    match s.meta.index % 7 {
        3 => Err(format!("item {} does not tokenize", s.meta.index).into()),
        5 => panic!("item {} panics", s.meta.index),
        _ => tokenize(s),
    }
}

fn host(d: &Delivered) -> &flowgate::Tensor {
    match d {
        Delivered::Host(t) => t,
        _ => panic!("a batch in host memory"),
    }
}

/// Each item of a batch: its index, image bytes and field values.
fn items(b: &Batch) -> Vec<(usize, Vec<u8>, Vec<FieldValue>)> {
    let t = host(&b.fields[0]);
    let each = t.nbytes() / b.len();
    b.items
        .iter()
        .enumerate()
        .map(|(k, m)| {
            (
                m.index,
                t.bytes()[k * each..(k + 1) * each].to_vec(),
                m.extras.clone(),
            )
        })
        .collect()
}

fn epoch(l: &mut Loader) -> Vec<(usize, Vec<u8>, Vec<FieldValue>)> {
    l.epoch()
        .unwrap()
        .flat_map(|b| items(&b.unwrap()))
        .collect()
}

#[test]
fn each_item_is_its_own_function_output_in_order_across_ranks() {
    for (rank, world) in [(0, 1), (1, 3)] {
        let plain = epoch(&mut loader(None, rank, world, FailureBudget::unlimited()));
        let mut l = loader(Some(tokenize), rank, world, FailureBudget::unlimited());
        let mapped = epoch(&mut l);
        assert_eq!(plain.len(), mapped.len());
        for ((i, image, fields), (j, neg, out)) in plain.iter().zip(&mapped) {
            assert_eq!(i, j, "the same items in the same order");
            assert!(
                image.iter().zip(neg).all(|(a, b)| a + b == 255),
                "item {i}'s image"
            );
            let FieldValue::Text(c) = &fields[0] else {
                panic!("{fields:?}")
            };
            let words: Vec<usize> = c.split(' ').map(str::len).collect();
            assert_eq!(
                out[0],
                FieldValue::Json(serde_json::json!(words)),
                "item {i}"
            );
            assert_eq!(out[1], FieldValue::Int((*i as i64 * 31) % 1000), "item {i}");
        }
        assert_eq!(l.field_names(), ["caption", "draw"]);
        let stats = l.stats();
        let stage = stats.stage("tokenize").expect("a stage of its own");
        assert_eq!(stage.items_out as usize, mapped.len());
        assert!(stage.workers >= 1);
    }
}

#[test]
fn errors_and_panics_are_the_items_failures_counted_or_fatal() {
    let mut l = loader(Some(failing), 0, 1, FailureBudget::unlimited());
    let got: Vec<usize> = epoch(&mut l).into_iter().map(|(i, ..)| i).collect();
    let want: Vec<usize> = (0..FILES).filter(|i| ![3, 5].contains(&(i % 7))).collect();
    let mut sorted = got.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, want, "every other item, once");
    let failed = l.watch().failures(None);
    assert_eq!(failed.len(), FILES - want.len(), "{failed:?}");
    assert!(failed.iter().all(|f| f.stage == "tokenize"), "{failed:?}");
    // Each named by its path, as the decode stage names its failures.
    assert!(
        failed.iter().all(|f| f.item.ends_with(".jpg")),
        "{failed:?}"
    );
    assert!(
        failed
            .iter()
            .any(|f| f.message.contains("does not tokenize")),
        "{failed:?}"
    );
    assert!(
        failed.iter().any(|f| f.message.contains("panics")),
        "{failed:?}"
    );
    assert_eq!(l.stats().failures as usize, failed.len());

    let mut strict = loader(Some(failing), 0, 1, FailureBudget::fail_fast());
    let err = strict
        .epoch()
        .unwrap()
        .find_map(Result::err)
        .expect("the first failure stops the epoch");
    assert!(err.is_failure_budget(), "{err}");
}

#[test]
fn a_checkpoint_resumes_to_exactly_the_same_mapped_items() {
    let whole = epoch(&mut loader(
        Some(tokenize),
        0,
        1,
        FailureBudget::unlimited(),
    ));
    let mut first = loader(Some(tokenize), 0, 1, FailureBudget::unlimited());
    let mut got = Vec::new();
    let state = {
        let mut e = first.epoch().unwrap();
        for _ in 0..3 {
            got.extend(items(&e.next().unwrap().unwrap()));
        }
        e.state().unwrap()
    };
    drop(first);
    let mut again = loader(Some(tokenize), 0, 1, FailureBudget::unlimited());
    again.resume(&state).unwrap();
    got.extend(epoch(&mut again));
    assert_eq!(got, whole);
}

#[test]
fn what_a_per_item_function_cannot_do_is_refused() {
    let dataset = || {
        Dataset::builder(Source::dir(data()).extensions(["jpg"]))
            .build()
            .unwrap()
    };
    let e = Loader::builder(dataset(), recipe())
        .map_items("decode", Ok)
        .build()
        .unwrap_err();
    assert!(
        e.to_string().contains("one of the loader's own stages"),
        "{e}"
    );
    // A function whose items cannot be stacked fails the batch, named.
    let mut l = Loader::builder(dataset(), recipe())
        .batch_size(4)
        .map_items("crop", |mut s: Sample| {
            if s.meta.index == 2 {
                s.fields[0] = flowgate::Tensor::zeros(&[3], flowgate::DType::U8);
            }
            Ok(s)
        })
        .build()
        .unwrap();
    let _ = l.epoch().unwrap().count();
    let failed = l.watch().failures(None);
    assert!(failed.iter().any(|f| f.stage == "collate"), "{failed:?}");
    // Fields added without a function, or named like the dataset's, are refused; a function
    // that drops a field fails its item.
    let e = Loader::builder(dataset(), recipe())
        .map_fields(["x"])
        .build()
        .unwrap_err();
    assert!(e.to_string().contains("without one"), "{e}");
    let captioned = Dataset::builder(
        Source::dir(data())
            .extensions(["jpg"])
            .extra_fields([FieldSpec::new("caption", "txt")]),
    )
    .build()
    .unwrap();
    let e = Loader::builder(captioned.clone(), recipe())
        .map_items("m", Ok)
        .map_fields(["caption"])
        .build()
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("map_fields: \"caption\" is a key the batch already has"),
        "{e}"
    );
    let mut l = Loader::builder(captioned, recipe())
        .map_items("m", |mut s: Sample| {
            s.meta.extras.clear();
            Ok(s)
        })
        .build()
        .unwrap();
    let got: Vec<_> = l.epoch().unwrap().collect();
    assert!(
        got.iter().all(Result::is_err),
        "every item failed: nothing delivered"
    );
    let failed = l.watch().failures(None);
    assert!(failed[0].message.contains("left 0 fields"), "{failed:?}");
    // An item of a labelled dataset left without its label fails alone (it panicked in
    // collate, losing its batch).
    let labelled = Dataset::builder(
        Source::dir(data())
            .extensions(["jpg"])
            .labels(flowgate::dataset::Labels::Values(vec![7; FILES])),
    )
    .build()
    .unwrap();
    let mut l = Loader::builder(labelled, recipe())
        .batch_size(4)
        .map_items("m", |mut s: Sample| {
            if s.meta.index == 6 {
                s.meta.label = None;
            }
            Ok(s)
        })
        .build()
        .unwrap();
    let n: usize = l.epoch().unwrap().map(|b| b.unwrap().len()).sum();
    assert_eq!(n, FILES - 1, "the batch's other items delivered");
    let failed = l.watch().failures(None);
    assert!(
        failed[0].message.contains("without its label"),
        "{failed:?}"
    );
}
