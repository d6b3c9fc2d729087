//! # flowgate
//!
//! A thread-based data-loading pipeline for keeping accelerators fed: stages with their own
//! concurrency, bounded (item *and* byte) budgets between them, and results in completion or
//! input order. See the [`Pipeline`] builder, and `ARCHITECTURE.md` for a map of the crate.

mod blob;
pub mod board;
pub mod build_info;
pub mod byte_cache;
pub mod collate;
pub mod dataset;
pub mod device;
mod engine;
pub mod extensions;
mod hash;
pub use flowgate_actors::limits;
pub mod loader;
pub mod measure;
pub mod media;
pub mod prometheus;
#[cfg(feature = "s3")]
pub mod s3;
pub mod sample;
pub mod sampler;
#[cfg(feature = "spec")]
pub mod spec;
#[cfg(feature = "synth")]
pub mod synth;
pub mod tensor;

pub use blob::Blob;
pub use build_info::{build_info, BuildInfo};
pub use dataset::Dataset;
pub use engine::builder::{PipelineBuilder, SourceBuilder};
pub use engine::checkpoint::{Fingerprint, Part, PipelineState, ShareState, STATE_VERSION};
pub use engine::config::Workers;
pub use engine::control::{ControlHandle, StopHandle};
pub use engine::pipeline::{EpochIter, EpochStream, Pipeline, Within};
pub use engine::stats::{MemoryBudget, Monitor, PipelineStats, StatsCallback};
pub use loader::Loader;
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

/// `ARCHITECTURE.md` is a map: every path it names must exist, whole from the repository's
/// root, or the map misleads; and every top-level module must be on it.
#[cfg(test)]
mod architecture_map {
    use std::path::{Component, Path};

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

    /// The names among `named` that are not a path from `root` exactly as written: relative,
    /// nothing but plain components (no `..`), a folder where it ends with `/` and a file
    /// where it does not. A bare file name (`tar.rs`) is not the whole path of a file deeper
    /// in the tree, so it is missing too.
    fn missing<'a>(root: &Path, named: &'a [String]) -> Vec<&'a String> {
        named
            .iter()
            .filter(|w| {
                let path = Path::new(w.as_str());
                let plain = path.components().all(|c| matches!(c, Component::Normal(_)));
                let at = root.join(path);
                let there = if w.ends_with('/') {
                    at.is_dir()
                } else {
                    at.is_file()
                };
                !(plain && there)
            })
            .collect()
    }

    /// The top-level modules `lib_rs` declares: its lines `mod NAME;` or `pub mod NAME;`
    /// (attributes such as `#[cfg(...)]` on the lines before them), not indented (a `mod`
    /// inside another module is not top-level) and not inline (`mod NAME {`).
    fn declared_modules(lib_rs: &str) -> Vec<String> {
        lib_rs
            .lines()
            .filter_map(|line| {
                let line = line.trim_end();
                let rest = ["pub mod ", "pub(crate) mod ", "mod "]
                    .iter()
                    .find_map(|p| line.strip_prefix(p))?;
                let name = rest.strip_suffix(';')?.trim();
                let ident =
                    !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
                ident.then(|| name.to_owned())
            })
            .collect()
    }

    /// The modules of `modules` that `named` does not name as `src/NAME.rs` or `src/NAME/`.
    fn unnamed_modules<'a>(modules: &'a [String], named: &[String]) -> Vec<&'a String> {
        modules
            .iter()
            .filter(|m| {
                let (file, folder) = (format!("src/{m}.rs"), format!("src/{m}/"));
                !named.iter().any(|w| *w == file || *w == folder)
            })
            .collect()
    }

    #[test]
    fn every_path_the_architecture_map_names_exists() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let text = std::fs::read_to_string(root.join("ARCHITECTURE.md")).unwrap();
        let named = named_paths(&text);
        assert!(
            named.len() > 50,
            "the map names its files ({})",
            named.len()
        );
        let missing_paths = missing(root, &named);
        assert!(
            missing_paths.is_empty(),
            "ARCHITECTURE.md names paths that are not whole paths from the repository root \
             (a folder with a trailing `/`, a file without): {missing_paths:?}"
        );

        // Every top-level module of the crate is on the map.
        let lib_rs = std::fs::read_to_string(root.join("src/lib.rs")).unwrap();
        let modules = declared_modules(&lib_rs);
        assert!(
            modules.len() >= 20 && modules.iter().any(|m| m == "synth"),
            "src/lib.rs's modules are found, those behind a feature too: {modules:?}"
        );
        let unnamed = unnamed_modules(&modules, &named);
        assert!(
            unnamed.is_empty(),
            "ARCHITECTURE.md does not describe these modules of src/lib.rs \
             (name each as `src/NAME.rs` or `src/NAME/`): {unnamed:?}"
        );

        // The checker itself: a stale name is caught, and a bare file name is refused even
        // where a file of that name exists deeper in the tree.
        let names = |ws: &[&str]| ws.iter().map(|w| w.to_string()).collect::<Vec<_>>();
        let probe = names(&[
            "src/media/files.rs",
            "tar.rs",
            "shards/tar.rs",
            "src/dataset/shards/tar.rs",
            "src/dataset/shards/",
            "src/dataset/shards",
            "src/lib.rs/",
            "src/../src/lib.rs",
        ]);
        assert!(root.join("src/dataset/shards/tar.rs").is_file());
        assert_eq!(
            missing(root, &probe),
            [
                "src/media/files.rs",
                "tar.rs",
                "shards/tar.rs",
                "src/dataset/shards",
                "src/lib.rs/",
                "src/../src/lib.rs"
            ]
        );
        assert_eq!(
            named_paths("`src/a.rs` and `Files::new` and `x/`"),
            ["src/a.rs", "x/"]
        );
        assert_eq!(named_paths("a bare `tar.rs`"), ["tar.rs"]);
        assert_eq!(
            declared_modules(
                "mod a;\n#[cfg(feature = \"x\")]\npub mod b;\n#[cfg(test)]\nmod c {\n    mod d;\n}\n"
            ),
            ["a", "b"]
        );
        assert_eq!(
            unnamed_modules(
                &names(&["a", "b", "c"]),
                &names(&["src/a.rs", "src/b/", "src/c"])
            ),
            ["c"]
        );
    }
}
