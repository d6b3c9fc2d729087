use super::*;

fn parse(json: &str) -> Result<MediaArgs, String> {
    serde_json::from_str(json).map_err(|e| e.to_string())
}

#[test]
fn every_default_is_its_named_constant() {
    let MediaArgs::Image(i) = parse(r#"{"kind":"image"}"#).unwrap() else {
        panic!()
    };
    assert_eq!(i, ImageArgs::default());
    let MediaArgs::Audio(a) = parse(r#"{"kind":"audio"}"#).unwrap() else {
        panic!()
    };
    assert_eq!(a, AudioArgs::default());
    let MediaArgs::Video(v) = parse(r#"{"kind":"video"}"#).unwrap() else {
        panic!()
    };
    assert_eq!(v, VideoArgs::default());
}

#[test]
fn unknown_arguments_and_kinds_are_refused() {
    let e = parse(r#"{"kind":"image","crpo":3}"#).unwrap_err();
    assert!(e.contains("unknown field `crpo`"), "{e}");
    let e = parse(r#"{"kind":"text"}"#).unwrap_err();
    assert!(e.contains("unknown variant `text`"), "{e}");
    let v = serde_json::json!({"kind": "image", "normalize": [[1, 2], [3, 4, 5]]});
    let e = MediaArgs::from_value(v).unwrap_err();
    assert_eq!(
        e,
        "normalize: must be true, false or [mean, std] with three numbers each"
    );
    // A number JSON cannot hold, by its name, reaches the rule that refuses it.
    let v = serde_json::json!({"kind": "image", "normalize": [[0, 0, 0], ["nan", 1, 1]]});
    let a = MediaArgs::from_value(v).unwrap();
    let e = a.check(None).unwrap_err().to_string();
    assert!(
        e.starts_with("normalize must have finite standard deviations"),
        "{e}"
    );
}

#[test]
fn errors_from_data_name_the_key() {
    use serde_json::json;
    let e = MediaArgs::from_value(json!({"kind": "video", "layout": "nchw"})).unwrap_err();
    assert!(e.starts_with("layout: unknown variant `nchw`"), "{e}");
    let e = MediaArgs::from_value(json!({"kind": "image", "scale": [1, 2, 3]})).unwrap_err();
    assert!(e.starts_with("scale: "), "{e}");
    let e = MediaArgs::from_value(json!({"kind": "text"})).unwrap_err();
    assert!(e.starts_with("kind: "), "{e}");
    let ok = MediaArgs::from_value(json!({"kind": "audio", "rate": 8000})).unwrap();
    assert_eq!(
        ok,
        MediaArgs::Audio(AudioArgs {
            rate: 8000,
            ..AudioArgs::default()
        })
    );
}

#[test]
fn normalize_takes_a_flag_or_the_statistics() {
    let n = |j: &str| serde_json::from_str::<NormalizeArg>(j).unwrap().stats();
    assert_eq!(n("false"), None);
    assert_eq!(n("true"), Some((IMAGENET_MEAN, IMAGENET_STD)));
    assert_eq!(
        n("[[0.5,0.5,0.5],[0.25,0.25,0.25]]"),
        Some(([0.5; 3], [0.25; 3]))
    );
}

#[cfg(feature = "image")]
#[test]
fn image_rules() {
    let args = |j: &str| parse(j).unwrap();
    let r = args(r#"{"kind":"image","train":true,"seed":9}"#)
        .recipe(None, 1)
        .unwrap();
    let img = r.as_image().unwrap();
    assert!(img.flip && img.random_crop.is_some() && img.seed == 9);
    let r = args(r#"{"kind":"image"}"#).recipe(None, 4).unwrap();
    assert_eq!(r.as_image().unwrap().seed, 4);
    let e = args(r#"{"kind":"image","crop":0}"#)
        .recipe(None, 0)
        .unwrap_err();
    assert_eq!(e.field(), "crop");
    let e = args(r#"{"kind":"image","train":true,"scale":[0.5,0.1]}"#)
        .recipe(None, 0)
        .unwrap_err();
    assert_eq!(e.field(), "scale");
    let e = args(r#"{"kind":"image"}"#)
        .recipe(Some(3.0), 0)
        .unwrap_err();
    assert_eq!(e.field(), "length-aware batches");
}

#[cfg(feature = "audio")]
#[test]
fn audio_window_follows_the_length_cap() {
    let a = parse(r#"{"kind":"audio","seconds":2.0,"train":true,"rate":8000}"#).unwrap();
    let plain = a.recipe(None, 0).unwrap();
    let plain = plain.as_audio().unwrap();
    assert_eq!((plain.samples, plain.random_crop), (16_000, true));
    let capped = a.recipe(Some(5.0), 0).unwrap();
    let capped = capped.as_audio().unwrap();
    assert_eq!((capped.samples, capped.random_crop), (40_000, false));
    let e = parse(r#"{"kind":"audio","seconds":-1}"#)
        .unwrap()
        .recipe(None, 0)
        .unwrap_err();
    assert_eq!(e.field(), "seconds");
}

#[cfg(feature = "video")]
#[test]
fn video_sampling_is_chosen_once() {
    use crate::media::video::Sampling;
    let v = |j: &str| parse(j).unwrap();
    let sampling = |a: MediaArgs, cap| {
        a.recipe(cap, 0)
            .map(|r| r.as_video().unwrap().sampling.clone())
    };
    assert_eq!(
        sampling(v(r#"{"kind":"video"}"#), None),
        Ok(Sampling::Uniform(8))
    );
    assert_eq!(
        sampling(v(r#"{"kind":"video","stride":2,"train":true}"#), None),
        Ok(Sampling::Window {
            frames: 8,
            stride: 2,
            random: true
        })
    );
    assert_eq!(
        sampling(v(r#"{"kind":"video","fps":4}"#), Some(32.0)),
        Ok(Sampling::Rate { fps: 4.0, max: 32 })
    );
    for (json, cap, field, words) in [
        (
            r#"{"kind":"video","train":true}"#,
            None,
            "stride",
            "set stride",
        ),
        (r#"{"kind":"video","fps":4}"#, None, "fps", "set both"),
        (r#"{"kind":"video"}"#, Some(32.0), "fps", "must be set"),
        (
            r#"{"kind":"video","fps":4,"stride":2}"#,
            Some(32.0),
            "stride",
            "choose one",
        ),
        (
            r#"{"kind":"video","fps":4,"audio_seconds":1}"#,
            Some(32.0),
            "max_batch_frames",
            "frames only",
        ),
        (
            r#"{"kind":"video","fps":4}"#,
            Some(2.5),
            "max_batch_frames",
            "whole number",
        ),
    ] {
        let e = sampling(v(json), cap).unwrap_err();
        assert_eq!(e.field(), field, "{json}");
        assert!(e.to_string().contains(words), "{json}: {e}");
    }
}
