//! [`write_parquet`]: media files into a Parquet file in the Hugging Face layout (an `image`
//! column of `struct<bytes, path>` and a `label` column), for demos, examples and tests.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use ::parquet::arrow::ArrowWriter;
use ::parquet::file::properties::WriterProperties;
use arrow_array::builder::{BinaryBuilder, StringBuilder};
use arrow_array::{ArrayRef, Int64Array, RecordBatch, StructArray};
use arrow_schema::{DataType, Field, Fields, Schema};

/// Writes the files at `paths` into one Parquet file at `out`, in row groups of
/// `rows_per_group` rows: column `image` (`struct<bytes: binary, path: string>`, the
/// Hugging Face `Image` feature) holds each file's bytes and name, column `label` (`int64`)
/// `label(i, path)`. Returns the number of rows.
pub fn write_parquet(
    paths: &[PathBuf],
    out: &Path,
    rows_per_group: usize,
    label: impl Fn(usize, &Path) -> i64,
) -> std::io::Result<usize> {
    let mut bytes = BinaryBuilder::new();
    let mut names = StringBuilder::new();
    let mut labels = Vec::with_capacity(paths.len());
    for (i, p) in paths.iter().enumerate() {
        bytes.append_value(std::fs::read(p)?);
        names.append_value(
            p.file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default(),
        );
        labels.push(label(i, p));
    }
    let fields = Fields::from(vec![
        Field::new("bytes", DataType::Binary, true),
        Field::new("path", DataType::Utf8, true),
    ]);
    let image = StructArray::new(
        fields.clone(),
        vec![
            Arc::new(bytes.finish()) as ArrayRef,
            Arc::new(names.finish()) as ArrayRef,
        ],
        None,
    );
    let schema = Arc::new(Schema::new(vec![
        Field::new("image", DataType::Struct(fields), true),
        Field::new("label", DataType::Int64, false),
    ]));
    let batch = RecordBatch::try_new(
        Arc::clone(&schema),
        vec![Arc::new(image), Arc::new(Int64Array::from(labels))],
    )
    .map_err(std::io::Error::other)?;
    if let Some(dir) = out.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let props = WriterProperties::builder()
        .set_max_row_group_row_count(Some(rows_per_group.max(1)))
        .build();
    let mut w = ArrowWriter::try_new(std::fs::File::create(out)?, schema, Some(props))
        .map_err(std::io::Error::other)?;
    w.write(&batch).map_err(std::io::Error::other)?;
    w.close().map_err(std::io::Error::other)?;
    Ok(paths.len())
}
