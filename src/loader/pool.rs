//! [`PoolSettings`]: how a loader decodes its epoch's units on a pool of remote workers (Ray
//! actors in the Python package: `flowgate.Ray(...)`), as plain data with named defaults and
//! one check, and the placement rules: the CPUs each worker reserves, a pinned pool the cluster
//! cannot place, what a sized pool says when it starts. The books of the hand-out itself are
//! the tuner's ([`Dispatcher`](crate::tuner::pool::dispatch::Dispatcher)); these settings
//! become its [`DispatchSettings`].
//!
//! Front ends pass the user's raw arguments ([`PoolSettings::from_value`]) and the cluster's
//! figures ([`Cluster`]); every rule and every message is here, tested once.

use std::fmt;

use flowgate_tuner::pool::dispatch::{DispatchSettings, PoolSize};
use flowgate_tuner::pool::PoolLimits;
use serde::de::{self, Deserializer, Visitor};
use serde::{Deserialize, Serialize, Serializer};

use super::settings::SettingsError;
use flowgate_actors::limits::{self, OutOfRange, BATCHES_PER_UNIT, POOL_WORKERS};

/// The most workers a sized pool grows to, by default: past it, one training process
/// collecting units is the bound, not the workers.
pub const DEFAULT_MAX_WORKERS: usize = 16;
/// Batches per unit of work, by default: few enough that a lost worker costs little decoding
/// again, enough that a unit's overhead (a round trip, a loader's resume) is small per batch.
pub const DEFAULT_BATCHES_PER_UNIT: usize = 2;
/// Seconds the loop may wait with no worker started (and nothing decoding in the training
/// process) before it says the cluster cannot place the pool, by default: long enough for a
/// cluster's autoscaler to add a node.
pub const DEFAULT_START_TIMEOUT: f64 = 300.0;
/// CPUs a worker reserves when none are given: the cluster's largest node, at most this many
/// (past four threads, a decoder's own tuner gains little per CPU and more workers place
/// better).
pub const DEFAULT_MAX_CPUS_PER_WORKER: f64 = 4.0;
const fn default_max_workers() -> usize {
    DEFAULT_MAX_WORKERS
}
const fn default_true() -> bool {
    true
}
const fn default_batches_per_unit() -> usize {
    DEFAULT_BATCHES_PER_UNIT
}
const fn default_start_timeout() -> f64 {
    DEFAULT_START_TIMEOUT
}

/// A pool's size as the user gives it: `"auto"` (sized from what the loop waits) or a count.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Workers {
    /// Sized within `min_workers..=max_workers` and the cluster's free CPUs. The default.
    #[default]
    Auto,
    /// Exactly this many workers (a dead one is replaced).
    Pinned(usize),
}

impl fmt::Display for Workers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Auto => write!(f, "\"auto\""),
            Self::Pinned(n) => write!(f, "{n}"),
        }
    }
}

impl Serialize for Workers {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Self::Auto => s.serialize_str("auto"),
            Self::Pinned(n) => s.serialize_u64(*n as u64),
        }
    }
}

impl<'de> Deserialize<'de> for Workers {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Workers;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "\"auto\" or a whole number, at least 0")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Workers, E> {
                if s == "auto" {
                    Ok(Workers::Auto)
                } else {
                    Err(E::invalid_value(de::Unexpected::Str(s), &self))
                }
            }
            fn visit_u64<E: de::Error>(self, n: u64) -> Result<Workers, E> {
                Ok(Workers::Pinned(usize::try_from(n).unwrap_or(usize::MAX)))
            }
            fn visit_i64<E: de::Error>(self, n: i64) -> Result<Workers, E> {
                match u64::try_from(n) {
                    Ok(n) => self.visit_u64(n),
                    Err(_) => Err(E::invalid_value(de::Unexpected::Signed(n), &self)),
                }
            }
        }
        d.deserialize_any(V)
    }
}

