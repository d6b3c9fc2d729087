//! Fields decoded as media (`LoaderBuilder::media_field`, the `fields` mapping's tables of
//! kind image/audio/video): a sample holding two images (`KEY.jpg` and `KEY.right.jpg`) gives
//! both as tensors of their own, each row its own sample's, over ranks and a resume; a second
//! image that is missing or does not decode fails its item, named; what cannot be is refused
//! when the loader is built, in the words every front end shares.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use flowgate::dataset::shards::tar::write_archive;
use flowgate::dataset::{Dataset, Labels, Source};
use flowgate::device::Delivered;
use flowgate::loader::{fields_and_media, Batch};
use flowgate::media::Recipe;
use flowgate::{Blob, FailureBudget, Loader, Tensor};

use crate::common;
use common::small_recipe as recipe;

/// Samples: divisible by no batch size or rank count used.
const SAMPLES: usize = 37;
/// The sample whose second image is missing.
const MISSING: usize = 11;
/// The sample whose second image is cut short.
const BROKEN: usize = 23;

/// The second image's recipe: another size than the first's.
fn right_recipe() -> Recipe {
    Recipe::image(flowgate::media::image::ImageRecipe {
        resize: 10,
        crop: 6,
        ..Default::default()
    })
    .unwrap()
}

/// Shards of `KEY.jpg` (shade `i`), `KEY.right.jpg` (shade `i + 50`), `KEY.cls` and
/// `KEY.txt`; with `faults`, `MISSING` has no second image and `BROKEN`'s is cut short.
fn write(dir: &Path, faults: bool) -> String {
    std::fs::create_dir_all(dir).unwrap();
    for s in 0..SAMPLES.div_ceil(10) {
        let mut members = Vec::new();
        for i in (s * 10)..((s + 1) * 10).min(SAMPLES) {
            let key = format!("{i:05}");
            members.push((format!("{key}.jpg"), common::tiny_jpeg(i)));
            let mut right = common::tiny_jpeg(i + 50);
            if faults && i == BROKEN {
                right.truncate(40);
            }
            if !(faults && i == MISSING) {
                members.push((format!("{key}.right.jpg"), right));
            }
            members.push((format!("{key}.cls"), i.to_string().into_bytes()));
            members.push((format!("{key}.txt"), format!("sample {i}").into_bytes()));
        }
        let f = std::fs::File::create(dir.join(format!("s-{s}.tar"))).unwrap();
        write_archive(std::io::BufWriter::new(f), members).unwrap();
    }
    format!("{}/s-{{0..3}}.tar", dir.display())
}

fn shards(faults: bool) -> &'static str {
    static CLEAN: OnceLock<String> = OnceLock::new();
    static FAULTY: OnceLock<String> = OnceLock::new();
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("media-fields");
    if faults {
        FAULTY.get_or_init(|| write(&dir.join("faulty"), true))
    } else {
        CLEAN.get_or_init(|| write(&dir.join("clean"), false))
    }
}

/// The fields as every front end spells them.
fn fields() -> serde_json::Value {
    serde_json::json!({
        "caption": "txt",
        "right": {"from": "right.jpg", "kind": "image", "resize": 10, "crop": 6},
    })
}

fn loader(faults: bool, rank: usize, world: usize, failures: FailureBudget) -> Loader {
    let (specs, media) = fields_and_media(fields()).unwrap();
    assert_eq!(media.len(), 1);
    let source = Source::shards(shards(faults))
        .labels(Labels::Field("cls".into()))
        .extra_fields(specs);
    let dataset = Dataset::builder(source)
        .extensions(&["jpg"])
        .shuffle(5)
        .ranks(rank, world)
        .build()
        .unwrap();
    Loader::builder(dataset, recipe())
        .batch_size(4)
        .workers(2)
        .max_failures(failures)
        .media_field("right", right_recipe())
        .build()
        .unwrap()
}

fn host(d: &Delivered) -> &Tensor {
    match d {
        Delivered::Host(t) => t,
        _ => panic!("host memory"),
    }
}

