//! What this build of flowgate has: its version, the JPEG decoder compiled in and the optional
//! features on. [`build_info()`] is the library's answer; the Python package's
//! `flowgate.build_info()` returns it as a dict, and the command prints it.
//!
//! ```
//! let info = flowgate::build_info();
//! assert_eq!(info.version, env!("CARGO_PKG_VERSION"));
//! println!("{info}"); // flowgate 0.1.0 (jpeg: libjpeg-turbo; features: image, audio)
//! ```

use std::fmt;

/// This build of flowgate: see [`build_info()`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct BuildInfo {
    /// The crate's version (`CARGO_PKG_VERSION`), e.g. `"0.1.0"`.
    pub version: &'static str,
    /// The JPEG decoder compiled in: `"libjpeg-turbo"` (feature `turbojpeg`, built against
    /// libjpeg-turbo), `"zune-jpeg (pure Rust)"`, or `"none"` without the `image` feature.
    pub jpeg: &'static str,
    /// The optional features compiled in, in a fixed order (`"image"`, `"audio"`, `"video"`,
    /// `"parquet"`, `"s3"`, `"cuda"`, `"spec"`, `"synth"`, `"test-util"`).
    pub features: Vec<&'static str>,
}

/// The version, JPEG decoder and optional features of this build of flowgate.
pub fn build_info() -> BuildInfo {
    let jpeg = if cfg!(flowgate_libjpeg) {
        "libjpeg-turbo"
    } else if cfg!(feature = "image") {
        "zune-jpeg (pure Rust)"
    } else {
        "none"
    };
    let features = [
        ("image", cfg!(feature = "image")),
        ("audio", cfg!(feature = "audio")),
        ("video", cfg!(feature = "video")),
        ("parquet", cfg!(feature = "parquet")),
        ("s3", cfg!(feature = "s3")),
        ("cuda", cfg!(feature = "cuda")),
        ("spec", cfg!(feature = "spec")),
        ("synth", cfg!(feature = "synth")),
        ("test-util", cfg!(feature = "test-util")),
    ]
    .into_iter()
    .filter_map(|(name, on)| on.then_some(name))
    .collect();
    BuildInfo {
        version: env!("CARGO_PKG_VERSION"),
        jpeg,
        features,
    }
}

impl fmt::Display for BuildInfo {
    /// One line: `flowgate 0.1.0 (jpeg: libjpeg-turbo; features: image, audio, parquet, s3)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let features = if self.features.is_empty() {
            "none".to_owned()
        } else {
            self.features.join(", ")
        };
        write!(
            f,
            "flowgate {} (jpeg: {}; features: {})",
            self.version, self.jpeg, features
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_this_build() {
        let info = build_info();
        assert_eq!(info.version, env!("CARGO_PKG_VERSION"));
        assert_eq!(info.features.contains(&"image"), cfg!(feature = "image"));
        if cfg!(feature = "image") {
            assert_eq!(info.jpeg == "libjpeg-turbo", cfg!(flowgate_libjpeg));
            #[cfg(feature = "image")]
            assert_eq!(
                info.jpeg.split(' ').next(),
                Some(crate::media::image::jpeg_decoder())
            );
        }
        let line = info.to_string();
        assert!(
            line.starts_with(&format!("flowgate {} (jpeg: ", info.version)),
            "{line}"
        );
        let json = serde_json::to_value(&info).unwrap();
        assert_eq!(json["jpeg"], info.jpeg);
        assert_eq!(
            json["features"].as_array().unwrap().len(),
            info.features.len()
        );
    }

    #[test]
    fn no_features_reads_none() {
        let info = BuildInfo {
            version: "1.2.3",
            jpeg: "none",
            features: vec![],
        };
        assert_eq!(
            info.to_string(),
            "flowgate 1.2.3 (jpeg: none; features: none)"
        );
    }
}
