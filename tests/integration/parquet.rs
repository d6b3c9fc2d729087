//! Parquet in the Hugging Face image layout (`image: struct<bytes, path>`, `label: int64`,
//! `caption: string`), written here with arrow-rs in three row groups: the right images and
//! labels (against a decode of the stored bytes), ranks, exact resume, and bad rows named by
//! file, row group and row.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_array::builder::{BinaryBuilder, StringBuilder};
use arrow_array::{ArrayRef, Int64Array, RecordBatch, StringArray, StructArray};
use arrow_schema::{DataType, Field, Fields, Schema};
use flowgate::dataset::parquet::ParquetRows;
use flowgate::media::image::ImageRecipe;
use flowgate::media::Recipe;
use flowgate::sample::FieldMap;
use flowgate::sample::{Field as SampleField, Sample};
use flowgate::{FailureBudget, Order, Pipeline, PipelineState, Workers};
use parquet::arrow::ArrowWriter;
use parquet::file::properties::WriterProperties;

const ROWS: usize = 90;

fn jpeg(shade: u8) -> Vec<u8> {
    let mut out = Vec::new();
    let pixels: Vec<u8> = (0..16 * 12 * 3)
        .map(|i| shade.wrapping_mul(3).wrapping_add(i as u8))
        .collect();
    jpeg_encoder::Encoder::new(&mut out, 90)
        .encode(&pixels, 16, 12, jpeg_encoder::ColorType::Rgb)
        .unwrap();
    out
}

