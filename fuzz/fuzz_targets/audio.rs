//! Any bytes into the audio decoder, with the container hinted by the first byte: an error or
//! a tensor of the recipe's shape, never a panic.
#![no_main]

use std::path::Path;

use flowgate::media::audio::{AudioRecipe, Channels};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // libfuzzer-sys aborts on every panic, even one the decoder catches and turns into an
    // error (as it does for panics inside codecs): go back to the default hook. A panic that
    // escapes the decoder still aborts (libfuzzer-sys catches it and aborts).
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| drop(std::panic::take_hook()));
    let Some((&hint, bytes)) = data.split_first() else {
        return;
    };
    let ext = ["wav", "flac", "mp3", "ogg", "m4a"][usize::from(hint) % 5];
    let recipe = AudioRecipe {
        rate: 16_000,
        samples: 4_000,
        channels: if hint & 0x80 == 0 {
            Channels::Mono
        } else {
            Channels::Keep
        },
        random_crop: hint & 0x40 != 0,
        seed: u64::from(hint),
    };
    let path = format!("fuzz.{ext}");
    if let Ok(t) = recipe.decode(bytes.to_vec(), Path::new(&path)) {
        assert_eq!(*t.shape().last().unwrap(), 4_000);
    }
});
