//! The loader benchmark: the same work as the peer loaders' scripts (SPDL, PyTorch DataLoader; see
//! `scripts/peers.py`), on a file list.
//!
//! ```text
//! cargo run --release -p flowgate-tools --bin bench -- images --list FILE [--batch 32] [--resize 256]
//!     [--crop 224] [--layout nchw|nhwc] [--draft true|false] [--workers N] [--dump FILE.npy]
//! cargo run --release -p flowgate-tools --bin bench -- audio --list FILE [--batch 32] [--rate 16000]
//!     [--seconds 4] [--workers N] [--dump FILE.npy] [--max-batch-seconds S [--buckets 20]]
//! cargo run --release -p flowgate-tools --features video --bin bench -- video --list FILE [--batch 8]
//!     [--frames 8] [--resize 128] [--crop 112] [--draft true|false] [--workers N] [--threads T]
//!     [--dump FILE.npy]
//! ```
//!
//! (`--dir DIR` is accepted instead of `--list`, and `--shards PATTERN` reads WebDataset tar
//! shards instead: a brace pattern or comma list of tar files whose samples are `KEY.jpg` (or
//! the workload's other extensions) and `KEY.cls`, e.g. from `flowgate gen-data --shards 100`
//! or `../shared/peers/wds_images.py --make-shards`; each sample's media field is decoded and
//! its `cls` parsed, in shard order.) One epoch, in-process, from building the
//! pipeline to the last batch; prints one JSON line:
//! `{"workload":..,"items":..,"seconds":..,"items_per_s":..,"cpu_seconds":..,"peak_rss_mb":..,
//! "batch_shape":[..],"dtype":..}`. Without `--workers` the decode stage starts at its share of
//! the cores and the tuner sizes it; `--workers N` pins it. `--draft true` decodes JPEGs in
//! draft mode (see `ImageRecipe::draft`), and video without the in-loop deblocking filter
//! (`VideoRecipe::draft`). `--dump` writes the first batch (the list's first items,
//! in list order) as a NumPy file. Audio is decoded to mono `f32`, resampled to `--rate` if the
//! files differ, cropped or zero-padded to `--seconds`. Video (feature `video`) samples
//! `--frames` frames uniformly per clip, scaled and center-cropped, as `u8` NTHWC; the tuner
//! sets the decoder threads per clip (the JSON's `item_threads`, the last setting) unless
//! `--threads T` pins them.
//! `audio --max-batch-seconds S` batches by length instead (see `bucketed_audio`): clips in
//! `--buckets` length buckets, each batch at most `S` padded seconds, padded only to its
//! longest clip; its JSON adds `batches`, `padding_fraction`, `max_batch_seconds_seen` and
//! `fixed_window_padding_fraction`.

use std::path::PathBuf;
use std::time::Instant;

use flowgate::dataset::shards::{SampleRef, ShardError, Shards};
use flowgate::dataset::Files;
use flowgate::media::audio::AudioRecipe;
use flowgate::media::image::{ImageRecipe, Layout};
use flowgate::media::MediaError;
use flowgate::{Order, Pipeline, PipelineError, Tensor, Workers};

#[cfg(feature = "video")]
use flowgate::media::video::{Sampling, VideoRecipe};

/// What each file becomes.
enum Work {
    Images(ImageRecipe),
    Audio(AudioRecipe),
    /// A video recipe, its decoder threads per clip tuned (see `Recipe::item_threads`).
    #[cfg(feature = "video")]
    Video(flowgate::media::Recipe),
}

/// One item of the epoch: a file, or a sample of a shard.
enum Item {
    File(PathBuf),
    Sample(SampleRef),
}

impl Work {
    fn load(&self, path: &std::path::Path) -> Result<Tensor, MediaError> {
        match self {
            Work::Images(r) => r.load(path),
            Work::Audio(r) => r.load(path),
            #[cfg(feature = "video")]
            Work::Video(r) => r.load(path),
        }
    }

