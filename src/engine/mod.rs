//! The generic engine: a pipeline of stages (any item type), built by
//! [`PipelineBuilder`](builder::PipelineBuilder), run by [`Engine`](running::Engine), driven
//! epoch by epoch by [`Pipeline`](pipeline::Pipeline), checkpointed as a
//! [`PipelineState`](checkpoint::PipelineState), observed through its statistics and steered
//! through its control plane. It knows nothing of media, datasets or loaders: those build on
//! it.

pub(crate) mod builder;
pub(crate) mod checkpoint;
pub(crate) mod config;
pub(crate) mod control;
pub(crate) mod pipeline;
pub(crate) mod running;
pub(crate) mod sharding;
mod share_layout;
pub(crate) mod stats;