/// Row `i`: a JPEG (row 7's image is null, row 11's bytes are not an image), label `i * 2`,
/// caption `"row i"`; row groups of 40 rows.
fn write(path: &Path) -> Vec<Vec<u8>> {
    let images: Vec<Vec<u8>> = (0..ROWS)
        .map(|i| {
            if i == 11 {
                b"not a jpeg".to_vec()
            } else {
                jpeg(i as u8)
            }
        })
        .collect();
    let mut bytes = BinaryBuilder::new();
    let mut paths = StringBuilder::new();
    for (i, img) in images.iter().enumerate() {
        bytes.append_value(img);
        paths.append_value(format!("img{i}.jpg"));
    }
    let fields = Fields::from(vec![
        Field::new("bytes", DataType::Binary, true),
        Field::new("path", DataType::Utf8, true),
    ]);
    let nulls = arrow_buffer::NullBuffer::from((0..ROWS).map(|i| i != 7).collect::<Vec<_>>());
    let image = StructArray::new(
        fields.clone(),
        vec![
            Arc::new(bytes.finish()) as ArrayRef,
            Arc::new(paths.finish()) as ArrayRef,
        ],
        Some(nulls),
    );
    let schema = Arc::new(Schema::new(vec![
        Field::new("image", DataType::Struct(fields), true),
        Field::new("label", DataType::Int64, false),
        Field::new("caption", DataType::Utf8, false),
    ]));
    let batch = RecordBatch::try_new(
        Arc::clone(&schema),
        vec![
            Arc::new(image),
            Arc::new(Int64Array::from_iter_values(
                (0..ROWS as i64).map(|i| i * 2),
            )),
            Arc::new(StringArray::from_iter_values(
                (0..ROWS).map(|i| format!("row {i}")),
            )),
        ],
    )
    .unwrap();
    let props = WriterProperties::builder()
        .set_max_row_group_row_count(Some(40))
        .build();
    let mut w =
        ArrowWriter::try_new(std::fs::File::create(path).unwrap(), schema, Some(props)).unwrap();
    w.write(&batch).unwrap();
    w.close().unwrap();
    images
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("flowgate-pq-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn recipe() -> Recipe {
    Recipe::image(ImageRecipe {
        resize: 12,
        crop: 12,
        ..ImageRecipe::default()
    })
    .unwrap()
}

fn fields() -> FieldMap {
    FieldMap::new()
        .decode("image", &["image"], recipe())
        .label("label", "label")
        .text("caption", "caption")
}

fn label(s: &Sample) -> i64 {
    match s.get("label") {
        Some(SampleField::Label(v)) => *v,
        other => panic!("{other:?}"),
    }
}

fn build(rows: &ParquetRows) -> Pipeline<Sample> {
    let (r, fields) = (rows.clone(), fields());
    let names = rows.clone();
    Pipeline::builder()
        .source_sampled(rows.sampler().clone(), rows.refs())
        .checkpoint_fields(rows.fingerprint())
        .describe(move |&(_, i)| names.name(i))
        .pipe(
            "decode",
            move |(epoch, i): (u64, usize)| fields.apply(r.read(epoch, i)?),
            Workers::fixed(2),
        )
        .budget(8, u64::MAX)
        .max_failures(FailureBudget::unlimited())
        .output_order(Order::Input)
        .build()
        .unwrap()
}

#[test]
fn hugging_face_layout_reads_the_right_images_and_labels() {
    let dir = tmp("hf");
    let file = dir.join("train-00000-of-00001.parquet");
    let images = write(&file);
    let rows = ParquetRows::open([&file], &["image", "label", "caption"])
        .unwrap()
        .shuffle(3)
        .buffer(16);
    assert_eq!(rows.len(), ROWS);
    let failures = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let seen = Arc::clone(&failures);
    let (r, f) = (rows.clone(), fields());
    let names = rows.clone();
    let mut p = Pipeline::builder()
        .source_sampled(rows.sampler().clone(), rows.refs())
        .describe(move |&(_, i)| names.name(i))
        .pipe(
            "decode",
            move |(epoch, i): (u64, usize)| f.apply(r.read(epoch, i)?),
            2,
        )
        .on_failure(move |e| seen.lock().push(e.to_string()))
        .build()
        .unwrap();
    let mut got: BTreeMap<i64, Vec<u8>> = BTreeMap::new();
    for s in p.iter() {
        let s = s.unwrap();
        let l = label(&s);
        match s.get("caption") {
            Some(SampleField::Text(t)) => assert_eq!(*t, format!("row {}", l / 2)),
            other => panic!("{other:?}"),
        }
        let Some(SampleField::Tensor(t)) = s.get("image") else {
            panic!("no image")
        };
        got.insert(l, t.bytes().to_vec());
    }
    assert_eq!(
        got.len(),
        ROWS - 2,
        "all rows but the null and the corrupt image"
    );
    for (l, t) in &got {
        let i = (*l / 2) as usize;
        let want = recipe()
            .decode(flowgate::Blob {
                path: "x.jpg".into(),
                bytes: images[i].clone(),
            })
            .unwrap();
        assert_eq!(&t[..], want.bytes(), "row {i}");
    }
    let f = failures.lock().join("\n");
    assert!(f.contains("rg0/row7: no field image"), "{f}");
    assert!(f.contains("rg0/row11"), "{f}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn ranks_and_resume_are_exact_to_the_row() {
    let dir = tmp("ranks");
    let file = dir.join("a.parquet");
    write(&file);
    let open = |rank, world| {
        ParquetRows::open([&file], &["image", "label", "caption"])
            .unwrap()
            .shuffle(5)
            .buffer(10)
            .shard(rank, world)
            .unwrap()
    };
    let mut all = Vec::new();
    for rank in 0..2 {
        all.extend(build(&open(rank, 2)).iter().map(|s| label(&s.unwrap())));
    }
    all.sort_unstable();
    let want: Vec<i64> = (0..ROWS as i64)
        .filter(|i| *i != 7 && *i != 11)
        .map(|i| i * 2)
        .collect();
    assert_eq!(all, want, "each row once across ranks");

    let whole: Vec<i64> = build(&open(0, 1))
        .iter()
        .map(|s| label(&s.unwrap()))
        .collect();
    let mut got = Vec::new();
    let mut state: Option<PipelineState> = None;
    for stop in [13usize, 29, usize::MAX] {
        let mut p = build(&open(0, 1));
        if let Some(s) = &state {
            p.resume(s).unwrap();
        }
        got.extend(p.iter().take(stop).map(|s| label(&s.unwrap())));
        state = Some(p.state());
    }
    assert_eq!(got, whole, "chained resumes give the epoch in order");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_files_and_columns_are_errors_naming_them() {
    let dir = tmp("bad");
    let not = dir.join("not.parquet");
    std::fs::write(&not, b"PAR1 but not really").unwrap();
    let e = ParquetRows::open([&not], &["image"]).unwrap_err();
    assert!(
        e.to_string()
            .contains("not.parquet: not a readable Parquet file"),
        "{e}"
    );
    let good = dir.join("good.parquet");
    write(&good);
    let e = ParquetRows::open([&good], &["jpg"]).unwrap_err();
    assert!(
        e.to_string()
            .contains("no column \"jpg\" (it has: image, label, caption)"),
        "{e}"
    );
    assert!(ParquetRows::open([dir.join("missing.parquet")], &["image"]).is_err());
    let _ = std::fs::remove_dir_all(&dir);
}

#[cfg(feature = "spec")]
#[test]
fn pipeline_files_read_parquet() {
    use flowgate::spec::{Hooks, PipelineSpec};
    let dir = tmp("spec");
    write(&dir.join("part-0.parquet"));
    write(&dir.join("part-1.parquet"));
    let toml = format!(
        "[source]\nkind = \"parquet\"\npath = \"{}\"\ncolumn = \"image\"\nshuffle = 1\nbuffer = 20\n\
         [decode]\nkind = \"image\"\nresize = 12\ncrop = 12\nworkers = 2\n[batch]\nsize = 16\n",
        dir.display()
    );
    let spec = PipelineSpec::parse(&toml, "p.toml").unwrap();
    let mut loader = spec.build(Hooks::default()).unwrap();
    let n: usize = loader.epoch().unwrap().map(|b| b.unwrap().shape()[0]).sum();
    assert_eq!(
        n,
        2 * (ROWS - 2),
        "every row of both files but the two bad ones"
    );
    assert_eq!(loader.stats().failures, 4);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Parquet on the local S3 server (a real s3s-fs on 127.0.0.1): the same rows as the local
/// file, footers and row groups by ranged GETs (one per row group), and only the requested
/// columns' bytes fetched.
#[cfg(all(feature = "s3", feature = "test-util"))]
#[test]
fn parquet_on_s3_reads_the_same_rows_by_ranged_gets_of_the_requested_columns() {
    use flowgate::s3::{LocalServer, S3};
    let dir = tmp("s3");
    let local = dir.join("train.parquet");
    write(&local);
    let size = std::fs::metadata(&local).unwrap().len();
    let server = LocalServer::start(dir.join("server")).expect("start s3s-fs");
    let s3 = S3::connect(server.config("data")).unwrap();
    futures::executor::block_on(s3.create_bucket()).unwrap();
    futures::executor::block_on(s3.put("hf/train-0.parquet", std::fs::read(&local).unwrap()))
        .unwrap();
    let columns = ["image", "label"];
    let want = ParquetRows::open([&local], &columns).unwrap();
    let before = s3.stats();
    let remote = ParquetRows::open_s3(&s3, "hf/", &columns).unwrap();
    assert_eq!(remote.len(), ROWS);
    assert_eq!(remote.name(0), "s3://data/hf/train-0.parquet:rg0/row0");
    for i in 0..ROWS {
        let (a, b) = (want.read(0, i), remote.read(0, i));
        match (a, b) {
            (Ok(a), Ok(b)) => assert_eq!(a.fields, b.fields, "row {i}"),
            (Err(_), Err(_)) => {}
            (a, b) => panic!("row {i}: {a:?} vs {b:?}"),
        }
    }
    let spent = s3.stats().attempts - before.attempts;
    // A listing, the footer, and one GET per row group (3 of 40, 40, 10 rows).
    assert!(spent <= 5, "{spent} requests");

    let labels = ParquetRows::open_s3(&s3, "hf/train-0.parquet", &["label"]).unwrap();
    let before = s3.stats();
    for i in 0..ROWS {
        labels.read(0, i).unwrap();
    }
    let fetched = s3.stats().bytes - before.bytes;
    assert!(
        fetched * 4 < size,
        "only the label column: {fetched} of {size} bytes fetched"
    );
    let e = ParquetRows::open_s3(&s3, "hf/missing.parquet", &columns).unwrap_err();
    assert!(
        e.to_string()
            .contains("s3://data/hf/missing.parquet: no such object"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[cfg(all(feature = "s3", feature = "test-util"))]
use crate::s3_common;

/// A Parquet object rewritten on the store after it was opened: its row groups are read at
/// the version whose footer was read (`If-Match`, checked by the proxy as S3 does), so each
/// read is an error saying the object changed, never the new bytes decoded at the old
/// footer's offsets. Reads before the rewrite are unaffected.
#[cfg(all(feature = "s3", feature = "test-util"))]
#[test]
fn a_parquet_object_rewritten_while_read_is_an_error_never_mixed_versions() {
    use std::sync::atomic::Ordering;
    let f = s3_common::fixture("parquet-rewrite");
    let dir = tmp("s3-rewrite");
    let local = dir.join("train.parquet");
    write(&local);
    s3_common::put(&f.s3, "hf/train-0.parquet", std::fs::read(&local).unwrap());
    let proxy = s3_common::proxy_to(&f, false);
    let s3 = s3_common::through(&f, &proxy);
    let rows = ParquetRows::open_s3(&s3, "hf/train-0.parquet", &["image", "label"]).unwrap();
    let want = ParquetRows::open([&local], &["image", "label"]).unwrap();
    // Row group 0 read before the rewrite.
    assert_eq!(
        rows.read(0, 0).unwrap().fields,
        want.read(0, 0).unwrap().fields
    );
    // The same rows, written again with other row groups: other bytes, another entity tag.
    let other = dir.join("other.parquet");
    {
        let file = std::fs::File::open(&local).unwrap();
        let reader = parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(file)
            .unwrap()
            .build()
            .unwrap();
        let batches: Vec<RecordBatch> = reader.map(Result::unwrap).collect();
        let props = WriterProperties::builder()
            .set_max_row_group_row_count(Some(17))
            .build();
        let mut w = ArrowWriter::try_new(
            std::fs::File::create(&other).unwrap(),
            batches[0].schema(),
            Some(props),
        )
        .unwrap();
        for b in &batches {
            w.write(b).unwrap();
        }
        w.close().unwrap();
    }
    s3_common::put(&f.s3, "hf/train-0.parquet", std::fs::read(&other).unwrap());
    for i in [45, 85] {
        eprintln!(
            "ranged {} if-match {} 412 {}",
            proxy.counts.ranged.load(Ordering::Relaxed),
            proxy.counts.ranged_if_match.load(Ordering::Relaxed),
            proxy.counts.precondition_failed.load(Ordering::Relaxed)
        );
        let e = rows.read(0, i).unwrap_err().to_string();
        assert!(e.contains("changed on the store"), "row {i}: {e}");
    }
    assert!(proxy.counts.precondition_failed.load(Ordering::Relaxed) >= 1);
    // Every ranged GET of the object after the first (the footer's, which pins the
    // version: the local server's listing names no entity tag) carried If-Match.
    assert_eq!(
        proxy.counts.ranged.load(Ordering::Relaxed) - 1,
        proxy.counts.ranged_if_match.load(Ordering::Relaxed)
    );
    let _ = std::fs::remove_dir_all(&dir);
}
