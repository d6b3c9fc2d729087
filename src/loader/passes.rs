//! [`Passes`]: the one epoch machine of every loader — the library's [`Loader`](super::Loader)
//! (Rust, pipeline files, the Python media loaders) and the Python package's map-style and
//! iterable pipelines (`flowgate.DataLoader`, `flowgate.Pipeline`). It holds positions only:
//! where the pass being iterated started, where one left before its end stopped (the
//! checkpoint), which epoch a rebuilt pipeline starts at, and the results a pass delivered;
//! its owner holds the pipeline and tells it what happened.
//!
//! A *pass* is one iteration (an `iter()`, a [`Loader::epoch`](super::Loader::epoch)); it
//! reads an epoch from where it starts to its end, unless it is left before (a `break`, a
//! dropped iterator, a peek at one result, `close`). What the next pass starts is the
//! [`PassRule`], the one setting in which routes differ:
//!
//! | after a pass left before its epoch's end | [`AfterLeft::Again`] | [`AfterLeft::Anew`] |
//! |---|---|---|
//! | the next pass reads | that epoch again, from where it started | the next epoch |
//! | its checkpoint ([`checkpoint`](Passes::checkpoint)) | what the consumer received | the same |
//! | as in PyTorch | `DistributedSampler` until `set_epoch` | `RandomSampler`: each `iter()` draws anew |
//!
//! A pass that took at most one result of an epoch resumed from a checkpoint starts that
//! resumed position again under either rule (its rest is not skipped for a peek). After a pass
//! that reached its epoch's end, took every result of it (a loop that stops without asking for
//! the end: `zip(range(len(loader)), loader)`), or that an error ended, the next pass reads the
//! next epoch.
//! [`set_epoch`](Passes::set_epoch) names the next epoch; during a pass it abandons the pass
//! ([`PassRule::LOADER`]) or, as torch's sampler, takes effect at the next `iter()`
//! ([`PassRule::torch`]). Which route uses which rule is in `docs/settings.md`.

use crate::engine::checkpoint::PipelineState;

/// What the next pass reads after one left before its epoch's end; see the [module
/// docs](self).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AfterLeft {
    /// That epoch again, from where the pass started, until `set_epoch` names another.
    Again,
    /// The next epoch.
    Anew,
}

/// How a loader's passes follow one another; see the [module docs](self).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PassRule {
    /// What the next pass reads after one left before its epoch's end.
    pub after_left: AfterLeft,
    /// `set_epoch` during a pass names the epoch of the next pass and lets this one go on
    /// (`true`, torch's: the iterator already holds its order), or abandons it (`false`).
    pub set_epoch_waits: bool,
}

impl PassRule {
    /// The library's loaders: an epoch left mid-way is read again from where it started
    /// (every rank keeps one shuffle, a peek costs no epoch); `set_epoch` during a pass
    /// abandons it.
    pub const LOADER: Self = Self {
        after_left: AfterLeft::Again,
        set_epoch_waits: false,
    };

    /// `torch.utils.data.DataLoader`'s, for a loader over a map-style dataset or an iterable
    /// read by `world` ranks: in one process each pass is a new epoch (its `RandomSampler`
    /// draws a new order at every `iter()`); under several ranks an epoch left mid-way is read
    /// again (`DistributedSampler` gives the same order until `set_epoch`), so a rank that
    /// peeks, or breaks to log a batch, keeps the others' epoch. `set_epoch` during a pass
    /// names the next one.
    pub fn torch(world: usize) -> Self {
        Self {
            after_left: match world {
                0 | 1 => AfterLeft::Anew,
                _ => AfterLeft::Again,
            },
            set_epoch_waits: true,
        }
    }
}

/// What [`Passes::set_epoch`] asks of its owner.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[must_use]
pub enum SetEpoch {
    /// Nothing: the epoch already comes next (a resumed position, or an abandoned epoch's
    /// start, is kept), or it waits for the pass being iterated to end.
    Kept,
    /// Stop the pipeline (abandoning a pass being iterated), then call
    /// [`Passes::set_next`] with the epoch.
    Restart,
}