    /// The extensions of the sample field this workload decodes.
    fn exts(&self) -> Vec<String> {
        let e: &[&str] = match self {
            Work::Images(_) => &["jpg", "jpeg", "png", "webp"],
            Work::Audio(_) => &["flac", "wav", "mp3", "ogg", "m4a"],
            #[cfg(feature = "video")]
            Work::Video(_) => &["mp4", "mkv", "webm", "mov"],
        };
        e.iter().map(|x| x.to_string()).collect()
    }

    /// Reads a shard sample, parses its label and decodes its media field.
    fn sample(&self, r: &SampleRef, exts: &[String]) -> Result<Tensor, ShardError> {
        let mut raw = r.read()?;
        if raw.fields.iter().any(|(e, _)| e == "cls") {
            raw.take_label("cls")?;
        }
        let (ext, bytes) = raw.take_required(exts)?;
        let path = raw.field_path(&ext);
        Ok(match self {
            Work::Images(r) => r.decode(&bytes, &path)?,
            Work::Audio(r) => r.decode(bytes, &path)?,
            #[cfg(feature = "video")]
            Work::Video(r) => r.decode(flowgate::Blob { path, bytes })?,
        })
    }
}

struct Args {
    workload: String,
    files: Files,
    shards: Option<Shards>,
    batch: usize,
    recipe: ImageRecipe,
    audio: AudioRecipe,
    seconds: f64,
    frames: usize,
    resize: Option<u32>,
    crop: Option<u32>,
    workers: Option<usize>,
    /// Video decoder threads per clip (tuned without it).
    threads: Option<usize>,
    dump: Option<PathBuf>,
    /// Audio in length-aware batches of at most this many padded seconds.
    max_batch_seconds: Option<f64>,
    buckets: usize,
}

fn parse() -> Result<Args, PipelineError> {
    let mut it = std::env::args().skip(1);
    let workload = it.next().unwrap_or_default();
    let mut a = Args {
        workload,
        files: Files::new(Vec::<PathBuf>::new()),
        shards: None,
        batch: 32,
        recipe: ImageRecipe::default(),
        audio: AudioRecipe::default(),
        seconds: 4.0,
        frames: 8,
        resize: None,
        crop: None,
        workers: None,
        threads: None,
        dump: None,
        max_batch_seconds: None,
        buckets: 20,
    };
    let bad = |m: String| PipelineError::config(m);
    while let Some(flag) = it.next() {
        let v = it
            .next()
            .ok_or_else(|| bad(format!("{flag} needs a value")))?;
        let num = |v: &str| {
            v.parse::<u32>()
                .map_err(|_| bad(format!("{flag}: not a number: {v}")))
        };
        match flag.as_str() {
            "--list" => a.files = Files::list(&v)?,
            "--shards" => a.shards = Some(Shards::open(&v)?),
            "--dir" => {
                a.files = Files::dir(
                    &v,
                    &[
                        "jpg", "jpeg", "png", "webp", "wav", "flac", "mp3", "ogg", "m4a", "mp4",
                        "mkv", "webm", "mov",
                    ],
                )?
            }
            "--batch" => a.batch = num(&v)? as usize,
            "--resize" => a.resize = Some(num(&v)?),
            "--crop" => a.crop = Some(num(&v)?),
            "--frames" => a.frames = num(&v)? as usize,
            "--layout" => {
                a.recipe.layout = match v.as_str() {
                    "nchw" => Layout::Nchw,
                    "nhwc" => Layout::Nhwc,
                    _ => return Err(bad(format!("--layout: nchw or nhwc, not {v}"))),
                }
            }
            "--workers" => a.workers = Some(num(&v)? as usize),
            "--threads" => a.threads = Some(num(&v)? as usize),
            "--draft" => {
                a.recipe.draft = match v.as_str() {
                    "true" | "1" => true,
                    "false" | "0" => false,
                    _ => return Err(bad(format!("--draft: true or false, not {v}"))),
                }
            }
            "--rate" => a.audio.rate = num(&v)?,
            "--seconds" => a.seconds = v.parse().map_err(|_| bad(format!("--seconds: {v}")))?,
            "--dump" => a.dump = Some(v.into()),
            "--max-batch-seconds" => {
                a.max_batch_seconds = Some(
                    v.parse()
                        .map_err(|_| bad(format!("--max-batch-seconds: {v}")))?,
                )
            }
            "--buckets" => a.buckets = num(&v)? as usize,
            _ => return Err(bad(format!("unknown flag {flag}"))),
        }
    }
    match a.workload.as_str() {
        "images" | "audio" => {}
        "video" if cfg!(feature = "video") => {}
        "video" => {
            return Err(bad(
                "the video workload needs `--features video` (FFmpeg)".into()
            ))
        }
        w => return Err(bad(format!("workload `{w}`: `images`, `audio` or `video`"))),
    }
    a.recipe.resize = a.resize.unwrap_or(a.recipe.resize);
    a.recipe.crop = a.crop.unwrap_or(a.recipe.crop);
    a.audio.samples = (a.seconds * a.audio.rate as f64).round() as usize;
    if a.files.is_empty() && a.shards.is_none() {
        return Err(bad(
            "no files: give --list FILE, --dir DIR or --shards PATTERN".into(),
        ));
    }
    Ok(a)
}

