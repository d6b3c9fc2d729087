//! A loader's per-batch function (`LoaderBuilder::map_batches`): a stage of its own after
//! collation, whose output is what the loop receives (tensors replaced and added, fields
//! added, labels changed; the rows the loader's own, in order); its errors and panics fail the
//! batch's items, counted or fatal; a seeded function resumes to exactly the same batches;
//! what would break a checkpoint or a batch's shape fails the batch, named; the memory budget
//! makes room for the batches the stage holds.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use flowgate::dataset::{Dataset, FieldSpec, FieldValue, Labels, Source};
use flowgate::device::Delivered;
use flowgate::loader::Batch;
use flowgate::{BoxError, DType, FailureBudget, Loader, Tensor};

use crate::common;
use common::small_recipe as recipe;

/// Images (29: divisible by no batch size or rank count used) with a caption beside each.
const FILES: usize = 29;

fn data() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("map-batches");
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        for i in 0..FILES {
            std::fs::write(dir.join(format!("{i:03}.jpg")), common::tiny_jpeg(i)).unwrap();
            let words = " word".repeat(i % 5);
            std::fs::write(dir.join(format!("{i:03}.txt")), format!("photo {i}{words}")).unwrap();
        }
        dir
    })
}

type Map = fn(Batch) -> Result<Batch, BoxError>;

fn dataset(rank: usize, world: usize) -> Dataset {
    let source = Source::dir(data())
        .extensions(["jpg"])
        .labels(Labels::Values((0..FILES as i64).map(|i| i % 3).collect()))
        .extra_fields([FieldSpec::new("caption", "txt")]);
    Dataset::builder(source)
        .shuffle(9)
        .ranks(rank, world)
        .build()
        .unwrap()
}

fn loader(map: Option<Map>, rank: usize, world: usize, failures: FailureBudget) -> Loader {
    let mut b = Loader::builder(dataset(rank, world), recipe())
        .batch_size(4)
        .workers(2)
        .max_failures(failures);
    if let Some(f) = map {
        b = b.map_batches("pad", f);
    }
    b.build().unwrap()
}

fn host(d: &Delivered) -> &Tensor {
    match d {
        Delivered::Host(t) => t,
        _ => panic!("a batch in host memory"),
    }
}

fn i64s(t: &Tensor) -> Vec<i64> {
    t.bytes()
        .chunks_exact(8)
        .map(|b| i64::from_ne_bytes(b.try_into().unwrap()))
        .collect()
}

fn captions(b: &Batch) -> Vec<String> {
    b.field("caption")
        .unwrap()
        .into_iter()
        .map(|v| match v {
            FieldValue::Text(s) => s.clone(),
            v => panic!("{v:?}"),
        })
        .collect()
}

/// Tokenizes the batch's captions at once, padded to its longest: `tokens` `[B, L]` (each
/// word's length, 0 after the caption) and `mask` `[B, L]` (1 for a word); each image its
/// negative; the labels plus 10; a field `words` per row; and a draw seeded by the batch's
/// first row and epoch in `draw` (`[B]`).
fn pad(mut b: Batch) -> Result<Batch, BoxError> {
    let words: Vec<Vec<i64>> = captions(&b)
        .iter()
        .map(|c| c.split(' ').map(|w| w.len() as i64).collect())
        .collect();
    let (n, longest) = (b.len(), words.iter().map(Vec::len).max().unwrap_or(0));
    let mut tokens = vec![0i64; n * longest];
    let mut mask = vec![0i64; n * longest];
    for (r, w) in words.iter().enumerate() {
        tokens[r * longest..r * longest + w.len()].copy_from_slice(w);
        mask[r * longest..r * longest + w.len()].fill(1);
    }
    let draw = (b.items[0].index as i64 * 31 + b.items[0].epoch as i64 * 7) % 1000;
    let Delivered::Host(image) = &mut b.fields[0] else {
        return Err("a host batch".into());
    };
    for x in image.bytes_mut() {
        *x = 255 - *x;
    }
    let Some(Delivered::Host(labels)) = &mut b.labels else {
        return Err("labels".into());
    };
    let shifted: Vec<i64> = i64s(labels).iter().map(|l| l + 10).collect();
    labels
        .bytes_mut()
        .copy_from_slice(Tensor::from_i64(&shifted).bytes());
    b.fields.push(Delivered::Host(
        Tensor::from_i64(&tokens).reshaped(&[n, longest]),
    ));
    b.fields.push(Delivered::Host(
        Tensor::from_i64(&mask).reshaped(&[n, longest]),
    ));
    b.fields
        .push(Delivered::Host(Tensor::from_i64(&vec![draw; n])));
    b.names = b
        .names
        .iter()
        .cloned()
        .chain(["tokens", "mask", "draw"].map(String::from))
        .collect();
    for (m, w) in b.items.iter_mut().zip(&words) {
        m.extras.push(FieldValue::Int(w.len() as i64));
    }
    b.extra_names = b
        .extra_names
        .iter()
        .cloned()
        .chain(["words".to_owned()])
        .collect();
    Ok(b)
}

