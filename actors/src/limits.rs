//! The ranges of the numbers a user gives a loader, and the one conversion of MiB to bytes.
//!
//! Every front end — the Rust builders, pipeline files, the Python package — checks a number
//! against the same [`Limit`] here, so each refuses the same values with the same words
//! (`must be in 1..=65536, not 70000`); a pipeline file adds its line and dotted key, the
//! others the argument's name. A number past a limit would allocate or keep more than any
//! machine has (a batch, a shuffle buffer, a disk cache) or start more threads than a node
//! runs well, so it is refused when the loader is built, not met later as an out-of-memory
//! kill or an overflow.
//!
//! It lives in `flowgate-actors`, below the library, so that the engine's own types (a
//! failure budget, the tuner's settings) check their numbers against the same table; the
//! library re-exports it as `flowgate::limits`. It knows nothing of the rest of either crate.

/// A number out of its range: the setting's name and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutOfRange {
    /// The setting, as the Rust API and Python name it (`batch_size`).
    pub key: &'static str,
    /// What is wrong, without the key (`must be in 1..=65536, not 0`): what every front end
    /// says after its own name for the setting.
    pub message: String,
}

impl std::fmt::Display for OutOfRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.key, self.message)
    }
}

impl std::error::Error for OutOfRange {}

/// The range of a whole number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limit {
    /// The setting's name.
    pub key: &'static str,
    /// The least value allowed.
    pub min: u64,
    /// The largest value allowed.
    pub max: u64,
}

impl Limit {
    /// `v` if it is in range (a negative number never is).
    pub fn check(&self, v: i128) -> Result<u64, OutOfRange> {
        if v < i128::from(self.min) || v > i128::from(self.max) {
            return Err(OutOfRange {
                key: self.key,
                message: format!("must be in {}..={}, not {v}", self.min, self.max),
            });
        }
        Ok(v as u64)
    }

    /// `v` as a `usize` if it is in range.
    pub fn check_usize(&self, v: usize) -> Result<usize, OutOfRange> {
        self.check(v as i128).map(|v| v as usize)
    }
}

/// Items per batch: a batch is allocated whole, and 65,536 items of anything is past what a
/// training step takes.
pub const BATCH_SIZE: Limit = Limit {
    key: "batch_size",
    min: 1,
    max: 1 << 16,
};

/// Decode workers fixed by hand: threads on one node.
pub const WORKERS: Limit = Limit {
    key: "workers",
    min: 1,
    max: 1 << 10,
};

/// Workers of a stage a front end adds to a generic pipeline (Python's `Pipeline.map`, a
/// `DataLoader`'s `num_workers`): as [`WORKERS`], and 0 for the tuner's (or the cores') start.
pub const STAGE_WORKERS: Limit = Limit {
    key: "workers",
    min: 0,
    max: WORKERS.max,
};

/// Items in flight at once in one async stage (S3 requests: a pipeline file's
/// `source.concurrency`): each holds a request and its bytes.
pub const IN_FLIGHT: Limit = Limit {
    key: "concurrency",
    min: 1,
    max: 1 << 16,
};

/// Results a generic pipeline's last stage and its consumer's buffer may each hold ahead of
/// the loop (Python's `Pipeline.prefetch`, a `DataLoader`'s `prefetch_factor` times its
/// workers): past a few thousand batches of unmeasured Python objects is a memory risk.
pub const STAGE_PREFETCH: Limit = Limit {
    key: "prefetch",
    min: 1,
    max: 1 << 12,
};

/// An epoch a loop may name (`set_epoch`): past 2^32 it is a step counter or a timestamp
/// passed by mistake, and the epoch after it must not wrap around to 0.
pub const EPOCH: Limit = Limit {
    key: "epoch",
    min: 0,
    max: 1 << 32,
};

/// A mixture's draws per epoch: its order is an epoch's, at most
/// `flowgate::sampler::MAX_EPOCH_ITEMS` positions.
pub const DRAWS: Limit = Limit {
    key: "draws",
    min: 1,
    max: 1 << 32,
};

