//! The image decoder's tests: torchvision geometry, region decoding equal to whole decoding,
//! augmentation, normalisation, bad files.

use super::*;

#[test]
fn geometry_matches_torchvision() {
    assert_eq!(resized(500, 375, 256), (341, 256)); // int(256 * 500 / 375) = 341
    assert_eq!(resized(375, 500, 256), (256, 341));
    assert_eq!(resized(300, 300, 256), (256, 256));
    assert_eq!(crop_offset(341, 224), 58); // round(58.5) = 58 (half to even)
    assert_eq!(crop_offset(343, 224), 60); // round(59.5) = 60
    assert_eq!(crop_offset(256, 224), 16);
}

fn encode(img: &::image::RgbImage, fmt: ::image::ImageFormat) -> Vec<u8> {
    let mut out = std::io::Cursor::new(Vec::new());
    img.write_to(&mut out, fmt).unwrap();
    out.into_inner()
}

#[test]
fn a_flat_image_stays_flat_in_both_layouts() {
    let img = ::image::RgbImage::from_pixel(400, 300, ::image::Rgb([10, 120, 240]));
    let png = encode(&img, ::image::ImageFormat::Png);
    let recipe = ImageRecipe::default();
    let mut chw = vec![0; 3 * 224 * 224];
    recipe
        .decode_into(&png, Path::new("flat.png"), &mut chw)
        .unwrap();
    assert!(chw[..224 * 224].iter().all(|&v| v == 10));
    assert!(chw[224 * 224..2 * 224 * 224].iter().all(|&v| v == 120));
    assert!(chw[2 * 224 * 224..].iter().all(|&v| v == 240));
    let nhwc = ImageRecipe {
        layout: Layout::Nhwc,
        ..recipe
    };
    let mut hwc = vec![0; 3 * 224 * 224];
    nhwc.decode_into(&png, Path::new("flat.png"), &mut hwc)
        .unwrap();
    assert!(hwc.chunks(3).all(|p| p == [10, 120, 240]));
}

#[test]
fn the_crop_window_equals_resize_then_crop() {
    // A gradient, so that any misplaced window shows.
    let img = ::image::RgbImage::from_fn(500, 375, |x, y| {
        ::image::Rgb([(x / 2) as u8, (y / 2) as u8, ((x + y) / 4) as u8])
    });
    let png = encode(&img, ::image::ImageFormat::Png);
    let recipe = ImageRecipe {
        layout: Layout::Nhwc,
        ..ImageRecipe::default()
    };
    let mut fast = vec![0; 3 * 224 * 224];
    recipe
        .decode_into(&png, Path::new("g.png"), &mut fast)
        .unwrap();
    // The slow way: resize the whole image to 341x256, then crop at (58, 16).
    let src = Image::from_vec_u8(500, 375, img.into_raw(), PixelType::U8x3).unwrap();
    let mut full = Image::new(341, 256, PixelType::U8x3);
    let opts = ResizeOptions::new().resize_alg(ResizeAlg::Convolution(FilterType::Bilinear));
    Resizer::new().resize(&src, &mut full, &opts).unwrap();
    let full = full.buffer();
    let mut worst = 0;
    for y in 0..224 {
        for x in 0..224 * 3 {
            let a = fast[y * 224 * 3 + x] as i32;
            let b = full[(y + 16) * 341 * 3 + 58 * 3 + x] as i32;
            worst = worst.max((a - b).abs());
        }
    }
    assert!(worst <= 1, "max difference {worst}");
}

#[test]
fn random_windows_stay_inside_and_respect_scale_and_ratio() {
    let rc = RandomCrop::default();
    for seed in 0..2000 {
        let mut rng = flowgate_tuner::Rng::new(seed);
        let (w, h) = (300 + (seed % 7) as u32 * 50, 200 + (seed % 5) as u32 * 60);
        let (x, y, cw, ch) = random_window(w, h, rc.scale, rc.ratio, &mut rng);
        assert!(x >= 0.0 && y >= 0.0 && cw >= 1.0 && ch >= 1.0);
        assert!(x + cw <= f64::from(w) && y + ch <= f64::from(h), "{seed}");
        let frac = cw * ch / (f64::from(w) * f64::from(h));
        assert!((0.07..=1.0).contains(&frac), "{seed}: area {frac}");
    }
}