/// A loader's passes over its epochs; see the [module docs](self).
#[derive(Clone, Debug)]
pub struct Passes {
    rule: PassRule,
    /// Whether a pass is being iterated.
    in_epoch: bool,
    /// The epoch a rebuilt pipeline starts at: the one after an epoch an error ended, or the
    /// one `set_epoch` named.
    resume_at: u64,
    /// Where the pass being iterated started; once it is left before its end under
    /// [`AfterLeft::Again`] (or a resumed state is stopped before its pass), where the next
    /// pass starts. `None` once an epoch ended (its end, or an error).
    began: Option<PipelineState>,
    /// The progress of a pass left before its end (or of a resumed state not iterated), until
    /// another pass starts: what a checkpoint taken now records.
    left: Option<PipelineState>,
    /// Results the pass being iterated (or the last) delivered.
    taken: usize,
    /// The pipeline was positioned at a resumed state whose pass has not started.
    resumed: bool,
    /// The pass being iterated started at a resumed state.
    from_resume: bool,
    /// An epoch `set_epoch` named during a pass, for the next pass ([`PassRule`]'s
    /// `set_epoch_waits`).
    named: Option<u64>,
    /// Items of the epoch being iterated delivered before its pass started (a resumed
    /// position, every rank's of a merged state).
    delivered_before: u64,
    /// Results the pass makes from where it started with nothing skipped.
    due: usize,
}

impl Passes {
    /// Before the first pass, under `rule`.
    pub fn new(rule: PassRule) -> Self {
        Self {
            rule,
            in_epoch: false,
            resume_at: 0,
            began: None,
            left: None,
            taken: 0,
            resumed: false,
            from_resume: false,
            named: None,
            delivered_before: 0,
            due: 0,
        }
    }

    /// How its passes follow one another.
    pub fn rule(&self) -> PassRule {
        self.rule
    }

    /// Whether a pass is being iterated.
    pub fn in_epoch(&self) -> bool {
        self.in_epoch
    }

    /// Results the pass being iterated (or the last) delivered.
    pub fn taken(&self) -> usize {
        self.taken
    }

    /// The pass delivered a result.
    pub fn took(&mut self) {
        self.taken += 1;
    }

    /// A result counted by [`took`](Self::took) was not the consumer's after all.
    pub fn took_back(&mut self) {
        self.taken = self.taken.saturating_sub(1);
    }

    /// Results the pass makes from where it started with nothing skipped (its owner's count,
    /// given to [`started`](Self::started)).
    pub fn due(&self) -> usize {
        self.due
    }

    /// The epoch a pipeline built now starts at (unless a state is resumed).
    pub fn resume_at(&self) -> u64 {
        self.resume_at
    }

    /// Whether the pipeline stands at a resumed state whose pass has not started.
    pub fn resumed(&self) -> bool {
        self.resumed
    }

    /// Whether nothing of the epoch being iterated was delivered before its pass (it did not
    /// start at a resumed position): such an epoch that ends without a result failed.
    pub fn whole(&self) -> bool {
        self.delivered_before == 0
    }

    /// The checkpoint of a pass left before its end (or of a resumed state not iterated yet),
    /// while no pass runs: what the consumer received. `None` otherwise (the owner's pipeline
    /// then says where it stands).
    pub fn checkpoint(&self) -> Option<&PipelineState> {
        self.left.as_ref().filter(|_| !self.in_epoch)
    }

    /// The epoch a pass left before its end that the next pass starts again, with the results
    /// it had delivered: `None` while a pass runs, after an epoch's end or error, after
    /// `set_epoch` named another epoch, and under [`AfterLeft::Anew`] (but for a peek at a
    /// resumed epoch). A front end warns with it when a loop that delivered more than a peek's
    /// one result is about to read the same results again.
    pub fn abandoned_epoch(&self) -> Option<(u64, usize)> {
        match (&self.began, self.in_epoch, self.named) {
            (Some(s), false, None) => Some((s.epoch, self.taken)),
            _ => None,
        }
    }

    /// Where the next pass starts again (an abandoned epoch's start, a resumed state stopped
    /// before its pass), if it does.
    pub fn restart_from(&self) -> Option<&PipelineState> {
        self.began
            .as_ref()
            .filter(|_| !self.in_epoch && self.named.is_none())
    }

