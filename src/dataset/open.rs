//! Opening a [`Source`] into a [`Dataset`]: files found, shards indexed, Parquet footers
//! read, labels checked, mixtures assembled from their parts, S3 URLs connected.

use std::path::Path;

use flowgate_actors::error::PipelineError;

use super::files::Files;
use super::order::EpochOrder;
use super::records::Records;
use super::shards::Shards;
use super::source::{Labels, Remote, Source, SourceKind};
use super::{Dataset, FieldSpec, Kind};
use crate::sampler::Sampler;

/// Opens `source`, ordered by `order`; `extensions` are the media files' (walks, shard
/// fields).
pub(super) fn open(
    source: &Source,
    order: EpochOrder,
    extensions: &[String],
) -> Result<Dataset, PipelineError> {
    check_numbers(source)?;
    extras(source)?;
    let kind = match &source.kind {
        SourceKind::Paths(_) | SourceKind::Dir(..) | SourceKind::List(_) => {
            files(source, order, extensions)?
        }
        SourceKind::Shards {
            pattern,
            fields,
            remote,
        } => {
            let shards = open_shards(pattern, remote)?;
            let shards = match order.seed {
                Some(_) => shards.buffer(source.buffer),
                None => shards,
            };
            let media: Vec<String> = fields
                .clone()
                .unwrap_or_else(|| extensions.to_vec())
                .iter()
                .map(|e| e.trim_start_matches('.').to_ascii_lowercase())
                .collect();
            Kind::Records {
                records: Records::Tar(order.apply(shards)?),
                media: media.into(),
                label: field_label(source)?.map(|l| l.to_ascii_lowercase()),
                extras: extras(source)?
                    .into_iter()
                    .map(FieldSpec::normalized)
                    .collect(),
            }
        }
        SourceKind::Parquet { .. } => parquet(source, order)?,
        #[cfg(feature = "s3")]
        SourceKind::Objects { .. } => objects(source, order)?,
        SourceKind::Mix {
            parts,
            weights,
            stop,
        } => {
            let mut opened = Vec::with_capacity(parts.len());
            for (k, part) in parts.iter().enumerate() {
                if part.is_remote() || matches!(part.kind, SourceKind::Mix { .. }) {
                    return Err(PipelineError::config(format!(
                        "mixture: sources[{k}] is {}{}: a mixture mixes files, local shards \
                         and Parquet (local or on S3); it reads a source's samples in random \
                         order, which would fetch remote shards again and again",
                        if part.is_remote() { "on S3, " } else { "" },
                        part.kind_name()
                    )));
                }
                // Each part reads the mixture's fields, unless it names its own.
                let with_fields;
                let part = if part.extras.is_empty() && !source.extras.is_empty() {
                    with_fields = part.clone().extra_fields(source.extras.iter().cloned());
                    &with_fields
                } else {
                    part
                };
                opened.push(open(part, EpochOrder::WHOLE, extensions)?);
            }
            let labelled = opened.iter().filter(|p| p.has_labels()).count();
            if labelled != 0 && labelled != opened.len() {
                return Err(PipelineError::config(
                    "mixture: every source needs a label field, or none (labels are set per source)",
                ));
            }
            let names = |d: &Dataset| -> Vec<String> {
                d.extra_fields().iter().map(|f| f.name.clone()).collect()
            };
            if let Some(k) = opened.iter().position(|p| names(p) != names(&opened[0])) {
                return Err(PipelineError::config(format!(
                    "mixture: sources[{k}]'s fields ({:?}) are not sources[0]'s ({:?}): every \
                     source gives a batch the same fields",
                    names(&opened[k]),
                    names(&opened[0])
                )));
            }
            let lengths: Vec<usize> = opened.iter().map(Dataset::dataset_len).collect();
            let sampler = Sampler::mixture(&lengths, weights, *stop)?;
            Kind::Mix {
                parts: opened.into(),
                sampler: order.apply(sampler)?,
            }
        }
    };
    Ok(Dataset { kind, order })
}

