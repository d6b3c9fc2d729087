//! Hard bounds, measured on the process's resident memory (each test here takes the RSS lock,
//! so they do not overlap).
//!
//! - The memory budget: large items behind a slow consumer, with the tuner trying to grow the
//!   buffers: the bytes the pipeline accounts for stay within the budget, and so does the
//!   process's peak RSS growth (plus a documented overhead).
//! - Decompression bombs: files whose headers lie about their size (JPEG, PNG and WebP claiming
//!   huge dimensions; WAV and FLAC claiming absurd rates, channels and lengths). Each must be a
//!   typed `MediaError::TooLarge` naming the file, decided before anything the size of the
//!   claim is allocated: the pipeline goes on, and the process's peak RSS barely moves (without
//!   the limits the first of these aborts the process asking for ~12 GB).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use flowgate::media::audio::AudioRecipe;
use flowgate::media::image::ImageRecipe;
use flowgate::media::{MediaError, Recipe};
use flowgate::{Pipeline, TunerSettings, Workers};

use crate::common;
use common::{peak_rss, reset_peak_rss};

/// Tests that measure the process's peak RSS run one at a time.
static RSS: Mutex<()> = Mutex::new(());

/// CRC-32 (the PNG chunk checksum), bit by bit.
fn crc32(bytes: &[u8]) -> u32 {
    let mut c = !0u32;
    for &b in bytes {
        c ^= u32::from(b);
        for _ in 0..8 {
            c = if c & 1 != 0 {
                0xEDB8_8320 ^ (c >> 1)
            } else {
                c >> 1
            };
        }
    }
    !c
}

fn encoded(format: image::ImageFormat) -> Vec<u8> {
    let img = image::RgbImage::from_fn(64, 48, |x, y| image::Rgb([x as u8, y as u8, 9]));
    let mut out = std::io::Cursor::new(Vec::new());
    img.write_to(&mut out, format).unwrap();
    out.into_inner()
}

/// A real JPEG whose frame header (SOF0) claims `w × h`.
fn jpeg_claiming(w: u16, h: u16) -> Vec<u8> {
    let mut b = encoded(image::ImageFormat::Jpeg);
    let sof = b
        .windows(2)
        .position(|m| m == [0xFF, 0xC0])
        .expect("a baseline JPEG");
    b[sof + 5..sof + 7].copy_from_slice(&h.to_be_bytes());
    b[sof + 7..sof + 9].copy_from_slice(&w.to_be_bytes());
    b
}

/// A real PNG whose IHDR claims `w × h` (with a valid checksum).
fn png_claiming(w: u32, h: u32) -> Vec<u8> {
    let mut b = encoded(image::ImageFormat::Png);
    b[16..20].copy_from_slice(&w.to_be_bytes());
    b[20..24].copy_from_slice(&h.to_be_bytes());
    let crc = crc32(&b[12..29]);
    b[29..33].copy_from_slice(&crc.to_be_bytes());
    b
}

/// A lossy WebP whose VP8 frame header claims `w × h` (14 bits each).
fn webp_claiming(w: u16, h: u16) -> Vec<u8> {
    let mut vp8 = vec![0x50, 0x05, 0x00, 0x9d, 0x01, 0x2a]; // a key frame, its start code
    vp8.extend_from_slice(&w.to_le_bytes());
    vp8.extend_from_slice(&h.to_le_bytes());
    vp8.resize(64, 0);
    let mut b = b"RIFF".to_vec();
    b.extend_from_slice(&(4 + 8 + vp8.len() as u32).to_le_bytes());
    b.extend_from_slice(b"WEBPVP8 ");
    b.extend_from_slice(&(vp8.len() as u32).to_le_bytes());
    b.extend_from_slice(&vp8);
    b
}

/// A PCM WAV header claiming `channels` at `rate` Hz and a data chunk of `data_len` bytes,
/// followed by a little data.
fn wav_claiming(channels: u16, rate: u32, data_len: u32) -> Vec<u8> {
    let bits = 16u16;
    let align = channels.saturating_mul(bits / 8);
    let mut b = b"RIFF".to_vec();
    b.extend_from_slice(&u32::MAX.to_le_bytes());
    b.extend_from_slice(b"WAVEfmt ");
    b.extend_from_slice(&16u32.to_le_bytes());
    b.extend_from_slice(&1u16.to_le_bytes()); // PCM
    b.extend_from_slice(&channels.to_le_bytes());
    b.extend_from_slice(&rate.to_le_bytes());
    b.extend_from_slice(&rate.wrapping_mul(u32::from(align)).to_le_bytes());
    b.extend_from_slice(&align.to_le_bytes());
    b.extend_from_slice(&bits.to_le_bytes());
    b.extend_from_slice(b"data");
    b.extend_from_slice(&data_len.to_le_bytes());
    b.extend_from_slice(&[0u8; 4096]);
    b
}