    /// The epoch the next pass reads, given the epoch the owner's pipeline stands at (`None`
    /// without one).
    pub fn next_epoch(&self, pipeline_epoch: Option<u64>) -> u64 {
        if let Some(e) = self.named {
            return e;
        }
        if let Some((epoch, _)) = self.abandoned_epoch() {
            return epoch;
        }
        let here = pipeline_epoch.unwrap_or(self.resume_at);
        match self.in_epoch {
            // A pass left now starts this epoch again, or the next; one read to its end, the
            // next.
            true if self.again() => here,
            true => here + 1,
            false => here,
        }
    }

    /// Whether the pass being iterated, left now, is started again where it started.
    fn again(&self) -> bool {
        self.rule.after_left == AfterLeft::Again || (self.from_resume && self.taken <= 1)
    }

    /// Makes `epoch` the next one read (as PyTorch's `DistributedSampler.set_epoch`), given
    /// the epoch the owner's pipeline stands at; see [`SetEpoch`]. A no-op when it already
    /// comes next (a resumed position, or an abandoned epoch's start, is kept).
    pub fn set_epoch(&mut self, epoch: u64, pipeline_epoch: Option<u64>) -> SetEpoch {
        if self.in_epoch && self.rule.set_epoch_waits {
            // The pass goes on; the next reads `epoch` (none named when it is what comes next
            // anyway: a peek of an epoch read by ranks keeps its position).
            self.named = None;
            if self.next_epoch(pipeline_epoch) != epoch {
                self.named = Some(epoch);
            }
            return SetEpoch::Kept;
        }
        if !self.in_epoch && self.next_epoch(pipeline_epoch) == epoch {
            // An abandoned epoch's progress is no longer what comes next.
            if self.left.as_ref().is_some_and(|s| s.epoch != epoch) {
                self.left = None;
            }
            // An abandoned epoch named again is started again by choice: nothing to warn of.
            if self.abandoned_epoch().is_some() {
                self.taken = 0;
            }
            return SetEpoch::Kept;
        }
        SetEpoch::Restart
    }

    /// After [`SetEpoch::Restart`] (the owner stopped its pipeline), or where an epoch of the
    /// owner's ended elsewhere: `epoch` is the next one read, from its start.
    pub fn set_next(&mut self, epoch: u64) {
        self.left = None;
        self.began = None;
        self.named = None;
        self.resumed = false;
        self.resume_at = epoch;
    }

    /// At the start of a pass (after the owner stopped a pipeline still in a pass): the epoch
    /// a `set_epoch` during the last pass named, if any. The owner stops its pipeline and
    /// calls [`set_next`](Self::set_next) with it.
    pub fn take_named(&mut self) -> Option<u64> {
        self.named.take()
    }

    /// At the start of a pass: the state it starts again from (an abandoned epoch's start, a
    /// resumed state stopped before its pass), which the owner resumes; `None` when the
    /// pipeline stands where the pass starts.
    pub fn take_restart(&mut self) -> Option<PipelineState> {
        match self.in_epoch {
            true => None,
            false => self.began.take(),
        }
    }

    /// The owner's pipeline was positioned at a resumed state (a checkpoint loaded, or an
    /// abandoned epoch started again): its pass starts there.
    pub fn resumed_at(&mut self) {
        self.in_epoch = false;
        self.began = None;
        self.left = None;
        self.named = None;
        self.resume_at = 0; // the state says where to start
        self.taken = 0;
        self.resumed = true;
    }

    /// A pass starts at `start` (where the owner's pipeline stands), owing `due` results with
    /// nothing skipped.
    pub fn started(&mut self, start: PipelineState, due: usize) {
        // An epoch resumed after some of it was delivered (here, or by any rank of a merged
        // state: its base) has delivered something, whatever the rest does.
        self.delivered_before = start.delivered_items
            + start
                .shard
                .as_ref()
                .map_or(0, |s| s.base.iter().map(|(a, b)| b - a).sum::<u64>());
        self.from_resume = self.resumed;
        self.began = Some(start);
        self.in_epoch = true;
        self.resumed = false;
        self.taken = 0;
        self.left = None;
        self.due = due;
    }

