//! Which file extensions name which kind of media: a fact about file names that the datasets
//! (which files a folder holds) and the decoders (which files a recipe reads) both use, kept
//! apart from either.

/// Image files' extensions (lower case, without the dot).
pub const IMAGE_EXTENSIONS: &[&str] = &["jpg", "jpeg", "png", "webp"];
/// Audio files' extensions.
pub const AUDIO_EXTENSIONS: &[&str] = &["flac", "wav", "mp3", "ogg", "m4a"];
/// Video files' extensions.
pub const VIDEO_EXTENSIONS: &[&str] = &["mp4", "mkv", "webm", "mov", "avi"];

/// Every media extension this build's decoders may read.
pub fn media_extensions() -> Vec<&'static str> {
    IMAGE_EXTENSIONS
        .iter()
        .chain(AUDIO_EXTENSIONS)
        .chain(VIDEO_EXTENSIONS)
        .copied()
        .collect()
}
