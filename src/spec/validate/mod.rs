//! Parsing a pipeline file and the checks no pipeline can run without; every error names the
//! file, the line and the dotted key.

use std::path::{Path, PathBuf};

use super::schema::*;
use crate::media::MediaArgs;

/// A bad pipeline file: where, which key, what is wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpecError {
    /// The file.
    pub file: String,
    /// The line (1-based; 0 when the file itself is the problem).
    pub line: usize,
    /// The key, dotted (`batch.size`), or the table for a missing one.
    pub key: String,
    /// What is wrong.
    pub message: String,
}

impl std::fmt::Display for SpecError {
    /// `FILE:LINE: KEY: MESSAGE`, leaving out a line or key that is not known.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.file)?;
        if self.line > 0 {
            write!(f, ":{}", self.line)?;
        }
        if !self.key.is_empty() {
            write!(f, ": {}", self.key)?;
        }
        write!(f, ": {}", self.message)
    }
}

impl std::error::Error for SpecError {}

/// The most S3 requests in flight.
const MAX_CONCURRENCY: u64 = flowgate_actors::limits::IN_FLIGHT.max;
/// The longest time setting, in milliseconds: an hour.
const MAX_MS: f64 = 3_600_000.0;
/// The most epochs a run may ask for (the summary has a line per epoch).
const MAX_EPOCHS: u64 = 1_000_000;

/// A number checked against the library's [`limits`](flowgate_actors::limits) (the same words every
/// front end uses), located at `table.key` of the file.
fn limit<T>(
    r: Result<T, flowgate_actors::limits::OutOfRange>,
    err: &dyn Fn(&str, &str, String) -> SpecError,
    table: &str,
    key: &str,
) -> Result<T, SpecError> {
    r.map_err(|e| err(table, key, e.message))
}

impl PipelineSpec {
    /// Reads and checks a pipeline file. Relative paths in it (sources, caches, traces,
    /// metrics files) are relative to the file's folder, so the file runs from any directory.
    pub fn load(path: &Path) -> Result<Self, SpecError> {
        let text = std::fs::read_to_string(path).map_err(|e| SpecError {
            file: path.display().to_string(),
            line: 0,
            key: String::new(),
            message: format!("cannot read: {e}"),
        })?;
        let mut spec = Self::parse(&text, &path.display().to_string())?;
        spec.relative_to(path.parent().unwrap_or(Path::new("")));
        Ok(spec)
    }

    /// Makes the file's relative local paths relative to `base` (what [`load`](Self::load)
    /// does with the file's folder); S3 URLs and absolute paths stay as they are.
    pub fn relative_to(&mut self, base: &Path) {
        fn fix(p: &mut PathBuf, base: &Path) {
            if p.is_relative() && !p.to_string_lossy().starts_with("s3://") {
                *p = base.join(&*p);
            }
        }
        fn source(s: &mut SourceSpec, base: &Path) {
            match s {
                SourceSpec::List {
                    path, label_file, ..
                }
                | SourceSpec::Dir {
                    path, label_file, ..
                } => {
                    fix(path, base);
                    if let Some(f) = label_file {
                        fix(f, base);
                    }
                }
                SourceSpec::Parquet { path, .. } => fix(path, base),
                SourceSpec::Tar {
                    shards, cache_dir, ..
                } => {
                    if let Some(d) = cache_dir {
                        fix(d, base);
                    }
                    // A comma list of patterns, folders or S3 URLs.
                    *shards = shards
                        .split(',')
                        .map(|part| {
                            let t = part.trim();
                            let mut p = PathBuf::from(t);
                            fix(&mut p, base);
                            if t.is_empty() {
                                part.to_owned()
                            } else {
                                p.to_string_lossy().into_owned()
                            }
                        })
                        .collect::<Vec<_>>()
                        .join(",");
                }
                SourceSpec::Mix { sources, .. } => {
                    for s in sources {
                        source(s, base);
                    }
                }
                SourceSpec::S3 {
                    serve_locally_from, ..
                } => {
                    if let Some(p) = serve_locally_from {
                        fix(p, base);
                    }
                }
            }
        }
        if base.as_os_str().is_empty() {
            return;
        }
        source(&mut self.source, base);
        for p in [&mut self.tuner.trace, &mut self.metrics.jsonl]
            .into_iter()
            .flatten()
        {
            fix(p, base);
        }
    }