/// Each row: its index, image bytes, label and caption.
type Row = (usize, Vec<u8>, i64, String);

fn rows(b: &Batch) -> Vec<Row> {
    let t = host(&b.fields[0]);
    let each = t.nbytes() / b.len();
    let labels = i64s(host(b.labels.as_ref().unwrap()));
    b.items
        .iter()
        .zip(captions(b))
        .enumerate()
        .map(|(k, (m, c))| {
            assert_eq!(
                m.label,
                Some(labels[k]),
                "the rows' labels follow the tensor"
            );
            (
                m.index,
                t.bytes()[k * each..(k + 1) * each].to_vec(),
                labels[k],
                c,
            )
        })
        .collect()
}

fn batches(l: &mut Loader) -> Vec<Batch> {
    l.epoch().unwrap().map(Result::unwrap).collect()
}

#[test]
fn each_batch_is_the_functions_output_for_its_own_rows_in_order_across_ranks() {
    for (rank, world) in [(0, 1), (2, 3)] {
        let plain = batches(&mut loader(None, rank, world, FailureBudget::unlimited()));
        let mut l = loader(Some(pad), rank, world, FailureBudget::unlimited());
        let mapped = batches(&mut l);
        assert_eq!(plain.len(), mapped.len(), "rank {rank} of {world}");
        assert_eq!(l.tensor_names(), ["image"], "as collated");
        for (p, m) in plain.iter().zip(&mapped) {
            assert_eq!(&*m.names, ["image", "tokens", "mask", "draw"]);
            assert_eq!(&*m.extra_names, ["caption", "words"]);
            let (before, after) = (rows(p), rows(m));
            assert_eq!(before.len(), after.len());
            for ((i, image, label, caption), (j, neg, shifted, same)) in before.iter().zip(&after) {
                assert_eq!(i, j, "the same rows in the same order");
                assert!(image.iter().zip(neg).all(|(a, b)| a + b == 255), "{i}");
                assert_eq!(label + 10, *shifted, "{i}");
                assert_eq!(caption, same, "{i}");
            }
            // The tokens: each row's words, padded to the batch's longest caption.
            let longest = captions(m).iter().map(|c| c.split(' ').count()).max();
            let tokens = host(m.tensor("tokens").unwrap());
            assert_eq!(tokens.shape(), [m.len(), longest.unwrap()]);
            let (t, mask) = (i64s(tokens), i64s(host(m.tensor("mask").unwrap())));
            for (r, c) in captions(m).iter().enumerate() {
                let w: Vec<i64> = c.split(' ').map(|w| w.len() as i64).collect();
                let row = &t[r * longest.unwrap()..(r + 1) * longest.unwrap()];
                assert_eq!(&row[..w.len()], &w[..], "{c}");
                assert!(row[w.len()..].iter().all(|&x| x == 0), "padding");
                let ones: i64 = mask[r * longest.unwrap()..(r + 1) * longest.unwrap()]
                    .iter()
                    .sum();
                assert_eq!(ones as usize, w.len());
                assert_eq!(
                    m.field("words").unwrap()[r],
                    &FieldValue::Int(w.len() as i64)
                );
            }
            let first = m.items[0].index as i64 * 31 % 1000;
            assert!(i64s(host(m.tensor("draw").unwrap()))
                .iter()
                .all(|&d| d == first));
        }
        let stats = l.stats();
        let stage = stats.stage("pad").expect("a stage of its own");
        assert_eq!(stage.items_out as usize, mapped.len(), "one call per batch");
        assert!(stage.workers >= 1);
    }
}

fn failing(b: Batch) -> Result<Batch, BoxError> {
    match b.items[0].index % 5 {
        1 => Err(format!("the batch from {} does not pad", b.items[0].index).into()),
        2 => panic!("the batch from {} panics", b.items[0].index),
        _ => pad(b),
    }
}

