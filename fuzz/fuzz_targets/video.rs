//! Any bytes into the video decoder (through FFmpeg): an error or a tensor of the recipe's
//! shape, never a panic or a hang.
#![no_main]

use std::path::Path;

use flowgate::media::video::{Sampling, VideoRecipe};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let recipe = VideoRecipe {
        sampling: Sampling::Uniform(3),
        resize: 32,
        crop: 32,
        ..VideoRecipe::default()
    };
    if let Ok(t) = recipe.decode(data, Path::new("fuzz.mp4")) {
        assert_eq!(t.shape(), [3, 32, 32, 3]);
    }
});
