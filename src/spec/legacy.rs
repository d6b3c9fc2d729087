//! A pipeline file's older loader keys (`batch.size`, `source.shuffle = <seed>`,
//! `decode.workers`, …), read into its `[loader]` table: the library's
//! [`LoaderSettings`](crate::loader::LoaderSettings), by the names every front end uses. Each
//! older key a file uses is said once in a deprecation line; a setting given both ways is
//! refused, naming both keys.

use super::schema::PipelineSpec;

/// The older keys: `(table, key, the [loader] key it became)`.
pub const OLD_KEYS: &[(&str, &str, &str)] = &[
    ("batch", "size", "batch_size"),
    ("batch", "drop_last", "drop_last"),
    ("batch", "order", "order"),
    ("batch", "max_seconds", "max_batch_seconds"),
    ("batch", "max_frames", "max_batch_frames"),
    ("batch", "buckets", "buckets"),
    ("source", "shuffle", "seed"),
    ("decode", "workers", "workers"),
    ("tuner", "memory_mb", "memory_mb"),
    ("tuner", "cpu_budget", "cpu_budget"),
];

/// A setting given both ways, or two that cannot go together: `(table, key, message)`.
pub(super) type Clash = (&'static str, &'static str, String);

/// Whether `raw` (the file's tables) has `table.key`.
fn has(raw: &toml::Table, table: &str, key: &str) -> bool {
    raw.get(table)
        .and_then(toml::Value::as_table)
        .is_some_and(|t| t.contains_key(key))
}

impl PipelineSpec {
    /// Reads the older keys `raw` (the file's tables) holds into [`loader`](Self::loader),
    /// noting each in [`deprecated`](Self::deprecated); refuses a setting given both ways,
    /// and `loader.skip_errors` beside `run.max_failures` (the budget says all it does).
    pub(super) fn read_old_keys(&mut self, raw: &toml::Table) -> Result<(), Clash> {
        for &(table, key, new) in OLD_KEYS {
            if !has(raw, table, key) {
                continue;
            }
            // `source.shuffle = <seed>` was the shuffle and its seed at once.
            let news: &[&str] = match (table, key) {
                ("source", "shuffle") => &["shuffle", "seed"],
                _ => &[new],
            };
            if let Some(n) = news.iter().find(|n| has(raw, "loader", n)) {
                return Err((
                    table,
                    key,
                    format!(
                        "loader.{n} says this too: give it once, as loader.{n} (the name every \
                         front end uses)"
                    ),
                ));
            }
            let seed = self.written_shuffle().unwrap_or(0);
            let l = &mut self.loader;
            match (table, key) {
                ("batch", "size") => l.batch_size = self.batch.size,
                ("batch", "drop_last") => l.drop_last = self.batch.drop_last,
                ("batch", "order") => l.order = self.batch.order,
                ("batch", "max_seconds") => l.max_batch_seconds = self.batch.max_seconds,
                ("batch", "max_frames") => l.max_batch_frames = self.batch.max_frames,
                ("batch", "buckets") => l.buckets = self.batch.buckets,
                ("source", "shuffle") => {
                    l.shuffle = true;
                    l.seed = seed;
                }
                ("decode", "workers") => l.workers = self.decode.workers,
                ("tuner", "memory_mb") => l.memory_mb = self.tuner.memory_mb,
                ("tuner", "cpu_budget") => l.cpu_budget = self.tuner.cpu_budget,
                _ => unreachable!("every older key is read"),
            }
            let line = match (table, key) {
                ("source", "shuffle") => "pipeline file: source.shuffle = <seed> is deprecated: \
                    write loader.seed = <seed> (the loader shuffles by default, as in every \
                    front end; loader.shuffle = false keeps the source's order)"
                    .to_owned(),
                _ => format!(
                    "pipeline file: {table}.{key} is deprecated: write loader.{new} (the name \
                     every front end uses)"
                ),
            };
            tracing::warn!("{line}");
            self.deprecated.push(line);
            self.old_keys.push((table, key));
        }
        // A file of older keys kept the source's order unless `source.shuffle` named a seed:
        // it now shuffles, as every front end does by default; said once.
        let shuffle_named = has(raw, "source", "shuffle")
            || has(raw, "loader", "shuffle")
            || has(raw, "loader", "seed");
        if !self.deprecated.is_empty() && !shuffle_named {
            let line = "pipeline file: without source.shuffle this file kept the source's \
                order; the loader now shuffles by default (seed 0), as in every front end: write \
                loader.shuffle = false to keep the order"
                .to_owned();
            tracing::warn!("{line}");
            self.deprecated.push(line);
        }
        if has(raw, "loader", "skip_errors") && self.run.max_failures.is_some() {
            return Err((
                "loader",
                "skip_errors",
                "run.max_failures says what failures do too: give one".into(),
            ));
        }
        Ok(())
    }

    /// Where the file wrote the loader setting `new` (a [`LoaderSettings`] key): its older
    /// key when it used that, else `loader.<new>`; errors name it there.
    ///
    /// [`LoaderSettings`]: crate::loader::LoaderSettings
    pub(super) fn written_at(&self, new: &'static str) -> (&'static str, &'static str) {
        OLD_KEYS
            .iter()
            .find(|&&(table, key, n)| n == new && self.old_keys.contains(&(table, key)))
            .map_or(("loader", new), |&(table, key, _)| (table, key))
    }
}
