//! What `flowgate run --dump DIR` writes beside each batch: its labels (`-labels.npy`), each
//! other tensor by its name (a media field's `-depth.npy`), so that a pipeline file's batches
//! can be checked against a Python loader's.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

mod common;
use common::{assert_succeeded, images, json, scratch};

fn flowgate() -> Command {
    Command::new(env!("CARGO_BIN_EXE_flowgate"))
}

fn run_quiet(file: &Path) -> Output {
    flowgate()
        .args(["run", "--quiet"])
        .arg(file)
        .output()
        .unwrap()
}

/// `flowgate run --quiet FILE --dump DIR/dump` (the dump emptied first): its output and the
/// dump's folder.
fn run_with_dump(dir: &Path, file: &Path) -> (Output, PathBuf) {
    let dump = dir.join("dump");
    let _ = std::fs::remove_dir_all(&dump);
    let out = flowgate()
        .args(["run", "--quiet"])
        .arg(file)
        .arg("--dump")
        .arg(&dump)
        .output()
        .unwrap();
    (out, dump)
}

/// The `i64` values of a dumped `.npy` file (format 1.0: a 10-byte preamble and a header).
fn npy_i64(path: &Path) -> Vec<i64> {
    let b = std::fs::read(path).unwrap();
    assert_eq!(&b[..6], b"\x93NUMPY", "{}", path.display());
    let header = u16::from_le_bytes([b[8], b[9]]) as usize;
    let text = String::from_utf8_lossy(&b[10..10 + header]);
    assert!(text.contains("<i8"), "{text}");
    b[10 + header..]
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// Labels in pipeline files — a directory's folders, or a label file — reach the batches and
/// `--dump` (`epoch{E}-batch{N}-labels.npy` beside each batch); a directory's extensions
/// default to the decoder's, with or without the dot.
#[test]
fn labels_from_folders_or_a_label_file_round_trip_through_dump() {
    let dir = scratch("labels");
    let tree = dir.join("tree");
    let imgs = images();
    let mut files = Vec::new();
    for (i, p) in imgs.iter().take(6).enumerate() {
        let class = if i < 3 { "cat" } else { "dog" };
        let q = tree.join(class).join(format!("{i}.jpg"));
        std::fs::create_dir_all(q.parent().unwrap()).unwrap();
        std::fs::copy(p, &q).unwrap();
        files.push(q);
    }
    std::fs::write(
        dir.join("labels.tsv"),
        files
            .iter()
            .enumerate()
            .map(|(i, _)| {
                format!(
                    "tree/{}/{i}.jpg {}\n",
                    if i < 3 { "cat" } else { "dog" },
                    10 + i
                )
            })
            .collect::<String>(),
    )
    .unwrap();
    for (labels, want) in [
        ("labels = \"folder\"", vec![0, 0, 0, 1, 1, 1]),
        ("label_file = \"labels.tsv\"", vec![10, 11, 12, 13, 14, 15]),
        (
            "labels = \"folder\"\nextensions = [\".JPG\"]",
            vec![0, 0, 0, 1, 1, 1],
        ),
    ] {
        let file = dir.join("labels.toml");
        std::fs::write(
            &file,
            format!(
                "[source]\nkind = \"dir\"\npath = \"tree\"\n{labels}\n[decode]\nkind = \"image\"\n\
                 resize = 32\ncrop = 32\n[loader]\nshuffle = false\nbatch_size = 4\n"
            ),
        )
        .unwrap();
        let (out, dump) = run_with_dump(&dir, &file);
        assert_eq!(
            out.status.code(),
            Some(0),
            "{labels}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let got: Vec<i64> = [
            "epoch0-batch00000-labels.npy",
            "epoch0-batch00001-labels.npy",
        ]
        .iter()
        .flat_map(|f| npy_i64(&dump.join(f)))
        .collect();
        assert_eq!(got, want, "{labels}");
    }
    // A list or dir source takes "folder" or a label file, nothing else.
    std::fs::write(
        dir.join("bad.toml"),
        "[source]\nkind = \"dir\"\npath = \"tree\"\nlabels = \"cls\"\n[decode]\nkind = \"image\"\n",
    )
    .unwrap();
    let out = run_quiet(&dir.join("bad.toml"));
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("\"folder\""),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A media field in a pipeline file (`[fields] depth = { kind = "image", ... }` over loose
/// files with `a.depth.jpg` beside each `a.jpg`): the run decodes it, and `--dump` writes it by
/// name beside each batch (`-depth.npy`, its own crop); the walk takes the sidecars as fields,
/// not samples.
#[test]
fn a_media_field_runs_and_is_dumped_by_name() {
    let dir = scratch("media-field");
    let tree = dir.join("tree");
    std::fs::create_dir_all(&tree).unwrap();
    for (i, p) in images().iter().take(6).enumerate() {
        std::fs::copy(p, tree.join(format!("{i}.jpg"))).unwrap();
        std::fs::copy(p, tree.join(format!("{i}.depth.jpg"))).unwrap();
    }
    let file = dir.join("depth.toml");
    std::fs::write(
        &file,
        "[source]\nkind = \"dir\"\npath = \"tree\"\n[fields]\ndepth = { from = \"depth.jpg\", \
         kind = \"image\", resize = 24, crop = 16 }\n[decode]\nkind = \"image\"\nresize = 32\n\
         crop = 32\n[loader]\nbatch_size = 4\n",
    )
    .unwrap();
    let (out, dump) = run_with_dump(&dir, &file);
    assert_succeeded(&out);
    assert_eq!(json(&out)["items"], 6, "six samples, not twelve");
    for (batch, rows) in [(0, 4), (1, 2)] {
        let npy = std::fs::read(dump.join(format!("epoch0-batch{batch:05}-depth.npy"))).unwrap();
        let header = String::from_utf8_lossy(&npy[10..npy.len().min(128)]).to_string();
        assert!(
            header.contains(&format!("'shape': ({rows}, 3, 16, 16)")),
            "{header}"
        );
    }
}