/// User plus system CPU seconds of this process so far.
fn cpu_seconds() -> f64 {
    let mut ru = std::mem::MaybeUninit::<libc_rusage>::zeroed();
    // SAFETY: getrusage fills the struct; RUSAGE_SELF = 0.
    let ok = unsafe { getrusage(0, ru.as_mut_ptr()) } == 0;
    if !ok {
        return f64::NAN;
    }
    // SAFETY: initialised by the successful call.
    let ru = unsafe { ru.assume_init() };
    let tv = |t: [i64; 2]| t[0] as f64 + t[1] as f64 / 1e6;
    tv(ru.utime) + tv(ru.stime)
}

#[repr(C)]
struct libc_rusage {
    utime: [i64; 2],
    stime: [i64; 2],
    rest: [i64; 14],
}

extern "C" {
    fn getrusage(who: i32, usage: *mut libc_rusage) -> i32;
}

/// Peak resident memory of this process, MiB (`VmHWM`).
fn peak_rss_mb() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        })
        .map_or(f64::NAN, |kb| kb / 1024.0)
}

/// Caps glibc's malloc arenas at two and fixes its mmap threshold at 128 KiB. glibc gives
/// every thread that allocates its own arena (up to 8 per core) and keeps freed memory in
/// each; a pipeline's many short-lived buffers then cost resident memory without benefit.
/// Measured here: peak RSS 141 → 83 MB (audio) and 133 → 128 MB (images), with equal or better
/// throughput. glibc also raises its mmap threshold to the largest block freed, after which
/// batch-sized blocks stay in the arenas; flowgate's tensor pool already reuses those, so a
/// fixed threshold costs nothing and took FLAC audio from 66–128 MB to 60–67 MB.
/// (`MALLOC_ARENA_MAX=2 MALLOC_MMAP_THRESHOLD_=131072` do the same for any program.)
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn cap_malloc_arenas() {
    extern "C" {
        fn mallopt(param: i32, value: i32) -> i32;
    }
    const M_ARENA_MAX: i32 = -8;
    const M_MMAP_THRESHOLD: i32 = -3;
    // SAFETY: mallopt only adjusts allocator parameters; called before any thread starts.
    unsafe {
        mallopt(M_ARENA_MAX, 2);
        mallopt(M_MMAP_THRESHOLD, 128 << 10);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn cap_malloc_arenas() {}

fn main() -> Result<(), PipelineError> {
    cap_malloc_arenas();
    let a = parse()?;
    if let Some(cap) = a.max_batch_seconds {
        if a.workload != "audio" || a.shards.is_some() {
            return Err(PipelineError::config(
                "--max-batch-seconds is for the audio workload over files",
            ));
        }
        return bucketed_audio(&a, cap);
    }
    let work = match a.workload.as_str() {
        "audio" => Work::Audio(a.audio),
        #[cfg(feature = "video")]
        "video" => {
            let d = VideoRecipe::default();
            Work::Video(
                flowgate::media::Recipe::video(VideoRecipe {
                    sampling: Sampling::Uniform(a.frames),
                    resize: a.resize.unwrap_or(d.resize),
                    crop: a.crop.unwrap_or(d.crop),
                    draft: a.recipe.draft,
                    threads: a.threads.unwrap_or(0),
                    ..d
                })
                .map_err(|e| PipelineError::config(e.to_string()))?,
            )
        }
        _ => {
            eprintln!("JPEG decoder: {}", flowgate::media::image::jpeg_decoder());
            Work::Images(a.recipe)
        }
    };
    let items: Vec<Item> = match &a.shards {
        Some(s) => s.epoch(0).into_iter().map(Item::Sample).collect(),
        None => a.files.epoch(0).into_iter().map(Item::File).collect(),
    };
    let n_files = items.len();
    let exts = work.exts();
    let item_threads = match &work {
        #[cfg(feature = "video")]
        Work::Video(r) => r.item_threads(),
        _ => None,
    };
    let workers = a.workers.map_or(Workers::auto(), Workers::fixed);
    let cpu0 = cpu_seconds();
    let t0 = Instant::now();
    let p = Pipeline::builder()
        .source(items)
        .output_order(if a.dump.is_some() {
            Order::Input
        } else {
            Order::Completion
        })
        .pipe(
            "decode",
            move |item: Item| match &item {
                Item::File(path) => work.load(path).map_err(ShardError::from),
                Item::Sample(r) => work.sample(r, &exts),
            },
            workers,
        );
    let p = match item_threads {
        Some(t) => p.item_threads(t),
        None => p,
    };
    let mut p = p.batch(a.batch, false).build()?;
    let (mut items, mut shape, mut dtype) = (0usize, Vec::new(), None);
    for batch in p.iter() {
        let batch = batch?;
        if items == 0 {
            if let Some(path) = &a.dump {
                std::fs::write(path, batch.to_npy()).map_err(|e| {
                    PipelineError::config(format!("writing {}: {e}", path.display()))
                })?;
            }
            shape = batch.shape().to_vec();
            dtype = Some(batch.dtype());
        }
        items += batch.shape()[0];
    }
    let secs = t0.elapsed().as_secs_f64();
    let cpu = cpu_seconds() - cpu0;
    let stats = p.stats();
    if std::env::var_os("BENCH_TRACE").is_some() {
        for r in p.tuner_trace() {
            eprintln!(
                "tuner @{:.1}s: rate {:.0} wait {:.2} workers {:?} queued {:?} {:?}",
                r.t,
                r.rate,
                r.wait,
                r.workers,
                r.queued,
                r.decisions.iter().map(|d| &d.reason).collect::<Vec<_>>()
            );
        }
    }
    drop(p);
    eprintln!(
        "{n_files} files, {} failed; decode workers at the end: {}",
        stats.failures,
        stats.stage("decode").map_or(0, |s| s.workers)
    );
    // Video: frames decoded per clip against frames sampled (decoding only what the
    // samples need: seeks, unreferenced frames dropped).
    #[cfg(feature = "video")]
    let video = if a.workload == "video" {
        format!(
            ",\"frames_decoded_per_clip\":{:.1},\"frames_sampled_per_clip\":{},\"item_threads\":{}",
            flowgate::media::video::frames_decoded() as f64 / items.max(1) as f64,
            a.frames,
            stats
                .stage("decode")
                .and_then(|s| s.item_threads)
                .map_or(a.threads.unwrap_or(1), |t| t.threads)
        )
    } else {
        String::new()
    };
    #[cfg(not(feature = "video"))]
    let video = String::new();
    println!(
        "{{\"workload\":\"{}\",\"items\":{items},\"seconds\":{secs:.3},\"items_per_s\":{:.1},\"cpu_seconds\":{cpu:.3},\"peak_rss_mb\":{:.1},\"batch_shape\":{shape:?},\"dtype\":\"{}\"{video}}}",
        a.workload,
        items as f64 / secs,
        peak_rss_mb(),
        dtype.map_or("none", |d| d.numpy()),
    );
    Ok(())
}

/// `audio --max-batch-seconds S`: length-aware batches (clips in length buckets, each batch's
/// clips × its longest clip at most `S` seconds, padded only to the longest), one epoch.
/// Prints the usual JSON line plus `batches`, `padding_fraction` (of the decoded batches),
/// `max_batch_seconds_seen`, `fixed_window_padding_fraction` (the same clips padded to a fixed
/// window of the longest clip, the size a fixed-shape batch needs) and `lengths_seconds` (the
/// time reading the declared lengths took, included in `seconds`).
fn bucketed_audio(a: &Args, cap: f64) -> Result<(), PipelineError> {
    use flowgate::sampler::{Bucketing, LengthBatches};
    let cpu0 = cpu_seconds();
    let t0 = Instant::now();
    let paths = a.files.epoch(0);
    let mut lengths = Vec::with_capacity(paths.len());
    for p in &paths {
        let d = flowgate::media::audio::duration(p)
            .map_err(|e| PipelineError::config(e.to_string()))?;
        lengths.push(d.ok_or_else(|| {
            PipelineError::config(format!(
                "{}: the container does not say its length",
                p.display()
            ))
        })?);
    }
    let lengths_seconds = t0.elapsed().as_secs_f64();
    let plan = LengthBatches::new(lengths, cap, Bucketing::Quantiles(a.buckets.max(1)))?.shuffle(0);
    let rate = f64::from(a.audio.rate);
    let longest = plan.lengths().iter().copied().fold(0.0, f64::max);
    let fixed = 1.0 - plan.lengths().iter().sum::<f64>() / (plan.lengths().len() as f64 * longest);
    // The window crops a clip longer than the cap (it then fills a batch of its own).
    let recipe = AudioRecipe {
        samples: (cap * rate).floor() as usize,
        ..a.audio
    };
    let slots = plan.sampler().shuffle(0).epoch(0);
    let plan = std::sync::Arc::new(plan);
    let batches = std::sync::Arc::clone(&plan);
    let workers = a.workers.map_or(Workers::auto(), Workers::fixed);
    let mut p = Pipeline::builder()
        .source(slots)
        .pipe(
            "decode",
            move |slot: usize| {
                let clips: Vec<PathBuf> = batches
                    .batch(0, slot)
                    .into_iter()
                    .map(|i| paths[i].clone())
                    .collect();
                match recipe.load_batch(&clips) {
                    (Some(b), _) => Ok(b),
                    (None, mut errors) => Err(errors.remove(0)),
                }
            },
            workers,
        )
        .build()?;
    let (mut items, mut n_batches, mut real, mut padded, mut seen) =
        (0usize, 0usize, 0.0, 0.0, 0.0f64);
    for b in p.iter() {
        let (batch, lens) = b?;
        let (rows, t) = (batch.shape()[0], batch.shape()[1]);
        items += rows;
        n_batches += 1;
        let lens: Vec<i64> = lens
            .bytes()
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")))
            .collect();
        real += lens.iter().sum::<i64>() as f64;
        padded += (rows * t) as f64;
        seen = seen.max((rows * t) as f64 / rate);
    }
    let secs = t0.elapsed().as_secs_f64();
    let cpu = cpu_seconds() - cpu0;
    let failures = p.stats().failures;
    println!(
        "{}",
        serde_json::json!({
            "workload": "audio",
            "items": items,
            "batches": n_batches,
            "seconds": secs,
            "items_per_s": items as f64 / secs,
            "cpu_seconds": cpu,
            "peak_rss_mb": peak_rss_mb(),
            "failures": failures,
            "max_batch_seconds": cap,
            "max_batch_seconds_seen": seen,
            "padding_fraction": if padded > 0.0 { 1.0 - real / padded } else { 0.0 },
            "fixed_window_padding_fraction": fixed,
            "lengths_seconds": lengths_seconds,
        })
    );
    Ok(())
}
