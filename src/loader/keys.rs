//! [`BatchKeys`]: the one rule for the names a batch is read by. A batch's tensors (the media,
//! `lengths`, a video's `audio`, the media fields), its labels (`label`, where the dataset has
//! labels) and its fields share one namespace: Python hands a batch over as a dict, a
//! per-batch function gets and returns one, and [`Batch::tensor`](super::Batch::tensor) and
//! [`Batch::field`](super::Batch::field) look names up. So the loader (for every front end),
//! a pipeline file's check and a per-batch function's output are held to this rule, in these
//! words; a front end adds its own keys ([`BatchKeys::reserve`]: Python's `path`, a function
//! dict's `index` and `epoch`).

/// The keys a batch already has; see the [module docs](self).
#[derive(Clone, Debug, Default)]
pub struct BatchKeys {
    /// The tensors', the labels' where the dataset has them, then a front end's own.
    taken: Vec<String>,
}

impl BatchKeys {
    /// A batch of the tensors `tensors` (in their order: [`LoaderBuilder::tensor_names`]),
    /// with `label` taken where the dataset has labels (`labels`).
    ///
    /// [`LoaderBuilder::tensor_names`]: super::LoaderBuilder::tensor_names
    pub fn new(tensors: impl IntoIterator<Item = impl Into<String>>, labels: bool) -> Self {
        let mut taken: Vec<String> = tensors.into_iter().map(Into::into).collect();
        if labels {
            taken.push("label".into());
        }
        Self { taken }
    }

    /// Adds a front end's own keys (Python's `path` with `return_paths`; a per-item or
    /// per-batch function's dict, its `index` and `epoch`).
    pub fn reserve(mut self, keys: impl IntoIterator<Item = impl Into<String>>) -> Self {
        self.taken.extend(keys.into_iter().map(Into::into));
        self
    }

    /// The first problem with the keys taken themselves (a tensor named empty, or as another
    /// key), then with `fields` (the batch's fields besides its tensors: named empty, as a
    /// key taken, or twice): `"NAME" is ...`, for the caller to name where the name came from
    /// (`fields: `, the per-batch function's output).
    pub fn check(&self, fields: &[impl AsRef<str>]) -> Result<(), String> {
        let mut seen: Vec<&str> = Vec::with_capacity(self.taken.len() + fields.len());
        let names = self
            .taken
            .iter()
            .map(String::as_str)
            .chain(fields.iter().map(AsRef::as_ref));
        for name in names {
            if name.is_empty() {
                return Err("\"\" is empty: a key of a batch needs a name".into());
            }
            if seen.contains(&name) {
                return Err(format!(
                    "{name:?} is a key the batch already has (its keys: {})",
                    quoted(&seen)
                ));
            }
            seen.push(name);
        }
        Ok(())
    }
}

/// `"a", "b"`.
fn quoted(names: &[&str]) -> String {
    names
        .iter()
        .map(|n| format!("{n:?}"))
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    const NONE: [&str; 0] = [];

    #[test]
    fn a_field_may_not_take_a_key_the_batch_has() {
        let keys = BatchKeys::new(["image", "lengths"], true);
        for taken in ["image", "lengths", "label"] {
            let e = keys.check(&["caption", taken]).unwrap_err();
            assert_eq!(
                e,
                format!(
                    "{taken:?} is a key the batch already has (its keys: \"image\", \
                     \"lengths\", \"label\", \"caption\")"
                )
            );
        }
        assert!(keys.check(&["caption", "meta"]).is_ok());
        let twice = keys.check(&["caption", "caption"]).unwrap_err();
        assert!(twice.starts_with("\"caption\" is a key"), "{twice}");
        assert!(keys.check(&[""]).unwrap_err().contains("empty"));
    }

    #[test]
    fn label_is_taken_only_where_the_dataset_has_labels() {
        // Without labels, a field may be the label (a shard's `.cls` read as a field).
        assert!(BatchKeys::new(["image"], false).check(&["label"]).is_ok());
        assert!(BatchKeys::new(["image"], true).check(&["label"]).is_err());
        // A media field named `label` is a tensor: the same rule.
        assert!(BatchKeys::new(["image", "label"], false)
            .check(&NONE)
            .is_ok());
        assert!(BatchKeys::new(["image", "label"], true)
            .check(&NONE)
            .is_err());
    }

    #[test]
    fn a_front_ends_own_keys_and_tensors_named_twice() {
        let keys = BatchKeys::new(["audio"], false).reserve(["path", "index", "epoch"]);
        for own in ["path", "index", "epoch"] {
            assert!(keys.check(&[own]).is_err(), "{own}");
        }
        assert!(BatchKeys::new(["image"], false).check(&["path"]).is_ok());
        let e = BatchKeys::new(["video", "audio", "audio"], false)
            .check(&NONE)
            .unwrap_err();
        assert!(
            e.starts_with("\"audio\" is a key the batch already has"),
            "{e}"
        );
    }
}
