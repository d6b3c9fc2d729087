//! Helpers shared by the engine's integration tests (each test file uses some of them).
#![allow(dead_code)]

pub(crate) mod jpegs41;

use std::sync::Once;
use std::time::Duration;

/// An error a test injects into a stage.
#[derive(Debug)]
pub(crate) struct Injected(pub(crate) u64);
impl std::fmt::Display for Injected {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "injected failure on {}", self.0)
    }
}
impl std::error::Error for Injected {}

/// Keeps injected panics out of the test output, and lets every other panic through.
pub(crate) fn quiet_injected_panics() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let msg = info
                .payload()
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| info.payload().downcast_ref::<&str>().copied())
                .unwrap_or("");
            if !msg.contains("injected") {
                default(info);
            }
        }));
    });
}

/// Runs `f` on its own thread and fails the test if it takes longer than `secs`: a lost item
/// shows up as an epoch that never ends, and must fail the test rather than hang it.
pub(crate) fn within<R: Send + 'static>(secs: u64, f: impl FnOnce() -> R + Send + 'static) -> R {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(Duration::from_secs(secs)) {
        Ok(r) => r,
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => panic!("hung for {secs} s"),
        Err(e) => panic!("the test body panicked: {e}"),
    }
}

pub(crate) fn mix(x: u64, salt: u64) -> u64 {
    let mut h = x ^ salt.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    h = (h ^ (h >> 31)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    h ^ (h >> 29)
}

/// Resets the process's peak resident set to its current one (Linux: `clear_refs` 5).
pub(crate) fn reset_peak_rss() {
    std::fs::write("/proc/self/clear_refs", "5").expect("resetting VmHWM");
}

/// The process's peak resident set so far, in bytes (`VmHWM`).
pub(crate) fn peak_rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    kb * 1024
}

/// The dataset positions a loader resumed from `state` delivers in its epoch.
pub(crate) fn rest_after(
    loader: &mut flowgate::Loader,
    state: &flowgate::PipelineState,
) -> Vec<usize> {
    loader.resume(state).unwrap();
    loader
        .epoch()
        .unwrap()
        .flat_map(|b| b.unwrap().items.into_iter().map(|m| m.index))
        .collect()
}

/// Starts `loader`'s next epoch, takes its first `n` batches and a state: the dataset
/// positions delivered (in order) and the checkpoint after them (a preempted job's).
pub(crate) fn take_then_save(
    loader: &mut flowgate::Loader,
    n: usize,
) -> (Vec<usize>, flowgate::PipelineState) {
    let mut taken = Vec::new();
    let mut e = loader.epoch().unwrap();
    for _ in 0..n {
        let b = e.next().unwrap().unwrap();
        taken.extend(b.items.iter().map(|m| m.index));
    }
    (taken, e.state().unwrap())
}

/// A 16 x 12 JPEG whose pixels depend on `shade` (so every file decodes differently).
pub(crate) fn tiny_jpeg(shade: usize) -> Vec<u8> {
    let mut out = Vec::new();
    let pixels: Vec<u8> = (0..16 * 12 * 3).map(|i| (shade * 7 + i) as u8).collect();
    jpeg_encoder::Encoder::new(&mut out, 90)
        .encode(&pixels, 16, 12, jpeg_encoder::ColorType::Rgb)
        .unwrap();
    out
}

/// The loader tests' small image recipe: resize 12, center crop 8.
#[cfg(feature = "image")]
pub(crate) fn small_recipe() -> flowgate::media::Recipe {
    flowgate::media::Recipe::image(flowgate::media::image::ImageRecipe {
        resize: 12,
        crop: 8,
        ..Default::default()
    })
    .unwrap()
}

/// A loader of `source` with [`small_recipe`]: shuffled with `seed`, rank `rank` of `world`,
/// batches of `batch`, two decode workers.
#[cfg(feature = "image")]
pub(crate) fn small_loader(
    source: flowgate::dataset::Source,
    seed: u64,
    rank: usize,
    world: usize,
    batch: usize,
) -> flowgate::Loader {
    let dataset = flowgate::dataset::Dataset::builder(source)
        .shuffle(seed)
        .ranks(rank, world)
        .build()
        .unwrap();
    flowgate::Loader::builder(dataset, small_recipe())
        .batch_size(batch)
        .workers(2)
        .build()
        .unwrap()
}

/// Every batch of one epoch of `loader`: each item's path (or `SHARD:KEY`) and label, and the
/// batch sizes.
#[cfg(feature = "image")]
pub(crate) fn epoch_items(
    loader: &mut flowgate::Loader,
) -> (Vec<(String, Option<i64>)>, Vec<usize>) {
    let mut items = Vec::new();
    let mut sizes = Vec::new();
    let batches: Vec<flowgate::loader::Batch> =
        loader.epoch().unwrap().map(Result::unwrap).collect();
    for b in batches {
        assert_eq!(b.fields[0].shape()[0], b.len());
        sizes.push(b.len());
        for m in &b.items {
            items.push((loader.path_of(m), m.label));
        }
    }
    (items, sizes)
}
