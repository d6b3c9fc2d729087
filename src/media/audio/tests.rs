//! The audio decoder's tests: formats, channels, crops and padding, resampling, random
//! windows, lengths, bad files.

use super::*;

/// Inputs the fuzzer (`scripts/fuzz.sh`) crashed on: each must give a result or a typed
/// error. The first byte picks the extension hint, as in `fuzz/fuzz_targets/audio.rs`.
#[test]
fn fuzz_findings_are_errors_not_panics() {
    let data: &[u8] = include_bytes!("../../../tests/data/fuzz/audio-aac-adts-overflow.bin");
    let (hint, bytes) = data.split_first().expect("bytes");
    let ext = ["wav", "flac", "mp3", "ogg", "m4a"][usize::from(*hint) % 5];
    let recipe = AudioRecipe {
        rate: 16_000,
        samples: 4_000,
        ..AudioRecipe::default()
    };
    let path = format!("fuzz.{ext}");
    match recipe.decode(bytes.to_vec(), Path::new(&path)) {
        Ok(t) => assert_eq!(t.shape(), [4_000]),
        Err(e) => assert!(e.to_string().contains(&path), "{e}"),
    }
}

fn wav(rate: u32, channels: u16, frames: &[[i16; 2]]) -> Vec<u8> {
    let data = (frames.len() * 2 * channels as usize) as u32;
    let mut v = Vec::new();
    v.extend_from_slice(b"RIFF");
    v.extend_from_slice(&(36 + data).to_le_bytes());
    v.extend_from_slice(b"WAVEfmt ");
    v.extend_from_slice(&16u32.to_le_bytes());
    v.extend_from_slice(&1u16.to_le_bytes());
    v.extend_from_slice(&channels.to_le_bytes());
    v.extend_from_slice(&rate.to_le_bytes());
    v.extend_from_slice(&(rate * 2 * channels as u32).to_le_bytes());
    v.extend_from_slice(&(2 * channels).to_le_bytes());
    v.extend_from_slice(&16u16.to_le_bytes());
    v.extend_from_slice(b"data");
    v.extend_from_slice(&data.to_le_bytes());
    for f in frames {
        for s in &f[..channels as usize] {
            v.extend_from_slice(&s.to_le_bytes());
        }
    }
    v
}

