//! # flowgate
//!
//! A thread-based data-loading pipeline for keeping accelerators fed: stages with their own
//! concurrency, bounded (item *and* byte) budgets between them, and results in completion or
//! input order. See the [`Pipeline`] builder, and `ARCHITECTURE.md` for a map of the crate.

mod blob;
mod builder;
pub mod cache;
mod checkpoint;
pub mod collate;
mod config;
mod control;
pub mod dataset;
pub mod device;
mod engine;
pub mod limits;
pub mod loader;
pub mod measure;
pub mod media;
mod pipeline;
#[cfg(feature = "s3")]
pub mod s3;
pub mod sample;
pub mod sampler;
#[cfg(feature = "spec")]
pub mod spec;
mod stats;
pub mod tensor;

pub use blob::Blob;
pub use builder::{PipelineBuilder, SourceBuilder};
pub use checkpoint::{Fingerprint, Part, PipelineState, ShardState, STATE_VERSION};
pub use config::Workers;
pub use control::{ControlHandle, StopHandle};
pub use dataset::Dataset;
pub use loader::Loader;
pub use pipeline::{EpochIter, EpochStream, Pipeline, Within};
pub use stats::{Monitor, PipelineStats, StatsCallback};
pub use tensor::{DType, Tensor};

pub use flowgate_actors as actors;
pub use flowgate_actors::cap::{cpu_worker_cap, set_cpu_worker_cap};
pub use flowgate_actors::emit::Order;
pub use flowgate_actors::error::{BoxError, Described, ItemError, Panicked, PipelineError};
pub use flowgate_actors::failure::{skip_part, FailureBudget};
pub use flowgate_actors::node::CpuBudget;
pub use flowgate_actors::tuner::{PolicyChoice, TraceRecord, TunerSettings};
pub use flowgate_tuner as tuner;
pub use flowgate_tuner::{LatencySummary, StageKind, StageStats};

/// Makes a process forked from one that ran pipelines ready to run its own: forgets the
/// worker tokens the parent's pipelines held and the parent's pooled tensor buffers (their
/// threads and locks do not exist in the child). Call it in the child right after `fork`,
/// before anything else of flowgate; the parent's pipelines must not be used or dropped in
/// the child (leak them: dropping one would wait for threads the child does not have).
/// The Python package does this itself (`os.register_at_fork`).
pub fn after_fork_in_child() {
    flowgate_actors::cap::reset_after_fork();
    flowgate_actors::node::reset_after_fork();
    tensor::pool::forget_after_fork();
}

#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

#[cfg(doctest)]
#[doc = include_str!("../docs/guide.md")]
struct GuideDoctests;

#[cfg(doctest)]
#[doc = include_str!("../docs/tuner.md")]
struct TunerDoctests;

#[cfg(doctest)]
#[doc = include_str!("../docs/reliability.md")]
struct ReliabilityDoctests;

/// `ARCHITECTURE.md` is a map: every path it names must exist, or the map misleads.
#[cfg(test)]
mod architecture_map {
    use std::path::{Path, PathBuf};

    /// Every file and folder of the repository (no build output, no git), relative.
    fn tree(root: &Path, dir: &Path, out: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap().flatten() {
            let p = e.path();
            let name = e.file_name();
            if name == "target" || name == ".git" {
                continue;
            }
            out.push(p.strip_prefix(root).unwrap().to_path_buf());
            if p.is_dir() {
                tree(root, &p, out);
            }
        }
    }

    /// The code-quoted words of `text` that name a file or folder: with a `/` or a known
    /// file extension, and nothing of code (`::`, brackets, spaces).
    fn named_paths(text: &str) -> Vec<String> {
        const EXTENSIONS: [&str; 8] = [".rs", ".md", ".c", ".py", ".toml", ".sh", ".yaml", ".svg"];
        text.split('`')
            .skip(1)
            .step_by(2)
            .filter(|w| !w.is_empty() && !w.starts_with("//"))
            .filter(|w| !w.contains([' ', ':', '(', '<', '[', '*']))
            .filter(|w| w.contains('/') || EXTENSIONS.iter().any(|x| w.ends_with(x)))
            .map(str::to_owned)
            .collect()
    }

    #[test]
    fn every_path_the_architecture_map_names_exists() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let text = std::fs::read_to_string(root.join("ARCHITECTURE.md")).unwrap();
        let mut all = Vec::new();
        tree(root, root, &mut all);
        let named = named_paths(&text);
        assert!(
            named.len() > 50,
            "the map names its files ({})",
            named.len()
        );
        let missing: Vec<&String> = named
            .iter()
            .filter(|w| {
                let want = Path::new(w.trim_end_matches('/'));
                !all.iter().any(|p| p.ends_with(want))
            })
            .collect();
        assert!(
            missing.is_empty(),
            "ARCHITECTURE.md names paths that do not exist: {missing:?}"
        );
        // The checker itself: a stale name is caught.
        assert!(!all.iter().any(|p| p.ends_with("media/files.rs")));
        assert_eq!(
            named_paths("`src/a.rs` and `Files::new` and `x/`"),
            ["src/a.rs", "x/"]
        );
    }
}