    /// The pass reached its epoch's end: the next pass reads the next epoch (or the one
    /// `set_epoch` named).
    pub fn ended(&mut self) {
        self.in_epoch = false;
        self.began = None;
    }

    /// The owner stopped its pipeline (a `close`, a pass left, an error: `over`), which stood
    /// at `epoch` (`None`: there was none) with `progress` (its checkpoint: given for a pass
    /// being iterated, or a resumed state not iterated yet).
    pub fn stopped(&mut self, progress: Option<PipelineState>, epoch: Option<u64>, over: bool) {
        let mut next = 0;
        let mut epoch = epoch;
        // A pass that took every result of its epoch and stopped before asking for the end
        // (`zip(range(len(loader)), loader)`) read its epoch through: ended, as its checkpoint
        // says (it was read again, every item twice, while a resume read the next epoch).
        if let (true, Some(p)) = (self.in_epoch, progress.as_ref().filter(|p| read_through(p))) {
            epoch = Some(p.epoch);
            self.began = None;
            self.left = None;
            self.in_epoch = false;
            next = 1;
        }
        if self.in_epoch {
            if over {
                // Over: the next pass reads the next epoch.
                self.began = None;
                self.left = None;
                next = 1;
            } else {
                self.left = progress.or(self.left.take());
                if !self.again() {
                    self.began = None;
                    next = 1;
                }
            }
        } else if let (true, Some(p)) = (self.resumed, progress) {
            // A resumed state not iterated yet: the next pass starts there, and it is the
            // checkpoint.
            self.left = Some(p.clone());
            self.began = Some(p);
            self.taken = 0;
        }
        if let Some(e) = epoch {
            self.resume_at = e + next;
        }
        self.in_epoch = false;
        self.resumed = false;
    }

    /// In a process forked from the one whose pipeline stood at `epoch` (its threads are not
    /// here): the next pass reads that epoch from its start (the one the parent was in, or
    /// the next between epochs), or the one `set_epoch` named.
    pub fn forked(&mut self, epoch: u64) {
        self.in_epoch = false;
        self.began = None;
        self.left = None;
        self.resumed = false;
        self.resume_at = epoch;
    }
}

