//! What a node CPU budget is: a number of cores or a fraction of the node, its parsing, and
//! which ranks share one (the key).

use serde::{Deserialize, Serialize};

/// Most cores a budget may name (a byte each in the ledger file).
pub const MAX_CORES: usize = 4096;

/// How many cores the ranks of a node may keep busy decoding, together.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[serde(into = "BudgetRepr")]
pub enum CpuBudget {
    /// A number of cores (1..=[`MAX_CORES`]).
    Cores(usize),
    /// A fraction (0..1, exclusive) of the node's cores, at least one core.
    Fraction(f64),
}

#[derive(Serialize)]
#[serde(untagged)]
enum BudgetRepr {
    Number(f64),
}

/// A number of cores, a fraction or a percentage; anything else (a bool above all, which
/// would otherwise read as one core) is refused, saying what is wanted.
impl<'de> Deserialize<'de> for CpuBudget {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = CpuBudget;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a number of cores (2), a fraction (0.4) or a percentage (\"40%\")")
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<CpuBudget, E> {
                CpuBudget::from_number(v as f64).map_err(E::custom)
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<CpuBudget, E> {
                CpuBudget::from_number(v as f64).map_err(E::custom)
            }
            fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<CpuBudget, E> {
                CpuBudget::from_number(v).map_err(E::custom)
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<CpuBudget, E> {
                v.parse().map_err(E::custom)
            }
        }
        d.deserialize_any(V)
    }
}

impl From<CpuBudget> for BudgetRepr {
    fn from(b: CpuBudget) -> Self {
        match b {
            CpuBudget::Cores(n) => BudgetRepr::Number(n as f64),
            CpuBudget::Fraction(f) => BudgetRepr::Number(f),
        }
    }
}

impl CpuBudget {
    /// A whole number of cores (1..=[`MAX_CORES`]), or a fraction of the node strictly
    /// between 0 and 1; anything else is an error that says so.
    pub fn from_number(v: f64) -> Result<Self, String> {
        if !v.is_finite() || v <= 0.0 {
            return Err(format!(
                "must be a number of cores (1, 2, ...) or a fraction of the node (0.4), not {v}"
            ));
        }
        if v < 1.0 {
            return Ok(Self::Fraction(v));
        }
        if v.fract() != 0.0 || v > MAX_CORES as f64 {
            return Err(format!(
                "must be a whole number of cores from 1 to {MAX_CORES}, or a fraction of \
                 the node below 1 (0.4, or \"40%\"), not {v}"
            ));
        }
        Ok(Self::Cores(v as usize))
    }

    /// The cores this budget stands for on a node of `node_cores`.
    pub fn cores_of(self, node_cores: usize) -> usize {
        match self {
            Self::Cores(n) => n,
            Self::Fraction(f) => ((f * node_cores as f64).round() as usize).max(1),
        }
    }

    /// The cores this budget stands for on this node: never more than the node has (a
    /// budget written for a bigger node is the whole of a smaller one).
    pub fn cores(self) -> usize {
        let node = node_cores();
        self.cores_of(node).min(node)
    }
}

impl std::str::FromStr for CpuBudget {
    type Err = String;
    /// `2` (cores), `0.4` or `40%` (of the node).
    fn from_str(s: &str) -> Result<Self, String> {
        let t = s.trim();
        if let Some(p) = t.strip_suffix('%') {
            let v: f64 = p.trim().parse().map_err(|_| {
                format!("must be a percentage of the node's cores (40%), not `{s}`")
            })?;
            if !(v > 0.0 && v <= 100.0) {
                return Err(format!(
                    "must be a percentage above 0 and at most 100, not `{s}`"
                ));
            }
            return Ok(if v == 100.0 {
                Self::Cores(node_cores())
            } else {
                Self::Fraction(v / 100.0)
            });
        }
        let v: f64 = t.parse().map_err(|_| {
            format!(
                "must be a number of cores (2), a fraction (0.4) or a percentage (40%), not `{s}`"
            )
        })?;
        Self::from_number(v)
    }
}

/// The node's cores: every core of the machine, whatever this process's affinity mask (ranks
/// pinned to different cores still share the node).
pub fn node_cores() -> usize {
    std::fs::read_to_string("/sys/devices/system/cpu/online")
        .ok()
        .and_then(|s| count_cpu_list(s.trim()))
        .unwrap_or_else(flowgate_tuner::machine_cores)
}

/// Counts a kernel CPU list (`0-3,8-11`).
pub(super) fn count_cpu_list(s: &str) -> Option<usize> {
    let mut n = 0;
    for part in s.split(',') {
        n += match part.split_once('-') {
            Some((a, b)) => b.parse::<usize>().ok()?.checked_sub(a.parse().ok()?)? + 1,
            None => {
                part.parse::<usize>().ok()?;
                1
            }
        };
    }
    (n > 0).then_some(n)
}

/// The key ranks of one job on one node share: `FLOWGATE_NODE_KEY`, else `torchrun`'s run id
/// and master port, else the user.
pub fn node_key() -> String {
    let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    let raw = var("FLOWGATE_NODE_KEY").unwrap_or_else(|| {
        match (var("TORCHELASTIC_RUN_ID"), var("MASTER_PORT")) {
            (None, None) => format!("uid{}", unsafe { libc::getuid() }),
            (run, port) => format!("{}-{}", run.unwrap_or_default(), port.unwrap_or_default()),
        }
    });
    raw.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.' {
                c
            } else {
                '_'
            }
        })
        .take(100)
        .collect()
}