    /// Parses and checks the text of a pipeline file (`file` names it in errors).
    pub fn parse(text: &str, file: &str) -> Result<Self, SpecError> {
        let mut spec: PipelineSpec = toml::from_str(text).map_err(|e| {
            let line = e.span().map_or(0, |s| {
                text[..s.start.min(text.len())].matches('\n').count() + 1
            });
            let message = e.message().to_owned();
            let named = message.split('`').nth(1).map(str::to_owned);
            let mut key = key_at(text, line).unwrap_or_else(|| {
                // A missing table or key: serde names it in the message.
                named.clone().unwrap_or_default()
            });
            let mut line = line;
            // An unknown or missing key inside a table is reported at the table's header:
            // point at the key itself when it is there, and name it with its table.
            if let Some(field) = named.filter(|_| !key.contains('.')) {
                if message.starts_with("unknown field") && field != key {
                    let at = find_key(text, &key, &field);
                    if at > line {
                        line = at;
                    }
                    key = format!("{key}.{field}");
                } else if message.starts_with("missing field") && field != key {
                    key = format!("{key}.{field}");
                } else if message.starts_with("missing field") && !text.contains('[') {
                    line = 0;
                }
            }
            // A bad value in a table parsed by its `kind` (source, decode) is reported at the
            // table: find the key whose removal changes the error, and point at it.
            if !key.contains('.') && !key.is_empty() {
                if let Some(field) = culprit(text, &key, &message) {
                    line = find_key(text, &key, &field).max(line);
                    key = format!("{key}.{field}");
                }
            }
            let message = match message.as_str() {
                m if m.contains("untagged enum MaxFailures") => "expected a count of failures \
                    (an integer, 0 for none) or a rate of the items seen (a number in (0, 1))"
                    .to_owned(),
                _ => flowgate_actors::limits::in_words(&message),
            };
            SpecError {
                file: file.to_owned(),
                line,
                key,
                message,
            }
        })?;
        let raw: toml::Table = toml::from_str(text).unwrap_or_default();
        spec.read_old_keys(&raw)
            .map_err(|(table, key, message)| SpecError {
                file: file.to_owned(),
                line: find_key(text, table, key),
                key: format!("{table}.{key}"),
                message,
            })?;
        spec.check(text, file)?;
        Ok(spec)
    }

