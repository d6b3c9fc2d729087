//! Any bytes into the image decoder, evaluation and training recipes: an error or a tensor of
//! the recipe's shape, never a panic.
#![no_main]

use std::path::Path;

use flowgate::media::image::{ImageRecipe, Layout};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let eval = ImageRecipe {
        resize: 64,
        crop: 56,
        layout: Layout::Nhwc,
        ..ImageRecipe::default()
    };
    if let Ok(t) = eval.decode(data, Path::new("fuzz.jpg")) {
        assert_eq!(t.shape(), [56, 56, 3]);
    }
    let train = ImageRecipe::train(32);
    if let Ok(t) = train.decode(data, Path::new("fuzz.png")) {
        assert_eq!(t.shape(), [3, 32, 32]);
    }
});
