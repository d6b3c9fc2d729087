//! A spec's `[source]` table as the library's [`Source`] (S3 prefixes included, with the
//! local test server of `serve_locally_from`), and the units of length-aware batches.

use flowgate_actors::error::PipelineError;

use super::schema::*;
use crate::dataset::{Labels, Remote, Source};
use crate::media::{MediaArgs, Recipe};
use crate::sampler::MixStop;

/// Whatever a source needs kept alive while it is read (a local S3 server).
pub(super) type Keep = Option<Box<dyn std::fmt::Debug + Send>>;

impl PipelineSpec {
    /// The cap of length-aware batches, if the spec asks for them: `batch.max_seconds` for
    /// audio, `batch.max_frames` for video.
    pub(super) fn length_cap(&self) -> Option<f64> {
        match &self.decode.media {
            MediaArgs::Audio(_) => self.loader.max_batch_seconds,
            MediaArgs::Video(_) => self.loader.max_batch_frames.map(|f| f as f64),
            MediaArgs::Image(_) => None,
        }
    }

    /// The extensions of the media to decode: the recipe's (a directory's own `extensions`
    /// apply to its walk).
    pub(super) fn extensions(&self, recipe: &Recipe) -> Vec<&'static str> {
        recipe.extensions().to_vec()
    }

    /// The library's source for `spec`, and what it needs kept alive.
    pub(super) fn source(&self, spec: &SourceSpec) -> Result<(Source, Keep), PipelineError> {
        let source = match spec {
            SourceSpec::List {
                path,
                labels,
                label_file,
                ..
            } => with_file_labels(Source::list(path), labels, label_file)?,
            SourceSpec::Dir {
                path,
                extensions,
                labels,
                label_file,
                ..
            } => {
                let s = Source::dir(path);
                let s = if extensions.is_empty() {
                    s
                } else {
                    s.extensions(extensions.iter().cloned())
                };
                with_file_labels(s, labels, label_file)?
            }
            SourceSpec::Tar {
                shards,
                endpoint,
                region,
                cache_mb,
                cache_dir,
                prefetch,
                fields,
                buffer,
                labels,
                ..
            } => {
                let s = Source::shards(shards.clone())
                    .remote(Remote {
                        endpoint: endpoint.clone(),
                        region: region.clone(),
                        cache_dir: cache_dir.clone(),
                        cache_bytes: flowgate_actors::limits::mib_to_bytes(*cache_mb),
                        prefetch: *prefetch,
                    })
                    .buffer(*buffer);
                let s = match labels {
                    Some(field) => s.labels(Labels::Field(field.clone())),
                    None => s,
                };
                if fields.is_empty() {
                    s
                } else {
                    s.fields(fields.iter().cloned())
                }
            }
            SourceSpec::Parquet {
                path,
                endpoint,
                region,
                column,
                buffer,
                labels,
                ..
            } => {
                let s = Source::parquet([path], column.clone())
                    .remote(Remote {
                        endpoint: endpoint.clone(),
                        region: region.clone(),
                        ..Remote::default()
                    })
                    .buffer(*buffer);
                match labels {
                    Some(column) => s.labels(Labels::Field(column.clone())),
                    None => s,
                }
            }
            SourceSpec::Mix {
                sources,
                weights,
                draws,
                stop,
                ..
            } => {
                let mut parts = Vec::with_capacity(sources.len());
                for (k, sub) in sources.iter().enumerate() {
                    let local = match sub {
                        SourceSpec::Mix { .. } | SourceSpec::S3 { .. } => false,
                        SourceSpec::Tar { shards, .. } => !shards.starts_with("s3://"),
                        // Parquet on S3 reads row groups by ranged GETs: it mixes.
                        SourceSpec::Parquet { .. }
                        | SourceSpec::List { .. }
                        | SourceSpec::Dir { .. } => true,
                    };
                    if !local {
                        // Named by its key here; the library refuses it too (for every front
                        // end), by its place.
                        return Err(PipelineError::config(format!(
                            "source.sources[{k}]: a mixture mixes list, dir, local tar and \
                             parquet sources; not tar shards or objects on S3, or another \
                             mixture"
                        )));
                    }
                    parts.push(self.source(sub)?.0);
                }
                let stop = match (draws, stop) {
                    (Some(n), _) => MixStop::Draws(*n),
                    (None, MixStopName::First) => MixStop::FirstExhausted,
                    (None, MixStopName::All) => MixStop::AllExhausted,
                };
                Source::mix(parts, weights.iter().copied()).stop(stop)
            }
            SourceSpec::S3 { .. } => return self.s3_source(spec),
        };
        Ok((source, None))
    }

    /// The loader's shuffle seed (`None`: the source's order).
    pub(super) fn shuffle_seed(&self) -> Option<u64> {
        self.loader.shuffle.then_some(self.loader.seed)
    }

    /// The shuffle seed the `[source]` table gives (`source.shuffle`, deprecated).
    pub(super) fn written_shuffle(&self) -> Option<u64> {
        match &self.source {
            SourceSpec::List { shuffle, .. }
            | SourceSpec::Dir { shuffle, .. }
            | SourceSpec::Tar { shuffle, .. }
            | SourceSpec::Parquet { shuffle, .. }
            | SourceSpec::Mix { shuffle, .. }
            | SourceSpec::S3 { shuffle, .. } => *shuffle,
        }
    }

    /// An S3 prefix (feature `s3`): reached at its endpoint, or served from local files by a
    /// server on this machine (`serve_locally_from`, feature `test-util`).
    #[cfg_attr(not(feature = "s3"), allow(unused_variables))]
    fn s3_source(&self, spec: &SourceSpec) -> Result<(Source, Keep), PipelineError> {
        let SourceSpec::S3 {
            bucket,
            prefix,
            endpoint,
            region,
            concurrency,
            serve_locally_from,
            ..
        } = spec
        else {
            unreachable!("an S3 source")
        };
        #[cfg(feature = "s3")]
        {
            let (source, keep) = match serve_locally_from {
                Some(list) => {
                    let (s3, keep) = super::s3::serve_locally(bucket, prefix, list)?;
                    (Source::s3_with(s3, prefix.clone()), keep)
                }
                None => (
                    Source::s3(bucket.clone(), prefix.clone()).remote(Remote {
                        endpoint: endpoint.clone(),
                        region: region.clone(),
                        ..Remote::default()
                    }),
                    None,
                ),
            };
            Ok((source.concurrency(*concurrency), keep))
        }
        #[cfg(not(feature = "s3"))]
        Err(PipelineError::config(
            "source.kind = \"s3\" needs flowgate built with the `s3` feature".to_owned(),
        ))
    }
}