/// Each row: its sample's number, its first image's and second image's bytes, its caption.
fn rows(b: &Batch) -> Vec<(i64, Vec<u8>, Vec<u8>, String)> {
    assert_eq!(&*b.names, ["image", "right"]);
    assert_eq!(
        &*b.extra_names,
        ["caption"],
        "the media field is a tensor, not a field"
    );
    let (left, right) = (host(&b.fields[0]), host(&b.fields[1]));
    assert_eq!(right.shape(), [b.len(), 3, 6, 6]);
    (0..b.len())
        .map(|k| {
            let caption = match b.field("caption").unwrap()[k] {
                flowgate::dataset::FieldValue::Text(t) => t.clone(),
                v => panic!("{v:?}"),
            };
            (
                b.items[k].label.unwrap(),
                left.item(k).to_vec(),
                right.item(k).to_vec(),
                caption,
            )
        })
        .collect()
}

fn alone(r: &Recipe, shade: usize) -> Vec<u8> {
    let blob = Blob {
        path: "alone.jpg".into(),
        bytes: common::tiny_jpeg(shade),
    };
    r.decode(blob).unwrap().bytes().to_vec()
}

#[test]
fn a_sample_of_two_images_gives_both_each_its_own_across_ranks_and_a_resume() {
    let mut seen = Vec::new();
    for rank in 0..3 {
        let mut l = loader(false, rank, 3, FailureBudget::fail_fast());
        assert_eq!(l.tensor_names(), ["image", "right"]);
        assert_eq!(l.field_names(), ["caption"]);
        for b in l.epoch().unwrap() {
            for (n, left, right, caption) in rows(&b.unwrap()) {
                let n = n as usize;
                assert_eq!(left, alone(&recipe(), n), "sample {n}'s first image");
                assert_eq!(right, alone(&right_recipe(), n + 50), "sample {n}'s second");
                assert_eq!(caption, format!("sample {n}"));
                seen.push(n);
            }
        }
    }
    seen.sort_unstable();
    seen.dedup();
    // Equal counts per rank may repeat a sample; every sample comes at least once.
    assert_eq!(seen, (0..SAMPLES).collect::<Vec<_>>());

    // A resume after 3 batches gives the rest of the epoch, both images with each row.
    let whole: Vec<_> = loader(false, 1, 3, FailureBudget::fail_fast())
        .epoch()
        .unwrap()
        .flat_map(|b| rows(&b.unwrap()))
        .collect();
    let mut first = loader(false, 1, 3, FailureBudget::fail_fast());
    let (mut got, state) = {
        let mut e = first.epoch().unwrap();
        let got: Vec<_> = (0..3)
            .flat_map(|_| rows(&e.next().unwrap().unwrap()))
            .collect();
        (got, e.state().unwrap())
    };
    drop(first);
    let mut again = loader(false, 1, 3, FailureBudget::fail_fast());
    again.resume(&state).unwrap();
    got.extend(again.epoch().unwrap().flat_map(|b| rows(&b.unwrap())));
    assert_eq!(got, whole);
}

#[test]
fn a_second_image_missing_or_broken_fails_its_item_named() {
    let mut l = loader(true, 0, 1, FailureBudget::unlimited());
    let got: Vec<usize> = l
        .epoch()
        .unwrap()
        .flat_map(|b| rows(&b.unwrap()))
        .map(|(n, ..)| n as usize)
        .collect();
    let mut sorted = got.clone();
    sorted.sort_unstable();
    let want: Vec<usize> = (0..SAMPLES)
        .filter(|&i| i != MISSING && i != BROKEN)
        .collect();
    assert_eq!(sorted, want, "every other sample once");
    let failed = l.watch().failures(None);
    assert_eq!(failed.len(), 2, "{failed:?}");
    let broken = failed
        .iter()
        .find(|f| f.item.contains(&format!("{BROKEN:05}")))
        .expect("the broken one named");
    assert!(broken.message.contains("field \"right\""), "{broken:?}");
    let missing = failed
        .iter()
        .find(|f| f.item.contains(&format!("{MISSING:05}")))
        .expect("the missing one named");
    assert!(missing.message.contains("right.jpg"), "{missing:?}");

    let mut strict = loader(true, 0, 1, FailureBudget::fail_fast());
    let err = strict.epoch().unwrap().find_map(Result::err).unwrap();
    assert!(err.is_failure_budget(), "{err}");
}

