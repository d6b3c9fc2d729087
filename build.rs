//! Builds the libjpeg-turbo region decoder (`src/media/image/libjpeg.c`) when the `turbojpeg`
//! feature is on (it is by default), and sets `cfg(flowgate_libjpeg)` for the Rust side.
//!
//! Where libjpeg-turbo's headers are missing, the build FAILS, naming the package to install
//! (`scripts/setup.sh` installs it) and the way out: asking for the pure-Rust decoder
//! (zune-jpeg, slower), either by building without `turbojpeg`
//! (`cargo build --no-default-features --features image,audio`) or with the feature
//! `pure-rust-jpeg`, which wins over `turbojpeg` (`--features pure-rust-jpeg`: for the Python
//! package, `MATURIN_PEP517_ARGS="--features pure-rust-jpeg" pip install ./python`). A build
//! that silently fell back to zune-jpeg used to hide the slower path from pip users.
//!
//! `FLOWGATE_LIBJPEG_INCLUDE_DIR` (`jpeglib.h` and the headers it includes) and
//! `FLOWGATE_LIBJPEG_LIB_DIR` (`libjpeg.so`): where to find libjpeg-turbo when the C compiler
//! and linker do not look in the system's directories, as in the zig builds of the portable
//! wheels (`scripts/wheel.sh`).

fn main() {
    println!("cargo::rustc-check-cfg=cfg(flowgate_libjpeg)");
    println!("cargo::rerun-if-changed=build.rs");
    #[cfg(all(feature = "turbojpeg", not(feature = "pure-rust-jpeg")))]
    libjpeg();
}

#[cfg(all(feature = "turbojpeg", not(feature = "pure-rust-jpeg")))]
fn libjpeg() {
    println!("cargo::rerun-if-changed=src/media/image/libjpeg.c");
    println!("cargo::rerun-if-env-changed=FLOWGATE_LIBJPEG_INCLUDE_DIR");
    println!("cargo::rerun-if-env-changed=FLOWGATE_LIBJPEG_LIB_DIR");
    let mut build = cc::Build::new();
    if let Some(dir) = std::env::var_os("FLOWGATE_LIBJPEG_INCLUDE_DIR") {
        build.include(dir);
    }
    build
        .file("src/media/image/libjpeg.c")
        .opt_level(2)
        .warnings(true)
        .cargo_warnings(false);
    let built = build.try_compile("flowgate_libjpeg");
    match built {
        Ok(()) => {
            if let Some(dir) = std::env::var_os("FLOWGATE_LIBJPEG_LIB_DIR") {
                println!("cargo::rustc-link-search=native={}", dir.to_string_lossy());
            }
            println!("cargo::rustc-link-lib=jpeg");
            println!("cargo::rustc-cfg=flowgate_libjpeg");
        }
        Err(e) => {
            eprintln!(
                "\nerror: flowgate's feature `turbojpeg` (on by default) needs libjpeg-turbo's \
                 development files, and src/media/image/libjpeg.c did not compile:\n  {e}\n{}\n\
                 Install them:\n  \
                 Debian/Ubuntu:      sudo apt-get install libjpeg62-turbo-dev   (Ubuntu: \
                 libjpeg-turbo8-dev; or run scripts/setup.sh)\n  \
                 Fedora/RHEL:        sudo dnf install libjpeg-turbo-devel\n  \
                 macOS (Homebrew):   brew install jpeg-turbo\n\n\
                 Or build with the pure-Rust JPEG decoder (zune-jpeg; slower, no region \
                 decoding):\n  \
                 Rust:   cargo build --no-default-features --features image,audio   (or \
                 --features pure-rust-jpeg)\n  \
                 Python: MATURIN_PEP517_ARGS=\"--no-default-features --features \
                 pure-rust-jpeg\" pip install ./python\n",
                compiler_says(&build)
            );
            std::process::exit(1);
        }
    }
}

/// The first lines of the C compiler's diagnostics on `libjpeg.c` (`cc` keeps them to itself
/// with `cargo_warnings(false)`), e.g. `fatal error: jpeglib.h: No such file or directory`.
#[cfg(all(feature = "turbojpeg", not(feature = "pure-rust-jpeg")))]
fn compiler_says(build: &cc::Build) -> String {
    let Ok(compiler) = build.try_get_compiler() else {
        return String::new();
    };
    if compiler.is_like_msvc() {
        return String::new();
    }
    let out = compiler
        .to_command()
        .args(["-fsyntax-only", "src/media/image/libjpeg.c"])
        .output();
    match out {
        Ok(out) => String::from_utf8_lossy(&out.stderr)
            .lines()
            .filter(|l| l.contains("error"))
            .take(5)
            .map(|l| format!("  {l}\n"))
            .collect(),
        Err(_) => String::new(),
    }
}
