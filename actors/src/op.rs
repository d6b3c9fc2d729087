//! The work a stage does per item, as a trait the pool and async stages call.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use crate::error::{BoxError, Panicked};

/// How many bytes an item counts for in a budget.
pub type Sizer<T> = Arc<dyn Fn(&T) -> u64 + Send + Sync>;
/// A description of an item for error messages (called before the item is consumed).
pub type Describe<T> = Arc<dyn Fn(&T) -> String + Send + Sync>;

/// The default [`Sizer`]: the item's inline size. Items that own heap memory should be measured
/// with a sizer of their own.
pub fn inline_size<T>() -> Sizer<T> {
    Arc::new(|_| std::mem::size_of::<T>() as u64)
}

/// Synchronous per-item work producing zero, one or many outputs.
pub trait Op<I, O>: Send + Sync + 'static {
    /// Processes `input`, appending its outputs to `out`.
    fn call(&self, input: I, out: &mut Vec<O>) -> Result<(), BoxError>;
}

/// One output per input: `f(x)?`.
#[derive(Debug)]
pub struct Map<F>(pub F);

impl<I, O, E, F> Op<I, O> for Map<F>
where
    F: Fn(I) -> Result<O, E> + Send + Sync + 'static,
    E: Into<BoxError>,
{
    #[inline]
    fn call(&self, input: I, out: &mut Vec<O>) -> Result<(), BoxError> {
        out.push((self.0)(input).map_err(Into::into)?);
        Ok(())
    }
}

/// Zero or one output per input: `None` filters the item out.
#[derive(Debug)]
pub struct FilterMap<F>(pub F);

impl<I, O, E, F> Op<I, O> for FilterMap<F>
where
    F: Fn(I) -> Result<Option<O>, E> + Send + Sync + 'static,
    E: Into<BoxError>,
{
    #[inline]
    fn call(&self, input: I, out: &mut Vec<O>) -> Result<(), BoxError> {
        out.extend((self.0)(input).map_err(Into::into)?);
        Ok(())
    }
}

/// Every element of the input as its own output (the inverse of aggregation).
#[derive(Debug, Default)]
pub struct Flatten;

impl<I> Op<I, I::Item> for Flatten
where
    I: IntoIterator,
{
    #[inline]
    fn call(&self, input: I, out: &mut Vec<I::Item>) -> Result<(), BoxError> {
        out.extend(input);
        Ok(())
    }
}

/// Calls `op`, turning a panic into an error.
#[inline]
pub fn call_caught<I: 'static, O: 'static>(
    op: &dyn Op<I, O>,
    input: I,
    out: &mut Vec<O>,
) -> Result<(), BoxError> {
    match catch_unwind(AssertUnwindSafe(|| op.call(input, out))) {
        Ok(r) => r,
        Err(payload) => Err(Box::new(Panicked::from_payload(&*payload))),
    }
}
