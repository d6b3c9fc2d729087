//! What the command's test files share: the sample configs and a small dataset.

#![allow(dead_code)] // each test file uses some of it

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use flowgate::synth::{write_dataset, DatasetSpec};

/// The repository's sample configs.
pub(crate) fn configs() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/configs")
}

/// One small dataset for every test of a test binary (40 images, 10 clips, 10-sample tar
/// shards), in a folder of that binary's own.
pub(crate) fn dataset() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let exe = std::env::current_exe().unwrap();
        let name = exe.file_stem().unwrap().to_string_lossy().into_owned();
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("dataset-{name}"));
        let _ = std::fs::remove_dir_all(&dir);
        write_dataset(&DatasetSpec {
            out: dir.clone(),
            images: 40,
            audio: 10,
            audio_seconds: (3.0, 10.0),
            flac: true,
            video: 0,
            shards: 10,
            seed: 7,
        })
        .expect("write the sample dataset")
    })
}

/// A sample config, pointed at the test's dataset.
pub(crate) fn config(name: &str) -> String {
    let text = std::fs::read_to_string(configs().join(name)).unwrap();
    text.replace(
        "../../target/sample-data/",
        &format!("{}/", dataset().display()),
    )
}

/// A fresh folder for one test.
pub(crate) fn scratch(name: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A pseudo-terminal of `cols`×`rows`: its master (read the screen from it) and its slave
/// (a child's stdout or stderr).
pub(crate) fn pty(cols: u16, rows: u16) -> (std::fs::File, std::process::Stdio) {
    use std::os::fd::{FromRawFd, OwnedFd};
    let (mut master, mut slave) = (0, 0);
    let ws = libc::winsize {
        ws_row: rows,
        ws_col: cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: openpty fills two descriptors, which OwnedFd then owns.
    let rc = unsafe {
        libc::openpty(
            &mut master,
            &mut slave,
            std::ptr::null_mut(),
            std::ptr::null(),
            &ws,
        )
    };
    assert_eq!(rc, 0, "openpty");
    let (master, slave) = unsafe { (OwnedFd::from_raw_fd(master), OwnedFd::from_raw_fd(slave)) };
    (
        std::fs::File::from(master),
        std::process::Stdio::from(slave),
    )
}

/// The sample dataset's images, sorted.
pub(crate) fn images() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dataset().join("images"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    v.sort();
    v
}

/// Asserts the run exited 0, showing its stderr if not.
pub(crate) fn assert_succeeded(out: &std::process::Output) {
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The JSON line a run ends with.
pub(crate) fn json(out: &std::process::Output) -> serde_json::Value {
    let stdout = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(stdout.lines().last().unwrap_or(""))
        .unwrap_or_else(|e| panic!("{e}: {stdout}\n{}", String::from_utf8_lossy(&out.stderr)))
}
