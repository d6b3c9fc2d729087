//! Video decoding through FFmpeg: sampling, seeking, geometry, layouts, bad files, a pipeline,
//! and the audio track of the same clip. Clips are written with `ffmpeg` (installed by
//! `scripts/setup.sh`) from frames whose grey level encodes their index.
#![cfg(feature = "video")]

use std::path::{Path, PathBuf};

use flowgate::media::video::{Sampling, VideoLayout, VideoRecipe};
use flowgate::media::MediaError;
use flowgate::synth::{clip_level, write_clip, ClipSpec};
use flowgate::{Pipeline, Tensor};

struct Dir(PathBuf);

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn dir(name: &str) -> Dir {
    let d = std::env::temp_dir().join(format!("flowgate-video-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    Dir(d)
}

/// 50 flat frames at 10 fps (5 s), 96×64, a keyframe every 10 frames.
fn flat_clip(path: &Path) -> ClipSpec {
    let spec = ClipSpec {
        width: 96,
        height: 64,
        fps: 10,
        frames: 50,
        gop: 10,
        pattern: false,
        seed: 1,
        audio_rate: None,
    };
    write_clip(path, &spec).unwrap();
    spec
}

/// A moving pattern of 150 frames at 25 fps (6 s), a keyframe every 50 frames.
fn pattern_clip(path: &Path, width: u32, height: u32, seed: u64) {
    let spec = ClipSpec {
        width,
        height,
        fps: 25,
        frames: 150,
        gop: 50,
        pattern: true,
        seed,
        audio_rate: None,
    };
    write_clip(path, &spec).unwrap();
}

fn mean(bytes: &[u8]) -> f64 {
    bytes.iter().map(|&b| f64::from(b)).sum::<f64>() / bytes.len() as f64
}

fn recipe(sampling: Sampling) -> VideoRecipe {
    VideoRecipe {
        sampling,
        resize: 64,
        crop: 64,
        ..VideoRecipe::default()
    }
}

#[test]
fn uniform_samples_are_the_frames_at_the_middle_of_each_span() {
    let d = dir("uniform");
    let clip = d.0.join("flat.mp4");
    let spec = flat_clip(&clip);
    let t = recipe(Sampling::Uniform(5)).load(&clip).unwrap();
    assert_eq!(t.shape(), [5, 64, 64, 3]);
    for k in 0..5 {
        // Spans of 1 s; middles at 0.5, 1.5, ... s: frames 5, 15, 25, 35, 45.
        let want = f64::from(clip_level(5 + 10 * k as u32, spec.frames));
        let got = mean(t.item(k));
        assert!(
            (got - want).abs() < 3.0,
            "sample {k}: mean {got}, want {want}"
        );
    }
}

#[test]
fn timestamps_far_apart_are_reached_by_seeking_and_match_decoding_forward() {
    let d = dir("seek");
    let clip = d.0.join("flat.mp4");
    let spec = flat_clip(&clip);
    let times = vec![0.0, 0.35, 2.05, 4.6];
    let frames = [0u32, 3, 20, 46];
    let seeking = recipe(Sampling::At(times.clone())).load(&clip).unwrap();
    let forward = VideoRecipe {
        seek_gap: f64::INFINITY,
        ..recipe(Sampling::At(times))
    }
    .load(&clip)
    .unwrap();
    for (k, &f) in frames.iter().enumerate() {
        let want = f64::from(clip_level(f, spec.frames));
        let got = mean(seeking.item(k));
        assert!((got - want).abs() < 3.0, "t#{k}: mean {got}, want {want}");
    }
    assert_eq!(seeking.bytes(), forward.bytes());
}

#[test]
fn geometry_follows_torchvision_and_layouts_are_permutations() {
    let d = dir("layout");
    let clip = d.0.join("pattern.mp4");
    write_clip(
        &clip,
        &ClipSpec {
            width: 160,
            height: 96,
            frames: 20,
            audio_rate: None,
            ..ClipSpec::default()
        },
    )
    .unwrap();
    let base = VideoRecipe {
        sampling: Sampling::Uniform(3),
        resize: 48,
        crop: 40,
        ..VideoRecipe::default()
    };
    let a = base.load(&clip).unwrap();
    let b = VideoRecipe {
        layout: VideoLayout::Ncthw,
        ..base.clone()
    }
    .load(&clip)
    .unwrap();
    assert_eq!(a.shape(), [3, 40, 40, 3]);
    assert_eq!(b.shape(), [3, 3, 40, 40]);
    let (a, b) = (a.bytes(), b.bytes());
    for t in 0..3 {
        for y in 0..40 {
            for x in 0..40 {
                for c in 0..3 {
                    assert_eq!(
                        a[((t * 40 + y) * 40 + x) * 3 + c],
                        b[((c * 3 + t) * 40 + y) * 40 + x]
                    );
                }
            }
        }
    }
    let bytes = std::fs::read(&clip).unwrap();
    let from_memory = base
        .decode(&bytes, Path::new("s3/key/pattern.mp4"))
        .unwrap();
    assert_eq!(from_memory.bytes(), a);
}

#[test]
fn bad_clips_are_typed_errors_naming_the_file() {
    let d = dir("bad");
    let good = d.0.join("good.mp4");
    flat_clip(&good);
    let bytes = std::fs::read(&good).unwrap();
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("empty.mp4", Vec::new()),
        (
            "random.mp4",
            (0..20_000u32)
                .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
                .collect(),
        ),
        ("truncated.mp4", bytes[..bytes.len() / 2].to_vec()),
        ("text.mp4", b"not a video at all".to_vec()),
    ];
    let r = recipe(Sampling::Uniform(4));
    for (name, content) in &cases {
        let path = d.0.join(name);
        std::fs::write(&path, content).unwrap();
        let err = r.load(&path).unwrap_err();
        assert_eq!(err.path(), path, "{name}: {err}");
        if content.is_empty() {
            assert!(matches!(err, MediaError::Empty { .. }), "{err}");
        }
    }
    // A clip that ends before the sample asked for.
    let err = recipe(Sampling::At(vec![1.0, 9.0]))
        .load(&good)
        .unwrap_err();
    assert!(err.to_string().contains("before the sample"), "{err}");
    let missing = d.0.join("missing.mp4");
    assert!(matches!(
        r.load(&missing).unwrap_err(),
        MediaError::Read { .. }
    ));
    let audio_only = d.0.join("tone.m4a");
    let status = std::process::Command::new("ffmpeg")
        .args(["-y", "-loglevel", "error", "-f", "lavfi", "-i"])
        .arg("sine=frequency=440:sample_rate=16000:duration=1")
        .arg(&audio_only)
        .status()
        .unwrap();
    assert!(status.success());
    let err = r.load(&audio_only).unwrap_err();
    assert!(err.to_string().contains("no video stream"), "{err}");
}

#[test]
fn a_pipeline_batches_clips_and_their_audio_tracks() {
    use flowgate::media::audio::AudioRecipe;
    let d = dir("pipeline");
    let mut paths = Vec::new();
    for i in 0..6 {
        let p = d.0.join(format!("clip{i}.mp4"));
        write_clip(
            &p,
            &ClipSpec {
                frames: 30,
                seed: i,
                ..ClipSpec::default()
            },
        )
        .unwrap();
        paths.push(p);
    }
    let broken = d.0.join("broken.mp4");
    std::fs::write(&broken, b"\0\0\0\x18ftypmp42").unwrap();
    paths.push(broken);
    let video = VideoRecipe::default();
    let audio = AudioRecipe {
        rate: 16_000,
        samples: 16_000,
        ..AudioRecipe::default()
    };
    let mut p = Pipeline::builder()
        .source(paths)
        .pipe(
            "decode",
            move |path: PathBuf| -> Result<(Tensor, Tensor), MediaError> {
                Ok((video.load(&path)?, audio.load(&path)?))
            },
            2,
        )
        .aggregate(3, false)
        .build()
        .unwrap();
    let batches: Vec<_> = p.iter().map(Result::unwrap).collect();
    assert_eq!(batches.iter().map(Vec::len).sum::<usize>(), 6);
    for batch in batches {
        let (frames, tracks): (Vec<Tensor>, Vec<Tensor>) = batch.into_iter().unzip();
        let frames = Tensor::stack(&frames).unwrap();
        let tracks = Tensor::stack(&tracks).unwrap();
        assert_eq!(&frames.shape()[1..], [8, 112, 112, 3]);
        assert_eq!(&tracks.shape()[1..], [16_000]);
        assert!(tracks.bytes().iter().any(|&b| b != 0), "the tone is there");
    }
    let stats = p.stats();
    assert_eq!(stats.failures, 1);
    assert!(stats.recent_failures[0].contains("broken.mp4"));
}

#[test]
fn frames_and_durations_past_the_limits_are_typed_errors() {
    let d = dir("limits");
    let clip = d.0.join("flat.mp4");
    flat_clip(&clip);
    let limited = |max_pixels: u64, max_seconds: f64| VideoRecipe {
        limits: flowgate::media::Limits {
            max_pixels,
            max_seconds,
            ..Default::default()
        },
        ..recipe(Sampling::Uniform(2))
    };
    match limited(96 * 64 - 1, 3600.0).load(&clip) {
        Err(MediaError::TooLarge {
            what, value, limit, ..
        }) => assert_eq!((what, value, limit), ("pixels", 96 * 64, 96 * 64 - 1)),
        other => panic!("{other:?}"),
    }
    match limited(96 * 64, 4.0).load(&clip) {
        Err(MediaError::TooLarge { what, limit, .. }) => assert_eq!((what, limit), ("seconds", 4)),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        limited(96 * 64, 5.5).load(&clip).unwrap().shape(),
        [2, 64, 64, 3]
    );
}

/// Rate sampling: a clip's frames follow its declared duration (read from the header without
/// decoding), are the frames shown at `(k + 0.5) / fps` (the same as asking for those times),
/// and clips of different lengths pad into one batch with their lengths.
#[test]
fn rate_sampling_follows_the_clips_length_and_pads_into_a_batch() {
    let d = dir("rate");
    let long = d.0.join("long.mp4");
    let spec = flat_clip(&long); // 5 s at 10 fps
    let short = d.0.join("short.mp4");
    write_clip(
        &short,
        &ClipSpec {
            frames: 20, // 2 s
            ..spec
        },
    )
    .unwrap();
    let secs = flowgate::media::video::duration(&long).unwrap().unwrap();
    assert!((secs - 5.0).abs() < 0.15, "{secs}");
    let r = recipe(Sampling::Rate { fps: 2.0, max: 8 });
    assert_eq!(r.planned_frames(secs), 8, "10 frames at 2 fps, cut at 8");
    let short_secs = flowgate::media::video::duration(&short).unwrap().unwrap();
    assert_eq!(r.planned_frames(short_secs), 4);
    assert_eq!(
        r.planned_frames(0.2),
        1,
        "a clip shorter than 1/fps: one frame"
    );
    let (a, n) = r.load_with_length(&long).unwrap();
    assert_eq!((n, a.shape()), (8, &[8usize, 64, 64, 3][..]));
    let times: Vec<f64> = (0..8).map(|k| (k as f64 + 0.5) / 2.0).collect();
    let at = recipe(Sampling::At(times)).load(&long).unwrap();
    assert_eq!(a.bytes(), at.bytes(), "the frames at (k + 0.5) / fps");
    for k in 0..8 {
        // 0.25 s, 0.75 s, ...: frames 2, 7, 12, ... at 10 fps.
        let want = f64::from(clip_level(2 + 5 * k as u32, spec.frames));
        assert!((mean(a.item(k)) - want).abs() < 3.0, "frame {k}");
    }
    let (b, m) = r.load_with_length(&short).unwrap();
    assert_eq!(m, 4);
    let (batch, lengths) = flowgate::collate::pad_longest(&[(a, n), (b, m)]);
    assert_eq!(batch.shape(), [2, 8, 64, 64, 3]);
    assert_eq!(lengths.bytes(), Tensor::from_i64(&[8, 4]).bytes());
    let row = batch.item(1);
    let frame = 64 * 64 * 3;
    assert!(row[4 * frame..].iter().all(|&x| x == 0), "padding is zeros");
    assert!(row[..4 * frame].iter().any(|&x| x != 0));
    let bad = recipe(Sampling::Rate { fps: 0.0, max: 8 });
    assert_eq!(bad.validate().unwrap_err().field(), "fps");
}

/// Window sampling: the frames are consecutive at the stride (read from the grey level each
/// frame encodes), the window is centered without `random`, and with it the start is drawn
/// anew every epoch, the same for the same seed, epoch and file (so a resume redraws it).
#[test]
fn window_sampling_takes_consecutive_frames_at_the_stride_reproducibly() {
    let d = dir("window");
    let clip = d.0.join("flat.mp4");
    let spec = flat_clip(&clip); // 50 frames at 10 fps
    let index = |t: &Tensor, k: usize| {
        // The frame whose level is nearest the sample's mean.
        let m = mean(t.item(k));
        (0..spec.frames)
            .min_by(|&a, &b| {
                let da = (f64::from(clip_level(a, spec.frames)) - m).abs();
                let db = (f64::from(clip_level(b, spec.frames)) - m).abs();
                da.total_cmp(&db)
            })
            .unwrap()
    };
    let window = |random, seed, epoch| {
        recipe(Sampling::Window {
            frames: 4,
            stride: 3,
            random,
        })
        .with_seed(seed)
        .for_epoch(epoch)
        .load(&clip)
        .unwrap()
    };
    let frames = |t: &Tensor| (0..4).map(|k| index(t, k)).collect::<Vec<u32>>();
    let centered = frames(&window(false, 0, 0));
    assert_eq!(
        centered,
        [20, 23, 26, 29],
        "a 10-frame window in the middle of 50 (start 40 / 2)"
    );
    let mut starts = std::collections::BTreeSet::new();
    for epoch in 0..6 {
        let a = window(true, 7, epoch);
        let f = frames(&a);
        assert!(
            f.windows(2).all(|w| w[1] == w[0] + 3),
            "epoch {epoch}: {f:?} not consecutive at stride 3"
        );
        assert!(f[3] < spec.frames);
        assert_eq!(a.bytes(), window(true, 7, epoch).bytes(), "reproducible");
        starts.insert(f[0]);
    }
    assert!(
        starts.len() >= 3,
        "the start is drawn anew every epoch: {starts:?}"
    );
    let other_seed: Vec<u32> = (0..6).map(|e| frames(&window(true, 8, e))[0]).collect();
    let same_seed: Vec<u32> = (0..6).map(|e| frames(&window(true, 7, e))[0]).collect();
    assert_ne!(other_seed, same_seed, "another seed, other windows");
    let bad = recipe(Sampling::Window {
        frames: 4,
        stride: 0,
        random: false,
    });
    assert_eq!(bad.validate().unwrap_err().field(), "stride");
}

/// Dropping unreferenced frames on the way to a sample changes no sampled frame: every
/// sampling mode gives the same bytes with `skip_unreferenced` on and off, on a clip with
/// B-frames and a moving pattern.
#[test]
fn skipping_unreferenced_frames_keeps_the_sampled_frames_identical() {
    let d = dir("skip");
    let clip = d.0.join("pattern.mp4");
    pattern_clip(&clip, 160, 120, 3);
    for sampling in [
        Sampling::Uniform(8),
        Sampling::At(vec![0.0, 0.37, 1.5, 2.02, 5.9]),
        Sampling::Window {
            frames: 6,
            stride: 4,
            random: true,
        },
        Sampling::Rate { fps: 3.0, max: 30 },
    ] {
        let on = VideoRecipe {
            skip_unreferenced: true,
            ..recipe(sampling.clone())
        }
        .with_seed(1)
        .for_epoch(2);
        let off = VideoRecipe {
            skip_unreferenced: false,
            ..on.clone()
        };
        let (a, b) = (on.load(&clip).unwrap(), off.load(&clip).unwrap());
        assert_eq!(a.shape(), b.shape(), "{sampling:?}");
        assert!(a.bytes() == b.bytes(), "{sampling:?}: the frames differ");
    }
}

/// Draft mode (no in-loop deblocking filter) stays close to the full decode: bounded mean and
/// 99th-percentile differences in every sampling mode.
#[test]
fn draft_mode_stays_close_to_the_full_decode() {
    let d = dir("draft");
    let clip = d.0.join("pattern.mp4");
    pattern_clip(&clip, 320, 240, 5);
    let mut total = (0.0, 0usize);
    for sampling in [
        Sampling::Uniform(8),
        Sampling::At(vec![0.0, 0.37, 1.5, 1.9, 5.9]),
        Sampling::Window {
            frames: 4,
            stride: 4,
            random: true,
        },
    ] {
        let exact = VideoRecipe {
            resize: 128,
            crop: 112,
            ..recipe(sampling.clone())
        }
        .with_seed(1);
        let draft = VideoRecipe {
            draft: true,
            ..exact.clone()
        };
        let (a, b) = (exact.load(&clip).unwrap(), draft.load(&clip).unwrap());
        assert_eq!(a.shape(), b.shape(), "{sampling:?}");
        let mut diffs: Vec<u8> = a
            .bytes()
            .iter()
            .zip(b.bytes())
            .map(|(x, y)| x.abs_diff(*y))
            .collect();
        let mean = diffs.iter().map(|&d| f64::from(d)).sum::<f64>() / diffs.len() as f64;
        diffs.sort_unstable();
        let p99 = diffs[diffs.len() * 99 / 100];
        assert!(
            mean < 0.5 && p99 <= 8,
            "{sampling:?}: mean {mean:.3}, p99 {p99}"
        );
        total.0 += mean;
        total.1 += 1;
    }
    // The filter was skipped somewhere: a sample far from its keyframe differs a little.
    assert!(total.0 > 0.0, "draft mode changed nothing");
}

/// With `threads: 0` the tuner sets the decoder threads per clip: clips decoded on one pinned
/// worker while cores sit idle get a trial of more threads (in the trace, kept only if it
/// pays); frame threads give the same frames as one thread.
#[test]
fn the_tuner_gives_clips_threads_where_the_workers_are_pinned() {
    use flowgate::media::Recipe;
    use flowgate::tuner::Action;
    use std::time::Duration;

    let d = dir("threads");
    let clip = d.0.join("pattern.mp4");
    pattern_clip(&clip, 320, 240, 5);
    let one = VideoRecipe {
        threads: 1,
        ..recipe(Sampling::Uniform(8))
    };
    let four = VideoRecipe {
        threads: 4,
        ..one.clone()
    };
    assert!(
        one.load(&clip).unwrap().bytes() == four.load(&clip).unwrap().bytes(),
        "frame threads changed the frames"
    );
    assert!(
        Recipe::video(one).unwrap().item_threads().is_none(),
        "pinned"
    );

    let r = Recipe::video(recipe(Sampling::Uniform(8))).unwrap();
    let knob = r.item_threads().expect("threads: 0 is the tuner's");
    assert_eq!(
        knob.get(),
        1,
        "one thread per clip until the tuner says otherwise"
    );
    // The trial needs 2 s of measurement first: clips are fed until it shows (at most 3,000,
    // a minute on a slow machine), so that a fast machine does not finish first.
    let cores = flowgate::tuner::process_cores();
    let n = if cores >= 2 { 3000 } else { 240 };
    let mut p = Pipeline::builder()
        .source(vec![clip.clone(); n])
        .pipe(
            "decode",
            move |p: PathBuf| r.load(&p),
            flowgate::Workers::fixed(1),
        )
        .item_threads(knob.clone())
        .batch(4, false)
        .autotune(flowgate::TunerSettings {
            tick: Some(Duration::from_millis(50)),
            ..Default::default()
        })
        .build()
        .unwrap();
    let decisions = |trace: &[flowgate::TraceRecord]| -> Vec<String> {
        trace
            .iter()
            .flat_map(|r| &r.decisions)
            .filter(|d| matches!(d.action, Action::SetItemThreads { stage: 0, .. }))
            .map(|d| d.reason.clone())
            .collect()
    };
    let monitor = p.monitor();
    let mut delivered = 0;
    for b in p.iter() {
        delivered += b.unwrap().shape()[0];
        if cores >= 2 && delivered % 40 == 0 && !decisions(&monitor.tuner_trace()).is_empty() {
            break;
        }
    }
    assert!(delivered <= n);
    let raised = decisions(&p.tuner_trace());
    let stats = p.stats();
    let seen = stats.stage("decode").unwrap().item_threads.unwrap();
    assert_eq!(seen.threads, knob.get());
    assert!((1..=cores).contains(&knob.get()), "{} threads", knob.get());
    if cores >= 2 {
        // A trial with the rate it must beat; whether it is kept depends on the machine.
        assert!(
            raised
                .first()
                .is_some_and(|r| r.contains("trying more threads per item")),
            "no trial on {cores} cores: {raised:?}"
        );
    } else {
        assert!(raised.is_empty(), "{raised:?}");
    }
}

/// A video loader's batch size defaults to `DEFAULT_VIDEO_BATCH_SIZE` clips in every front end:
/// the Rust builder and `LoaderSettings` (32 clips before, where Python and pipeline files
/// took 8).
#[test]
fn a_video_loaders_default_batch_is_the_video_default_in_rust_too() {
    use flowgate::dataset::{Dataset, Source};
    use flowgate::loader::{LoaderSettings, DEFAULT_VIDEO_BATCH_SIZE};
    use flowgate::media::MediaArgs;
    use flowgate::Loader;
    let clips: Vec<String> = (0..20).map(|i| format!("/nowhere/{i}.mp4")).collect();
    let dataset = || {
        Dataset::builder(Source::files(clips.clone()))
            .build()
            .unwrap()
    };
    let r = flowgate::media::Recipe::video(recipe(Sampling::Uniform(4))).unwrap();
    let l = Loader::builder(dataset(), r.clone()).build().unwrap();
    assert_eq!(l.len(), 20_usize.div_ceil(DEFAULT_VIDEO_BATCH_SIZE));
    let media = MediaArgs::Video(Default::default());
    let s = LoaderSettings::default();
    let l = s
        .builder(dataset(), r.clone(), &media)
        .unwrap()
        .build()
        .unwrap();
    assert_eq!(l.len(), 20_usize.div_ceil(DEFAULT_VIDEO_BATCH_SIZE));
    let s = LoaderSettings {
        batch_size: Some(5),
        ..LoaderSettings::default()
    };
    let l = s.builder(dataset(), r, &media).unwrap().build().unwrap();
    assert_eq!(l.len(), 4, "a batch size given is kept");
}
