//! A pipeline file and the Rust API refuse the numbers of `tests/data/refusals.json` with the
//! words every front end says (python/tests/test_refusals.py holds the Python loaders to the
//! same table).
#![cfg(feature = "spec")]

use flowgate::spec::PipelineSpec;

/// A pipeline file of a list source of images, its tables replaced by `tables`' where they
/// name the same table.
fn file(tables: &str) -> String {
    let mut out = String::new();
    let defaults = [
        (
            "[source]",
            "[source]\nkind = \"list\"\npath = \"images.txt\"",
        ),
        ("[decode]", "[decode]\nkind = \"image\""),
    ];
    for (header, default) in defaults {
        if !tables.contains(header) {
            out.push_str(default);
            out.push('\n');
        }
    }
    // A decode table given without a kind keeps the image kind.
    if tables.contains("[decode]\nkind") {
        out.push_str(tables);
    } else {
        out.push_str(&tables.replace("[decode]\n", "[decode]\nkind = \"image\"\n"));
    }
    out.push('\n');
    out
}

#[test]
fn a_pipeline_file_refuses_each_number_in_the_shared_words() {
    let table: serde_json::Value =
        serde_json::from_str(include_str!("../data/refusals.json")).unwrap();
    let cases = table["cases"].as_array().unwrap();
    assert!(cases.len() >= 10);
    for case in cases {
        let Some(toml) = case["toml"].as_str() else {
            continue; // a number no pipeline file takes
        };
        let text = file(toml);
        let says = case["says"].as_str().unwrap();
        let key = case["key"].as_str().unwrap();
        match PipelineSpec::parse(&text, "p.toml") {
            Ok(_) => panic!("accepted {key}:\n{text}"),
            Err(e) => {
                let e = e.to_string();
                assert!(
                    e.ends_with(says),
                    "{key}: {e}\n(wanted: ... {says})\n{text}"
                );
            }
        }
    }
}

/// The cases the Rust API takes directly (`rust`: the library's check and its arguments), in
/// the same words as the pipeline file's and Python's.
#[test]
fn the_rust_api_refuses_each_number_in_the_shared_words() {
    use flowgate::{FailureBudget, Pipeline, TunerSettings};
    let table: serde_json::Value =
        serde_json::from_str(include_str!("../data/refusals.json")).unwrap();
    let mut checked = 0;
    for case in table["cases"].as_array().unwrap() {
        let Some(rust) = case["rust"].as_object() else {
            continue;
        };
        let (check, args) = rust.iter().next().unwrap();
        let said = match check.as_str() {
            "failure_rate" => FailureBudget::try_rate(args.as_f64().unwrap())
                .unwrap_err()
                .to_string(),
            "tick_ms" => {
                let tick = std::time::Duration::from_millis(args.as_u64().unwrap());
                Pipeline::builder()
                    .source(0..4u32)
                    .autotune(TunerSettings {
                        tick: Some(tick),
                        ..TunerSettings::default()
                    })
                    .build()
                    .unwrap_err()
                    .to_string()
            }
            "batches_ahead" => {
                let a = args.as_array().unwrap();
                flowgate::limits::batches_ahead(
                    a[0].as_u64(),
                    a[1].as_u64().unwrap(),
                    a[2].as_u64().unwrap(),
                )
                .unwrap_err()
                .to_string()
            }
            other => panic!("no Rust check named {other}"),
        };
        let (key, says) = (
            case["key"].as_str().unwrap(),
            case["says"].as_str().unwrap(),
        );
        assert!(
            said.contains(&format!("{key}: ")) && said.ends_with(says),
            "{check}: {said}\n(wanted: {key}: ... {says})"
        );
        checked += 1;
    }
    assert!(checked >= 7, "{checked}");
    // At the bound, taken; one past it, refused: with workers given, and with the cores the
    // tuner starts from (num_workers=0).
    use flowgate::limits::batches_ahead;
    assert_eq!(batches_ahead(Some(1024), 4, 2), Ok(4096));
    assert_eq!(batches_ahead(None, 0, 2048), Ok(4096));
    let e = batches_ahead(None, 0, 2049).unwrap_err().to_string();
    assert!(
        e.ends_with(
            "2 batches per worker for the 2049 cores the tuner starts from (num_workers=0) is \
             4098 batches ahead of the loop, more than the 4096 allowed"
        ),
        "{e}"
    );
    assert!(batches_ahead(Some(1024), 0, 5).is_err() && batches_ahead(Some(1), 0, 0) == Ok(1));
    // A rate the table takes is taken.
    assert!(FailureBudget::try_rate(1.0).is_ok() && FailureBudget::try_rate(0.0).is_ok());
    let caught = std::panic::catch_unwind(|| FailureBudget::rate(2.0)).unwrap_err();
    let said = caught.downcast_ref::<String>().unwrap();
    assert!(said.ends_with("rate in 0..=1, not 2"), "{said}");
}
