//! Tests that each need a process of their own: a process-wide setting (the CPU worker cap, a
//! node CPU ledger's key), the peak RSS they measure, the threads they count, a `fork`. Each
//! such test starts with `isolate!()`, which runs it again alone in a new process of this
//! binary and takes that process's outcome as its own; so they share one binary (one link of
//! the whole library) and still meet no other test.

#[path = "../common/mod.rs"]
mod common;
#[cfg(all(feature = "s3", feature = "test-util"))]
#[path = "../s3_common/mod.rs"]
mod s3_common;

/// The environment variable that marks a test's own process (see [`in_parent`]).
const ISOLATED: &str = "FLOWGATE_TEST_ISOLATED";

/// Runs the enclosing test in a process of its own (see the module docs): in the test
/// binary's own process it returns from the test once that process has passed (and fails
/// with its output where it failed); in that process it goes on.
macro_rules! isolate {
    () => {{
        fn here() {}
        if $crate::in_parent(std::any::type_name_of_val(&here)) {
            return;
        }
    }};
}

/// Whether this is the binary's own process, where the test whose function holds `here`
/// (`isolated::MODULE::TEST::here`) was just run alone in a new one (and passed).
pub(crate) fn in_parent(here: &str) -> bool {
    if std::env::var_os(ISOLATED).is_some() {
        return false;
    }
    let name = here
        .strip_suffix("::here")
        .and_then(|n| n.split_once("::"))
        .map(|(_, n)| n)
        .expect("a test function's path");
    let out = std::process::Command::new(std::env::current_exe().expect("the test binary"))
        .args([
            name,
            "--exact",
            "--include-ignored",
            "--test-threads=1",
            "--nocapture",
        ])
        .env(ISOLATED, "1")
        .output()
        .expect("start the test in a process of its own");
    let ran = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && ran.contains("1 passed"),
        "{name}, in a process of its own: {}\n{ran}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    true
}

mod auto_workers;
#[cfg(all(feature = "image", feature = "audio"))]
mod bounds;
mod cpu_budget;
mod fork;
mod idle_tokens;
#[cfg(all(feature = "s3", feature = "test-util", feature = "image"))]
mod s3_urls;
mod shutdown;
#[cfg(feature = "video")]
mod video_bomb;
