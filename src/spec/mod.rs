//! Declarative pipelines (feature `spec`): a TOML file that says where the data is, how to
//! decode and batch it, what the training step costs, and how to tune, which
//! [`PipelineSpec::build`] turns into a running pipeline (what `flowgate run` does).
//!
//! ```toml
//! [source]
//! kind = "list"                  # list | dir | s3
//! path = "target/sample-data/images.txt"
//!
//! [loader]                       # the library's LoaderSettings, by the same names
//! batch_size = 32
//! seed = 0                       # shuffled anew every epoch (shuffle = false: file order)
//!
//! [decode]
//! kind = "image"                 # image | audio | video
//! resize = 256
//! crop = 224
//!
//! [run]
//! epochs = 2
//! step_ms = 1.0                  # a simulated training step per batch
//! ```
//!
//! Every table rejects unknown keys, and every error names the key and its line
//! ([`SpecError`]). Relative paths are relative to the working directory.
//!
//! Files:
//! 1. `schema` — the tables and keys ([`PipelineSpec`] and its parts), with their defaults.
//! 2. `validate` — parsing and the checks no pipeline can run without, each error naming its
//!    line and key ([`SpecError`]).
//! 3. `source` — the `[source]` table as a [`Source`](crate::dataset::Source).
//! 4. `build` — [`PipelineSpec::build`]: the recipe, the dataset and the library's
//!    [`Loader`](crate::Loader) with the spec's settings ([`Job`]).
//! 5. `s3` (feature `s3`) — the local S3 server of `serve_locally_from`.
//! 6. `legacy` — the older loader keys (`batch.size`, `source.shuffle`, …) read into
//!    `[loader]`, each said in a deprecation line.

mod build;
mod legacy;
#[cfg(feature = "s3")]
mod s3;
mod schema;
mod source;
mod validate;

pub use build::{DecisionHook, FailureHook, Hooks, Job};
pub use legacy::OLD_KEYS;
pub use schema::*;
pub use validate::SpecError;