#[test]
fn flips_and_normalisation_are_exact_and_seeded() {
    let img = ::image::RgbImage::from_fn(256, 256, |x, y| ::image::Rgb([x as u8, y as u8, 100]));
    let png = encode(&img, ::image::ImageFormat::Png);
    let p = Path::new("grad.png");
    let plain = ImageRecipe {
        resize: 224,
        crop: 224,
        layout: Layout::Nhwc,
        ..ImageRecipe::default()
    };
    let base = plain.decode(&png, p).unwrap();
    let flipping = ImageRecipe {
        flip: true,
        ..plain
    };
    let (mut flipped, mut kept) = (0, 0);
    for seed in 0..20 {
        let t = flipping.with_seed(seed).decode(&png, p).unwrap();
        assert_eq!(
            t.bytes(),
            flipping.with_seed(seed).decode(&png, p).unwrap().bytes(),
            "the same seed gives the same output"
        );
        if t.bytes() == base.bytes() {
            kept += 1;
            continue;
        }
        flipped += 1;
        for y in 0..224 {
            for x in 0..224 {
                let a = &t.bytes()[(y * 224 + x) * 3..][..3];
                let b = &base.bytes()[(y * 224 + 223 - x) * 3..][..3];
                assert_eq!(a, b, "a mirror image");
            }
        }
    }
    assert!(flipped > 3 && kept > 3, "{flipped} flipped, {kept} kept");
    let norm = ImageRecipe {
        normalize: Some(Normalize::IMAGENET),
        layout: Layout::Nchw,
        ..plain
    };
    let t = norm.decode(&png, p).unwrap();
    assert_eq!(
        (t.shape(), t.dtype()),
        (&[3usize, 224, 224][..], DType::F32)
    );
    let f = |i: usize| f32::from_ne_bytes(t.bytes()[4 * i..4 * i + 4].try_into().unwrap());
    let blue = (100.0 / 255.0 - 0.406) / 0.225;
    assert!((f(2 * 224 * 224 + 5) - blue).abs() < 1e-5);
    let nhwc = base.bytes();
    for i in [0usize, 1000, 50_000] {
        let want = (f32::from(nhwc[3 * i]) / 255.0 - 0.485) / 0.229;
        assert!((f(i) - want).abs() < 1e-5, "red plane at {i}");
    }
    let train = ImageRecipe::train(112);
    let a = train.decode(&png, p).unwrap();
    assert_eq!(a.shape(), [3, 112, 112]);
    assert_ne!(
        a.bytes(),
        train.with_seed(1).decode(&png, p).unwrap().bytes()
    );
}

/// A photo-like picture: smooth gradients, edges and some noise.
fn photo(w: u32, h: u32, seed: u64) -> Vec<u8> {
    let mut rng = flowgate_tuner::Rng::new(seed);
    let mut px = Vec::with_capacity((w * h * 3) as usize);
    for y in 0..h {
        for x in 0..w {
            let n = (rng.uniform() * 24.0) as u32;
            let edge = if (x / 37 + y / 29) % 2 == 0 { 60 } else { 0 };
            px.push(((x * 255 / w + n + edge) % 256) as u8);
            px.push(((y * 255 / h + n) % 256) as u8);
            px.push((((x + y) * 128 / (w + h) + n * 2 + edge) % 256) as u8);
        }
    }
    px
}

fn jpeg(
    px: &[u8],
    w: u32,
    h: u32,
    color: jpeg_encoder::ColorType,
    sampling: jpeg_encoder::SamplingFactor,
    progressive: bool,
) -> Vec<u8> {
    let mut out = Vec::new();
    let mut enc = jpeg_encoder::Encoder::new(&mut out, 90);
    enc.set_sampling_factor(sampling);
    enc.set_progressive(progressive);
    enc.encode(px, w as u16, h as u16, color).unwrap();
    out
}

