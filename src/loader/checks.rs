//! What a [`LoaderBuilder`]'s settings must hold before a loader is built, beyond each
//! number's range: what units cannot carry, media fields found among the dataset's fields,
//! the batch's keys ([`BatchKeys`]), and the memory and device budgets against a batch the
//! recipe bounds (the stages' floors, which the pipeline then reserves).

use flowgate_actors::error::PipelineError;

use super::builder::LoaderBuilder;
use super::keys::BatchKeys;
use super::Plan;

impl LoaderBuilder {
    /// Why this loader's epochs cannot be cut into units decoded elsewhere, if they cannot:
    /// a unit carries the media and labels of its batches, which the planning loader regroups
    /// into its own, in host memory.
    pub(super) fn units_refusal(&self) -> Option<&'static str> {
        Some(if !self.dataset.extra_fields().is_empty() {
            "remote decoding: units decoded elsewhere carry the media and labels, not a sample's other fields \
             (fields): read them where the loader is iterated"
        } else if self.map.is_some() {
            "remote decoding: a per-item function (map) runs where items are decoded, and units decoded \
             elsewhere are regrouped into batches where the loader is iterated: map the \
             batches there"
        } else if self.map_batches.is_some() {
            "remote decoding: units decoded elsewhere are regrouped into batches where the loader is iterated: \
             run the per-batch function (map_batch) there"
        } else if self.device.is_some() {
            "remote decoding: units decoded elsewhere arrive in host memory: build the loader for the cpu and \
             move its batches to the device"
        } else {
            return None;
        })
    }

    /// Finds each media field among the dataset's fields: a required bytes field; not with
    /// length-aware batches. (Its name against the batch's other keys: `check_keys`.)
    pub(super) fn place_media_fields(&mut self) -> Result<(), PipelineError> {
        if self.decoder.media_fields.is_empty() {
            return Ok(());
        }
        if self.lengths.is_some() {
            return Err(PipelineError::config(
                "media fields are not for length-aware batches (a batch is planned by its \
                 media's lengths alone)",
            ));
        }
        let specs = self.dataset.extra_fields();
        for f in &mut self.decoder.media_fields {
            let Some(at) = specs.iter().position(|s| s.name == f.name) else {
                return Err(PipelineError::config(format!(
                    "media field {:?}: the dataset reads no field of that name (its fields: \
                     {:?})",
                    f.name,
                    specs.iter().map(|s| &s.name).collect::<Vec<_>>()
                )));
            };
            let s = &specs[at];
            if s.kind != crate::dataset::FieldKind::Bytes || s.optional {
                return Err(PipelineError::config(format!(
                    "media field {:?}: the dataset's field must be required bytes, not {:?}{}",
                    f.name,
                    s.kind,
                    if s.optional { " (optional)" } else { "" }
                )));
            }
            f.at = at;
        }
        Ok(())
    }

    /// Refuses, where the recipe bounds a batch ([`batch_bound`](Self::batch_bound)), a
    /// device budget that cannot hold one, and a memory budget that cannot hold what the
    /// stages hold whatever their byte budgets ([`stage_floors`](super::builder::stage_floors)).
    pub(super) fn check_floor(&self, plan: &Plan) -> Result<(), PipelineError> {
        let Some(batch) = self.batch_bound(plan) else {
            return Ok(());
        };
        let mib = |b: u64| format!("{:.1} MiB", flowgate_actors::limits::bytes_to_mib(b));
        // The device's budget lets one batch through whatever its size (or no batch would
        // ever reach the loop): one that cannot hold a batch cannot be kept.
        if let Some(device) = self.device.as_ref().filter(|d| d.device_limit() < batch.0) {
            return Err(PipelineError::config(format!(
                "a device budget of {} cannot hold one batch of {} bytes ({}): raise it \
                 (device_memory_mb; a pipeline file's device.memory_mb) above that, or make \
                 batches smaller",
                mib(device.device_limit()),
                batch.0,
                mib(batch.0)
            )));
        }
        let Some(budget) = self.memory_limit() else {
            return Ok(());
        };
        let needed = self.floor(batch, self.decoding());
        let memory = budget.bytes;
        // The stages' floors are admitted whatever the byte budgets say (or a budget could
        // keep a batch from ever filling): a budget that cannot hold them cannot be kept.
        if needed <= memory {
            return Ok(());
        }
        Err(PipelineError::config(format!(
            "a memory budget of {} cannot hold a batch in flight: a batch of {} bytes ({}) is \
             held as its items while it is assembled, in the collate stage's hand and waiting \
             for it, and ready for the loop, beside an item per decode worker ({} at once); \
             raise the budget above that, or make batches or items smaller (the budget was {})",
            mib(memory),
            batch.0,
            mib(batch.0),
            mib(needed),
            budget.source,
        )))
    }

    /// A batch's bytes at most and the pipeline items it is made of, where the recipe bounds
    /// them: its items' bytes times the batch size, or for length-aware batches (an item of
    /// the pipeline is a whole batch) the cap's units of padded media with the clips' lengths
    /// and labels beside.
    pub(super) fn batch_bound(&self, plan: &Plan) -> Option<(u64, usize)> {
        match (plan, self.lengths) {
            (Plan::Batches(p), Some(cap)) => {
                let media = (cap.cap * self.decoder.recipe.unit_bytes()? as f64).ceil() as u64;
                Some((media + 16 * p.most_clips() as u64, 1))
            }
            _ => Some((self.batch_bytes()?, self.batch_size)),
        }
    }

    /// What the stages hold whatever their byte budgets for batches of `batch`
    /// ([`batch_bound`](Self::batch_bound)) and `decoding` decode workers.
    pub(super) fn floor(&self, batch: (u64, usize), decoding: usize) -> u64 {
        super::builder::stage_floors(batch.0, batch.1, decoding, &self.function_stages())
    }

    /// The batch's keys by the one rule ([`BatchKeys`]): its tensors (media fields included),
    /// `label` where the dataset has labels, its fields, then those a per-item function adds.
    pub(super) fn check_keys(&self) -> Result<(), PipelineError> {
        let media: Vec<&str> = self
            .decoder
            .media_fields
            .iter()
            .map(|f| f.name.as_str())
            .collect();
        let fields: Vec<&str> = (self.dataset.extra_fields().iter())
            .map(|f| f.name.as_str())
            .filter(|n| !media.contains(n))
            .collect();
        let keys = BatchKeys::new(self.tensor_names(), self.dataset.has_labels());
        keys.check(&fields)
            .map_err(|e| PipelineError::config(format!("fields: {e}")))?;
        let added = fields
            .iter()
            .copied()
            .chain(self.map_fields.iter().map(String::as_str));
        keys.check(&added.collect::<Vec<_>>())
            .map_err(|e| PipelineError::config(format!("map_fields: {e}")))
    }
}