#[test]
fn errors_and_panics_fail_the_batch_counted_or_fatal() {
    common::quiet_injected_panics();
    let all = batches(&mut loader(None, 0, 1, FailureBudget::unlimited()));
    let doomed: Vec<&Batch> = all
        .iter()
        .filter(|b| [1, 2].contains(&(b.items[0].index % 5)))
        .collect();
    assert!(
        !doomed.is_empty() && doomed.len() < all.len(),
        "the test fails some"
    );
    let mut l = loader(Some(failing), 0, 1, FailureBudget::unlimited());
    let got = batches(&mut l);
    assert_eq!(
        got.len(),
        all.len() - doomed.len(),
        "every other batch, once"
    );
    let failed = l.watch().failures(None);
    assert_eq!(failed.len(), doomed.len(), "{failed:?}");
    assert!(failed.iter().all(|f| f.stage == "pad"), "{failed:?}");
    assert!(
        failed
            .iter()
            .all(|f| f.item.starts_with("the batch of ") && f.item.contains(".jpg")),
        "{failed:?}"
    );
    assert!(
        failed.iter().any(|f| f.message.contains("does not pad")),
        "{failed:?}"
    );
    assert!(
        failed.iter().any(|f| f.message.contains("panics")),
        "{failed:?}"
    );

    let mut strict = loader(Some(failing), 0, 1, FailureBudget::fail_fast());
    let err = strict
        .epoch()
        .unwrap()
        .find_map(Result::err)
        .expect("the first failure stops the epoch");
    assert!(err.is_failure_budget(), "{err}");
}

#[test]
fn a_checkpoint_resumes_to_exactly_the_same_mapped_batches() {
    let signature = |b: &Batch| {
        (
            rows(b),
            i64s(host(b.tensor("tokens").unwrap())),
            i64s(host(b.tensor("draw").unwrap())),
        )
    };
    for world in [1, 3] {
        let whole: Vec<_> = batches(&mut loader(
            Some(pad),
            world - 1,
            world,
            FailureBudget::unlimited(),
        ))
        .iter()
        .map(signature)
        .collect();
        let mut first = loader(Some(pad), world - 1, world, FailureBudget::unlimited());
        let mut got = Vec::new();
        let state = {
            let mut e = first.epoch().unwrap();
            for _ in 0..2 {
                got.push(signature(&e.next().unwrap().unwrap()));
            }
            e.state().unwrap()
        };
        drop(first);
        let mut again = loader(Some(pad), world - 1, world, FailureBudget::unlimited());
        again.resume(&state).unwrap();
        got.extend(batches(&mut again).iter().map(signature));
        assert_eq!(got, whole, "world {world}");
    }
}

/// Runs an epoch with `f` and returns the failures' messages (every batch fails).
fn failures_of(f: Map) -> Vec<String> {
    let mut l = loader(Some(f), 0, 1, FailureBudget::unlimited());
    let n = l.epoch().unwrap().filter(Result::is_ok).count();
    assert_eq!(n, 0, "no batch delivered");
    let failed = l.watch().failures(None);
    assert_eq!(failed.len(), FILES.div_ceil(4), "each batch failed once");
    failed.into_iter().map(|f| f.message).collect()
}

#[test]
fn what_would_break_a_checkpoint_or_a_batch_fails_the_batch_named() {
    let said = |f: Map, what: &str| {
        let m = failures_of(f);
        assert!(m.iter().all(|m| m.contains(what)), "{what}: {m:?}");
    };
    // Rows dropped or reordered: a checkpoint counts them.
    said(
        |mut b| {
            b.items.pop();
            Ok(b)
        },
        "changed the batch's rows",
    );
    said(
        |mut b| {
            b.items.reverse();
            if b.len() == 1 {
                b.items[0].index += FILES;
            }
            Ok(b)
        },
        "changed the batch's rows",
    );
    // A tensor without the batch's rows first, a name short, a name twice, the labels' name.
    said(
        |mut b| {
            b.fields
                .push(Delivered::Host(Tensor::zeros(&[b.len() + 1], DType::U8)));
            b.names = ["image", "x"].map(String::from).into();
            Ok(b)
        },
        "first dimension",
    );
    said(
        |mut b| {
            b.fields
                .push(Delivered::Host(Tensor::zeros(&[b.len()], DType::U8)));
            Ok(b)
        },
        "2 tensors and 1 names",
    );
    said(
        |mut b| {
            b.extra_names = ["image".to_owned()].into();
            Ok(b)
        },
        "\"image\" is a key the batch already has",
    );
    said(
        |mut b| {
            b.names = ["label".to_owned()].into();
            Ok(b)
        },
        "\"label\"",
    );
    // The labels dropped or of another type; a row short of a field.
    said(
        |mut b| {
            b.labels = None;
            Ok(b)
        },
        "left the labels out",
    );
    said(
        |mut b| {
            b.labels = Some(Delivered::Host(Tensor::zeros(&[b.len()], DType::F32)));
            Ok(b)
        },
        "int64",
    );
    said(
        |mut b| {
            b.items[0].extras.clear();
            Ok(b)
        },
        "fields besides the media",
    );
}