/// Tar shards fetched ahead of the readers: each is kept on disk until it is read.
pub const PREFETCH: Limit = Limit {
    key: "prefetch",
    min: 0,
    max: 1 << 10,
};

/// A shuffle buffer, in samples: positions, at most an epoch's worth
/// (`flowgate::sampler::MAX_EPOCH_ITEMS`).
pub const BUFFER: Limit = Limit {
    key: "buffer",
    min: 0,
    max: 1 << 32,
};

/// Length buckets of length-aware batches: each is a queue of clips waiting for a batch of
/// their length, and past a thousand a bucket holds too few clips to batch alike.
pub const BUCKETS: Limit = Limit {
    key: "buckets",
    min: 1,
    max: 1000,
};

/// Worker threads a `DataLoader` starts with (`num_workers`): as [`STAGE_WORKERS`], 0 for
/// "the tuner decides".
pub const NUM_WORKERS: Limit = Limit {
    key: "num_workers",
    ..STAGE_WORKERS
};

/// Batches a `DataLoader` makes ahead of the loop per worker (`prefetch_factor`, torch's):
/// at least one, at most 1,024; with the workers, at most [`STAGE_PREFETCH`] in all
/// ([`batches_ahead`]).
pub const PREFETCH_FACTOR: Limit = Limit {
    key: "prefetch_factor",
    min: 1,
    max: 1 << 10,
};

/// The batches a `DataLoader` makes ahead of the loop: `prefetch_factor` (default 2) per
/// worker, `workers` being `num_workers` or, where that is 0, the cores the tuner starts from.
/// Refused past [`STAGE_PREFETCH`] (unmeasured Python objects), naming both numbers: a bound
/// that binds says so rather than being cut to the limit.
pub fn batches_ahead(
    prefetch_factor: Option<u64>,
    num_workers: u64,
    cores: u64,
) -> Result<u64, OutOfRange> {
    let factor = prefetch_factor.unwrap_or(2);
    PREFETCH_FACTOR.check(i128::from(factor))?;
    NUM_WORKERS.check(i128::from(num_workers))?;
    let workers = if num_workers == 0 {
        cores.max(1)
    } else {
        num_workers
    };
    let ahead = factor.saturating_mul(workers);
    if ahead > STAGE_PREFETCH.max {
        let whose = match num_workers {
            0 => format!("the {workers} cores the tuner starts from (num_workers=0)"),
            n => format!("num_workers={n}"),
        };
        return Err(OutOfRange {
            key: "prefetch_factor",
            message: format!(
                "{factor} batches per worker for {whose} is {ahead} batches ahead of the loop, \
                 more than the {} allowed",
                STAGE_PREFETCH.max
            ),
        });
    }
    Ok(ahead)
}

/// A failure budget's rate (`max_failures` as a fraction of the items seen): 0 fails at the
/// first failure, 1 never fails.
pub fn failure_rate(rate: f64) -> Result<f64, OutOfRange> {
    if !(0.0..=1.0).contains(&rate) {
        return Err(OutOfRange {
            key: "max_failures",
            message: format!("a count (an integer) or a rate in 0..=1, not {rate}"),
        });
    }
    Ok(rate)
}

/// The tuner's tick, in milliseconds: at least 1, at most an hour (a tuner that never ticks
/// is `autotune_off`).
pub const TICK_MS: Limit = Limit {
    key: "tick_ms",
    min: 1,
    max: 3_600_000,
};

/// The range of an amount of memory or disk, in MiB.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MibLimit {
    /// The setting's name.
    pub key: &'static str,
    /// Whether 0 is allowed (a cache that keeps nothing beyond what is read); otherwise the
    /// amount must be above 0.
    pub zero: bool,
}

/// The largest amount of memory or disk any setting may name: 16 TiB, in MiB.
pub const MAX_MIB: f64 = (1u64 << 24) as f64;

/// A disk cache of tar shards beyond those being read; 0 keeps none.
pub const CACHE_MB: MibLimit = MibLimit {
    key: "cache_mb",
    zero: true,
};