    /// The numbers of a source (and a mixture's sources) that size what is allocated or kept:
    /// shuffle buffers, read-aheads, disk caches, draws.
    fn check_source(
        &self,
        source: &SourceSpec,
        table: &str,
        err: &dyn Fn(&str, &str, String) -> SpecError,
    ) -> Result<(), SpecError> {
        use flowgate_actors::limits::{BUFFER, CACHE_MB, PREFETCH};
        let max_items = crate::sampler::MAX_EPOCH_ITEMS as u64;
        let range = |v: u64, lo: u64, hi: u64| -> Option<String> {
            (v < lo || v > hi).then(|| format!("must be in {lo}..={hi}, not {v}"))
        };
        match source {
            SourceSpec::Tar {
                buffer,
                prefetch,
                cache_mb,
                ..
            } => {
                limit(BUFFER.check(*buffer as i128), err, table, "buffer")?;
                limit(PREFETCH.check(*prefetch as i128), err, table, "prefetch")?;
                limit(CACHE_MB.bytes(*cache_mb), err, table, "cache_mb")?;
            }
            SourceSpec::Parquet { buffer, .. } => {
                limit(BUFFER.check(*buffer as i128), err, table, "buffer")?;
            }
            SourceSpec::Mix { sources, draws, .. } => {
                if let Some(m) = draws.and_then(|d| range(d as u64, 1, max_items)) {
                    return Err(err(table, "draws", m));
                }
                for s in sources {
                    self.check_source(s, "source.sources", err)?;
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// The numbers no pipeline can run with.
    fn check(&self, text: &str, file: &str) -> Result<(), SpecError> {
        let err = |table: &str, key: &str, message: String| SpecError {
            file: file.to_owned(),
            line: find_key(text, table, key),
            key: format!("{table}.{key}"),
            message,
        };
        let range = |v: u64, lo: u64, hi: u64| -> Option<String> {
            (v < lo || v > hi).then(|| format!("must be in {lo}..={hi}, not {v}"))
        };
        // Each loader setting's error names the key the file wrote it with.
        let written = |new: &'static str| self.written_at(new);
        let check = flowgate_actors::limits::BATCH_SIZE.check(self.batch_size() as i128);
        let (t, k) = written("batch_size");
        limit(check, &err, t, k)?;
        if let Some(f) = &self.fields {
            // A media field's recipe too (its crop against its resize, ...), and its name
            // against the media's: named by its key and line, as every other error.
            let checked = crate::loader::fields_and_media(f.clone()).and_then(|(plain, media)| {
                // The batch's keys by the loader's rule (the media's tensors, `label` with
                // labels): refused here with the key's line, before any read.
                let tensors = std::iter::once(self.decode.media.kind())
                    .chain(media.iter().map(|m| m.name.as_str()));
                let plain: Vec<&str> = (plain.iter().map(|f| f.name.as_str()))
                    .filter(|n| !media.iter().any(|m| m.name == *n))
                    .collect();
                crate::loader::BatchKeys::new(tensors, self.source.has_labels())
                    .check(&plain)
                    .map_err(|e| format!("fields: {e}"))?;
                for m in &media {
                    m.media
                        .recipe(None, 0)
                        .map_err(|e| format!("fields: {:?}: {e}", m.name))?;
                }
                Ok(())
            });
            if let Err(m) = checked {
                let name = f
                    .as_object()
                    .and_then(|o| o.keys().find(|k| m.starts_with(&format!("fields: {k:?}"))))
                    .cloned()
                    .unwrap_or_default();
                return Err(SpecError {
                    file: file.to_owned(),
                    line: find_key(text, "fields", &name),
                    key: if name.is_empty() {
                        "fields".into()
                    } else {
                        format!("fields.{name}")
                    },
                    message: m,
                });
            }
        }
        // Whether or not the batches are length-aware: the loader's settings refuse it
        // otherwise, later and without the file's line.
        let buckets = flowgate_actors::limits::BUCKETS.check(self.loader.buckets as i128);
        let (t, k) = written("buckets");
        limit(buckets, &err, t, k)?;
        let (st, sk) = written("max_batch_seconds");
        let (ft, fk) = written("max_batch_frames");
        if let Some(m) = self.loader.max_batch_seconds {
            if let Err(e) = flowgate_actors::limits::batch_seconds(m) {
                return Err(err(st, sk, e.message));
            }
            if !matches!(self.decode.media, MediaArgs::Audio(_))
                || matches!(self.source, SourceSpec::Mix { .. })
            {
                return Err(err(
                    st,
                    sk,
                    "length-aware batches are for audio from a list, dir, tar or parquet source"
                        .into(),
                ));
            }
        }
        let fps = match &self.decode.media {
            MediaArgs::Video(v) => v.fps,
            _ => None,
        };
        if let Some(m) = self.loader.max_batch_frames {
            if let Some(m) = range(m as u64, 1, crate::media::rules::MAX_FRAMES as u64) {
                return Err(err(ft, fk, m));
            }
            if fps.is_none() || matches!(self.source, SourceSpec::Mix { .. }) {
                return Err(err(
                    ft,
                    fk,
                    "length-aware batches of frames are for video (with decode.fps) from a \
                     list, dir, tar or parquet source"
                        .into(),
                ));
            }
        }
        if let Some(f) = fps {
            crate::media::rules::check::fps(f)
                .map_err(|e| err("decode", e.field(), e.message().to_owned()))?;
            if self.loader.max_batch_frames.is_none() {
                return Err(err(
                    "decode",
                    "fps",
                    "samples clips by their length for loader.max_batch_frames; set both".into(),
                ));
            }
        }
        if let Some(m) = range(self.run.epochs, 1, MAX_EPOCHS) {
            return Err(err("run", "epochs", m));
        }
        self.check_source(&self.source, "source", &err)?;
        if !(self.run.step_ms >= 0.0 && self.run.step_ms <= MAX_MS) {
            return Err(err("run", "step_ms", format!("must be in 0..={MAX_MS}")));
        }
        let mut at = 0.0;
        for (i, c) in self.run.step_changes.iter().enumerate() {
            if !(c.at_s >= at && c.at_s <= MAX_MS / 1000.0) {
                return Err(err(
                    "run",
                    "step_changes",
                    format!(
                        "change {}: at_s {} must be in {at}..={} (in order)",
                        i + 1,
                        c.at_s,
                        MAX_MS / 1000.0
                    ),
                ));
            }
            if !(c.ms >= 0.0 && c.ms <= MAX_MS) {
                return Err(err(
                    "run",
                    "step_changes",
                    format!("change {}: ms {} must be in 0..={MAX_MS}", i + 1, c.ms),
                ));
            }
            at = c.at_s;
        }
        if let Some(t) = self.run.seconds {
            if !(t > 0.0 && t <= MAX_MS / 1000.0) {
                return Err(err(
                    "run",
                    "seconds",
                    format!("must be in (0, {}]", MAX_MS / 1000.0),
                ));
            }
        }
        if !(self.run.progress_s >= 0.1 && self.run.progress_s <= MAX_MS / 1000.0) {
            return Err(err(
                "run",
                "progress_s",
                format!("must be in 0.1..={}", MAX_MS / 1000.0),
            ));
        }
        if let Some(MaxFailures::Rate(r)) = self.run.max_failures {
            limit(
                flowgate_actors::limits::failure_rate(r),
                &err,
                "run",
                "max_failures",
            )?;
        }
        // The media's own rules, the ones every front end applies, located here.
        // A rule about the cap names the library's key: a pipeline file's is in `[batch]`.
        self.decode
            .media
            .check(self.length_cap())
            .map_err(|e| match e.field() {
                "max_batch_frames" => err(ft, fk, e.message().to_owned()),
                "max_batch_seconds" => err(st, sk, e.message().to_owned()),
                f => err("decode", f, e.message().to_owned()),
            })?;
        if let Some(w) = self.loader.workers {
            let (t, k) = written("workers");
            limit(
                flowgate_actors::limits::WORKERS.check(w as i128),
                &err,
                t,
                k,
            )?;
        }
        // The rest of the loader's settings, by the library's one check (ranks, the budget).
        if let Err(e) = self.loader.check() {
            let ((t, k), message) = match e {
                crate::loader::SettingsError::Range(r) => (written(r.key), r.message),
                // Settings that do not go together: named by the first the message names.
                other => {
                    let m = other.to_string();
                    let key = [
                        "rank",
                        "world_size",
                        "max_batch_seconds",
                        "max_batch_frames",
                    ]
                    .into_iter()
                    .find(|k| m.contains(k))
                    .unwrap_or("rank");
                    (written(key), m)
                }
            };
            return Err(err(t, k, message));
        }
        if let SourceSpec::Mix {
            sources, weights, ..
        } = &self.source
        {
            if let Err(m) = crate::sampler::check_weights(sources.len(), weights) {
                let m = m.strip_prefix("weights: ").unwrap_or(&m).to_owned();
                return Err(err("source", "weights", m));
            }
        }
        if let SourceSpec::S3 { concurrency, .. } = &self.source {
            if let Some(m) = range(*concurrency as u64, 1, MAX_CONCURRENCY) {
                return Err(err("source", "concurrency", m));
            }
        }
        if let Some(c) = &self.cache {
            use flowgate_actors::limits::BYTE_CACHE_MB;
            limit(BYTE_CACHE_MB.bytes(c.mb), &err, "cache", "mb")?;
            if let Some(m) = c.max_mb {
                limit(BYTE_CACHE_MB.bytes(m), &err, "cache", "max_mb")?;
                if m < c.mb {
                    return Err(err(
                        "cache",
                        "max_mb",
                        format!("must be at least `mb` ({}), not {m}", c.mb),
                    ));
                }
            }
        }
        if let Some(m) = self.tuner.memory_mb {
            limit(
                flowgate_actors::limits::MEMORY_MB.bytes(m),
                &err,
                "tuner",
                "memory_mb",
            )?;
        }
        if let Some(t) = self.tuner.tick_ms {
            limit(
                flowgate_actors::limits::TICK_MS.check(i128::from(t)),
                &err,
                "tuner",
                "tick_ms",
            )?;
        }
        if let Some(m) = self
            .metrics
            .interval_ms
            .and_then(|t| range(t, 1, MAX_MS as u64))
        {
            return Err(err("metrics", "interval_ms", m));
        }
        if let Some(addr) = &self.metrics.prometheus {
            if let Err(e) = crate::prometheus::address(addr) {
                return Err(err("metrics", "prometheus", e));
            }
        }
        if self.device.kind == DeviceKind::Cuda && !cfg!(feature = "cuda") {
            return Err(err(
                "device",
                "kind",
                "cuda needs flowgate built with the `cuda` feature (cargo build --release --features cuda); use `cpu` or `simulated`".into(),
            ));
        }
        let d = &self.device;
        limit(
            flowgate_actors::limits::DEVICE_MEMORY_MB.bytes(d.memory_mb),
            &err,
            "device",
            "memory_mb",
        )?;
        limit(
            flowgate_actors::limits::STAGING_MB.bytes(d.staging_mb),
            &err,
            "device",
            "staging_mb",
        )?;
        for (key, v) in [("bandwidth_gbps", self.device.bandwidth_gbps)] {
            if !(v.is_finite() && v > 0.0) {
                return Err(err(
                    "device",
                    key,
                    format!("must be a positive number, not {v}"),
                ));
            }
        }
        if !(self.device.latency_us.is_finite() && self.device.latency_us >= 0.0) {
            return Err(err(
                "device",
                "latency_us",
                format!("must be at least 0, not {}", self.device.latency_us),
            ));
        }
        Ok(())
    }
}

/// The dotted key on `line` (1-based): `table.key` from the nearest header above and the text
/// before `=`.
fn key_at(text: &str, line: usize) -> Option<String> {
    let lines: Vec<&str> = text.lines().collect();
    let here = lines.get(line.checked_sub(1)?)?.trim();
    let table = lines[..line - 1]
        .iter()
        .rev()
        .map(|l| l.trim())
        .find(|l| l.starts_with('['))
        .map(|l| l.trim_matches(|c| c == '[' || c == ']').trim().to_owned());
    if here.starts_with('[') {
        return Some(
            here.trim_matches(|c| c == '[' || c == ']')
                .trim()
                .to_owned(),
        );
    }
    let key = here.split('=').next()?.trim();
    if key.is_empty() {
        return None;
    }
    Some(match table {
        Some(t) => format!("{t}.{key}"),
        None => key.to_owned(),
    })
}

/// The key of `table` whose value makes the file fail with `message`: the one whose removal
/// changes the error (or removes it). `None` when no single key does.
fn culprit(text: &str, table: &str, message: &str) -> Option<String> {
    let doc: toml::Table = toml::from_str(text).ok()?;
    let whole = doc.get(table)?.as_table()?.clone();
    // The table with `kind` and one key alone: the key that alone gives the same error
    // (`kind` itself first: an unknown kind fails whatever else the table holds).
    let keys = whole.keys().filter(|k| *k != "kind");
    let kind = whole.contains_key("kind").then(|| "kind".to_owned());
    kind.iter().chain(keys).find_map(|k| {
        let mut alone = toml::Table::new();
        if let Some(kind) = whole.get("kind") {
            alone.insert("kind".into(), kind.clone());
        }
        alone.insert(k.clone(), whole[k].clone());
        let alone = toml::Value::Table(alone);
        let e = match table {
            "source" => alone.try_into::<SourceSpec>().err(),
            "decode" => alone.try_into::<DecodeSpec>().err(),
            _ => None,
        }?;
        (e.message() == message).then(|| k.clone())
    })
}

/// The line of `key` in `[table]` (1-based), or of the table's header, or 0.
fn find_key(text: &str, table: &str, key: &str) -> usize {
    let mut in_table = false;
    let mut header = 0;
    for (i, l) in text.lines().enumerate() {
        let t = l.trim();
        if t.starts_with('[') {
            in_table = t.trim_matches(|c| c == '[' || c == ']').trim() == table;
            if in_table {
                header = i + 1;
            }
            continue;
        }
        if in_table && t.split('=').next().map(str::trim) == Some(key) {
            return i + 1;
        }
    }
    header
}

#[cfg(test)]
mod tests;