/// A remote pool's settings. Every field has a default (`{}` is a valid setting: a sized
/// pool, the training process decoding too); unknown keys are refused.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolSettings {
    /// `"auto"` (default) or a pinned count; 0 is allowed only with `local` (the training
    /// process decodes alone: the remote path, tested without workers).
    #[serde(default)]
    pub workers: Workers,
    /// The most workers of a sized pool, in 1..=4,096 ([`limits::POOL_WORKERS`]). Default
    /// [`DEFAULT_MAX_WORKERS`].
    #[serde(default = "default_max_workers")]
    pub max_workers: usize,
    /// The fewest workers of a sized pool (where it starts). Default: 0 with `local`, else 1;
    /// a pinned pool's is its size (see [`PoolSettings::min_workers`]).
    #[serde(default)]
    pub min_workers: Option<usize>,
    /// CPUs each worker reserves and decodes on, above 0. Default: what fits the cluster's
    /// largest node, at most [`DEFAULT_MAX_CPUS_PER_WORKER`] ([`PoolSettings::cpus`]).
    #[serde(default, deserialize_with = "limits::float_or_name")]
    pub cpus_per_worker: Option<f64>,
    /// Whether the training process decodes units too, on its own threads (default on).
    #[serde(default = "default_true")]
    pub local: bool,
    /// Batches per unit of work, in 1..=1,024 ([`limits::BATCHES_PER_UNIT`]). Default
    /// [`DEFAULT_BATCHES_PER_UNIT`].
    #[serde(default = "default_batches_per_unit")]
    pub batches_per_unit: usize,
    /// Seconds the loop may wait with nothing to decode on, in (0, 86,400]. Default
    /// [`DEFAULT_START_TIMEOUT`].
    #[serde(default = "default_start_timeout", deserialize_with = "limits::float")]
    pub start_timeout: f64,
}

impl Default for PoolSettings {
    fn default() -> Self {
        Self {
            workers: Workers::Auto,
            max_workers: DEFAULT_MAX_WORKERS,
            min_workers: None,
            cpus_per_worker: None,
            local: true,
            batches_per_unit: DEFAULT_BATCHES_PER_UNIT,
            start_timeout: DEFAULT_START_TIMEOUT,
        }
    }
}

/// The cluster's CPUs as the front end finds them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Cluster {
    /// CPUs free now.
    pub free: f64,
    /// CPUs of every live node.
    pub total: f64,
    /// CPUs of the largest live node (a worker is placed on one node).
    pub largest: f64,
}

impl Cluster {
    /// A cluster whose figures could not be read: every placement check passes.
    pub const UNKNOWN: Cluster = Cluster {
        free: f64::INFINITY,
        total: f64::INFINITY,
        largest: f64::INFINITY,
    };
}

fn out_of_range(key: &'static str, message: String) -> SettingsError {
    OutOfRange { key, message }.into()
}

impl PoolSettings {
    /// Settings from JSON-like data (a Python dict), every key checked (an error names the
    /// key), then [`check`](Self::check)ed.
    pub fn from_value(v: serde_json::Value) -> Result<Self, SettingsError> {
        let s: Self = crate::media::args::keyed(v).map_err(SettingsError::Conflict)?;
        s.check()?;
        Ok(s)
    }

    /// The fewest workers: the given `min_workers`, else a pinned pool's size, else 0 with
    /// `local` and 1 without (someone must decode).
    pub fn min_workers(&self) -> usize {
        match (self.min_workers, self.workers) {
            (Some(m), _) => m,
            (None, Workers::Pinned(n)) => n,
            (None, Workers::Auto) => usize::from(!self.local),
        }
    }