/// The fields besides the media a source is asked for: checked, and only where a sample has
/// other members (tar shards), columns (Parquet) or files beside it (local files).
fn extras(source: &Source) -> Result<Vec<FieldSpec>, PipelineError> {
    if source.extras.is_empty() {
        return Ok(Vec::new());
    }
    super::extras::check(&source.extras).map_err(PipelineError::config)?;
    match source.kind {
        #[cfg(feature = "s3")]
        SourceKind::Objects { .. } => Err(PipelineError::config(format!(
            "fields: not for {}: fields are read from a tar sample's other members, a \
             Parquet row's other columns or the files beside a local file",
            source.kind_name()
        ))),
        SourceKind::Paths(_) | SourceKind::Dir(..) | SourceKind::List(_) => {
            // A sidecar's name is the media's with its extension replaced.
            for f in &source.extras {
                if let Some(e) = f.from.iter().find(|e| {
                    e.contains('/') || e.contains('\\') || e.trim_start_matches('.') == ".."
                }) {
                    return Err(PipelineError::config(format!(
                        "fields: {:?}: {e:?} is an extension of the files beside each, not a path",
                        f.name
                    )));
                }
            }
            Ok(source.extras.clone())
        }
        _ => Ok(source.extras.clone()),
    }
}

/// The label field of a shard or Parquet source; any other kind of labels is an error.
fn field_label(source: &Source) -> Result<Option<String>, PipelineError> {
    match &source.labels {
        None => Ok(None),
        Some(Labels::Field(f)) => Ok(Some(f.clone())),
        Some(_) => Err(PipelineError::config(format!(
            "{}: labels name the field that holds each sample's label (an extension such as \
             \"cls\", or a column); folder, value and path labels are for files",
            source.kind_name()
        ))),
    }
}

/// A dataset of local files, with its labels.
fn files(source: &Source, order: EpochOrder, extensions: &[String]) -> Result<Kind, PipelineError> {
    let mut files = match &source.kind {
        SourceKind::Paths(p) => Files::new(p.iter().cloned()),
        SourceKind::Dir(d, own) => {
            let exts: Vec<&str> = own
                .as_deref()
                .unwrap_or(extensions)
                .iter()
                .map(String::as_str)
                .collect();
            let walked = Files::dir(d, &exts)?;
            // A sample's field read from a file beside it with a media extension (`a.jpg`
            // and its `a.depth.jpg`) is that sample's, not a sample of its own.
            let sidecars = super::extras::sidecars_among(walked.paths(), &source.extras);
            if sidecars.is_empty() {
                walked
            } else {
                Files::new(
                    walked
                        .paths()
                        .iter()
                        .filter(|p| !sidecars.contains(*p))
                        .cloned(),
                )
            }
        }
        SourceKind::List(l) => Files::list(l)?,
        _ => unreachable!("a files source"),
    };
    if let Some(bucket) = s3_bucket_of(files.paths())? {
        return s3_urls(source, order, bucket, &files);
    }
    if files.is_empty() {
        let what = match &source.kind {
            SourceKind::Dir(d, own) => format!(
                "{} (no file with the extensions {})",
                d.display(),
                own.as_deref().unwrap_or(extensions).join(", ")
            ),
            SourceKind::List(l) => format!("{} (an empty list)", l.display()),
            _ => "an empty list of paths".to_owned(),
        };
        return Err(PipelineError::config(format!("no files to load in {what}")));
    }
    let (labels, classes) = match &source.labels {
        None => (None, None),
        Some(Labels::Folder) if matches!(source.kind, SourceKind::Dir(..)) => {
            let SourceKind::Dir(root, own) = &source.kind else {
                unreachable!("a directory")
            };
            let exts = own.as_deref().unwrap_or(extensions);
            let (kept, labels, classes) = image_folder(root, &files, exts)?;
            files = kept;
            (Some(labels), Some(classes))
        }
        Some(Labels::Folder) => {
            let folders = files.folder_labels();
            let labels: Vec<i64> = files
                .paths()
                .iter()
                .map(|p| {
                    folders
                        .label(p)
                        .expect("a dataset file's folder is a class")
                })
                .collect();
            (Some(labels), Some(folders.classes()))
        }
        Some(Labels::Values(v)) => {
            if v.len() != files.len() {
                return Err(PipelineError::config(format!(
                    "{} labels for {} files",
                    v.len(),
                    files.len()
                )));
            }
            (Some(v.clone()), None)
        }
        Some(Labels::ByPath(map)) => {
            let labels = files
                .paths()
                .iter()
                .map(|p| {
                    map.get(p).copied().ok_or_else(|| {
                        PipelineError::config(format!("labels has no entry for {:?}", p))
                    })
                })
                .collect::<Result<Vec<_>, _>>()?;
            (Some(labels), None)
        }
        Some(Labels::Field(f)) => {
            return Err(PipelineError::config(format!(
                "labels = field {f:?}: fields are for shards and Parquet; files take folder \
                 labels, a value per file or a label per path"
            )))
        }
    };
    Ok(Kind::Files {
        files: order.apply(files)?,
        labels: labels.map(Into::into),
        classes: classes.map(Into::into),
        extras: extras(source)?.into(),
    })
}