/// A hard memory budget for everything a loader holds.
pub const MEMORY_MB: MibLimit = MibLimit {
    key: "memory_mb",
    zero: false,
};

/// The device memory batches may hold at once.
pub const DEVICE_MEMORY_MB: MibLimit = MibLimit {
    key: "device_memory_mb",
    zero: false,
};

/// Pinned host memory staging batches for a device.
pub const STAGING_MB: MibLimit = MibLimit {
    key: "staging_mb",
    zero: false,
};

/// An in-memory byte cache of fetched objects, and its ceiling.
pub const BYTE_CACHE_MB: MibLimit = MibLimit {
    key: "cache.mb",
    zero: false,
};

impl MibLimit {
    /// `mib` checked (finite, in range) and turned into bytes: the one place in the crate
    /// and its front ends that does.
    pub fn bytes(&self, mib: f64) -> Result<u64, OutOfRange> {
        let low_ok = if self.zero { mib >= 0.0 } else { mib > 0.0 };
        if !(low_ok && mib <= MAX_MIB) {
            let range = if self.zero {
                format!("0..={MAX_MIB}")
            } else {
                format!("(0, {MAX_MIB}]")
            };
            return Err(OutOfRange {
                key: self.key,
                message: format!("must be in {range} (MiB), not {mib}"),
            });
        }
        Ok(mib_to_bytes(mib))
    }
}

/// `mib` MiB in bytes (rounded down), for a figure already in range.
pub fn mib_to_bytes(mib: f64) -> u64 {
    (mib * 1_048_576.0) as u64
}

/// `bytes` in MiB, for messages and reports.
pub fn bytes_to_mib(bytes: u64) -> f64 {
    bytes as f64 / 1_048_576.0
}

/// The longest padded audio of a length-aware batch, in seconds: an hour of audio per batch
/// is past any training step.
pub const MAX_BATCH_SECONDS: f64 = 3600.0;

/// `max_batch_seconds` (a pipeline file's `batch.max_seconds`) checked: above 0, at most
/// [`MAX_BATCH_SECONDS`].
pub fn batch_seconds(s: f64) -> Result<f64, OutOfRange> {
    above_zero("max_batch_seconds", s, MAX_BATCH_SECONDS)
}

/// `v` if it is above 0 and at most `max` (never NaN).
pub fn above_zero(key: &'static str, v: f64, max: f64) -> Result<f64, OutOfRange> {
    if !(v > 0.0 && v <= max) {
        return Err(OutOfRange {
            key,
            message: format!("must be in (0, {max}], not {v}"),
        });
    }
    Ok(v)
}

/// Workers of one remote pool (`max_workers`, a pinned `workers`): past a few thousand, the
/// one training process that collects their units is the bound.
pub const POOL_WORKERS: Limit = Limit {
    key: "max_workers",
    min: 1,
    max: 1 << 12,
};

/// Batches per unit of remote work: a unit is decoded whole before any of it is yielded.
pub const BATCHES_PER_UNIT: Limit = Limit {
    key: "batches_per_unit",
    min: 1,
    max: 1 << 10,
};

/// The most CPUs one remote worker may reserve: past any node's.
pub const MAX_CPUS_PER_WORKER: f64 = 4096.0;

/// The fewest CPUs one remote worker may reserve: a hundredth of one (a scheduler such as
/// Ray counts CPUs in ten-thousandths; a smaller share decodes nothing in useful time).
pub const MIN_CPUS_PER_WORKER: f64 = 0.01;

/// The longest a remote pool may wait for its first worker, in seconds (a day).
pub const MAX_START_TIMEOUT: f64 = 86_400.0;

