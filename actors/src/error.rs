//! Errors: [`ItemError`] for one failed item, [`PipelineError`] for the pipeline as a whole.

use std::any::Any;
use std::fmt;
use std::sync::Arc;

/// A boxed error from user code.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// A user function panicked while processing an item.
#[derive(Debug, Clone)]
pub struct Panicked {
    message: String,
}

impl Panicked {
    /// Builds the error from a panic payload.
    pub fn from_payload(payload: &(dyn Any + Send)) -> Self {
        let message = if let Some(s) = payload.downcast_ref::<&str>() {
            (*s).to_owned()
        } else if let Some(s) = payload.downcast_ref::<String>() {
            s.clone()
        } else {
            "a non-string panic payload".to_owned()
        };
        Self { message }
    }

    /// The panic message.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for Panicked {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "panicked: {}", self.message)
    }
}

impl std::error::Error for Panicked {}

/// An error that names the item it failed on: a stage that describes items only when they
/// fail returns this instead of registering a `describe` function, which runs for every item
/// (costly when describing means, say, taking Python's GIL for `repr()`). The failure record
/// takes `item` as the item's description and `cause` as the cause.
#[derive(Debug)]
pub struct Described {
    item: String,
    cause: BoxError,
}

impl Described {
    /// `cause`, for the item described as `item`.
    pub fn new(item: impl Into<String>, cause: impl Into<BoxError>) -> Self {
        Self {
            item: item.into(),
            cause: cause.into(),
        }
    }

    /// The item's description and the cause.
    pub fn into_parts(self) -> (String, BoxError) {
        (self.item, self.cause)
    }
}

impl fmt::Display for Described {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.cause.fmt(f)
    }
}

impl std::error::Error for Described {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.cause.source()
    }
}

/// One item failed in one stage. Cheap to clone; the cause is shared.
#[derive(Debug, Clone)]
pub struct ItemError {
    stage: Arc<str>,
    item: String,
    cause: Arc<dyn std::error::Error + Send + Sync + 'static>,
}

impl ItemError {
    /// An item error for `item` (a description) in `stage`.
    pub fn new(stage: Arc<str>, item: String, cause: BoxError) -> Self {
        Self {
            stage,
            item,
            cause: Arc::from(cause),
        }
    }

    /// The stage the item failed in.
    pub fn stage(&self) -> &str {
        &self.stage
    }

    /// The item's description (a user-supplied one, or its position in the stage's input).
    pub fn item(&self) -> &str {
        &self.item
    }

    /// Whether the user function panicked (rather than returning an error).
    pub fn is_panic(&self) -> bool {
        self.cause.downcast_ref::<Panicked>().is_some()
    }

    /// The error the user function returned, or a [`Panicked`].
    pub fn cause(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        &*self.cause
    }
}

impl fmt::Display for ItemError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "stage `{}` failed on {}: {}",
            self.stage, self.item, self.cause
        )
    }
}

impl std::error::Error for ItemError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.cause)
    }
}

#[derive(Debug, Clone)]
enum Kind {
    Config(String),
    Io(String),
    FailureBudget { scope: String, failures: u64 },
    NothingDelivered { epoch: u64, failures: u64 },
    Stopped,
    Runtime(String),
}

/// The error behind a [`PipelineError`], shared so that the error stays `Clone`.
type Cause = Arc<dyn std::error::Error + Send + Sync + 'static>;

/// What a pipeline reports when it cannot go on, or cannot be built.
///
/// Query it with the `is_*` methods; [`stage`](Self::stage) and [`item`](Self::item) name where
/// it happened, and [`source`](std::error::Error::source) walks the cause chain down to the
/// user's own error.
///
/// Its `Debug` is its message (what `fn main() -> Result<(), PipelineError>` prints on an
/// error), not the struct's fields.
#[derive(Clone)]
pub struct PipelineError {
    kind: Kind,
    item: Option<ItemError>,
    cause: Option<Cause>,
}

impl PipelineError {
    fn of(kind: Kind) -> Self {
        Self {
            kind,
            item: None,
            cause: None,
        }
    }

    fn with_cause(mut self, cause: impl Into<BoxError>) -> Self {
        self.cause = Some(Arc::from(cause.into()));
        self
    }

    /// An invalid configuration.
    pub fn config(msg: impl Into<String>) -> Self {
        Self::of(Kind::Config(msg.into()))
    }

    /// An invalid configuration found while `context` (e.g. parsing a value), caused by
    /// `cause`, which [`source`](std::error::Error::source) returns.
    pub fn config_from(context: impl Into<String>, cause: impl Into<BoxError>) -> Self {
        Self::of(Kind::Config(context.into())).with_cause(cause)
    }

    /// Reading or writing something the pipeline needs (a directory listing, a trace file, a
    /// remote store) failed while `context`; `cause` is the underlying error.
    pub fn io(context: impl Into<String>, cause: impl Into<BoxError>) -> Self {
        Self::of(Kind::Io(context.into())).with_cause(cause)
    }