/// A real FLAC stream (a second of a tone) whose STREAMINFO claims `total` samples, or a
/// sample rate of `rate` Hz when given.
fn flac_claiming(rate: Option<u32>, total: u64) -> Vec<u8> {
    use flacenc::component::BitRepr;
    use flacenc::error::Verify;
    let samples: Vec<i32> = (0..16_000).map(|i| ((i % 64) * 200) - 6400).collect();
    let config = flacenc::config::Encoder::default().into_verified().unwrap();
    let source = flacenc::source::MemSource::from_samples(&samples, 1, 16, 16_000);
    let stream = flacenc::encode_with_fixed_block_size(&config, source, config.block_size).unwrap();
    let mut sink = flacenc::bitsink::ByteSink::new();
    stream.write(&mut sink).unwrap();
    let mut b = sink.as_slice().to_vec();
    assert_eq!(&b[..4], b"fLaC");
    // STREAMINFO's bytes 10..18 (file bytes 18..26): 20 bits rate, 3 channels - 1, 5 bits per
    // sample - 1, 36 bits total samples.
    let mut packed = u64::from_be_bytes(b[18..26].try_into().unwrap());
    packed = (packed & !((1u64 << 36) - 1)) | (total & ((1 << 36) - 1));
    if let Some(rate) = rate {
        packed = (packed & ((1u64 << 44) - 1)) | (u64::from(rate) << 44);
    }
    b[18..26].copy_from_slice(&packed.to_be_bytes());
    b
}