/// Folder labels of a directory as torchvision's `ImageFolder` makes them: the classes are
/// the root's folders (every one, sorted by name), each file's label is the index of the
/// top-level folder it lies under (at any depth), files at the root belong to no class and
/// are left out, and a class folder without a file to read is an error (as torchvision
/// raises), since a missing class would shift every index after it. Returns the files kept,
/// their labels and the class names.
fn image_folder(
    root: &Path,
    files: &Files,
    extensions: &[String],
) -> Result<(Files, Vec<i64>, Vec<String>), PipelineError> {
    let entries = std::fs::read_dir(root).map_err(|e| {
        PipelineError::config(format!("labels = folder: reading {}: {e}", root.display()))
    })?;
    let mut classes: Vec<std::ffi::OsString> = entries
        .flatten()
        // `is_dir` through symbolic links, as torchvision's `scandir(...).is_dir()`.
        .filter(|e| e.path().is_dir())
        .map(|e| e.file_name())
        .collect();
    classes.sort();
    if classes.is_empty() {
        return Err(PipelineError::config(format!(
            "labels = folder: Couldn't find any class folder in {} (ImageFolder takes \
             root/<class>/<file>)",
            root.display()
        )));
    }
    let mut kept = Vec::with_capacity(files.len());
    let mut labels = Vec::with_capacity(files.len());
    let mut used = vec![false; classes.len()];
    for p in files.paths() {
        let rel = p.strip_prefix(root).unwrap_or(p);
        let mut parts = rel.components();
        let (Some(top), Some(_)) = (parts.next(), parts.next()) else {
            continue; // a file at the root: no class
        };
        if let Ok(i) = classes.binary_search_by(|c| c.as_os_str().cmp(top.as_os_str())) {
            used[i] = true;
            kept.push(p.clone());
            labels.push(i as i64);
        }
    }
    let names: Vec<String> = classes
        .iter()
        .map(|c| c.to_string_lossy().into_owned())
        .collect();
    let empty: Vec<&str> = names
        .iter()
        .zip(&used)
        .filter(|(_, u)| !**u)
        .map(|(n, _)| n.as_str())
        .collect();
    if !empty.is_empty() {
        return Err(PipelineError::config(format!(
            "labels = folder: Found no valid file for the classes {} of {} (no file with the \
             extensions {} in their class folders; torchvision's ImageFolder raises too: an \
             empty class would shift every label after it; remove the folder or add its files)",
            empty.join(", "),
            root.display(),
            extensions.join(", "),
        )));
    }
    Ok((Files::new(kept), labels, names))
}

/// The numbers of `source` (and a mixture's sources) that size what is kept, against the
/// library's [`limits`](flowgate_actors::limits): the shuffle buffer, the shards fetched ahead.
fn check_numbers(source: &Source) -> Result<(), PipelineError> {
    use flowgate_actors::limits::{BUFFER, PREFETCH};
    let limit = |e: flowgate_actors::limits::OutOfRange| PipelineError::config(e.to_string());
    BUFFER.check_usize(source.buffer).map_err(limit)?;
    match &source.kind {
        SourceKind::Shards { remote, .. } => {
            PREFETCH.check_usize(remote.prefetch).map_err(limit)?;
        }
        SourceKind::Mix { parts, .. } => {
            for part in parts {
                check_numbers(part)?;
            }
        }
        _ => {}
    }
    Ok(())
}