#[test]
fn decoding_only_the_needed_region_changes_no_pixel() {
    use jpeg_encoder::{ColorType, SamplingFactor as S};
    let recipes = [
        ImageRecipe::default(),
        ImageRecipe {
            layout: Layout::Nhwc,
            ..ImageRecipe::default()
        },
        ImageRecipe {
            resize: 160,
            crop: 128,
            ..ImageRecipe::default()
        },
        ImageRecipe {
            normalize: None,
            ..ImageRecipe::train(224)
        },
        ImageRecipe::train(96).with_seed(7),
        ImageRecipe {
            draft: true,
            ..ImageRecipe::train(96).with_seed(3)
        },
    ];
    let sizes = [(500, 375), (375, 500), (333, 257), (1030, 771), (257, 256)];
    let mut n = 0;
    for (i, &(w, h)) in sizes.iter().enumerate() {
        let px = photo(w, h, i as u64);
        for (sampling, progressive) in [
            (S::F_2_2, false),
            (S::F_1_1, false),
            (S::F_2_1, true),
            (S::F_4_1, false),
            (S::F_2_2, true),
        ] {
            let bytes = jpeg(&px, w, h, ColorType::Rgb, sampling, progressive);
            for (k, recipe) in recipes.iter().enumerate() {
                for seed in 0..2 {
                    let recipe = recipe.with_seed(seed);
                    let path = std::path::PathBuf::from(format!("p{i}-{k}-{seed}.jpg"));
                    let len = 3 * (recipe.crop as usize).pow(2) * recipe.dtype().size();
                    let (mut part, mut all) = (vec![0; len], vec![1; len]);
                    recipe
                        .decode_region_into(&bytes, &path, &mut part, false)
                        .unwrap();
                    recipe
                        .decode_region_into(&bytes, &path, &mut all, true)
                        .unwrap();
                    assert!(
                        part == all,
                        "{w}x{h} {sampling:?} progressive={progressive} recipe {k} seed {seed}"
                    );
                    n += 1;
                }
            }
        }
    }
    assert_eq!(n, 5 * 5 * 6 * 2);
    // The region is a real saving: ~66% of a 500x375 photo for the evaluation recipe.
    let r = needed((85.3, 23.4, 328.1, 328.1), 500, 375, 224);
    assert!(r.w < 345 && r.h < 345 && r.x > 80 && r.y > 18, "{r:?}");
}

#[test]
fn draft_scales_only_while_the_window_covers_the_crop() {
    // A 656-pixel window over a 224 crop: 1/2 (328 >= 224), not 1/4 (164).
    assert_eq!(draft_denom((656.0, 700.0), 224, 8), 2);
    assert_eq!(draft_denom((1800.0, 1900.0), 224, 8), 8);
    assert_eq!(draft_denom((1800.0, 1900.0), 224, 4), 4);
    assert_eq!(draft_denom((1800.0, 1900.0), 224, 1), 1);
    assert_eq!(draft_denom((447.0, 900.0), 224, 8), 1);
    assert_eq!(draft_denom((448.0, 900.0), 224, 8), 2);
}

/// Draft mode against the exact decode of the same JPEGs: where the window allows a smaller
/// scale the pixels stay close (mean and 99th-percentile differences bounded) without being
/// identical (the scaled decode did happen); where it does not, they are identical.
#[cfg(flowgate_libjpeg)]
#[test]
fn draft_mode_stays_close_to_the_exact_decode() {
    if jpeg_decoder() != "libjpeg-turbo" {
        return; // FLOWGATE_JPEG_DECODER=zune-jpeg: no scaled decode to compare
    }
    use jpeg_encoder::{ColorType, SamplingFactor as S};
    let exact = ImageRecipe {
        layout: Layout::Nhwc,
        ..ImageRecipe::default()
    };
    let draft = ImageRecipe {
        draft: true,
        ..exact
    };
    let train = ImageRecipe {
        normalize: None,
        draft: true,
        ..ImageRecipe::train(112).with_seed(5)
    };
    for (i, &(w, h, scaled)) in [(1000, 750, true), (2000, 1400, true), (500, 375, false)]
        .iter()
        .enumerate()
    {
        let px = photo(w, h, 40 + i as u64);
        for (sampling, progressive) in [(S::F_2_2, false), (S::F_1_1, true)] {
            let bytes = jpeg(&px, w, h, ColorType::Rgb, sampling, progressive);
            let path = Path::new("draft.jpg");
            let a = exact.decode(&bytes, path).unwrap();
            let b = draft.decode(&bytes, path).unwrap();
            let mut diffs: Vec<u8> = a
                .bytes()
                .iter()
                .zip(b.bytes())
                .map(|(x, y)| x.abs_diff(*y))
                .collect();
            let mean = diffs.iter().map(|&d| f64::from(d)).sum::<f64>() / diffs.len() as f64;
            diffs.sort_unstable();
            let p99 = diffs[diffs.len() * 99 / 100];
            let what = format!("{w}x{h} {sampling:?}: mean {mean:.2}, p99 {p99}");
            if scaled {
                assert!(mean > 0.0 && mean < 2.5 && p99 <= 16, "{what}");
            } else {
                assert_eq!(mean, 0.0, "{what}");
            }
            // Training crops decode in draft mode too (same windows: same seed, same draws).
            let t = train.decode(&bytes, path).unwrap();
            assert_eq!(t.bytes().len(), 3 * 112 * 112);
        }
    }
}