fn floats(t: &Tensor) -> Vec<f32> {
    t.bytes()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

#[test]
fn random_crops_are_windows_of_the_clip_seeded_by_file_and_seed() {
    // A ramp: sample i is i, so a window's first sample is its offset.
    let frames: Vec<[i16; 2]> = (0..3000).map(|i| [i as i16, 0]).collect();
    let clip = wav(16_000, 1, &frames);
    let r = AudioRecipe {
        samples: 1000,
        random_crop: true,
        ..AudioRecipe::default()
    };
    let offsets: Vec<usize> = (0..40)
        .map(|seed| {
            let t = r
                .with_seed(seed)
                .decode(clip.clone(), Path::new("r.wav"))
                .unwrap();
            let v = floats(&t);
            let start = (v[0] * 32768.0).round() as usize;
            for (k, &x) in v.iter().enumerate() {
                assert_eq!(
                    (x * 32768.0).round() as usize,
                    start + k,
                    "a contiguous window"
                );
            }
            start
        })
        .collect();
    assert!(offsets.iter().all(|&o| o <= 2000), "inside the clip");
    let mut distinct = offsets.clone();
    distinct.sort_unstable();
    distinct.dedup();
    assert!(distinct.len() > 30, "spread over the clip: {offsets:?}");
    let again = r
        .with_seed(7)
        .decode(clip.clone(), Path::new("r.wav"))
        .unwrap();
    let other = r
        .with_seed(7)
        .decode(clip.clone(), Path::new("s.wav"))
        .unwrap();
    assert_eq!(
        floats(&again)[0] * 32768.0,
        offsets[7] as f32,
        "reproducible"
    );
    assert_ne!(
        floats(&other)[0],
        floats(&again)[0],
        "another file, another window"
    );
    // A clip shorter than the window: from the start, padded, and its real length told.
    let short = AudioRecipe { samples: 4000, ..r };
    let dir = std::env::temp_dir().join(format!("flowgate-audio-len-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join("short.wav");
    std::fs::write(&p, &clip).unwrap();
    let (t, len) = short.load_with_length(&p).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!((t.shape(), len), (&[4000][..], 3000));
    assert_eq!(floats(&t)[0], 0.0);
    assert!(floats(&t)[3000..].iter().all(|&x| x == 0.0));
}

#[test]
fn mixes_crops_and_pads() {
    let frames: Vec<[i16; 2]> = (0..100).map(|i| [i * 100, -(i * 100)]).collect();
    let stereo = wav(16_000, 2, &frames);
    let r = AudioRecipe {
        samples: 150,
        ..AudioRecipe::default()
    };
    let mono = r.decode(stereo.clone(), Path::new("a.wav")).unwrap();
    assert_eq!(mono.shape(), &[150]);
    assert!(
        floats(&mono).iter().all(|&v| v.abs() < 1e-6),
        "L and -L mix to silence"
    );
    let keep = AudioRecipe {
        channels: Channels::Keep,
        ..r
    }
    .decode(stereo, Path::new("a.wav"))
    .unwrap();
    assert_eq!(keep.shape(), &[2, 150]);
    let v = floats(&keep);
    assert!((v[10] - 1000.0 / 32768.0).abs() < 1e-6);
    assert!((v[150 + 10] + 1000.0 / 32768.0).abs() < 1e-6);
    assert!(v[100..150].iter().all(|&x| x == 0.0), "zero-padded");
    let short = AudioRecipe { samples: 40, ..r }
        .decode(wav(16_000, 1, &frames), Path::new("m.wav"))
        .unwrap();
    assert_eq!(short.shape(), &[40]);
    assert!(
        (floats(&short)[39] - 3900.0 / 32768.0).abs() < 1e-6,
        "cropped"
    );
}

/// `samples` (16-bit, mono, 16 kHz) encoded as FLAC.
fn flac(samples: &[i32]) -> flacenc::bitsink::ByteSink {
    use flacenc::component::BitRepr;
    use flacenc::error::Verify;
    let config = flacenc::config::Encoder::default().into_verified().unwrap();
    let source = flacenc::source::MemSource::from_samples(samples, 1, 16, 16_000);
    let stream = flacenc::encode_with_fixed_block_size(&config, source, config.block_size).unwrap();
    let mut sink = flacenc::bitsink::ByteSink::new();
    stream.write(&mut sink).unwrap();
    sink
}

#[test]
fn flac_stops_at_the_declared_length_and_pads_with_zeros() {
    // 5000 samples: the encoder's last 4096-sample block is only partly real.
    let samples: Vec<i32> = (0..5000).map(|i| ((i * 37) % 2000) - 1000).collect();
    let sink = flac(&samples);
    let r = AudioRecipe {
        samples: 9000,
        ..AudioRecipe::default()
    };
    // A recycled buffer full of NaNs, so that padding must really be written.
    let mut dirty = Tensor::for_overwrite(&[9000], DType::F32);
    dirty.bytes_mut().fill(0xff);
    drop(dirty);
    // Random windows across FLAC's 4096-frame blocks are the samples at their offsets.
    let window = AudioRecipe {
        samples: 1500,
        random_crop: true,
        ..AudioRecipe::default()
    };
    for seed in 0..12 {
        let w = floats(
            &window
                .with_seed(seed)
                .decode(sink.as_slice().to_vec(), Path::new("c.flac"))
                .unwrap(),
        );
        let at = (0..=3500)
            .find(|&o| (0..1500).all(|k| (w[k] * 32768.0).round() as i32 == samples[o + k]))
            .expect("a window of the clip");
        assert!(at + 1500 <= 5000);
    }
    let v = floats(
        &r.decode(sink.as_slice().to_vec(), Path::new("c.flac"))
            .unwrap(),
    );
    for (i, &s) in samples.iter().enumerate() {
        assert!((v[i] - s as f32 / 32768.0).abs() < 1e-6, "sample {i}");
    }
    assert!(
        v[5000..].iter().all(|&x| x == 0.0),
        "padding past the stream's end is zero"
    );
}

#[test]
fn other_rates_are_resampled_keeping_pitch_and_length() {
    // 0.5 s of a 1 kHz tone at 44.1 kHz, stereo (right channel silent).
    let frames: Vec<[i16; 2]> = (0..22_050)
        .map(|i| {
            let v = (i as f64 * std::f64::consts::TAU * 1000.0 / 44_100.0).sin();
            [(v * 16_000.0) as i16, 0]
        })
        .collect();
    let r = AudioRecipe {
        rate: 16_000,
        samples: 10_000,
        channels: Channels::Keep,
        ..AudioRecipe::default()
    };
    let t = r
        .decode(wav(44_100, 2, &frames), Path::new("tone.wav"))
        .unwrap();
    assert_eq!(t.shape(), &[2, 10_000]);
    let v = floats(&t);
    let (left, right) = v.split_at(10_000);
    // 0.5 s at 16 kHz is 8,000 samples, then zeros.
    assert!(left[8_100..].iter().all(|&x| x == 0.0));
    assert!(right.iter().all(|&x| x.abs() < 1e-3));
    // Same pitch: compare with the ideal 1 kHz tone at 16 kHz, away from the edges.
    for (i, &x) in left.iter().enumerate().take(7_500).skip(500) {
        let ideal =
            (i as f64 * std::f64::consts::TAU * 1000.0 / 16_000.0).sin() * 16_000.0 / 32_768.0;
        assert!(
            (f64::from(x) - ideal).abs() < 0.01,
            "sample {i}: {x} vs {ideal}"
        );
    }
    let mono = AudioRecipe {
        channels: Channels::Mono,
        ..r
    }
    .decode(wav(44_100, 2, &frames), Path::new("tone.wav"))
    .unwrap();
    assert_eq!(mono.shape(), &[10_000]);
}

#[test]
fn bad_audio_is_a_typed_error_naming_the_file() {
    let r = AudioRecipe::default();
    let p = Path::new("clips/bad.flac");
    assert!(matches!(
        r.decode(Vec::new(), p),
        Err(MediaError::Empty { .. })
    ));
    let e = r
        .decode(b"RIFF garbage garbage garbage".to_vec(), p)
        .unwrap_err();
    assert!(e.to_string().contains("clips/bad.flac"), "{e}");
    let frames: Vec<[i16; 2]> = (0..20_000).map(|i| [i as i16, 0]).collect();
    let full = wav(16_000, 1, &frames);
    assert!(
        r.decode(full[..full.len() / 2].to_vec(), p).is_err(),
        "truncated"
    );
}

/// A WAV with a valid header and no samples is a failed item in both modes: not 2 s of
/// zeros from `load`/`decode`, not a row of length 0 in a length-aware batch.
#[test]
fn a_clip_without_samples_is_a_failed_item_in_every_mode() {
    let r = AudioRecipe::default();
    let dir = std::env::temp_dir().join(format!("flowgate-silent-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let empty = dir.join("empty.wav");
    std::fs::write(&empty, wav(16_000, 1, &[])).unwrap();
    let e = r.load(&empty).unwrap_err();
    assert!(e.to_string().contains("no audio samples"), "{e}");
    let e = r.decode(wav(16_000, 1, &[]), &empty).unwrap_err();
    assert!(e.to_string().contains("empty.wav"), "{e}");
    let good = dir.join("good.wav");
    let frames: Vec<[i16; 2]> = (0..8_000).map(|i| [i as i16, 0]).collect();
    std::fs::write(&good, wav(16_000, 1, &frames)).unwrap();
    let (batch, errors) = r.load_batch(&[empty.clone(), good.clone()]);
    let (audio, lengths) = batch.expect("the good clip");
    assert_eq!(
        audio.shape()[0],
        1,
        "the empty clip is left out of its batch"
    );
    assert_eq!(lengths.shape(), [1]);
    assert_eq!(errors.len(), 1);
    assert!(errors[0].to_string().contains("no audio samples"));
    let (batch, errors) = r.load_batch(&[empty]);
    assert!(batch.is_none() && errors.len() == 1);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A WAV with a float or 16-bit data chunk after an unrelated chunk; `extensible` writes
/// WAVE_FORMAT_EXTENSIBLE's longer `fmt `.
fn wav_with(rate: u32, channels: u16, float: bool, extensible: bool, samples: &[f32]) -> Vec<u8> {
    let width: u16 = if float { 4 } else { 2 };
    let mut data = Vec::new();
    for &s in samples {
        if float {
            data.extend_from_slice(&s.to_le_bytes());
        } else {
            data.extend_from_slice(&((s * 32_767.0) as i16).to_le_bytes());
        }
    }
    let mut fmt = Vec::new();
    let tag: u16 = if float { 3 } else { 1 };
    fmt.extend_from_slice(&(if extensible { 0xFFFE } else { tag }).to_le_bytes());
    fmt.extend_from_slice(&channels.to_le_bytes());
    fmt.extend_from_slice(&rate.to_le_bytes());
    fmt.extend_from_slice(&(rate * u32::from(width * channels)).to_le_bytes());
    fmt.extend_from_slice(&(width * channels).to_le_bytes());
    fmt.extend_from_slice(&(width * 8).to_le_bytes());
    if extensible {
        fmt.extend_from_slice(&22u16.to_le_bytes());
        fmt.extend_from_slice(&(width * 8).to_le_bytes());
        fmt.extend_from_slice(&0u32.to_le_bytes());
        fmt.extend_from_slice(&tag.to_le_bytes());
        fmt.extend_from_slice(b"\x00\x00\x00\x00\x10\x00\x80\x00\x00\xAA\x00\x38\x9B\x71");
    }
    let mut v = Vec::new();
    v.extend_from_slice(b"RIFF");
    v.extend_from_slice(&(4 + 8 + fmt.len() + 8 + 3 + 1 + 8 + data.len()).to_le_bytes()[..4]);
    v.extend_from_slice(b"WAVEfmt ");
    v.extend_from_slice(&(fmt.len() as u32).to_le_bytes());
    v.extend_from_slice(&fmt);
    // An odd-sized chunk before the data (padded to even, as RIFF says).
    v.extend_from_slice(b"junk");
    v.extend_from_slice(&3u32.to_le_bytes());
    v.extend_from_slice(b"abc\0");
    v.extend_from_slice(b"data");
    v.extend_from_slice(&(data.len() as u32).to_le_bytes());
    v.extend_from_slice(&data);
    v
}

/// The direct WAV reader gives symphonia's samples bit for bit (formats, channels, mono
/// mixing, crops, random windows, padding), from files and from bytes, and leaves to
/// symphonia what it does not read (24-bit, another rate, a header that lies about the data).
#[test]
fn direct_wav_reading_matches_symphonia_bit_for_bit() {
    let dir = std::env::temp_dir().join(format!("flowgate-wav-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut rng = flowgate_tuner::Rng::new(9);
    let mut n = 0;
    for (channels, float, extensible, frames) in [
        (1u16, false, false, 5_000usize),
        (2, false, false, 5_000),
        (3, false, true, 1_500),
        (2, true, false, 5_000),
        (1, true, true, 800),
    ] {
        let samples: Vec<f32> = (0..frames * channels as usize)
            .map(|_| (rng.uniform() * 2.0 - 1.0) as f32)
            .collect();
        let bytes = wav_with(16_000, channels, float, extensible, &samples);
        let path = dir.join(format!("c{channels}-{float}-{extensible}.wav"));
        std::fs::write(&path, &bytes).unwrap();
        for (samples, mono, random_crop, seed) in [
            (2_000, true, false, 0),
            (2_000, false, false, 0),
            (2_000, true, true, 4),
            (2_000, false, true, 5),
            (9_000, true, false, 0),
        ] {
            let r = AudioRecipe {
                rate: 16_000,
                samples,
                channels: if mono { Channels::Mono } else { Channels::Keep },
                random_crop,
                seed,
                ..AudioRecipe::default()
            };
            let direct = r.load_wav(&path).expect("read directly").unwrap();
            let from_bytes = r.decode_wav(&bytes, &path).expect("read directly").unwrap();
            let symphonia = r
                .decode_source(Box::new(std::io::Cursor::new(bytes.clone())), &path)
                .unwrap();
            assert_eq!(
                direct.1, symphonia.1,
                "{path:?} {samples} {mono} {random_crop}"
            );
            assert_eq!(direct.0.shape(), symphonia.0.shape());
            assert!(
                direct.0.bytes() == symphonia.0.bytes(),
                "{path:?} {samples} {mono}"
            );
            assert!(from_bytes.0.bytes() == symphonia.0.bytes());
            // And through the public entry points.
            assert!(r.load(&path).unwrap().bytes() == symphonia.0.bytes());
            n += 1;
        }
    }
    assert_eq!(n, 25);
    let r = AudioRecipe {
        rate: 16_000,
        samples: 1_000,
        ..AudioRecipe::default()
    };
    let frames = vec![[100i16, -100]; 3_000];
    // Another rate: symphonia and the resampler.
    assert!(r
        .decode_wav(&wav(44_100, 1, &frames), Path::new("r.wav"))
        .is_none());
    // A data chunk that claims more than the file holds: symphonia decides.
    let mut lying = wav(16_000, 1, &frames);
    lying.truncate(lying.len() - 1_000);
    assert!(r.decode_wav(&lying, Path::new("l.wav")).is_none());
    assert_eq!(
        r.decode(lying, Path::new("l.wav")).unwrap().shape(),
        [1_000]
    );
    // Limits apply before anything the size of the data is read.
    let tight = AudioRecipe {
        limits: crate::media::Limits {
            max_channels: 1,
            ..crate::media::Limits::default()
        },
        ..r
    };
    let e = tight
        .decode(wav(16_000, 2, &frames), Path::new("s.wav"))
        .unwrap_err();
    assert!(e.to_string().contains("channels"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A clip for a batch padded to its longest ([`AudioRecipe::clip_with_length`]) holds its
/// samples only, in any window: a 0.3 s clip in a 120 s window is 4,800 samples, not 1.9 M
/// (a length-aware batch of 120 short clips held 0.9 GB of zeros before), the same samples
/// as the padded decode's; FLAC, WAV from a file and from bytes alike.
#[test]
fn clips_for_length_batches_hold_their_samples_only() {
    use crate::blob::{Blob, Input};
    let samples: Vec<i32> = (0..4800).map(|i| ((i * 53) % 3000) - 1500).collect();
    let sink = flac(&samples);
    let frames: Vec<[i16; 2]> = samples.iter().map(|&s| [s as i16, 0]).collect();
    let dir = std::env::temp_dir().join(format!("flowgate-clip-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let on_disk = dir.join("c.wav");
    std::fs::write(&on_disk, wav(16_000, 1, &frames)).unwrap();
    let r = AudioRecipe {
        samples: 120 * 16_000,
        ..AudioRecipe::default()
    };
    let bytes = |b: &[u8], name: &str| {
        Input::Bytes(Blob {
            path: name.into(),
            bytes: b.to_vec(),
        })
    };
    for input in [
        bytes(sink.as_slice(), "c.flac"),
        bytes(&wav(16_000, 1, &frames), "c.wav"),
        Input::Path(on_disk.clone()),
    ] {
        let padded = match &input {
            Input::Path(p) => r.load_with_length(p).unwrap(),
            Input::Bytes(b) => r.decode_with_length(b.bytes.clone(), &b.path).unwrap(),
        };
        let (clip, n) = r.clip_with_length(input).unwrap();
        assert_eq!((clip.shape(), n), (&[4800][..], 4800));
        assert_eq!(padded.1, 4800);
        assert_eq!(
            clip.bytes(),
            &padded.0.bytes()[..4800 * 4],
            "the same samples"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