    /// A failure budget was exceeded; `last` is the failure that exceeded it.
    pub fn failure_budget(scope: impl Into<String>, failures: u64, last: ItemError) -> Self {
        Self {
            kind: Kind::FailureBudget {
                scope: scope.into(),
                failures,
            },
            item: Some(last),
            cause: None,
        }
    }

    /// Epoch `epoch` delivered nothing because every one of its items failed (`failures` of
    /// them; `last` the last one): a dataset no item of which can be read (a label field no
    /// sample has, the wrong decoder) is an error, not an empty epoch.
    pub fn nothing_delivered(epoch: u64, failures: u64, last: Option<ItemError>) -> Self {
        Self {
            kind: Kind::NothingDelivered { epoch, failures },
            item: last,
            cause: None,
        }
    }

    /// The rule every front end's epoch ends by: an epoch that ran from its start
    /// (`whole`: not the rest of a resumed one, which may all fail), delivered nothing and had
    /// failures is [`nothing_delivered`](Self::nothing_delivered); anything else ended well.
    pub fn if_nothing_delivered(
        epoch: u64,
        whole: bool,
        delivered_any: bool,
        failures: u64,
        last: Option<ItemError>,
    ) -> Option<Self> {
        (whole && !delivered_any && failures > 0)
            .then(|| Self::nothing_delivered(epoch, failures, last))
    }

    /// The pipeline was stopped before the epoch ended.
    pub fn stopped() -> Self {
        Self::of(Kind::Stopped)
    }

    /// The runtime could not be started (threads, the control system).
    pub fn runtime(msg: impl Into<String>) -> Self {
        Self::of(Kind::Runtime(msg.into()))
    }

    /// The runtime could not be started while `context`, because of `cause`.
    pub fn runtime_from(context: impl Into<String>, cause: impl Into<BoxError>) -> Self {
        Self::of(Kind::Runtime(context.into())).with_cause(cause)
    }

    /// Whether the configuration was invalid.
    pub fn is_config(&self) -> bool {
        matches!(self.kind, Kind::Config(_))
    }

    /// Whether reading or writing something the pipeline needs failed (see [`io`](Self::io)).
    pub fn is_io(&self) -> bool {
        matches!(self.kind, Kind::Io(_))
    }

    /// Whether a failure budget (of a stage or of the pipeline) was exceeded.
    pub fn is_failure_budget(&self) -> bool {
        matches!(self.kind, Kind::FailureBudget { .. })
    }

    /// Whether an epoch delivered nothing because every item failed (see
    /// [`nothing_delivered`](Self::nothing_delivered)).
    pub fn is_nothing_delivered(&self) -> bool {
        matches!(self.kind, Kind::NothingDelivered { .. })
    }

    /// Whether the pipeline was stopped (by `stop()` or a drop) before the epoch ended.
    pub fn is_stopped(&self) -> bool {
        matches!(self.kind, Kind::Stopped)
    }

    /// The stage where the failure happened, if any.
    pub fn stage(&self) -> Option<&str> {
        self.item.as_ref().map(ItemError::stage)
    }

    /// The failed item's description, if any.
    pub fn item(&self) -> Option<&str> {
        self.item.as_ref().map(ItemError::item)
    }

    /// The item failure behind this error, if any.
    pub fn item_error(&self) -> Option<&ItemError> {
        self.item.as_ref()
    }
}

impl fmt::Debug for PipelineError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl fmt::Display for PipelineError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kind {
            Kind::Config(m) => write!(f, "invalid pipeline configuration: {m}")?,
            Kind::Io(m) => write!(f, "{m}")?,
            // A budget of no failure (fail-fast: Python's `skip_errors=False`) is no budget
            // to exceed: say that the first failure stopped it.
            Kind::FailureBudget { scope, failures } if *failures <= 1 => {
                write!(
                    f,
                    "{scope} stopped at its first failed item (fail-fast: no failure is skipped)"
                )?;
                if let Some(i) = &self.item {
                    write!(f, "; {i}")?;
                }
            }
            Kind::FailureBudget { scope, failures } => {
                write!(
                    f,
                    "{scope} exceeded its failure budget after {failures} failed items"
                )?;
                if let Some(i) = &self.item {
                    write!(f, "; last: {i}")?;
                }
            }
            Kind::NothingDelivered { epoch, failures } => {
                write!(
                    f,
                    "epoch {epoch} delivered nothing: every item failed ({failures} failed items)"
                )?;
                if let Some(i) = &self.item {
                    write!(f, "; last: {i}")?;
                }
            }
            Kind::Stopped => write!(f, "the pipeline was stopped before the epoch ended")?,
            Kind::Runtime(m) => write!(f, "pipeline runtime error: {m}")?,
        }
        // The cause is part of the message too: most reports print only the top error.
        if let Some(c) = &self.cause {
            write!(f, ": {c}")?;
        }
        Ok(())
    }
}

impl std::error::Error for PipelineError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match (&self.item, &self.cause) {
            (Some(e), _) => Some(e as _),
            (None, Some(c)) => Some(&**c as _),
            (None, None) => None,
        }
    }
}
