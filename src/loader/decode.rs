//! How one item becomes its fields: the recipe (of the item's epoch, which seeds its
//! augmentation), its real length when the loader gives lengths, and a video's audio track.

use crate::dataset::Input;
use crate::media::{MediaError, Recipe};
use crate::tensor::Tensor;

/// Decodes items into their fields.
#[derive(Clone, Debug)]
pub(crate) struct Decoder {
    pub(crate) recipe: Recipe,
    /// A second field: each item's real length (`i64`, shape `[]`).
    pub(crate) lengths: bool,
    /// A video recipe's audio track, decoded from the same file as a second field.
    #[cfg(all(feature = "video", feature = "audio"))]
    pub(crate) audio_track: Option<crate::media::audio::AudioRecipe>,
    /// Fields of the dataset decoded as media, each a tensor after the others.
    pub(crate) media_fields: Vec<super::media_fields::MediaField>,
}

impl Decoder {
    /// The names of the tensors an item's fields become, in order (`length_batches`: the
    /// loader plans length-aware batches, which always give the lengths).
    pub(crate) fn tensor_names(&self, length_batches: bool) -> Vec<String> {
        let mut names = vec![self.recipe.kind_name().to_owned()];
        if self.lengths || length_batches {
            names.push("lengths".to_owned());
        }
        #[cfg(all(feature = "video", feature = "audio"))]
        if self.audio_track.is_some() {
            names.push("audio".to_owned());
        }
        names.extend(self.media_fields.iter().map(|f| f.name.clone()));
        names
    }

    /// The fields of `input` in `epoch`.
    pub(crate) fn fields(&self, input: Input, epoch: u64) -> Result<Vec<Tensor>, MediaError> {
        let recipe = self.recipe.for_epoch(epoch);
        if self.lengths {
            let (t, len) = recipe.load_with_length(input)?;
            return Ok(vec![t, length_tensor(len)]);
        }
        #[cfg(all(feature = "video", feature = "audio"))]
        if let Some(audio) = &self.audio_track {
            return Ok(match input {
                Input::Path(p) => vec![recipe.load(&p)?, audio.load(&p)?],
                Input::Bytes(b) => {
                    let (path, bytes) = (b.path.clone(), b.bytes.clone());
                    vec![recipe.decode(b)?, audio.decode(bytes, &path)?]
                }
            });
        }
        Ok(vec![match input {
            Input::Path(p) => recipe.load(&p)?,
            Input::Bytes(b) => recipe.decode(b)?,
        }])
    }

    /// One clip of a length-aware batch and its real length.
    pub(crate) fn clip(&self, input: Input, epoch: u64) -> Result<(Tensor, usize), MediaError> {
        self.recipe.for_epoch(epoch).clip_with_length(input)
    }
}

/// A length as a scalar `i64` tensor.
fn length_tensor(len: usize) -> Tensor {
    let len = i64::try_from(len).unwrap_or(i64::MAX);
    Tensor::from_i64(&[len]).reshaped(&[])
}