#[test]
fn what_a_media_field_cannot_be_is_refused_in_the_front_ends_words() {
    let said = |v: serde_json::Value, what: &str| {
        let e = fields_and_media(v).unwrap_err();
        assert!(e.contains(what), "{what}: {e}");
    };
    said(
        serde_json::json!({"r": {"from": "r.jpg", "kind": "image", "optional": true}}),
        "a media field is required",
    );
    said(
        serde_json::json!({"r": {"kind": "image", "crop": 8}}),
        "needs \"from\"",
    );
    said(
        serde_json::json!({"r": {"from": "r.jpg", "kind": "image", "crops": 8}}),
        "\"r\": ",
    );
    let dataset = |fields: serde_json::Value| {
        let (specs, _) = fields_and_media(fields).unwrap();
        Dataset::builder(Source::shards(shards(false)).extra_fields(specs))
            .extensions(&["jpg"])
            .build()
            .unwrap()
    };
    let built = |d: Dataset, name: &str| {
        Loader::builder(d, recipe())
            .media_field(name, right_recipe())
            .build()
            .unwrap_err()
            .to_string()
    };
    let e = built(dataset(fields()), "left");
    assert!(e.contains("reads no field of that name"), "{e}");
    let e = built(dataset(serde_json::json!({"right": "txt"})), "right");
    assert!(e.contains("must be required bytes"), "{e}");
    let e = built(
        dataset(serde_json::json!({"image": {"from": "right.jpg", "kind": "image"}})),
        "image",
    );
    assert!(
        e.contains("fields: \"image\" is a key the batch already has (its keys: \"image\""),
        "{e}"
    );
    let e = Loader::builder(dataset(fields()), recipe())
        .media_field("right", right_recipe())
        .length_batches(10.0, 4)
        .build()
        .unwrap_err()
        .to_string();
    assert!(e.contains("not for length-aware batches"), "{e}");
}

/// A WAV of `n` samples at 8 kHz, every sample `level`.
#[cfg(feature = "audio")]
fn wav(level: i16, n: usize) -> Vec<u8> {
    let data: Vec<u8> = std::iter::repeat_n(level.to_le_bytes(), n)
        .flatten()
        .collect();
    let mut out = Vec::new();
    out.extend(b"RIFF");
    out.extend(&(36 + data.len() as u32).to_le_bytes());
    out.extend(b"WAVEfmt ");
    out.extend(&16u32.to_le_bytes());
    out.extend(&1u16.to_le_bytes()); // PCM
    out.extend(&1u16.to_le_bytes()); // mono
    out.extend(&8000u32.to_le_bytes());
    out.extend(&16000u32.to_le_bytes());
    out.extend(&2u16.to_le_bytes());
    out.extend(&16u16.to_le_bytes());
    out.extend(b"data");
    out.extend(&(data.len() as u32).to_le_bytes());
    out.extend(data);
    out
}