    /// Each number against its range, and the settings against each other.
    pub fn check(&self) -> Result<(), SettingsError> {
        POOL_WORKERS.check_usize(self.max_workers)?;
        BATCHES_PER_UNIT.check_usize(self.batches_per_unit)?;
        let floor = usize::from(!self.local);
        let at_least = |key: &'static str, n: usize| {
            if n < floor {
                Err(out_of_range(
                    key,
                    format!("must be at least 1 without local decoding (local=false), not {n}"),
                ))
            } else {
                Ok(())
            }
        };
        if let Workers::Pinned(n) = self.workers {
            at_least("workers", n)?;
            if n > self.max_workers {
                return Err(out_of_range(
                    "workers",
                    format!("{n} is more than max_workers={}", self.max_workers),
                ));
            }
            if let Some(m) = self.min_workers.filter(|&m| m != n) {
                return Err(SettingsError::Conflict(format!(
                    "min_workers={m} with a pinned pool of workers={n}: give one of them \
                     (min_workers applies to workers=\"auto\")"
                )));
            }
        }
        let min = self.min_workers();
        at_least("min_workers", min)?;
        if min > self.max_workers {
            return Err(out_of_range(
                "min_workers",
                format!("{min} is more than max_workers={}", self.max_workers),
            ));
        }
        if let Some(c) = self.cpus_per_worker {
            let (min, max) = (limits::MIN_CPUS_PER_WORKER, limits::MAX_CPUS_PER_WORKER);
            if !(min..=max).contains(&c) {
                return Err(out_of_range(
                    "cpus_per_worker",
                    format!("must be in [{min}, {max}], not {c}"),
                ));
            }
        }
        limits::above_zero(
            "start_timeout",
            self.start_timeout,
            limits::MAX_START_TIMEOUT,
        )?;
        Ok(())
    }

    fn pinned(&self) -> Option<usize> {
        match self.workers {
            Workers::Pinned(n) if n > 0 => Some(n),
            _ => None,
        }
    }

    /// The CPUs each worker reserves on `cluster`: `cpus_per_worker`, or what fits its largest
    /// node (at most [`DEFAULT_MAX_CPUS_PER_WORKER`], at least 1). Refused where a worker fits
    /// no node and the pool needs one: a pinned pool, or one without local decoding (a sized
    /// pool with `local` decodes in the training process, and [`start_line`](Self::start_line)
    /// says so).
    pub fn cpus(&self, cluster: &Cluster) -> Result<f64, SettingsError> {
        // In ten-thousandths of a CPU, as a scheduler (Ray) counts them.
        let cpus = self.cpus_per_worker.map(|c| (c * 1e4).round() / 1e4);
        let cpus = cpus.unwrap_or_else(|| {
            if cluster.largest.is_finite() {
                cluster.largest.clamp(1.0, DEFAULT_MAX_CPUS_PER_WORKER)
            } else {
                1.0
            }
        });
        if cpus > cluster.largest && (self.pinned().is_some() || !self.local) {
            return Err(SettingsError::Conflict(format!(
                "a worker needs {cpus} CPUs and the cluster's largest node has {}; lower \
                 cpus_per_worker",
                cluster.largest
            )));
        }
        Ok(cpus)
    }

    /// Why a pinned pool of workers of `cpus` CPUs cannot be placed on `cluster` now (more
    /// CPUs than are free), or `None` where it can (or the pool is sized). Workers just
    /// stopped give their CPUs back a little later: a front end asks again for a moment before
    /// it raises this.
    pub fn short_of_cpus(&self, cpus: f64, cluster: &Cluster) -> Option<String> {
        let n = self.pinned()?;
        let need = n as f64 * cpus;
        (need > cluster.free + 1e-9).then(|| {
            format!(
                "{n} workers of {cpus} CPUs need {need} CPUs and the cluster has {} free (of \
                 {}); lower workers or cpus_per_worker, or use workers=\"auto\" (sized to what \
                 is free)",
                cluster.free, cluster.total
            )
        })
    }

    /// A sized pool's first line on the log: how many workers it starts with and why, and
    /// whether it is a warning (no worker can start: none fits a node, or too few CPUs are
    /// free). `None` for a pinned pool.
    pub fn start_line(
        &self,
        cpus: f64,
        initial: usize,
        cluster: &Cluster,
    ) -> Option<(bool, String)> {
        if self.workers != Workers::Auto {
            return None;
        }
        if cpus > cluster.largest {
            return Some((
                true,
                format!(
                    "workers=\"auto\" will start no worker: each needs {cpus} CPUs and the \
                     cluster's largest node has {}; decoding in the training process only \
                     (lower cpus_per_worker)",
                    cluster.largest
                ),
            ));
        }
        let local = if self.local {
            "; the training process decodes too"
        } else {
            ""
        };
        let warn = initial == 0 && cluster.free + 1e-9 < cpus;
        Some((
            warn,
            format!(
                "workers=\"auto\": {initial} worker(s) at the start (min_workers={}{local}); \
                 workers of {cpus} CPUs are added while the training loop waits, up to {}, \
                 within the cluster's free CPUs ({} of {} now)",
                self.min_workers(),
                self.max_workers,
                cluster.free,
                cluster.total
            ),
        ))
    }

    /// The dispatcher's settings for workers of `cpus` CPUs.
    pub fn dispatch(&self, cpus: f64) -> DispatchSettings {
        let size = match self.workers {
            Workers::Pinned(n) => PoolSize::Pinned(n),
            Workers::Auto => PoolSize::Auto(PoolLimits {
                min_workers: self.min_workers(),
                max_workers: self.max_workers,
                cpus_per_worker: cpus,
                local: self.local,
            }),
        };
        let mut settings = DispatchSettings::new(size, self.local);
        settings.start_timeout = self.start_timeout;
        settings
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn refused(v: serde_json::Value) -> String {
        PoolSettings::from_value(v).unwrap_err().to_string()
    }

    #[test]
    fn the_empty_setting_is_a_sized_pool_with_local_decoding_and_named_defaults() {
        let s = PoolSettings::from_value(json!({})).unwrap();
        assert_eq!(s, PoolSettings::default());
        assert_eq!(s.min_workers(), 0);
        let no_local = PoolSettings::from_value(json!({"local": false})).unwrap();
        assert_eq!(no_local.min_workers(), 1);
        let pinned = PoolSettings::from_value(json!({"workers": 3})).unwrap();
        assert_eq!(
            (pinned.workers, pinned.min_workers()),
            (Workers::Pinned(3), 3)
        );
        // What it serializes to is read back as itself.
        let v = serde_json::to_value(pinned).unwrap();
        assert_eq!(PoolSettings::from_value(v).unwrap(), pinned);
    }

    #[test]
    fn out_of_range_and_contradicting_settings_are_refused_naming_the_key() {
        for (v, key) in [
            (
                json!({"workers": 0, "local": false}),
                "workers: must be at least 1",
            ),
            (
                json!({"min_workers": 0, "local": false}),
                "min_workers: must be at least 1",
            ),
            (
                json!({"min_workers": 5, "max_workers": 2}),
                "min_workers: 5 is more than max",
            ),
            (
                json!({"workers": 5, "max_workers": 2}),
                "workers: 5 is more than max_workers=2",
            ),
            (
                json!({"workers": 2, "min_workers": 3, "max_workers": 4}),
                "pinned pool",
            ),
            (
                json!({"max_workers": 0}),
                "max_workers: must be in 1..=4096, not 0",
            ),
            (
                json!({"max_workers": 5000}),
                "max_workers: must be in 1..=4096, not 5000",
            ),
            (
                json!({"batches_per_unit": 0}),
                "batches_per_unit: must be in 1..=1024",
            ),
            (
                json!({"cpus_per_worker": 0}),
                "cpus_per_worker: must be in [0.01, 4096], not 0",
            ),
            (
                json!({"cpus_per_worker": 1e-5}),
                "cpus_per_worker: must be in [0.01, 4096], not 0.00001",
            ),
            (
                json!({"cpus_per_worker": -1.5}),
                "cpus_per_worker: must be in [0.01, 4096], not -1.5",
            ),
            (
                json!({"cpus_per_worker": "inf"}),
                "cpus_per_worker: must be in [0.01, 4096], not inf",
            ),
            (
                json!({"start_timeout": "nan"}),
                "start_timeout: must be in (0, 86400], not NaN",
            ),
            (
                json!({"start_timeout": 0}),
                "start_timeout: must be in (0, 86400], not 0",
            ),
            (
                json!({"start_timeout": 1e9}),
                "start_timeout: must be in (0, 86400], not 1000000000",
            ),
            (
                json!({"workers": "all"}),
                "workers: invalid value: string \"all\", expected \"auto\"",
            ),
            (
                json!({"workers": -1}),
                "workers: invalid value: integer `-1`",
            ),
            (
                json!({"workers": true}),
                "workers: invalid type: boolean `true`",
            ),
            (
                json!({"local": "no"}),
                "local: invalid type: string \"no\", expected true or false",
            ),
            (
                json!({"max_workers": 2.5}),
                "max_workers: invalid type: floating point `2.5`",
            ),
            (json!({"cpus": 2}), "unknown field `cpus`"),
        ] {
            let m = refused(v.clone());
            assert!(m.contains(key), "{v}: {m}");
        }
        // A pinned pool of 0 decodes in the training process alone.
        assert!(PoolSettings::from_value(json!({"workers": 0})).is_ok());
        // At the limits a user may set.
        let most = json!({"workers": 4096, "max_workers": 4096, "batches_per_unit": 1024,
                          "start_timeout": 86400});
        assert!(PoolSettings::from_value(most).is_ok());
    }

    #[test]
    fn cpus_per_worker_defaults_to_the_largest_node_within_one_to_four() {
        let auto = PoolSettings::default();
        for (largest, cpus) in [(2.0, 2.0), (6.0, 4.0), (0.5, 1.0), (3.5, 3.5)] {
            let c = Cluster {
                free: largest,
                total: largest * 2.0,
                largest,
            };
            assert_eq!(auto.cpus(&c).unwrap(), cpus, "largest node {largest}");
        }
        assert_eq!(auto.cpus(&Cluster::UNKNOWN).unwrap(), 1.0);
        // Given, in ten-thousandths of a CPU (Ray refuses finer shares).
        let fine = PoolSettings::from_value(json!({"cpus_per_worker": 0.123456})).unwrap();
        assert_eq!(fine.cpus(&Cluster::UNKNOWN).unwrap(), 0.1235);
    }

    #[test]
    fn a_worker_that_fits_no_node_is_refused_unless_the_training_process_decodes_anyway() {
        let c = Cluster {
            free: 12.0,
            total: 12.0,
            largest: 6.0,
        };
        let big = |extra: serde_json::Value| {
            let mut v = json!({"cpus_per_worker": 100});
            v.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            PoolSettings::from_value(v).unwrap()
        };
        for s in [big(json!({"workers": 2})), big(json!({"local": false}))] {
            let m = s.cpus(&c).unwrap_err().to_string();
            assert!(
                m.contains("needs 100 CPUs and the cluster's largest node has 6"),
                "{m}"
            );
        }
        // Sized with local decoding: no error, the log line warns.
        let s = big(json!({}));
        assert_eq!(s.cpus(&c).unwrap(), 100.0);
        let (warn, line) = s.start_line(100.0, 0, &c).unwrap();
        assert!(warn && line.contains("will start no worker"), "{line}");
    }

    #[test]
    fn a_pinned_pool_is_short_of_cpus_only_past_what_is_free() {
        let s = PoolSettings::from_value(json!({"workers": 4, "cpus_per_worker": 2})).unwrap();
        let at = |free: f64| Cluster {
            free,
            total: 16.0,
            largest: 8.0,
        };
        assert_eq!(s.short_of_cpus(2.0, &at(8.0)), None, "exactly what is free");
        let m = s.short_of_cpus(2.0, &at(7.0)).unwrap();
        assert!(
            m.contains("need 8 CPUs and the cluster has 7 free (of 16)"),
            "{m}"
        );
        // A sized pool is never short: it starts what fits.
        assert_eq!(PoolSettings::default().short_of_cpus(4.0, &at(0.0)), None);
        assert_eq!(s.start_line(2.0, 4, &at(8.0)), None);
    }

    #[test]
    fn a_sized_pool_says_how_it_starts_and_warns_when_nothing_can() {
        let s = PoolSettings::from_value(json!({"min_workers": 1, "max_workers": 5})).unwrap();
        let c = Cluster {
            free: 6.0,
            total: 8.0,
            largest: 8.0,
        };
        let (warn, line) = s.start_line(2.0, 1, &c).unwrap();
        assert!(!warn);
        assert!(
            line.contains("1 worker(s) at the start (min_workers=1; the training"),
            "{line}"
        );
        assert!(
            line.contains("up to 5, within the cluster's free CPUs (6 of 8 now)"),
            "{line}"
        );
        let none_free = Cluster { free: 1.0, ..c };
        let s0 = PoolSettings::default();
        assert!(s0.start_line(2.0, 0, &none_free).unwrap().0);
    }

    #[test]
    fn the_dispatcher_gets_the_pools_size_and_its_timeout() {
        let s = PoolSettings::from_value(json!({"min_workers": 2, "max_workers": 3,
                                                "local": false, "start_timeout": 7}))
        .unwrap();
        let d = s.dispatch(1.5);
        assert_eq!(
            d.size,
            PoolSize::Auto(PoolLimits {
                min_workers: 2,
                max_workers: 3,
                cpus_per_worker: 1.5,
                local: false
            })
        );
        assert!(!d.local);
        assert_eq!(d.start_timeout, 7.0);
        let p = PoolSettings::from_value(json!({"workers": 2}))
            .unwrap()
            .dispatch(1.0);
        assert_eq!(p.size, PoolSize::Pinned(2));
    }
}
