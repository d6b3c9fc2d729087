//! A pipeline file refuses the numbers of `tests/data/refusals.json` with the words every
//! front end says (python/tests/test_refusals.py holds the Python loaders to the same table).
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
        serde_json::from_str(include_str!("data/refusals.json")).unwrap();
    let cases = table["cases"].as_array().unwrap();
    assert!(cases.len() >= 10);
    for case in cases {
        let toml = case["toml"].as_str().unwrap();
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
