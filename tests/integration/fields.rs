//! Samples with fields besides their media (`Source::extra_fields`): image-text tar shards
//! (`KEY.jpg`, `KEY.txt`, `KEY.json`) and Parquet rows (`image` beside `caption`), through
//! the loader: each batch's captions and records belong to its images, in order, every sample
//! once across ranks, resumed exactly from a mid-epoch checkpoint; a sample without a
//! required field is a failed item naming it, an optional one is `Missing`; sources without
//! other members are refused.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use arrow_array::{ArrayRef, BinaryArray, RecordBatch, StringArray};
use arrow_schema::{DataType, Field, Schema};
use flowgate::dataset::shards::tar::write_archive;
use flowgate::dataset::{Dataset, FieldKind, FieldSpec, FieldValue, Labels, Source};
use flowgate::loader::Batch;
use flowgate::{FailureBudget, Loader, PipelineState};
use parquet::arrow::ArrowWriter;

use crate::common;
use common::{small_loader as loader, small_recipe as recipe};

/// Samples in the shards (4 shards of 11, 11, 11, 8); rows in the Parquet file.
const SAMPLES: usize = 41;
const ROWS: usize = 23;
/// The sample with no caption in the shards of `gaps`.
const GAP: usize = 17;

struct Data {
    shards: String,
    gaps: String,
    parquet: PathBuf,
}

fn caption(i: usize) -> String {
    format!("a photo number {i}, café")
}

/// Shards of `KEY.jpg`, `KEY.cls` (the sample's number), `KEY.txt` (its caption) and
/// `KEY.json` (a record naming its key); without `GAP`'s caption when `gap`.
fn write_shards(dir: &Path, gap: bool) -> String {
    std::fs::create_dir_all(dir).unwrap();
    for s in 0..SAMPLES.div_ceil(11) {
        let mut members = Vec::new();
        for i in (s * 11)..((s + 1) * 11).min(SAMPLES) {
            let key = format!("{i:05}");
            members.push((format!("{key}.jpg"), common::tiny_jpeg(i)));
            members.push((format!("{key}.cls"), i.to_string().into_bytes()));
            if !(gap && i == GAP) {
                members.push((format!("{key}.txt"), caption(i).into_bytes()));
            }
            let json = serde_json::json!({"key": key, "n": i, "tags": ["x", i % 3]});
            members.push((format!("{key}.json"), json.to_string().into_bytes()));
        }
        let f = std::fs::File::create(dir.join(format!("s-{s:02}.tar"))).unwrap();
        write_archive(std::io::BufWriter::new(f), members).unwrap();
    }
    format!("{}/s-{{00..03}}.tar", dir.display())
}

fn data() -> &'static Data {
    static DATA: OnceLock<Data> = OnceLock::new();
    DATA.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("fields");
        let _ = std::fs::remove_dir_all(&dir);
        let shards = write_shards(&dir.join("shards"), false);
        let gaps = write_shards(&dir.join("gaps"), true);
        // Hugging Face's image-text layout: an image column of bytes beside a caption.
        let images: Vec<Vec<u8>> = (0..ROWS).map(common::tiny_jpeg).collect();
        let schema = Arc::new(Schema::new(vec![
            Field::new("image", DataType::Binary, false),
            Field::new("caption", DataType::Utf8, false),
        ]));
        let batch = RecordBatch::try_new(
            Arc::clone(&schema),
            vec![
                Arc::new(BinaryArray::from_iter_values(images.iter())) as ArrayRef,
                Arc::new(StringArray::from_iter_values((0..ROWS).map(caption))),
            ],
        )
        .unwrap();
        let parquet = dir.join("rows.parquet");
        let props = parquet::file::properties::WriterProperties::builder()
            .set_max_row_group_row_count(Some(5))
            .build();
        let f = std::fs::File::create(&parquet).unwrap();
        let mut w = ArrowWriter::try_new(f, schema, Some(props)).unwrap();
        w.write(&batch).unwrap();
        w.close().unwrap();
        Data {
            shards,
            gaps,
            parquet,
        }
    })
}

fn image_text(pattern: &str) -> Source {
    Source::shards(pattern)
        .labels(Labels::Field("cls".into()))
        .extra_fields([
            FieldSpec::new("caption", "txt"),
            FieldSpec::new("meta", ".JSON"),
        ])
}