/// A whole number for `limit`, as every front end's settings read one: anything that is not a
/// whole number of at least 0 (a negative, a fraction, a bool, a string, nothing) is refused in
/// the range's words, `must be in 1..=65536, not -1`, showing the value as it was written.
/// The range itself is checked after (by the settings' checks, which name the key and, in a
/// pipeline file, its line), in the same words. `None` where the data says null (`optional`).
fn whole_in<'de, D: serde::Deserializer<'de>>(
    limit: Limit,
    optional: bool,
    d: D,
) -> Result<Option<u64>, D::Error> {
    struct V(Limit, bool);
    impl V {
        fn refuse<E: serde::de::Error>(&self, shown: impl std::fmt::Display) -> E {
            E::custom(format!(
                "must be in {}..={}, not {shown}",
                self.0.min, self.0.max
            ))
        }
        fn whole<E: serde::de::Error>(&self, v: i128) -> Result<Option<u64>, E> {
            u64::try_from(v).map(Some).map_err(|_| self.refuse(v))
        }
    }
    impl<'de> serde::de::Visitor<'de> for V {
        type Value = Option<u64>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            write!(f, "a whole number in {}..={}", self.0.min, self.0.max)
        }
        fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Self::Value, E> {
            self.whole(i128::from(v))
        }
        fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Self::Value, E> {
            self.whole(i128::from(v))
        }
        fn visit_i128<E: serde::de::Error>(self, v: i128) -> Result<Self::Value, E> {
            self.whole(v)
        }
        fn visit_u128<E: serde::de::Error>(self, v: u128) -> Result<Self::Value, E> {
            match i128::try_from(v) {
                Ok(v) => self.whole(v),
                Err(_) => Err(self.refuse(v)),
            }
        }
        fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Self::Value, E> {
            Err(self.refuse(format_args!("{v:?}")))
        }
        fn visit_bool<E: serde::de::Error>(self, v: bool) -> Result<Self::Value, E> {
            Err(self.refuse(v))
        }
        fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
            match v {
                // A float JSON cannot hold (a Python float through it): shown as TOML's is.
                "nan" | "NaN" => Err(self.refuse("NaN")),
                "inf" | "-inf" => Err(self.refuse(v)),
                _ => Err(self.refuse(format_args!("{v:?}"))),
            }
        }
        fn visit_unit<E: serde::de::Error>(self) -> Result<Self::Value, E> {
            match self.1 {
                true => Ok(None),
                false => Err(self.refuse("null")),
            }
        }
        fn visit_none<E: serde::de::Error>(self) -> Result<Self::Value, E> {
            self.visit_unit()
        }
        fn visit_some<D2: serde::Deserializer<'de>>(self, d: D2) -> Result<Self::Value, D2::Error> {
            d.deserialize_any(self)
        }
    }
    d.deserialize_any(V(limit, optional))
}

/// Deserializers of whole-number settings in their [`Limit`]s' words
/// (`#[serde(deserialize_with = "limits::whole::batch_size")]`): a pipeline file's and a
/// Python loader's settings refuse the same values with the same message.
pub mod whole {
    use super::*;

    macro_rules! whole {
        ($($name:ident, $opt:ident: $limit:expr;)*) => {$(
            #[doc = concat!("A `", stringify!($name), "` ([`", stringify!($limit), "`]).")]
            pub fn $name<'de, D: serde::Deserializer<'de>>(d: D) -> Result<usize, D::Error> {
                whole_in($limit, false, d).map(|v| v.unwrap_or_default() as usize)
            }
            #[doc = concat!("An optional `", stringify!($name), "` ([`", stringify!($limit), "`]).")]
            pub fn $opt<'de, D: serde::Deserializer<'de>>(
                d: D,
            ) -> Result<Option<usize>, D::Error> {
                whole_in($limit, true, d).map(|v| v.map(|v| v as usize))
            }
        )*};
    }

    /// `v` (JSON-like data: a Python value, a JSON document) as a whole number in `limit`'s
    /// range, or the words its settings would refuse it in (`must be in 0..=1024, not true`).
    pub fn value(limit: Limit, v: serde_json::Value) -> Result<u64, String> {
        let v = whole_in(limit, false, v).map_err(|e| e.to_string())?;
        limit
            .check(i128::from(v.unwrap_or_default()))
            .map_err(|e| e.message)
    }

    whole! {
        batch_size, batch_size_or_none: BATCH_SIZE;
        workers, workers_or_none: WORKERS;
        prefetch, prefetch_or_none: PREFETCH;
        buffer, buffer_or_none: BUFFER;
        buckets, buckets_or_none: BUCKETS;
        draws, draws_or_none: DRAWS;
    }
}

