//! [`Recipe`]: how items of one modality become tensors, checked once, seeded by one rule.
//!
//! Every path that decodes media — the Rust API, pipeline files (`flowgate::spec`) and the
//! Python loaders — builds a [`Recipe`] from a modality's recipe ([`ImageRecipe`],
//! [`AudioRecipe`], [`VideoRecipe`]). Building it validates the geometry, once, with the rules
//! below (the pipeline-file checker uses the same rules, to name the offending key and line);
//! the per-item path does not check again.
//!
//! # Seeding
//!
//! Random augmentation (image crops and flips, audio windows) of an item in an epoch draws
//! from one generator, seeded by [`item_seed`](super::item_seed)`(seed, epoch, path)`:
//! `seed × 0x9E3779B97F4A7C15 ⊕ epoch ⊕ fnv1a(path)`. So the same seed, epoch and file give
//! the same augmentation whichever thread decodes it and in whatever order (an exact resume
//! redraws what the interrupted run would have), and every epoch draws anew. `seed` is the
//! user's (the Python loaders' `seed`, a pipeline file's `decode.seed`, a recipe's `seed`
//! field); the epoch is set by [`Recipe::for_epoch`].
//!
//! [`ImageRecipe`]: super::image::ImageRecipe
//! [`AudioRecipe`]: super::audio::AudioRecipe
//! [`VideoRecipe`]: super::video::VideoRecipe

use std::path::Path;
use std::sync::Arc;

use flowgate_actors::attached::ItemThreads;

#[cfg(any(feature = "image", feature = "audio", feature = "video"))]
use super::rules::RecipeError;
use crate::blob::Blob;
use crate::media::MediaError;
use crate::tensor::Tensor;

/// A validated decode recipe of any modality, and the seed of its augmentation.
///
/// ```
/// # #[cfg(feature = "image")] {
/// use flowgate::media::{image::ImageRecipe, Recipe};
///
/// let recipe = Recipe::image(ImageRecipe::train(224))?.with_seed(7);
/// let epoch_3 = recipe.for_epoch(3); // crops and flips of epoch 3
/// assert!(Recipe::image(ImageRecipe { crop: 300, ..ImageRecipe::default() }).is_err());
/// # }
/// # Ok::<(), flowgate::media::RecipeError>(())
/// ```
#[derive(Clone, Debug)]
pub struct Recipe {
    kind: Kind,
    /// Decoder threads per clip, set by the tuner (a video recipe with `threads: 0`).
    threads: Option<Arc<ItemThreads>>,
}

#[derive(Clone, Debug)]
enum Kind {
    #[cfg(feature = "image")]
    Image(crate::media::image::ImageRecipe),
    #[cfg(feature = "audio")]
    Audio(crate::media::audio::AudioRecipe),
    #[cfg(feature = "video")]
    Video(crate::media::video::VideoRecipe),
}

// A build with no decoder at all has no recipe kinds: every method is unreachable there.
#[cfg_attr(
    not(any(feature = "image", feature = "audio", feature = "video")),
    allow(unreachable_code, unused_variables)
)]
impl Recipe {
    /// An image recipe, validated.
    #[cfg(feature = "image")]
    pub fn image(r: crate::media::image::ImageRecipe) -> Result<Self, RecipeError> {
        r.validate()?;
        Ok(Self {
            kind: Kind::Image(r),
            threads: None,
        })
    }

    /// An audio recipe, validated.
    #[cfg(feature = "audio")]
    pub fn audio(r: crate::media::audio::AudioRecipe) -> Result<Self, RecipeError> {
        r.validate()?;
        Ok(Self {
            kind: Kind::Audio(r),
            threads: None,
        })
    }