/// Each item of `b` as (its number, its caption, its record), checking the image is the
/// number's: the caption and record are the image's own.
fn rows(b: &Batch) -> Vec<(i64, String, serde_json::Value)> {
    let captions = b.field("caption").expect("a caption field");
    let metas = b.field("meta").expect("a meta field");
    assert!(b.field("nothing").is_none());
    let mut out = Vec::new();
    for ((m, c), j) in b.items.iter().zip(captions).zip(metas) {
        let n = m.label.unwrap();
        let (FieldValue::Text(c), FieldValue::Json(j)) = (c, j) else {
            panic!("a text and a JSON value, not {c:?} and {j:?}")
        };
        out.push((n, c.clone(), j.clone()));
    }
    out
}

fn aligned(got: &[(i64, String, serde_json::Value)]) {
    for (n, c, j) in got {
        let i = *n as usize;
        assert_eq!(c, &caption(i), "sample {n}'s caption");
        assert_eq!(j["key"], format!("{i:05}"), "sample {n}'s record");
        assert_eq!(j["n"], *n);
    }
}

/// Three ranks, batches of 4 (41 samples: 14 a rank, one padded), two epochs: every item's
/// caption and record are its own, every sample in each epoch; a checkpoint after 2 batches
/// (through JSON) resumes to exactly the rest, fields and all.
#[test]
fn image_text_shards_keep_each_caption_and_record_with_its_image_across_ranks_and_resumes() {
    let pattern = data().shards.clone();
    for epoch in 0..2u64 {
        let mut seen = BTreeMap::new();
        for rank in 0..3 {
            let mut l = loader(image_text(&pattern), 7, rank, 3, 4);
            l.set_epoch(epoch);
            let batches: Vec<Batch> = l.epoch().unwrap().map(Result::unwrap).collect();
            assert_eq!(batches.len(), l.len());
            for b in &batches {
                let r = rows(b);
                aligned(&r);
                for (n, ..) in r {
                    *seen.entry(n).or_insert(0) += 1;
                }
            }
        }
        assert_eq!(seen.len(), SAMPLES, "every sample in epoch {epoch}");
        assert_eq!(seen.values().sum::<usize>(), 42, "one padded");
    }

    let mut l = loader(image_text(&pattern), 3, 1, 2, 3);
    let whole: Vec<_> = l
        .epoch()
        .unwrap()
        .map(Result::unwrap)
        .flat_map(|b| rows(&b))
        .collect();
    let mut l = loader(image_text(&pattern), 3, 1, 2, 3);
    let mut got: Vec<_> = Vec::new();
    l.start_epoch().unwrap();
    for _ in 0..2 {
        let b = l.next_batch().unwrap().unwrap();
        got.extend(rows(&b));
    }
    let state: PipelineState =
        serde_json::from_str(&serde_json::to_string(&l.state().unwrap()).unwrap()).unwrap();
    drop(l);
    let mut again = loader(image_text(&pattern), 3, 1, 2, 3);
    again.resume(&state).unwrap();
    let rest: Vec<Batch> = again.epoch().unwrap().map(Result::unwrap).collect();
    got.extend(rest.iter().flat_map(rows));
    assert_eq!(got, whole, "the resumed epoch's rest, with its fields");
    aligned(&got);
}

/// Hugging Face's layout: the caption column beside the image column, row by row, resumed
/// exactly; a column the file lacks is refused naming it.
#[test]
fn parquet_rows_give_their_caption_column_with_each_image() {
    let source = || {
        Source::parquet([&data().parquet], "image")
            .extra_fields([FieldSpec::new("caption", "caption").kind(FieldKind::Text)])
    };
    let mut l = loader(source(), 5, 0, 1, 4);
    let whole: Vec<String> = l
        .epoch()
        .unwrap()
        .map(Result::unwrap)
        .flat_map(|b| {
            b.field("caption")
                .unwrap()
                .into_iter()
                .zip(&b.items)
                .map(|(c, m)| {
                    // Rows are numbered by position: the caption names the row.
                    assert_eq!(c, &FieldValue::Text(caption(m.index)));
                    caption(m.index)
                })
                .collect::<Vec<_>>()
        })
        .collect();
    assert_eq!(whole.len(), ROWS);
    let mut l = loader(source(), 5, 0, 1, 4);
    l.start_epoch().unwrap();
    let first = l.next_batch().unwrap().unwrap();
    let mut got: Vec<String> = first
        .field("caption")
        .unwrap()
        .into_iter()
        .map(|v| match v {
            FieldValue::Text(t) => t.clone(),
            v => panic!("{v:?}"),
        })
        .collect();
    let state = l.state().unwrap();
    let mut again = loader(source(), 5, 0, 1, 4);
    again.resume(&state).unwrap();
    for b in again
        .epoch()
        .unwrap()
        .map(Result::unwrap)
        .collect::<Vec<_>>()
    {
        for v in b.field("caption").unwrap() {
            let FieldValue::Text(t) = v else { panic!() };
            got.push(t.clone());
        }
    }
    assert_eq!(got, whole);

    let missing = Dataset::builder(
        Source::parquet([&data().parquet], "image").extra_fields([FieldSpec::new("t", "text")]),
    )
    .build()
    .unwrap_err();
    assert!(
        missing.to_string().contains("no column \"text\""),
        "{missing}"
    );
}

