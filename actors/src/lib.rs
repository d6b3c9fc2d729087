//! `flowgate-actors`: flowgate's engine.
//!
//! - [`channel`]: budgeted, resizable channels between stages (items *and* bytes).
//! - [`pool`]: synchronous stages on resizable work-stealing thread pools.
//! - [`async_stage`]: asynchronous stages on tokio with resizable concurrency.
//! - [`aggregate`], [`source`], [`sink`]: batching, the producer and the consumer ends.
//! - [`emit`]: how results move downstream (budget handoff, input-order reordering).
//! - [`actor`]: the control plane, one actix actor per stage; [`tuner`]: the tuner actor.
//! - [`origin`]: which source items each result carries (exact checkpoints).
//! - [`attached`]: caches, read-aheads and threads per item attached to stages, reported and resized with them.
//! - [`failure`], [`error`]: skip-and-count failure budgets and the errors users see.
//! - [`metrics`], [`cap`]: per-worker counters flushed in batches; the process-wide CPU cap.
//!
//! Most users want the `flowgate` facade crate, whose `Pipeline` builder assembles these parts.

pub mod actor;
pub mod aggregate;
pub mod async_stage;
pub mod attached;
pub mod cap;
pub mod channel;
pub mod emit;
pub mod error;
pub mod failure;
pub mod limits;
pub mod metrics;
pub mod node;
pub mod op;
pub mod origin;
pub mod pool;
pub mod sink;
pub mod source;
pub mod stage;
pub mod tuner;