    /// A video recipe, validated. With `threads: 0` its decoder threads per clip are a knob
    /// (see [`item_threads`](Self::item_threads)).
    #[cfg(feature = "video")]
    pub fn video(r: crate::media::video::VideoRecipe) -> Result<Self, RecipeError> {
        r.validate()?;
        let threads =
            (r.threads == 0).then(|| ItemThreads::tuned(flowgate_tuner::process_cores().min(16)));
        Ok(Self {
            kind: Kind::Video(r),
            threads,
        })
    }

    /// The knob of the decoder threads each item uses, when the recipe leaves them to the
    /// tuner (a video recipe with `threads: 0`): attach it to the stage that decodes with this
    /// recipe ([`PipelineBuilder::item_threads`](crate::PipelineBuilder::item_threads)), and
    /// the tuner gives each clip more threads where the stage's workers cannot grow. One
    /// thread per clip until then (and where nothing tunes it). Copies of the recipe
    /// ([`for_epoch`](Self::for_epoch), [`with_seed`](Self::with_seed)) share it.
    pub fn item_threads(&self) -> Option<Arc<ItemThreads>> {
        self.threads.clone()
    }

    /// The extensions of the files this recipe decodes (a dataset's default for directory
    /// walks and shard fields).
    pub fn extensions(&self) -> &'static [&'static str] {
        match &self.kind {
            #[cfg(feature = "image")]
            Kind::Image(_) => super::IMAGE_EXTENSIONS,
            #[cfg(feature = "audio")]
            Kind::Audio(_) => super::AUDIO_EXTENSIONS,
            #[cfg(feature = "video")]
            Kind::Video(_) => super::VIDEO_EXTENSIONS,
            #[allow(unreachable_patterns)]
            _ => &[],
        }
    }

    /// The image recipe, if this is one.
    #[cfg(feature = "image")]
    pub fn as_image(&self) -> Option<&crate::media::image::ImageRecipe> {
        match &self.kind {
            Kind::Image(i) => Some(i),
            #[allow(unreachable_patterns)]
            _ => None,
        }
    }

    /// The audio recipe, if this is one.
    #[cfg(feature = "audio")]
    pub fn as_audio(&self) -> Option<&crate::media::audio::AudioRecipe> {
        match &self.kind {
            Kind::Audio(a) => Some(a),
            #[allow(unreachable_patterns)]
            _ => None,
        }
    }

    /// The video recipe, if this is one.
    #[cfg(feature = "video")]
    pub fn as_video(&self) -> Option<&crate::media::video::VideoRecipe> {
        match &self.kind {
            Kind::Video(v) => Some(v),
            #[allow(unreachable_patterns)]
            _ => None,
        }
    }

    /// The same recipe with the user's augmentation seed `seed` (see the module docs).
    pub fn with_seed(self, seed: u64) -> Self {
        let kind = match self.kind {
            #[cfg(feature = "image")]
            Kind::Image(r) => Kind::Image(r.with_seed(seed)),
            #[cfg(feature = "audio")]
            Kind::Audio(r) => Kind::Audio(r.with_seed(seed)),
            #[cfg(feature = "video")]
            Kind::Video(r) => Kind::Video(r.with_seed(seed)),
        };
        Self {
            kind,
            threads: self.threads,
        }
    }

    /// The recipe of `epoch`: random crops, flips and windows are drawn anew every epoch (and
    /// the same for the same seed, epoch and file).
    pub fn for_epoch(&self, epoch: u64) -> Recipe {
        let kind = match &self.kind {
            #[cfg(feature = "image")]
            Kind::Image(r) => Kind::Image(r.for_epoch(epoch)),
            #[cfg(feature = "audio")]
            Kind::Audio(r) => Kind::Audio(r.for_epoch(epoch)),
            #[cfg(feature = "video")]
            Kind::Video(r) => Kind::Video(r.for_epoch(epoch)),
            #[allow(unreachable_patterns)]
            _ => unreachable!("a build without decoders has no recipes"),
        };
        Self {
            kind,
            threads: self.threads.clone(),
        }
    }

    /// The decoder threads of a video recipe's next clip: what the tuner set now, else the
    /// recipe's own.
    #[cfg(feature = "video")]
    fn video_threads(&self, r: &crate::media::video::VideoRecipe) -> usize {
        self.threads.as_ref().map_or(r.threads, |t| t.get())
    }

    /// Reads and decodes the file at `path`.
    pub fn load(&self, path: &Path) -> Result<Tensor, MediaError> {
        match &self.kind {
            #[cfg(feature = "image")]
            Kind::Image(r) => r.load_checked(path),
            #[cfg(feature = "audio")]
            Kind::Audio(r) => r.load(path),
            #[cfg(feature = "video")]
            Kind::Video(r) => r.load_threaded(path, self.video_threads(r)).map(|(t, _)| t),
            #[allow(unreachable_patterns)]
            _ => unreachable!("a build without decoders has no recipes"),
        }
    }

    /// Decodes the bytes of `blob` (a fetched object).
    pub fn decode(&self, blob: Blob) -> Result<Tensor, MediaError> {
        match &self.kind {
            #[cfg(feature = "image")]
            Kind::Image(r) => r.decode_checked(&blob.bytes, &blob.path),
            #[cfg(feature = "audio")]
            Kind::Audio(r) => r.decode(blob.bytes, &blob.path),
            #[cfg(feature = "video")]
            Kind::Video(r) => r
                .decode_threaded(&blob.bytes, &blob.path, self.video_threads(r))
                .map(|(t, _)| t),
            #[allow(unreachable_patterns)]
            _ => unreachable!("a build without decoders has no recipes"),
        }
    }

    /// Decodes `input` and gives its real length too (audio: samples before padding; video:
    /// frames taken): what length-aware batches pad by. An image recipe has no length
    /// (an error naming the file).
    pub fn load_with_length(
        &self,
        input: crate::blob::Input,
    ) -> Result<(Tensor, usize), MediaError> {
        use crate::blob::Input;
        match (&self.kind, input) {
            #[cfg(feature = "audio")]
            (Kind::Audio(r), Input::Path(p)) => r.load_with_length(&p),
            #[cfg(feature = "audio")]
            (Kind::Audio(r), Input::Bytes(b)) => r.decode_with_length(b.bytes, &b.path),
            #[cfg(feature = "video")]
            (Kind::Video(r), Input::Path(p)) => r.load_threaded(&p, self.video_threads(r)),
            #[cfg(feature = "video")]
            (Kind::Video(r), Input::Bytes(b)) => {
                r.decode_threaded(&b.bytes, &b.path, self.video_threads(r))
            }
            #[allow(unreachable_patterns)]
            (_, input) => Err(MediaError::Geometry {
                path: match input {
                    Input::Path(p) => p,
                    Input::Bytes(b) => b.path,
                },
                reason: "an image has no length to batch by (length-aware batches are for \
                         audio and video)"
                    .into(),
            }),
        }
    }

    /// [`load_with_length`](Self::load_with_length) for a batch padded to its longest clip:
    /// an audio clip comes unpadded (`[n]`: no zeros for the window's rest), a video's frames
    /// as taken.
    pub fn clip_with_length(
        &self,
        input: crate::blob::Input,
    ) -> Result<(Tensor, usize), MediaError> {
        match &self.kind {
            #[cfg(feature = "audio")]
            Kind::Audio(r) => r.clip_with_length(input),
            #[allow(unreachable_patterns)]
            _ => self.load_with_length(input),
        }
    }

    /// The length a file declares in its container, in the unit length-aware batches cap
    /// (audio: seconds; video: the frames this recipe takes from it); `None` when it
    /// declares none. An image recipe has no such unit (`None`).
    pub fn declared_length(&self, path: &Path) -> Result<Option<f64>, MediaError> {
        match &self.kind {
            #[cfg(feature = "audio")]
            Kind::Audio(_) => crate::media::audio::duration(path),
            #[cfg(feature = "video")]
            Kind::Video(r) => {
                Ok(crate::media::video::duration(path)?.map(|d| r.planned_frames(d) as f64))
            }
            #[allow(unreachable_patterns)]
            _ => {
                let _ = path;
                Ok(None)
            }
        }
    }

    /// [`declared_length`](Self::declared_length) of a file or of bytes in memory (a tar
    /// shard's member, a Parquet cell).
    pub fn declared_length_of(&self, input: crate::blob::Input) -> Result<Option<f64>, MediaError> {
        use crate::blob::Input;
        let b = match input {
            Input::Path(p) => return self.declared_length(&p),
            Input::Bytes(b) => b,
        };
        match &self.kind {
            #[cfg(feature = "audio")]
            Kind::Audio(_) => crate::media::audio::duration_of_bytes(b.bytes, &b.path),
            #[cfg(feature = "video")]
            Kind::Video(r) => Ok(crate::media::video::duration_of_bytes(&b.bytes, &b.path)?
                .map(|d| r.planned_frames(d) as f64)),
            #[allow(unreachable_patterns)]
            _ => {
                let _ = b;
                Ok(None)
            }
        }
    }

    /// The modality's name (`"image"`, `"audio"`, `"video"`): a batch's name for its media.
    pub fn kind_name(&self) -> &'static str {
        match &self.kind {
            #[cfg(feature = "image")]
            Kind::Image(_) => "image",
            #[cfg(feature = "audio")]
            Kind::Audio(_) => "audio",
            #[cfg(feature = "video")]
            Kind::Video(_) => "video",
            #[allow(unreachable_patterns)]
            _ => unreachable!("a build without decoders has no recipes"),
        }
    }

    /// Whether the recipe's items have a length ([`load_with_length`](Self::load_with_length)).
    pub fn has_length(&self) -> bool {
        match &self.kind {
            #[cfg(feature = "audio")]
            Kind::Audio(_) => true,
            #[cfg(feature = "video")]
            Kind::Video(_) => true,
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }

    /// The bytes of one unit of a length-aware batch's cap, when the recipe fixes them: a
    /// second of mono audio (its samples, `f32`), a video frame (`u8` RGB at the crop). A
    /// batch holds at most its cap of them, padding included.
    pub fn unit_bytes(&self) -> Option<u64> {
        match &self.kind {
            #[cfg(feature = "audio")]
            Kind::Audio(r) => match r.channels {
                crate::media::audio::Channels::Mono => Some(u64::from(r.rate) * 4),
                _ => None,
            },
            #[cfg(feature = "video")]
            Kind::Video(r) => Some(u64::from(r.crop) * u64::from(r.crop) * 3),
            #[allow(unreachable_patterns)]
            _ => None,
        }
    }

    /// The bytes of one decoded item at most (its output tensor), when the recipe fixes them:
    /// an image's crop in its dtype, an audio window (mono; `None` for kept channels, whose
    /// count is the file's), a video's frames. What a loader reserves a batch by.
    pub fn item_bytes(&self) -> Option<u64> {
        match &self.kind {
            #[cfg(feature = "image")]
            Kind::Image(r) => {
                let px = u64::from(r.crop) * u64::from(r.crop) * 3;
                Some(px * if r.normalize.is_some() { 4 } else { 1 })
            }
            #[cfg(feature = "audio")]
            Kind::Audio(r) => match r.channels {
                crate::media::audio::Channels::Mono => Some(r.samples as u64 * 4),
                _ => None,
            },
            #[cfg(feature = "video")]
            Kind::Video(r) => {
                use crate::media::video::Sampling;
                let frames = match &r.sampling {
                    Sampling::Uniform(n) | Sampling::Window { frames: n, .. } => *n,
                    Sampling::Rate { max, .. } => *max,
                    Sampling::At(t) => t.len(),
                };
                Some(frames as u64 * u64::from(r.crop) * u64::from(r.crop) * 3)
            }
            #[allow(unreachable_patterns)]
            _ => None,
        }
    }
}