/// A sample without its caption: skipped and counted naming the field (the default), fatal
/// when failing fast; with the field optional, delivered with `Missing`. Loose files have no
/// other members: refused when the dataset is built.
#[test]
fn a_missing_field_is_a_failed_item_or_missing_when_optional_and_files_are_refused() {
    let gaps = data().gaps.clone();
    let mut l = loader(image_text(&gaps), 0, 0, 1, 8);
    let got: Vec<_> = l
        .epoch()
        .unwrap()
        .map(Result::unwrap)
        .flat_map(|b| rows(&b))
        .collect();
    aligned(&got);
    assert_eq!(got.len(), SAMPLES - 1);
    assert!(got.iter().all(|(n, ..)| *n as usize != GAP));
    let failures = l.watch().failures(Some(0));
    assert_eq!(failures.len(), 1, "{failures:?}");
    assert!(
        failures[0].message.contains("txt (field \"caption\")")
            && failures[0].item.contains("00017"),
        "{:?}",
        failures[0]
    );

    let dataset = Dataset::builder(image_text(&gaps)).build().unwrap();
    let mut strict = Loader::builder(dataset, recipe())
        .batch_size(8)
        .max_failures(FailureBudget::fail_fast())
        .build()
        .unwrap();
    let err = strict
        .epoch()
        .unwrap()
        .find_map(Result::err)
        .expect("the missing caption fails the epoch");
    assert!(err.to_string().contains("field \"caption\""), "{err}");

    let optional = Source::shards(gaps)
        .labels(Labels::Field("cls".into()))
        .extra_fields([FieldSpec::new("caption", "txt").optional(true)]);
    let mut l = loader(optional, 0, 0, 1, 8);
    let mut n = 0;
    for b in l.epoch().unwrap().map(Result::unwrap).collect::<Vec<_>>() {
        for (m, c) in b.items.iter().zip(b.field("caption").unwrap()) {
            let i = m.label.unwrap() as usize;
            let want = match i {
                GAP => FieldValue::Missing,
                _ => FieldValue::Text(caption(i)),
            };
            assert_eq!(c, &want);
            n += 1;
        }
    }
    assert_eq!(n, SAMPLES);

    let e = Dataset::builder(
        Source::shards(data().shards.clone())
            .extra_fields([FieldSpec::new("c", "txt"), FieldSpec::new("c", "json")]),
    )
    .build()
    .unwrap_err();
    assert!(e.to_string().contains("named twice"), "{e}");
}

