//! Writing shards and their manifest (WebDataset's `wids` format).

use std::path::{Path, PathBuf};

use super::{tar, MANIFEST};

/// Writes the files at `paths` into tar shards of `per_shard` samples in `out` (created if
/// missing), `shard-000000.tar`, …, as `webdataset` and the peers' scripts lay them out: sample
/// `i` is `{i:08}.EXT` (the file's bytes, its extension lower-cased), `{i:08}.cls` (the label
/// `label(i, path)`, as text) and `{i:08}.json` (`{"path": ...}`); and their manifest,
/// [`MANIFEST`]. Returns the shards' brace pattern.
pub fn write_shards(
    paths: &[PathBuf],
    out: &Path,
    per_shard: usize,
    label: impl Fn(usize, &Path) -> i64,
) -> std::io::Result<String> {
    let per_shard = per_shard.max(1);
    std::fs::create_dir_all(out)?;
    let n = paths.len().div_ceil(per_shard);
    let mut written = Vec::with_capacity(n);
    for s in 0..n {
        let mut members = Vec::new();
        for (i, path) in paths.iter().enumerate().skip(s * per_shard).take(per_shard) {
            let ext = path
                .extension()
                .map_or("bin".into(), |e| e.to_string_lossy().to_ascii_lowercase());
            let key = format!("{i:08}");
            members.push((format!("{key}.{ext}"), std::fs::read(path)?));
            members.push((
                format!("{key}.cls"),
                label(i, path).to_string().into_bytes(),
            ));
            let json = format!("{{\"path\": {:?}}}", path.display().to_string());
            members.push((format!("{key}.json"), json.into_bytes()));
        }
        let path = out.join(format!("shard-{s:06}.tar"));
        let file = std::fs::File::create(&path)?;
        let samples = members.len() / 3;
        tar::write_archive(std::io::BufWriter::new(file), members)?;
        written.push((path, samples));
    }
    std::fs::write(out.join(MANIFEST), manifest_json(&written, out))?;
    Ok(format!(
        "{}/shard-{{000000..{:06}}}.tar",
        out.display(),
        n.saturating_sub(1)
    ))
}

/// The manifest of local shards in WebDataset's `wids` format (`{"shardlist": [{"url",
/// "nsamples"}]}`), URLs relative to `folder` where they are under it.
pub(super) fn manifest_json(shards: &[(PathBuf, usize)], folder: &Path) -> String {
    let list: Vec<serde_json::Value> = shards
        .iter()
        .map(|(p, n)| {
            let url = p.strip_prefix(folder).unwrap_or(p);
            serde_json::json!({"url": url.to_string_lossy(), "nsamples": n})
        })
        .collect();
    serde_json::to_string_pretty(&serde_json::json!({
        "__kind__": "wids-shard-index-v1",
        "wids_version": 1,
        "shardlist": list,
    }))
    .expect("a manifest serialises")
}