/// A number that may be NaN or infinite: a number, or `"inf"`, `"-inf"` or `"nan"` where the
/// data cannot hold them (JSON, a Python float through it), so the range check, not the
/// parser, refuses them in the same words as everywhere else.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Float(pub f64);

impl<'de> serde::Deserialize<'de> for Float {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = Float;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a number")
            }
            fn visit_f64<E>(self, v: f64) -> Result<Float, E> {
                Ok(Float(v))
            }
            fn visit_i64<E>(self, v: i64) -> Result<Float, E> {
                Ok(Float(v as f64))
            }
            fn visit_u64<E>(self, v: u64) -> Result<Float, E> {
                Ok(Float(v as f64))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Float, E> {
                match v {
                    "inf" => Ok(Float(f64::INFINITY)),
                    "-inf" => Ok(Float(f64::NEG_INFINITY)),
                    "nan" | "NaN" => Ok(Float(f64::NAN)),
                    _ => Err(E::invalid_type(serde::de::Unexpected::Str(v), &self)),
                }
            }
        }
        d.deserialize_any(V)
    }
}

/// A [`Float`] field (`#[serde(deserialize_with = "limits::float")]`).
pub fn float<'de, D: serde::Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    <Float as serde::Deserialize>::deserialize(d).map(|f| f.0)
}

/// An optional [`Float`] field.
pub fn float_or_name<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<f64>, D::Error> {
    <Option<Float> as serde::Deserialize>::deserialize(d).map(|f| f.map(|f| f.0))
}

/// A pair of [`Float`]s (a range: `(lo, hi)`).
pub fn float_pair<'de, D: serde::Deserializer<'de>>(d: D) -> Result<(f64, f64), D::Error> {
    <(Float, Float) as serde::Deserialize>::deserialize(d).map(|(a, b)| (a.0, b.0))
}

/// A serde message in a user's words (`expected usize` → `expected a whole number, at least
/// 0`): what every front end's settings say of a value of the wrong type.
pub fn in_words(message: &str) -> String {
    let mut m = message.to_owned();
    for (rust, words) in [
        ("expected u8", "expected a whole number, at least 0"),
        ("expected u16", "expected a whole number, at least 0"),
        ("expected u32", "expected a whole number, at least 0"),
        ("expected u64", "expected a whole number, at least 0"),
        ("expected usize", "expected a whole number, at least 0"),
        ("expected f32", "expected a number"),
        ("expected f64", "expected a number"),
        ("expected a boolean", "expected true or false"),
    ] {
        if let Some(rest) = m.strip_suffix(rust) {
            m = format!("{rest}{words}");
        }
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_at_the_edges() {
        assert_eq!(BATCH_SIZE.check(1), Ok(1));
        assert_eq!(BATCH_SIZE.check(1 << 16), Ok(1 << 16));
        let e = BATCH_SIZE.check((1 << 16) + 1).unwrap_err();
        assert_eq!(e.to_string(), "batch_size: must be in 1..=65536, not 65537");
        assert!(BATCH_SIZE.check(0).is_err());
        assert!(WORKERS.check(-1).is_err());
        assert_eq!(PREFETCH.check(0), Ok(0));
        assert_eq!(BUFFER.check(1 << 32), Ok(1 << 32));
    }

    #[test]
    fn mib_are_checked_then_turned_into_bytes() {
        assert_eq!(MEMORY_MB.bytes(1.5), Ok(1_572_864));
        assert_eq!(CACHE_MB.bytes(0.0), Ok(0));
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY, MAX_MIB * 2.0] {
            assert!(MEMORY_MB.bytes(bad).is_err(), "{bad}");
        }
        for bad in [-0.5, f64::NAN, f64::INFINITY] {
            let e = CACHE_MB.bytes(bad).unwrap_err();
            assert!(
                e.message.starts_with("must be in 0..=16777216 (MiB), not"),
                "{e}"
            );
        }
    }
}