/// The shards `pattern` names: local paths, or `s3://` (feature `s3`).
fn open_shards(pattern: &str, remote: &Remote) -> Result<Shards, PipelineError> {
    if !pattern.starts_with("s3://") {
        return Ok(Shards::open(pattern)?.prefetch(remote.prefetch));
    }
    #[cfg(feature = "s3")]
    {
        use super::shards::remote::RemoteOptions;
        use crate::s3::Endpoint;
        let mut opts = RemoteOptions {
            cache_bytes: remote.cache_bytes,
            ..RemoteOptions::default()
        };
        if let Some(d) = &remote.cache_dir {
            opts.cache_dir = d.clone();
        }
        let endpoint = Endpoint {
            url: remote.endpoint.clone(),
            region: remote.region.clone(),
        };
        Ok(Shards::open_url(pattern, &endpoint, &opts)?.prefetch(remote.prefetch))
    }
    #[cfg(not(feature = "s3"))]
    Err(PipelineError::config(format!(
        "{pattern}: shards on S3 need flowgate built with the `s3` feature"
    )))
}

/// A dataset of Parquet rows.
#[cfg_attr(not(feature = "parquet"), allow(unused_variables))]
fn parquet(source: &Source, order: EpochOrder) -> Result<Kind, PipelineError> {
    let SourceKind::Parquet {
        paths,
        column,
        endpoint,
        region,
    } = &source.kind
    else {
        unreachable!("a Parquet source")
    };
    #[cfg(feature = "parquet")]
    {
        use super::parquet::ParquetRows;
        let label = field_label(source)?;
        let extras = extras(source)?;
        let mut columns = vec![column.as_str()];
        if let Some(l) = &label {
            columns.push(l.as_str());
        }
        for f in &extras {
            columns.extend(f.from.iter().map(String::as_str));
        }
        columns.dedup();
        let remote = paths
            .iter()
            .filter(|p| p.to_string_lossy().starts_with("s3://"))
            .count();
        let rows = if paths.is_empty() {
            return Err(PipelineError::config("Parquet: no paths"));
        } else if remote == 0 {
            let mut files = Vec::new();
            for p in paths {
                files.extend(ParquetRows::files_at(p)?);
            }
            ParquetRows::open(files, &columns)?
        } else if remote == paths.len() {
            parquet_on_s3(paths, endpoint, region, &columns)?
        } else {
            return Err(PipelineError::config(
                "Parquet: the paths are all local, or all s3:// URLs of one bucket",
            ));
        };
        let rows = match order.seed {
            Some(_) => rows.buffer(source.buffer),
            None => rows,
        };
        Ok(Kind::Records {
            records: Records::Parquet(order.apply(rows)?),
            media: [column.clone()].into(),
            label,
            extras: extras.into(),
        })
    }
    #[cfg(not(feature = "parquet"))]
    Err(PipelineError::config(format!(
        "{}: Parquet needs flowgate built with the `parquet` feature",
        paths
            .first()
            .map_or_else(String::new, |p| p.display().to_string())
    )))
}

/// Parquet files on S3: URLs of one bucket (`s3://bucket/key.parquet`, or one prefix).
#[cfg(feature = "parquet")]
#[cfg_attr(not(feature = "s3"), allow(unused_variables))]
fn parquet_on_s3(
    paths: &[std::path::PathBuf],
    endpoint: &Option<String>,
    region: &Option<String>,
    columns: &[&str],
) -> Result<super::parquet::ParquetRows, PipelineError> {
    #[cfg(feature = "s3")]
    {
        let urls: Vec<String> = paths
            .iter()
            .map(|p| p.to_string_lossy().into_owned())
            .collect();
        let split = |u: &str| -> (String, String) {
            let rest = u.trim_start_matches("s3://");
            let (b, k) = rest.split_once('/').unwrap_or((rest, ""));
            (b.to_owned(), k.to_owned())
        };
        let (bucket, _) = split(&urls[0]);
        let mut keys = Vec::with_capacity(urls.len());
        for u in &urls {
            let (b, k) = split(u);
            if b != bucket {
                return Err(PipelineError::config(
                    "Parquet: the paths are all local, or all s3:// URLs of one bucket",
                ));
            }
            keys.push(k);
        }
        let url = format!("s3://{bucket}/{}", keys.join(","));
        let endpoint = crate::s3::Endpoint {
            url: endpoint.clone(),
            region: region.clone(),
        };
        super::parquet::ParquetRows::open_url(&url, &endpoint, columns)
    }
    #[cfg(not(feature = "s3"))]
    Err(PipelineError::config(format!(
        "{}: Parquet on S3 needs flowgate built with the `s3` feature",
        paths[0].display()
    )))
}