#[test]
fn what_a_per_batch_function_cannot_do_is_refused_when_built() {
    let e = Loader::builder(dataset(0, 1), recipe())
        .map_batches("collate", Ok)
        .build()
        .unwrap_err();
    assert!(
        e.to_string().contains("one of the loader's own stages"),
        "{e}"
    );
    let e = Loader::builder(dataset(0, 1), recipe())
        .map_items("f", Ok)
        .map_batches("f", Ok)
        .build()
        .unwrap_err();
    assert!(e.to_string().contains("name each its own"), "{e}");
    let e = Loader::builder(dataset(0, 1), recipe())
        .decodes_units()
        .map_batches("f", Ok)
        .build()
        .unwrap_err();
    assert!(e.to_string().contains("remote decoding"), "{e}");
}

#[test]
fn a_batchs_keys_are_one_rule_when_built_and_in_the_functions_output() {
    // Without labels, `label` may be a field (a shard's `.cls` read as one): the batch and a
    // per-batch function's output pass it through, by the rule the build checked.
    let unlabelled = |fields: [FieldSpec; 1]| {
        let source = Source::dir(data()).extensions(["jpg"]);
        Dataset::builder(source.extra_fields(fields))
            .build()
            .unwrap()
    };
    let mut l = Loader::builder(unlabelled([FieldSpec::new("label", "txt")]), recipe())
        .batch_size(4)
        .map_batches("same", Ok)
        .build()
        .unwrap();
    let delivered: usize = batches(&mut l).iter().map(Batch::len).sum();
    assert_eq!(delivered, FILES);
    assert!(l.watch().failures(None).is_empty());
    // A field named as a tensor, or `label` where the dataset has labels: refused when built.
    let e = Loader::builder(unlabelled([FieldSpec::new("image", "txt")]), recipe())
        .build()
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("fields: \"image\" is a key the batch already has (its keys: \"image\""),
        "{e}"
    );
    let labelled = Source::dir(data())
        .extensions(["jpg"])
        .labels(Labels::Values(vec![0; FILES]))
        .extra_fields([FieldSpec::new("label", "txt")]);
    let e = Loader::builder(Dataset::builder(labelled).build().unwrap(), recipe())
        .build()
        .unwrap_err()
        .to_string();
    assert!(e.contains("fields: \"label\" is a key"), "{e}");
}

/// The smallest memory budget (in bytes) a loader builds with, found by bisection; `with`
/// adds the function stages under test.
fn smallest_budget(
    with: impl Fn(flowgate::loader::LoaderBuilder) -> flowgate::loader::LoaderBuilder,
) -> u64 {
    let builds = |bytes: u64| {
        let b = Loader::builder(dataset(0, 1), recipe())
            .batch_size(4)
            .workers(2)
            .memory_budget(bytes);
        with(b).build().is_ok()
    };
    let (mut lo, mut hi) = (1u64, 1 << 30);
    assert!(builds(hi) && !builds(lo));
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if builds(mid) {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    hi
}

#[test]
fn the_memory_budget_makes_room_for_the_batches_the_function_stage_holds() {
    let plain = smallest_budget(|b| b);
    let mapped = smallest_budget(|b| b.map_batches("pad", pad));
    // Two batches more: one waiting for the function, one in its hand.
    let item = recipe().item_bytes().unwrap();
    let batch = item * 4;
    assert_eq!(mapped - plain, 2 * batch, "{plain} {mapped}");
    // A per-item function's stage: two items more (one waiting, one in hand); both stages,
    // both rooms.
    let per_item = smallest_budget(|b| b.map_items("m", Ok));
    assert_eq!(per_item - plain, 2 * item, "{plain} {per_item}");
    let both = smallest_budget(|b| b.map_items("m", Ok).map_batches("pad", pad));
    assert_eq!(both - plain, 2 * item + 2 * batch, "{plain} {both}");
    // A budget that cannot hold them is refused, saying why.
    let e = Loader::builder(dataset(0, 1), recipe())
        .batch_size(4)
        .workers(2)
        .memory_budget(plain)
        .map_batches("pad", pad)
        .build()
        .unwrap_err();
    assert!(
        e.to_string().contains("cannot hold a batch in flight"),
        "{e}"
    );
    // And at the smallest budget, an epoch runs whole.
    let mut l = Loader::builder(dataset(0, 1), recipe())
        .batch_size(4)
        .workers(2)
        .memory_budget(mapped)
        .map_batches("pad", pad)
        .build()
        .unwrap();
    let n: usize = batches(&mut l).iter().map(Batch::len).sum();
    assert_eq!(n, FILES);
}