#[test]
fn grey_and_cmyk_jpegs_decode_to_rgb() {
    use jpeg_encoder::{ColorType, SamplingFactor as S};
    let (w, h) = (300, 260);
    let grey: Vec<u8> = (0..w * h).map(|i| (i % 251) as u8).collect();
    let bytes = jpeg(&grey, w, h, ColorType::Luma, S::F_1_1, false);
    let recipe = ImageRecipe {
        layout: Layout::Nhwc,
        ..ImageRecipe::default()
    };
    let t = recipe.decode(&bytes, Path::new("grey.jpg")).unwrap();
    assert!(t.bytes().chunks(3).all(|p| p[0] == p[1] && p[1] == p[2]));
    // Flat CMYK: cyan-ish, no black.
    let cmyk: Vec<u8> = (0..w * h).flat_map(|_| [200u8, 40, 0, 0]).collect();
    let bytes = jpeg(&cmyk, w, h, ColorType::Cmyk, S::F_1_1, false);
    let t = recipe.decode(&bytes, Path::new("cmyk.jpg")).unwrap();
    let mid = &t.bytes()[3 * (112 * 224 + 112)..][..3];
    assert!(mid[0] < mid[1] && mid[1] <= mid[2], "{mid:?}");
}

#[test]
fn bad_bytes_are_typed_errors_naming_the_file() {
    let r = ImageRecipe::default();
    let mut out = vec![0; 3 * 224 * 224];
    let p = Path::new("x/broken.jpg");
    assert!(matches!(
        r.decode_into(&[], p, &mut out),
        Err(MediaError::Empty { .. })
    ));
    let e = r
        .decode_into(b"definitely not an image", p, &mut out)
        .unwrap_err();
    assert!(
        matches!(e, MediaError::Decode { .. }) && e.to_string().contains("x/broken.jpg"),
        "{e}"
    );
    let img = ::image::RgbImage::from_pixel(64, 64, ::image::Rgb([1, 2, 3]));
    let jpg = encode(&img, ::image::ImageFormat::Jpeg);
    assert!(
        r.decode_into(&jpg[..jpg.len() / 2], p, &mut out).is_err(),
        "truncated"
    );
    assert!(
        r.decode_into(&jpg, p, &mut [0; 10]).is_err(),
        "wrong slot size"
    );
    let e = r.load(Path::new("/nonexistent/a.jpg")).unwrap_err();
    assert!(matches!(e, MediaError::Read { .. }) && e.path() == Path::new("/nonexistent/a.jpg"));
}

/// The decoder `FLOWGATE_JPEG_DECODER` asks for is the one in use: the test command's second
/// run of these tests (`scripts/test.sh`) sets `zune-jpeg`, and so runs the pure-Rust path,
/// not libjpeg-turbo's again.
#[test]
fn the_jpeg_decoder_asked_for_is_the_one_in_use() {
    match std::env::var("FLOWGATE_JPEG_DECODER").as_deref() {
        Ok("zune-jpeg") => assert_eq!(jpeg_decoder(), "zune-jpeg"),
        Ok(_) => {}
        Err(_) => assert_eq!(
            jpeg_decoder() == "libjpeg-turbo",
            cfg!(flowgate_libjpeg),
            "the build's decoder"
        ),
    }
}