/// Loose files with their fields in files beside them (`a.jpg` + `a.txt` + `a.json`): each
/// image's caption and record are its own across ranks and a resume; an image without its
/// caption is a failed item naming the file looked for, `None` where optional; a record
/// that does not parse names its file.
#[test]
fn loose_files_read_their_fields_from_the_files_beside_them() {
    const FILES: usize = 19;
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("fields-sidecars");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for i in 0..FILES {
        // A dot in the stem too: the sidecar replaces the last extension only.
        let file = |ext: &str| dir.join(format!("img.{i:03}.{ext}"));
        std::fs::write(file("jpg"), common::tiny_jpeg(i)).unwrap();
        if i != 5 {
            std::fs::write(file("txt"), caption(i)).unwrap();
        }
        let record = serde_json::json!({"key": format!("{i:05}"), "n": i});
        let body = if i == 9 {
            "{oops".to_owned()
        } else {
            record.to_string()
        };
        std::fs::write(file("json"), body).unwrap();
    }
    let source = |caption_optional: bool| {
        Source::dir(&dir).extensions(["jpg"]).extra_fields([
            FieldSpec::new("caption", "txt").optional(caption_optional),
            FieldSpec::new("meta", "json"),
        ])
    };
    // The file's number, from its path: the fields must be that file's.
    let number = |l: &Loader, m: &flowgate::loader::ItemMeta| -> usize {
        let p = l.path_of(m);
        p.rsplit('.').nth(1).unwrap().parse().unwrap()
    };
    let mut seen = BTreeMap::new();
    let mut failed = Vec::new();
    for rank in 0..2 {
        let mut l = loader(source(false), 4, rank, 2, 3);
        let batches: Vec<_> = l.epoch().unwrap().map(Result::unwrap).collect();
        for b in &batches {
            let caps = b.field("caption").unwrap();
            let metas = b.field("meta").unwrap();
            for ((m, c), j) in b.items.iter().zip(caps).zip(metas) {
                let i = number(&l, m);
                assert_eq!(c, &FieldValue::Text(caption(i)), "file {i}'s caption");
                let FieldValue::Json(j) = j else {
                    panic!("{j:?}")
                };
                assert_eq!(j["n"], i, "file {i}'s record");
                *seen.entry(i).or_insert(0) += 1;
            }
        }
        failed.extend(l.watch().failures(Some(0)).into_iter().map(|f| f.message));
    }
    let good: Vec<usize> = (0..FILES).filter(|i| ![5, 9].contains(i)).collect();
    assert_eq!(seen.keys().copied().collect::<Vec<_>>(), good);
    assert_eq!(failed.len(), 2, "{failed:?}");
    assert!(
        failed
            .iter()
            .any(|e| e.contains("img.005.txt") && e.contains("\"caption\"")),
        "{failed:?}"
    );
    assert!(
        failed
            .iter()
            .any(|e| e.contains("img.009.json") && e.contains("not JSON")),
        "{failed:?}"
    );

    // Optional: the file without its caption is delivered with `Missing`.
    let mut l = loader(source(true), 4, 0, 1, 4);
    let batches: Vec<_> = l.epoch().unwrap().map(Result::unwrap).collect();
    let mut missing = Vec::new();
    for b in &batches {
        for (m, c) in b.items.iter().zip(b.field("caption").unwrap()) {
            if *c == FieldValue::Missing {
                missing.push(number(&l, m));
            }
        }
    }
    assert_eq!(missing, [5]);

    // A checkpoint after 2 batches resumes to exactly the rest, fields and all.
    let mut whole = loader(source(true), 4, 0, 1, 4);
    let all: Vec<usize> = whole
        .epoch()
        .unwrap()
        .flat_map(|b| b.unwrap().items.into_iter().map(|m| m.index))
        .collect();
    let mut first = loader(source(true), 4, 0, 1, 4);
    let (mut taken, state) = common::take_then_save(&mut first, 2);
    drop(first);
    taken.extend(common::rest_after(
        &mut loader(source(true), 4, 0, 1, 4),
        &state,
    ));
    assert_eq!(taken, all, "the same items, in the same order");
}

/// A sidecar extension that is a path is refused when the dataset is built (it used to
/// panic in every item); one that names a FIFO, a device or a directory fails its item
/// ("not a regular file"), optional or not, instead of blocking a worker or reading forever.
#[test]
fn sidecars_are_regular_files_beside_the_media() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("fields-special");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for i in 0..5 {
        std::fs::write(dir.join(format!("{i}.jpg")), common::tiny_jpeg(i)).unwrap();
    }
    let e = Dataset::builder(
        Source::dir(&dir)
            .extensions(["jpg"])
            .extra_fields([FieldSpec::new("c", "meta/txt")]),
    )
    .build()
    .unwrap_err();
    assert!(e.to_string().contains("not a path"), "{e}");
    let fifo = dir.join("1.side");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap();
    assert!(made.success());
    std::fs::create_dir(dir.join("3.side")).unwrap();
    std::fs::write(dir.join("4.side"), b"four").unwrap();
    let source = Source::dir(&dir)
        .extensions(["jpg"])
        .extra_fields([FieldSpec::new("s", "side")
            .kind(FieldKind::Text)
            .optional(true)]);
    let mut l = loader(source, 0, 0, 1, 2);
    let mut got = BTreeMap::new();
    for b in l.epoch().unwrap().map(Result::unwrap).collect::<Vec<_>>() {
        for (m, v) in b.items.iter().zip(b.field("s").unwrap()) {
            got.insert(l.path_of(m), v.clone());
        }
    }
    let name = |i: usize| dir.join(format!("{i}.jpg")).display().to_string();
    assert_eq!(got.len(), 3, "{got:?}");
    assert_eq!(got[&name(0)], FieldValue::Missing);
    assert_eq!(got[&name(4)], FieldValue::Text("four".into()));
    let f = l.watch().failures(Some(0));
    assert_eq!(f.len(), 2, "{f:?}");
    assert!(
        f.iter().all(|f| f.message.contains("not a regular file")),
        "{f:?}"
    );
}