/// The bucket of a list of `s3://bucket/key` URLs, or `None` for local paths; a list of
/// both, or of several buckets, is refused. A list of paths is read one way in every front
/// end: a Rust `Source::files`, a list file, a Python list.
fn s3_bucket_of(paths: &[std::path::PathBuf]) -> Result<Option<String>, PipelineError> {
    let url = |p: &std::path::PathBuf| p.to_string_lossy().starts_with("s3://");
    let urls = paths.iter().filter(|p| url(p)).count();
    if urls == 0 {
        return Ok(None);
    }
    let refuse = |m: &str| {
        Err(PipelineError::config(format!(
            "a list of paths: {m}; the paths are all local, or all s3:// URLs of one bucket"
        )))
    };
    if urls < paths.len() {
        let local = paths.iter().find(|p| !url(p)).expect("a local path");
        return refuse(&format!(
            "{} is local and {} others are on S3",
            local.display(),
            urls
        ));
    }
    let bucket_of = |p: &std::path::PathBuf| {
        let rest = p.to_string_lossy();
        let rest = rest.trim_start_matches("s3://");
        rest.split_once('/')
            .map(|(b, k)| (b.to_owned(), k.is_empty()))
    };
    let mut bucket: Option<String> = None;
    for p in paths {
        match (bucket_of(p), &bucket) {
            (None, _) | (Some((_, true)), _) => {
                return refuse(&format!(
                    "{} names no object (s3://bucket/key)",
                    p.display()
                ))
            }
            (Some((b, _)), Some(first)) if &b != first => {
                return refuse(&format!(
                    "{} is in bucket {b:?}, not {first:?}",
                    p.display()
                ))
            }
            (Some((b, _)), _) => bucket = Some(b),
        }
    }
    Ok(bucket)
}

/// The objects a list of `s3://` URLs of `bucket` names, one item each (the endpoint from
/// `AWS_ENDPOINT_URL`, else AWS; credentials from the AWS chain).
#[cfg(feature = "s3")]
fn s3_urls(
    source: &Source,
    order: EpochOrder,
    bucket: String,
    files: &Files,
) -> Result<Kind, PipelineError> {
    if source.labels.is_some() {
        return Err(PipelineError::config(
            "S3 objects carry no labels (put them in tar shards or Parquet)",
        ));
    }
    let prefix = format!("s3://{bucket}/");
    let keys = files
        .paths()
        .iter()
        .map(|p| p.to_string_lossy().trim_start_matches(&prefix).to_owned());
    let s3 = crate::s3::Endpoint::default().client(&bucket)?;
    Ok(Kind::Objects {
        keys: order.apply(Files::new(keys))?,
        s3,
        concurrency: super::source::DEFAULT_FETCH_CONCURRENCY,
    })
}

/// Without the `s3` feature a list of `s3://` URLs is refused, saying why.
#[cfg(not(feature = "s3"))]
fn s3_urls(_: &Source, _: EpochOrder, bucket: String, _: &Files) -> Result<Kind, PipelineError> {
    Err(PipelineError::config(format!(
        "a list of s3://{bucket}/ URLs: reading S3 needs flowgate built with the `s3` feature"
    )))
}

/// The objects under an S3 prefix, listed now.
#[cfg(feature = "s3")]
fn objects(source: &Source, order: EpochOrder) -> Result<Kind, PipelineError> {
    let SourceKind::Objects {
        client,
        bucket,
        prefix,
        remote,
        concurrency,
    } = &source.kind
    else {
        unreachable!("an S3 source")
    };
    if source.labels.is_some() {
        return Err(PipelineError::config(
            "S3 objects carry no labels (put them in tar shards or Parquet)",
        ));
    }
    let s3_err = |e: crate::s3::S3Error| PipelineError::io("the S3 source", e);
    let s3 = match client {
        Some(c) => c.clone(),
        None => crate::s3::Endpoint {
            url: remote.endpoint.clone(),
            region: remote.region.clone(),
        }
        .client(bucket)?,
    };
    let keys: Vec<String> = s3
        .list(prefix)
        .map_err(s3_err)?
        .into_iter()
        .map(|o| o.key)
        .collect();
    Ok(Kind::Objects {
        keys: order.apply(Files::new(keys))?,
        s3,
        concurrency: *concurrency,
    })
}
