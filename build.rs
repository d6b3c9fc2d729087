//! Builds the libjpeg-turbo region decoder (`src/media/image/libjpeg.c`) when the `turbojpeg`
//! feature is on. Where libjpeg's headers are missing, the build goes on without it (JPEG
//! then decodes with zune-jpeg) and says so in a warning; `scripts/setup.sh` installs them.

fn main() {
    println!("cargo::rustc-check-cfg=cfg(flowgate_libjpeg)");
    println!("cargo::rerun-if-changed=build.rs");
    #[cfg(feature = "turbojpeg")]
    libjpeg();
}

#[cfg(feature = "turbojpeg")]
fn libjpeg() {
    println!("cargo::rerun-if-changed=src/media/image/libjpeg.c");
    let built = cc::Build::new()
        .file("src/media/image/libjpeg.c")
        .opt_level(2)
        .warnings(true)
        .cargo_warnings(false)
        .try_compile("flowgate_libjpeg");
    match built {
        Ok(()) => {
            println!("cargo::rustc-link-lib=jpeg");
            println!("cargo::rustc-cfg=flowgate_libjpeg");
        }
        Err(e) => println!(
            "cargo::warning=libjpeg-turbo's headers were not found ({e}); JPEG decodes with \
             zune-jpeg. Install libjpeg62-turbo-dev (scripts/setup.sh does) for the faster path."
        ),
    }
}