/// Whether `s` has every position of its epoch delivered, and no batch owed: the epoch was
/// read through. (A state without a share, an iterable's, never says so.)
fn read_through(s: &PipelineState) -> bool {
    let Some(shard) = &s.shard else {
        return false;
    };
    s.delivered_items >= shard.layout().len() as u64
        && s.partial.is_empty()
        && s.owed_batches.unwrap_or(0) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(epoch: u64, delivered: u64) -> PipelineState {
        PipelineState {
            epoch,
            delivered_items: delivered,
            ..PipelineState::default()
        }
    }

    /// A pass of epoch `e` from its start that takes `n` results.
    fn pass(p: &mut Passes, e: u64, n: usize) {
        assert!(p.take_restart().is_none());
        p.started(at(e, 0), 10);
        for _ in 0..n {
            p.took();
        }
    }

    #[test]
    fn a_pass_left_is_read_again_under_again_and_the_next_epoch_under_anew() {
        for (rule, next) in [(PassRule::LOADER, 2), (PassRule::torch(1), 3)] {
            let mut p = Passes::new(rule);
            p.set_next(2);
            pass(&mut p, 2, 3);
            p.stopped(Some(at(2, 12)), Some(2), false);
            // The checkpoint is what the consumer received, under either rule.
            assert_eq!(p.checkpoint().map(|s| s.delivered_items), Some(12));
            assert_eq!(p.next_epoch(None), next);
            let again = p.take_restart();
            assert_eq!(again.is_some(), next == 2, "{rule:?}");
            assert_eq!(p.resume_at(), if next == 2 { 2 } else { 3 });
        }
    }

    #[test]
    fn ranks_read_a_left_epoch_again_one_process_moves_on() {
        assert_eq!(PassRule::torch(2).after_left, AfterLeft::Again);
        assert_eq!(PassRule::torch(1).after_left, AfterLeft::Anew);
        assert!(PassRule::torch(4).set_epoch_waits && !PassRule::LOADER.set_epoch_waits);
    }

    #[test]
    fn a_peek_at_a_resumed_epoch_starts_it_again_under_either_rule() {
        for (taken, again) in [(0, true), (1, true), (2, false)] {
            let mut p = Passes::new(PassRule::torch(1));
            p.resumed_at();
            p.started(at(5, 40), 6);
            assert!(!p.whole());
            for _ in 0..taken {
                p.took();
            }
            p.stopped(Some(at(5, 40 + 8 * taken as u64)), Some(5), false);
            assert_eq!(
                p.take_restart().map(|s| s.delivered_items),
                again.then_some(40)
            );
            assert_eq!(p.resume_at(), if again { 5 } else { 6 }, "{taken}");
        }
    }

    #[test]
    fn an_error_or_an_end_moves_on_and_forgets_the_pass() {
        let mut p = Passes::new(PassRule::LOADER);
        pass(&mut p, 0, 2);
        p.stopped(Some(at(0, 8)), Some(0), true);
        assert!(p.checkpoint().is_none() && p.take_restart().is_none());
        assert_eq!((p.resume_at(), p.next_epoch(None)), (1, 1));
        pass(&mut p, 1, 4);
        p.ended();
        assert!(p.abandoned_epoch().is_none() && p.take_restart().is_none());
        assert_eq!(p.next_epoch(Some(2)), 2);
    }

    #[test]
    fn set_epoch_during_a_pass_abandons_it_or_waits_for_the_next() {
        let mut p = Passes::new(PassRule::LOADER);
        pass(&mut p, 0, 1);
        assert_eq!(p.set_epoch(7, Some(0)), SetEpoch::Restart);
        let mut t = Passes::new(PassRule::torch(1));
        pass(&mut t, 0, 1);
        assert_eq!(t.set_epoch(7, Some(0)), SetEpoch::Kept);
        assert!(t.in_epoch(), "the pass goes on");
        assert_eq!(t.next_epoch(Some(0)), 7);
        // Named back to what comes next anyway: nothing named.
        assert_eq!(t.set_epoch(1, Some(0)), SetEpoch::Kept);
        assert_eq!(t.take_named(), None);
        assert_eq!(t.set_epoch(9, Some(0)), SetEpoch::Kept);
        t.ended();
        assert_eq!(t.take_named(), Some(9));
    }

    #[test]
    fn set_epoch_of_what_comes_next_keeps_a_resumed_position() {
        let mut p = Passes::new(PassRule::LOADER);
        p.resumed_at();
        assert_eq!(p.set_epoch(4, Some(4)), SetEpoch::Kept);
        assert!(p.resumed());
        assert_eq!(p.set_epoch(5, Some(4)), SetEpoch::Restart);
    }

    #[test]
    fn a_resumed_state_stopped_before_its_pass_is_kept() {
        let mut p = Passes::new(PassRule::torch(1));
        p.resumed_at();
        p.stopped(Some(at(3, 9)), Some(3), false);
        assert_eq!(
            p.checkpoint().map(|s| (s.epoch, s.delivered_items)),
            Some((3, 9))
        );
        assert_eq!(p.next_epoch(None), 3);
        assert_eq!(p.take_restart().map(|s| s.delivered_items), Some(9));
    }

    #[test]
    fn set_epoch_of_an_abandoned_epoch_forgets_its_results_and_another_its_checkpoint() {
        let mut p = Passes::new(PassRule::LOADER);
        p.set_next(3);
        pass(&mut p, 3, 5);
        p.stopped(Some(at(3, 20)), Some(3), false);
        assert_eq!(p.abandoned_epoch(), Some((3, 5)));
        assert_eq!(p.set_epoch(3, None), SetEpoch::Kept);
        assert_eq!(p.abandoned_epoch(), Some((3, 0)));
        assert_eq!(p.set_epoch(4, None), SetEpoch::Restart);
        p.set_next(4);
        assert!(p.checkpoint().is_none() && p.abandoned_epoch().is_none());
        assert_eq!(p.next_epoch(None), 4);
    }

    #[test]
    fn a_forked_child_reads_the_epoch_its_parent_stood_at() {
        let mut p = Passes::new(PassRule::torch(1));
        pass(&mut p, 2, 1);
        p.forked(2);
        assert!(!p.in_epoch() && p.take_restart().is_none());
        assert_eq!(p.next_epoch(None), 2);
    }
}