/// Runs `recipe` over `files` in a pipeline that skips and counts failures; returns the items
/// delivered and each failure's cause.
fn run(recipe: Recipe, files: Vec<PathBuf>) -> (usize, Vec<(String, String)>) {
    let failures: Arc<Mutex<Vec<(String, String)>>> = Arc::default();
    let seen = Arc::clone(&failures);
    let mut p = Pipeline::builder()
        .source(files)
        .describe(|p: &PathBuf| p.display().to_string())
        .pipe(
            "decode",
            move |p: PathBuf| recipe.load(&p),
            Workers::fixed(2),
        )
        .on_failure(move |e| {
            let too_large = e
                .cause()
                .downcast_ref::<MediaError>()
                .map(|m| matches!(m, MediaError::TooLarge { .. }))
                .unwrap_or(false);
            let kind = if too_large { "too large" } else { "other" };
            seen.lock()
                .unwrap()
                .push((e.item().to_owned(), format!("{kind}: {}", e.cause())));
        })
        .build()
        .unwrap();
    let delivered = p.iter().map(Result::unwrap).count();
    drop(p);
    let f = failures.lock().unwrap().clone();
    (delivered, f)
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

#[test]
fn headers_that_lie_about_sizes_are_typed_errors_before_any_large_allocation() {
    isolate!();
    let _one_at_a_time = RSS.lock().unwrap_or_else(|e| e.into_inner());
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("bombs");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    reset_peak_rss();
    let before = peak_rss();

    let good = encoded(image::ImageFormat::Jpeg);
    let images = vec![
        write(&dir, "good.jpg", &good),
        write(&dir, "huge.jpg", &jpeg_claiming(65_500, 65_500)),
        write(&dir, "wide.jpg", &jpeg_claiming(65_500, 4_096)),
        write(&dir, "huge.png", &png_claiming(1 << 20, 1 << 20)),
        write(&dir, "huge.webp", &webp_claiming(16_383, 16_383)),
        write(&dir, "good.png", &encoded(image::ImageFormat::Png)),
    ];
    let recipe = Recipe::image(ImageRecipe {
        resize: 32,
        crop: 32,
        ..ImageRecipe::default()
    })
    .unwrap();
    let (delivered, failures) = run(recipe, images);
    assert_eq!(delivered, 2, "the good files: {failures:?}");
    assert_eq!(failures.len(), 4, "{failures:?}");
    for (item, cause) in &failures {
        assert!(cause.starts_with("too large"), "{item}: {cause}");
        assert!(
            cause.contains("pixels") && cause.contains(item.as_str()),
            "{cause}"
        );
    }

    let audio = vec![
        write(
            &dir,
            "rate.wav",
            &wav_claiming(1, 4_000_000_000, u32::MAX - 64),
        ),
        write(
            &dir,
            "channels.wav",
            &wav_claiming(1000, 16_000, u32::MAX - 64),
        ),
        write(&dir, "long.wav", &wav_claiming(1, 8_000, u32::MAX - 64)),
        write(&dir, "long.flac", &flac_claiming(None, (1 << 36) - 1)),
        write(&dir, "rate.flac", &flac_claiming(Some(1_048_575), 16_000)),
    ];
    let recipe = Recipe::audio(AudioRecipe::with_seconds(16_000, 1.0).unwrap()).unwrap();
    let (delivered, failures) = run(recipe, audio);
    assert_eq!(delivered, 0);
    assert_eq!(failures.len(), 5, "{failures:?}");
    for (item, cause) in &failures {
        // The rates, channel counts and lengths are past the limits; a decoder that refuses
        // the header first (symphonia caps WAV channels) is a typed decode error: either way
        // nothing was sized by the claim.
        assert!(cause.contains(item.as_str()), "{item}: {cause}");
    }
    for name in ["rate.wav", "long.wav", "long.flac"] {
        let (_, cause) = failures.iter().find(|(i, _)| i.ends_with(name)).unwrap();
        assert!(cause.starts_with("too large"), "{name}: {cause}");
    }

    let grown = peak_rss().saturating_sub(before);
    assert!(
        grown < 256 << 20,
        "peak RSS grew by {} MiB decoding the bombs",
        grown >> 20
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn limits_are_configurable_and_name_what_was_declared() {
    isolate!();
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("limits");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let jpg = write(&dir, "small.jpg", &encoded(image::ImageFormat::Jpeg));
    let tight = ImageRecipe {
        resize: 32,
        crop: 32,
        limits: flowgate::media::Limits {
            max_pixels: 64 * 48 - 1,
            ..Default::default()
        },
        ..ImageRecipe::default()
    };
    match tight.load(&jpg) {
        Err(MediaError::TooLarge {
            path,
            what,
            value,
            limit,
        }) => {
            assert_eq!(
                (path, what, value, limit),
                (jpg.clone(), "pixels", 3072, 3071)
            );
        }
        other => panic!("{other:?}"),
    }
    let fits = ImageRecipe {
        limits: flowgate::media::Limits {
            max_pixels: 64 * 48,
            ..Default::default()
        },
        ..tight
    };
    assert_eq!(fits.load(&jpg).unwrap().shape(), [3, 32, 32]);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The bytes every stage's buffer holds now, as the pipeline accounts for them.
fn accounted<T: Send + 'static>(p: &Pipeline<T>) -> u64 {
    p.stats().stages.iter().map(|s| s.queue_bytes).sum()
}

#[test]
fn the_memory_budget_bounds_accounted_bytes_and_rss_with_large_items() {
    isolate!();
    const ITEM: usize = 4 << 20;
    const BUDGET: u64 = 64 << 20;
    // Allocator and thread overhead the budget does not count: a few MiB of thread stacks
    // and arenas, plus items in transit between two budgets (an output enters the next
    // buffer just before its input leaves) and the consumer's own item.
    const OVERHEAD: u64 = 3 * ITEM as u64 + (24 << 20);
    let _one_at_a_time = RSS.lock().unwrap_or_else(|e| e.into_inner());
    // A CPU stage untuned and tuned, and an I/O stage (like an S3 fetch: 16 requests in
    // flight, each bringing 4 MiB) tuned; and the tuned CPU stage without a `measure` call
    // (its `Vec<u8>` items are measured by what they own, see `flowgate::measure`).
    for (tuned, io, measured) in [
        (false, false, true),
        (true, false, true),
        (true, true, true),
        (true, false, false),
    ] {
        reset_peak_rss();
        let before = peak_rss();
        let make = |i: u64| vec![i as u8 | 1; ITEM]; // every page touched: resident
        let b = Pipeline::builder().source_epochs(|_| 0..120u64);
        let b = if io {
            b.pipe_async(
                "make",
                move |i| async move { Ok::<_, std::io::Error>(make(i)) },
                16,
            )
        } else {
            b.pipe("make", move |i| Ok::<_, std::io::Error>(make(i)), 2)
        };
        let b = if measured { b.measure(Vec::len) } else { b };
        let mut b = b.memory_budget(BUDGET);
        b = if tuned {
            // A tuner that sees a starved-looking consumer would grow every buffer it can.
            b.autotune(TunerSettings {
                tick: Some(std::time::Duration::from_millis(20)),
                ..Default::default()
            })
        } else {
            b.autotune_off()
        };
        let mut p = b.build().unwrap();
        let mut peak_accounted = 0;
        let mut n = 0;
        // One item at a time (each `iter()` continues the epoch), so the stats can be taken
        // between items.
        while let Some(item) = p.iter().next() {
            let item = item.unwrap();
            assert_eq!(item.len(), ITEM);
            n += 1;
            std::thread::sleep(std::time::Duration::from_millis(8)); // a slow consumer
            drop(item);
            if n % 4 == 0 {
                peak_accounted = peak_accounted.max(accounted(&p));
            }
        }
        assert_eq!(n, 120);
        // Outputs enter the next buffer just before their input leaves this one: counted
        // twice for a moment (a worker's run: up to two items here), never less than once.
        assert!(
            peak_accounted <= BUDGET + 2 * ITEM as u64,
            "tuned {tuned}, io {io}, measured {measured}: accounted {} MiB over a budget of {} MiB",
            peak_accounted >> 20,
            BUDGET >> 20
        );
        assert!(
            peak_accounted >= BUDGET / 4,
            "tuned {tuned}, io {io}, measured {measured}: the budget binds (accounted {} MiB)",
            peak_accounted >> 20
        );
        drop(p);
        let grown = peak_rss().saturating_sub(before);
        assert!(
            grown <= BUDGET + OVERHEAD,
            "tuned {tuned}, io {io}, measured {measured}: peak RSS grew by {} MiB with a budget of {} MiB",
            grown >> 20,
            BUDGET >> 20
        );
    }
}

#[test]
fn stage_budgets_that_exceed_the_memory_budget_are_refused() {
    isolate!();
    let e = Pipeline::builder()
        .source_epochs(|_| 0..10u64)
        .pipe("a", Ok::<_, std::io::Error>, 1)
        .budget(8, 40 << 20)
        .pipe("b", Ok::<_, std::io::Error>, 1)
        .budget(8, 40 << 20)
        .memory_budget(64 << 20)
        .build()
        .unwrap_err();
    assert!(e.is_config(), "{e}");
    assert!(e.to_string().contains("`a`, `b`"), "{e}");
}

/// The library's loader with batches that are a large part of its memory budget: the stages
/// hold four batches, an item per decode worker and one waiting whatever their byte budgets
/// (a batch's items being assembled, a batch list in the collate stage's hand and one waiting, a batch
/// ready for the loop); a budget that cannot hold that is refused when built, naming both
/// sizes; one that can reserves it, and the bytes the pipeline accounts for and the process's
/// peak RSS stay within the budget (plus a named overhead) while the tuner tries to grow every
/// buffer behind a slow consumer over an epoch 4.5 times the budget. (How much of the floors
/// a run reaches depends on its timing: here two batches; the Python test
/// `test_memory_mb_binds_with_items_large_against_it` caught four and an item under a budget
/// that reserved two.)
#[test]
fn a_loaders_memory_budget_holds_with_batches_that_are_a_large_part_of_it() {
    isolate!();
    use flowgate::dataset::{Dataset, Source};
    use flowgate::Loader;
    // 512×512×3 bytes an item, 12 a batch (9 MiB), two decode workers: the floors are
    // 4 × 9 + 3 × 0.75 = 38.25 MiB, and a 40 MiB budget leaves the buffers 1.75 MiB.
    const ITEM: u64 = 512 * 512 * 3;
    const BATCH: usize = 12;
    const WORKERS: usize = 2;
    const FLOORS: u64 = 4 * BATCH as u64 * ITEM + (WORKERS as u64 + 1) * ITEM;
    const BUDGET: u64 = 40 << 20;
    // Beside the budget: the batch the loop holds, each decode worker's source image at full
    // size (1024×768×3), thread stacks and allocator arenas (measured here: peak RSS grew
    // 39.5 MiB under the 40 MiB budget).
    const OVERHEAD: u64 = BATCH as u64 * ITEM + WORKERS as u64 * 1024 * 768 * 3 + (16 << 20);
    let _one_at_a_time = RSS.lock().unwrap_or_else(|e| e.into_inner());
    let dir = std::env::temp_dir().join(format!("flowgate-loader-budget-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let paths: Vec<PathBuf> = (0..30)
        .map(|i| {
            let (w, h) = (1024u16, 768u16);
            let px: Vec<u8> = (0..w as usize * h as usize * 3)
                .map(|k| ((k * 7 + i * 13) % 251) as u8)
                .collect();
            let mut jpeg = Vec::new();
            jpeg_encoder::Encoder::new(&mut jpeg, 85)
                .encode(&px, w, h, jpeg_encoder::ColorType::Rgb)
                .unwrap();
            let p = dir.join(format!("{i:02}.jpg"));
            std::fs::write(&p, jpeg).unwrap();
            p
        })
        .collect();
    let recipe = Recipe::image(ImageRecipe {
        resize: 512,
        crop: 512,
        ..ImageRecipe::default()
    })
    .unwrap();
    let loader = |budget: u64| {
        // Each file 8 times: an epoch of 240 items (180 MiB decoded).
        let dataset = Dataset::builder(Source::files(
            paths.iter().cycle().take(8 * paths.len()).cloned(),
        ))
        .build()
        .unwrap();
        Loader::builder(dataset, recipe.clone())
            .batch_size(BATCH)
            .workers(WORKERS)
            .memory_budget(budget)
            .autotune(TunerSettings {
                tick: Some(std::time::Duration::from_millis(20)),
                ..Default::default()
            })
            .build()
    };
    let e = loader(38 << 20).unwrap_err().to_string();
    let mib = |b: u64| format!("{:.1} MiB", b as f64 / f64::from(1u32 << 20));
    assert!(
        e.contains("38.0 MiB cannot hold a batch in flight")
            && e.contains(&format!("({} at once)", mib(FLOORS))),
        "{e}"
    );

    reset_peak_rss();
    let before = peak_rss();
    let mut l = loader(BUDGET).unwrap();
    // The accounted bytes sampled every millisecond from another thread, all epoch long.
    let watch = l.watch();
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = {
        let done = Arc::clone(&done);
        std::thread::spawn(move || {
            let mut peak = 0u64;
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                if let Some(m) = watch.monitor() {
                    let held: u64 = m.stats().stages.iter().map(|s| s.queue_bytes).sum();
                    peak = peak.max(held);
                }
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            peak
        })
    };
    let mut batches = 0;
    for b in l.epoch().unwrap() {
        let b = b.unwrap();
        batches += 1;
        std::thread::sleep(std::time::Duration::from_millis(300)); // a slow consumer
        drop(b);
    }
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    let peak_accounted = sampler.join().unwrap();
    assert_eq!(batches, 20);
    drop(l);
    let grew = peak_rss().saturating_sub(before);
    eprintln!(
        "floors {} MiB, budget {} MiB: accounted at most {:.1} MiB, peak RSS grew {:.1} MiB",
        FLOORS >> 20,
        BUDGET >> 20,
        peak_accounted as f64 / 1048576.0,
        grew as f64 / 1048576.0
    );
    // Outputs enter the next buffer just before their input leaves this one (a worker's run:
    // two items).
    assert!(
        peak_accounted <= BUDGET + 2 * ITEM,
        "accounted {peak_accounted} bytes, budget {BUDGET}"
    );
    assert!(
        peak_accounted >= 2 * BATCH as u64 * ITEM,
        "the stages ran ahead of the slow loop: two batches held at once ({peak_accounted} bytes)"
    );
    assert!(
        grew <= BUDGET + OVERHEAD,
        "peak RSS grew {grew} bytes; budget {BUDGET} + overhead {OVERHEAD}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A memory cgroup of its own for a child process, `limit` bytes (v2 `memory.max` or v1
/// `memory.limit_in_bytes`), or `None` where none can be made (not root, no writable cgroup
/// file system): removed on drop.
struct Cgroup {
    dir: PathBuf,
    procs: PathBuf,
}

impl Cgroup {
    fn new(limit: u64) -> Option<Self> {
        let name = format!("flowgate-test-{}", std::process::id());
        let v2 = Path::new("/sys/fs/cgroup/cgroup.controllers").exists();
        let (dir, file) = if v2 {
            // The memory controller must be on for the children of the root.
            let _ = std::fs::write("/sys/fs/cgroup/cgroup.subtree_control", "+memory");
            (Path::new("/sys/fs/cgroup").join(&name), "memory.max")
        } else {
            (
                Path::new("/sys/fs/cgroup/memory").join(&name),
                "memory.limit_in_bytes",
            )
        };
        std::fs::create_dir(&dir).ok()?;
        let g = Self {
            procs: dir.join("cgroup.procs"),
            dir,
        };
        std::fs::write(g.dir.join(file), limit.to_string()).ok()?;
        if !v2 {
            // No swap to spill into: past the limit is a kill, as in a container.
            let _ = std::fs::write(g.dir.join("memory.memsw.limit_in_bytes"), limit.to_string());
        }
        Some(g)
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// Items the child in a cgroup loads.
const CGROUP_ITEMS: usize = 192;

/// In a child process put in a cgroup (see below): a loader with every memory setting
/// default over large crops, one epoch; prints what it did.
#[test]
#[ignore = "run by a_default_loader_in_a_container_keeps_within_its_memory_limit"]
fn child_default_loader_in_a_cgroup() {
    let batch: usize = std::env::var("FLOWGATE_TEST_BATCH")
        .unwrap()
        .parse()
        .unwrap();
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("cgroup-{batch}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    // 192 crops of 3 MiB (576 MiB decoded in all) behind a slow training step: decoding runs
    // ahead of the loop as far as the budget lets it.
    let files: Vec<PathBuf> = (0..CGROUP_ITEMS)
        .map(|i| write(&dir, &format!("{i:03}.jpg"), &common::tiny_jpeg(i)))
        .collect();
    let dataset = flowgate::dataset::Dataset::builder(flowgate::dataset::Source::files(files))
        .build()
        .unwrap();
    let recipe = Recipe::image(ImageRecipe {
        resize: 1024,
        crop: 1024,
        ..ImageRecipe::default()
    })
    .unwrap();
    match flowgate::Loader::builder(dataset, recipe)
        .batch_size(batch)
        .build()
    {
        Err(e) => println!("REFUSED {e}"),
        Ok(mut loader) => {
            let mut n = 0;
            for b in loader.epoch().unwrap() {
                n += b.unwrap().len();
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            let m = loader.stats().memory_budget.unwrap();
            println!("RAN {n} items; budget {} bytes: {}", m.bytes, m.source);
        }
    }
}

#[test]
fn a_default_loader_in_a_container_keeps_within_its_memory_limit() {
    isolate!();
    // 400 MiB, far under this machine's memory: batches of 8 crops of 1024² (24 MiB) run to
    // the end within it; batches of 32 (96 MiB, 192 in flight) cannot be held within the
    // default budget the container leaves, and are refused when the loader is built, saying
    // where the budget came from — never a kill by the kernel.
    let limit = 400u64 << 20;
    for batch in [32usize, 8] {
        let Some(group) = Cgroup::new(limit) else {
            eprintln!("skipped: no memory cgroup can be made here (not root?)");
            return;
        };
        let exe = std::env::current_exe().unwrap();
        let out = std::process::Command::new("sh")
            .arg("-c")
            .arg(format!(
                "echo $$ > {} && exec \"$0\" --exact bounds::child_default_loader_in_a_cgroup \
                 --ignored --nocapture --test-threads 1",
                group.procs.display()
            ))
            .arg(&exe)
            .env("FLOWGATE_TEST_BATCH", batch.to_string())
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let what = format!(
            "batch {batch}: {:?}\n{stdout}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "{what}");
        if batch == 8 {
            assert!(
                stdout.contains(&format!("RAN {CGROUP_ITEMS} items")),
                "{what}"
            );
        } else {
            assert!(
                stdout.contains("REFUSED") && stdout.contains("cannot hold a batch"),
                "{what}"
            );
        }
        assert!(stdout.contains("half of the cgroup's"), "{what}");
    }
}