/// An image and its own audio file beside it (`a.jpg` + `a.wav`, loose files): each row's
/// clip is its own, of the audio recipe's window (a shorter file padded).
#[cfg(feature = "audio")]
#[test]
fn a_loose_image_with_its_own_audio_file_gives_both() {
    use flowgate::media::audio::AudioRecipe;
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("media-fields-audio");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let n = 13;
    for i in 0..n {
        std::fs::write(dir.join(format!("{i:03}.jpg")), common::tiny_jpeg(i)).unwrap();
        // Clips of 300 + 40 i samples: some shorter than the 0.05 s window, some longer.
        std::fs::write(
            dir.join(format!("{i:03}.wav")),
            wav(1000 * i as i16, 300 + 40 * i),
        )
        .unwrap();
    }
    let (specs, media) = fields_and_media(serde_json::json!({
        "sound": {"from": "wav", "kind": "audio", "rate": 8000, "seconds": 0.05}
    }))
    .unwrap();
    assert_eq!(media[0].name, "sound");
    let labels: Vec<i64> = (0..n as i64).collect();
    let dataset = Dataset::builder(
        Source::dir(&dir)
            .extensions(["jpg"])
            .labels(Labels::Values(labels))
            .extra_fields(specs),
    )
    .ranks(1, 2)
    .build()
    .unwrap();
    let audio = Recipe::audio(AudioRecipe {
        rate: 8000,
        samples: 400,
        ..Default::default()
    })
    .unwrap();
    let mut l = Loader::builder(dataset, recipe())
        .batch_size(3)
        .media_field("sound", audio)
        .build()
        .unwrap();
    let mut seen = 0;
    for b in l.epoch().unwrap() {
        let b = b.unwrap();
        assert_eq!(&*b.names, ["image", "sound"]);
        let sound = host(&b.fields[1]);
        assert_eq!(sound.shape(), [b.len(), 400]);
        for (k, m) in b.items.iter().enumerate() {
            let i = m.label.unwrap() as usize;
            let clip: Vec<f32> = sound
                .item(k)
                .chunks_exact(4)
                .map(|x| f32::from_ne_bytes(x.try_into().unwrap()))
                .collect();
            let len = (300 + 40 * i).min(400);
            let level = 1000.0 * i as f32 / 32768.0;
            assert!(
                clip[..len].iter().all(|x| (x - level).abs() < 1e-3),
                "clip {i}: {:?}",
                &clip[..4]
            );
            assert!(clip[len..].iter().all(|&x| x == 0.0), "clip {i} padded");
            assert_eq!(host(&b.fields[0]).item(k), alone(&recipe(), i), "image {i}");
            seen += 1;
        }
    }
    assert_eq!(seen, n.div_ceil(2), "rank 1 of 2: equal counts");
}

/// A directory of `a.jpg` with `a.depth.jpg` beside it: the walk takes each second image as
/// its sample's field, not as a sample of its own (every sidecar failed as a
/// sample: `a.depth.depth.jpg` missing).
#[test]
fn a_directory_walk_takes_sidecar_images_as_fields_not_samples() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("media-fields-walk");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("sub")).unwrap();
    let n = 9;
    for i in 0..n {
        let at = if i % 3 == 0 {
            dir.join("sub")
        } else {
            dir.clone()
        };
        std::fs::write(at.join(format!("{i:03}.jpg")), common::tiny_jpeg(i)).unwrap();
        std::fs::write(
            at.join(format!("{i:03}.depth.jpg")),
            common::tiny_jpeg(i + 50),
        )
        .unwrap();
    }
    let (specs, _) = fields_and_media(fields_with_depth()).unwrap();
    let dataset = Dataset::builder(Source::dir(&dir).extensions(["jpg"]).extra_fields(specs))
        .build()
        .unwrap();
    assert_eq!(dataset.len(), n, "the sidecars are not samples");
    let mut l = Loader::builder(dataset, recipe())
        .batch_size(4)
        .max_failures(FailureBudget::fail_fast())
        .media_field("depth", right_recipe())
        .build()
        .unwrap();
    let mut seen = 0;
    for b in l.epoch().unwrap() {
        let b = b.unwrap();
        let (left, right) = (host(&b.fields[0]), host(&b.fields[1]));
        for k in 0..b.len() {
            let shade = (0..n)
                .find(|&i| alone(&recipe(), i) == left.item(k))
                .expect("a sample's own image");
            assert_eq!(right.item(k), alone(&right_recipe(), shade + 50), "{shade}");
            seen += 1;
        }
    }
    assert_eq!(seen, n);
}

fn fields_with_depth() -> serde_json::Value {
    serde_json::json!({"depth": {"from": "depth.jpg", "kind": "image", "resize": 10, "crop": 6}})
}