impl SourceSpec {
    /// Whether the source's items have labels (a mixture's: each source has them, as
    /// [`Dataset::has_labels`](crate::Dataset::has_labels)), as the file says, before any read.
    pub(super) fn has_labels(&self) -> bool {
        match self {
            SourceSpec::List {
                labels, label_file, ..
            }
            | SourceSpec::Dir {
                labels, label_file, ..
            } => labels.is_some() || label_file.is_some(),
            SourceSpec::Tar { labels, .. } | SourceSpec::Parquet { labels, .. } => labels.is_some(),
            SourceSpec::Mix { sources, .. } => sources.iter().all(SourceSpec::has_labels),
            SourceSpec::S3 { .. } => false,
        }
    }
}

/// A list or directory source with its labels: `"folder"`, or a file of `PATH LABEL` lines.
fn with_file_labels(
    source: Source,
    labels: &Option<String>,
    label_file: &Option<std::path::PathBuf>,
) -> Result<Source, PipelineError> {
    match (labels.as_deref(), label_file) {
        (None, None) => Ok(source),
        (Some("folder"), None) => Ok(source.labels(Labels::Folder)),
        (None, Some(file)) => Ok(source.labels(Labels::ByPath(read_label_file(file)?))),
        (Some(_), Some(_)) => Err(PipelineError::config(
            "source: labels and label_file both give labels; keep one",
        )),
        (Some(other), None) => Err(PipelineError::config(format!(
            "source.labels = {other:?}: a list or dir source takes \"folder\" (or a \
             label_file of PATH LABEL lines)"
        ))),
    }
}

/// A label file: `PATH LABEL` per line (whitespace or a comma between; the label an integer);
/// blank lines and `#` comments skipped. Errors name the file and the line.
fn read_label_file(
    file: &std::path::Path,
) -> Result<std::collections::HashMap<std::path::PathBuf, i64>, PipelineError> {
    let text = std::fs::read_to_string(file)
        .map_err(|e| PipelineError::io(format!("reading {}", file.display()), e))?;
    let mut out = std::collections::HashMap::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let bad = || {
            PipelineError::config(format!(
                "{}:{}: a label line is PATH LABEL (an integer label), not {line:?}",
                file.display(),
                n + 1
            ))
        };
        let (path, label) = line
            .rsplit_once(|c: char| c == ',' || c.is_whitespace())
            .ok_or_else(bad)?;
        let label: i64 = label.trim().parse().map_err(|_| bad())?;
        let path = std::path::PathBuf::from(path.trim().trim_end_matches(','));
        // Relative paths are relative to the label file's folder, like the pipeline file's.
        let path = match file.parent() {
            Some(dir) if path.is_relative() => dir.join(path),
            _ => path,
        };
        out.insert(path, label);
    }
    Ok(out)
}
