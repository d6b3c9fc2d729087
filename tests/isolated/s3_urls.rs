//! A list of `s3://bucket/key` URLs (`Source::files`, as a list file or a Python list gives
//! it) is read from S3, not as local paths; a list mixing local paths and URLs, or two
//! buckets, is refused naming the path. In a process of its own: it sets the environment the
//! AWS chain reads (`AWS_ENDPOINT_URL`, the keys).

use flowgate::dataset::{Dataset, Source};
use flowgate::media::{image::ImageRecipe, Recipe};
use flowgate::Loader;

use crate::s3_common::{fixture, jpeg, put};

#[test]
fn a_list_of_s3_urls_is_read_from_s3() {
    isolate!();
    let f = fixture("urls");
    for i in 0..7u8 {
        put(&f.s3, &format!("img/{i}.jpg"), jpeg(16, 16, i));
    }
    std::env::set_var("AWS_ENDPOINT_URL", f.server.endpoint());
    std::env::set_var("AWS_ACCESS_KEY_ID", flowgate::s3::LocalServer::ACCESS_KEY);
    std::env::set_var(
        "AWS_SECRET_ACCESS_KEY",
        flowgate::s3::LocalServer::SECRET_KEY,
    );
    std::env::set_var("AWS_REGION", "us-east-1");
    let recipe = || {
        Recipe::image(ImageRecipe {
            resize: 8,
            crop: 8,
            ..ImageRecipe::default()
        })
        .unwrap()
    };
    // Seven objects and one that is missing: read from S3, the missing one skipped, named.
    let mut urls: Vec<String> = (0..7).map(|i| format!("s3://data/img/{i}.jpg")).collect();
    urls.insert(3, "s3://data/img/missing.jpg".into());
    let dataset = Dataset::builder(Source::files(urls.clone()))
        .build()
        .unwrap();
    assert_eq!(dataset.len(), 8);
    let mut l = Loader::builder(dataset, recipe())
        .batch_size(3)
        .build()
        .unwrap();
    let batches: Vec<_> = l.epoch().unwrap().map(Result::unwrap).collect();
    let mut got: Vec<String> = batches
        .iter()
        .flat_map(|b| b.items.iter().map(|m| l.path_of(m)))
        .collect();
    got.sort();
    let mut want: Vec<String> = (0..7).map(|i| format!("img/{i}.jpg")).collect();
    want.sort();
    assert_eq!(got, want, "every object once, by its key");
    let failed = l.watch().failures(None);
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert!(failed[0].item.contains("missing.jpg"), "{failed:?}");

    let refused = |paths: Vec<&str>| {
        Dataset::builder(Source::files(paths))
            .build()
            .unwrap_err()
            .to_string()
    };
    let e = refused(vec!["s3://data/img/0.jpg", "/tmp/img/1.jpg"]);
    assert!(
        e.contains("/tmp/img/1.jpg is local") && e.contains("all s3:// URLs of one bucket"),
        "{e}"
    );
    let e = refused(vec!["s3://data/img/0.jpg", "s3://other/img/1.jpg"]);
    assert!(e.contains("is in bucket \"other\", not \"data\""), "{e}");
    let e = refused(vec!["s3://data/"]);
    assert!(e.contains("names no object"), "{e}");
}
