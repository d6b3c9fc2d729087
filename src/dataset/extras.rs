//! A sample's fields besides its media ([`FieldSpec`]): text (a caption, a transcript), JSON
//! (a record), an integer or raw bytes, read from a tar sample's other members by extension,
//! a Parquet row's other columns, or files beside a loose media file (sidecars: `a.txt`
//! beside `a.jpg`, the media's extension replaced by the field's), and delivered beside the
//! batch's media, one value per item in the batch's order ([`FieldValue`]).
//!
//! A field is required unless declared optional: a sample without it (or whose bytes are not
//! what its kind needs: text that is not UTF-8, JSON that does not parse, an integer that is
//! not one) is a failed item of the decode stage, skipped and counted or fatal as the
//! loader's failure policy says; an optional field a sample lacks is
//! [`FieldValue::Missing`].

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::shards::{RawSample, ShardError};

/// What a field's bytes become.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FieldKind {
    /// UTF-8 text (`str` in Python).
    Text,
    /// A JSON document, parsed.
    Json,
    /// A decimal integer (as WebDataset's `cls`).
    Int,
    /// The bytes as they are.
    Bytes,
}

impl FieldKind {
    /// The kind a member's extension suggests (its last part: `seg.txt` as `txt`): `txt`,
    /// `text`, `caption`, `transcript` → text; `json` → JSON; `cls`, `cls2`, `index`, `id`,
    /// `label` → an integer; anything else → bytes.
    pub fn of_extension(ext: &str) -> Self {
        let last = ext.rsplit('.').next().unwrap_or(ext);
        match last.to_ascii_lowercase().as_str() {
            "txt" | "text" | "caption" | "captions" | "transcript" => Self::Text,
            "json" => Self::Json,
            "cls" | "cls2" | "index" | "id" | "label" => Self::Int,
            _ => Self::Bytes,
        }
    }
}

/// One field besides the media: its name in the batch, the members (extensions) or columns
/// it is read from (the first present wins), what it becomes, and whether a sample may lack
/// it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FieldSpec {
    /// The field's name in the batch.
    pub name: String,
    /// Extensions of a tar sample's members or of the files beside a loose file (`txt`), or
    /// Parquet columns (`caption`).
    pub from: Vec<String>,
    /// What the bytes become.
    pub kind: FieldKind,
    /// A sample without it gives [`FieldValue::Missing`] instead of failing.
    #[serde(default)]
    pub optional: bool,
}

impl FieldSpec {
    /// A required field read from `from` (a member's extension or a column), its kind from
    /// the extension ([`FieldKind::of_extension`]).
    pub fn new(name: impl Into<String>, from: impl Into<String>) -> Self {
        let from = from.into();
        Self {
            name: name.into(),
            kind: FieldKind::of_extension(&from),
            from: vec![from],
            optional: false,
        }
    }

    /// What the bytes become.
    pub fn kind(mut self, kind: FieldKind) -> Self {
        self.kind = kind;
        self
    }

    /// A sample may lack it ([`FieldValue::Missing`]).
    pub fn optional(mut self, optional: bool) -> Self {
        self.optional = optional;
        self
    }

    /// Its extensions as a tar shard's samples name their members: lower case, no leading
    /// dot.
    pub(crate) fn normalized(mut self) -> Self {
        for e in &mut self.from {
            *e = e.trim_start_matches('.').to_ascii_lowercase();
        }
        self
    }
}

/// Fields as the front ends write them (a pipeline file's table, Python's dict), as JSON:
/// each name maps to where it is read from — an extension or column (`"txt"`), several
/// (`["txt", "caption"]`, the first present wins; the kind from the first), or a table
/// `{"from": ..., "kind": "text" | "json" | "int" | "bytes", "optional": bool}`.
pub fn fields_from_value(v: serde_json::Value) -> Result<Vec<FieldSpec>, String> {
    use serde_json::Value;
    let Value::Object(map) = v else {
        return Err(format!(
            "fields must map each field's name to where it is read from, not {v}"
        ));
    };
    let from = |name: &str, v: Value| -> Result<Vec<String>, String> {
        match v {
            Value::String(s) => Ok(vec![s]),
            Value::Array(a) if !a.is_empty() => a
                .into_iter()
                .map(|x| match x {
                    Value::String(s) => Ok(s),
                    x => Err(format!(
                        "fields: {name:?}: {x} is not an extension or column"
                    )),
                })
                .collect(),
            v => Err(format!(
                "fields: {name:?} is read from an extension or column (\"txt\"), a list of them, \
                 or a table with \"from\", \"kind\" and \"optional\"; not {v}"
            )),
        }
    };
    let mut out = Vec::with_capacity(map.len());
    for (name, v) in map {
        let spec = match v {
            Value::Object(mut t) => {
                let src = t
                    .remove("from")
                    .ok_or_else(|| format!("fields: {name:?} needs \"from\""))?;
                let mut spec = FieldSpec::new(name.clone(), String::new());
                spec.from = from(&name, src)?;
                spec.kind = FieldKind::of_extension(&spec.from[0]);
                if let Some(k) = t.remove("kind") {
                    spec.kind = serde_json::from_value(k.clone()).map_err(|_| {
                        format!(
                            "fields: {name:?}: kind must be \"text\", \"json\", \"int\", \
                             \"bytes\", or a media kind (\"image\", \"audio\", \"video\": \
                             decoded by a recipe of its own), not {k}"
                        )
                    })?;
                }
                if let Some(o) = t.remove("optional") {
                    spec.optional = o.as_bool().ok_or_else(|| {
                        format!("fields: {name:?}: optional must be true or false")
                    })?;
                }
                if let Some(k) = t.keys().next() {
                    return Err(format!(
                        "fields: {name:?}: unknown key {k:?} (from, kind, optional)"
                    ));
                }
                spec
            }
            v => {
                let exts = from(&name, v)?;
                let mut spec = FieldSpec::new(name.clone(), exts[0].clone());
                spec.from = exts;
                spec
            }
        };
        out.push(spec);
    }
    check(&out)?;
    Ok(out)
}

/// A field's value in one item.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FieldValue {
    /// Text.
    Text(String),
    /// A parsed JSON document.
    Json(serde_json::Value),
    /// An integer.
    Int(i64),
    /// Raw bytes.
    Bytes(Vec<u8>),
    /// An optional field the sample lacks.
    Missing,
}

/// Checks the fields a loader is asked for: names that are not empty and not repeated, and
/// each read from somewhere.
pub(crate) fn check(specs: &[FieldSpec]) -> Result<(), String> {
    for (i, s) in specs.iter().enumerate() {
        if s.name.is_empty() {
            return Err("fields: a field needs a name".into());
        }
        if specs[..i].iter().any(|o| o.name == s.name) {
            return Err(format!("fields: {:?} is named twice", s.name));
        }
        if s.from.is_empty() || s.from.iter().any(|e| e.trim_start_matches('.').is_empty()) {
            return Err(format!(
                "fields: {:?} needs the extensions (or columns) it is read from",
                s.name
            ));
        }
    }
    Ok(())
}

/// The values of `specs` in `raw` (its members left as they are).
pub(crate) fn read(raw: &RawSample, specs: &[FieldSpec]) -> Result<Vec<FieldValue>, ShardError> {
    specs.iter().map(|s| value(raw, s)).collect()
}

fn value(raw: &RawSample, spec: &FieldSpec) -> Result<FieldValue, ShardError> {
    let found = spec
        .from
        .iter()
        .find_map(|e| raw.fields.iter().find(|(x, _)| x == e));
    let Some((ext, bytes)) = found else {
        if spec.optional {
            return Ok(FieldValue::Missing);
        }
        return Err(ShardError::Missing {
            shard: raw.shard.clone(),
            key: raw.key.clone(),
            wanted: format!("{} (field {:?})", spec.from.join(" or "), spec.name),
            has: match raw.extensions() {
                e if e.is_empty() => "nothing".into(),
                e => e.join(", "),
            },
        });
    };
    let err = |reason: String| ShardError::Field {
        shard: raw.shard.clone(),
        key: raw.key.clone(),
        ext: ext.clone(),
        reason: format!("field {:?}: {reason}", spec.name),
    };
    match spec.kind {
        FieldKind::Int => Ok(FieldValue::Int(raw.parse_label(ext.clone(), bytes)?)),
        kind => parse(kind, bytes.clone()).map_err(err),
    }
}

/// The file beside the loose media file `media` that a field read from `ext` reads:
/// `media`'s last extension replaced (`a.jpg` → `a.txt`, `a.depth.png`).
pub(crate) fn sidecar(media: &Path, ext: &str) -> std::path::PathBuf {
    media.with_extension(ext.trim_start_matches('.'))
}

/// The files of a directory walk that are another listed file's sidecars (`a.depth.jpg`
/// beside `a.jpg` for a field read from `depth.jpg`): fields of a sample, not samples.
pub(crate) fn sidecars_among(
    files: &[std::path::PathBuf],
    specs: &[FieldSpec],
) -> std::collections::HashSet<std::path::PathBuf> {
    let listed: std::collections::HashSet<&Path> = files.iter().map(|p| p.as_path()).collect();
    files
        .iter()
        .flat_map(|p| {
            specs
                .iter()
                .flat_map(|f| f.from.iter())
                .map(move |e| (p, sidecar(p, e)))
        })
        .filter(|(p, s)| *p != s && listed.contains(s.as_path()))
        .map(|(_, s)| s)
        .collect()
}

/// The values of `specs` from the files beside the loose media file `media` (sidecars:
/// `media`'s extension replaced by each of a field's, the first that exists wins; names as
/// given, as case sensitive as the file system).
pub(crate) fn read_sidecars(
    media: &Path,
    specs: &[FieldSpec],
) -> Result<Vec<FieldValue>, ShardError> {
    let mut out = Vec::with_capacity(specs.len());
    for spec in specs {
        let err = |reason: String| ShardError::Sidecar {
            media: media.to_path_buf(),
            field: spec.name.clone(),
            reason,
        };
        let mut found = None;
        for ext in &spec.from {
            let path = sidecar(media, ext);
            match std::fs::metadata(&path) {
                // A FIFO, a device or a directory would block a worker, fill the memory or
                // fail: only regular files (symbolic links followed) are read.
                Ok(m) if !m.is_file() => {
                    return Err(err(format!("{}: not a regular file", path.display())))
                }
                Ok(_) => match std::fs::read(&path) {
                    Ok(bytes) => {
                        found = Some((path, bytes));
                        break;
                    }
                    Err(e) => return Err(err(format!("{}: {e}", path.display()))),
                },
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(err(format!("{}: {e}", path.display()))),
            }
        }
        out.push(match found {
            Some((path, bytes)) => {
                parse(spec.kind, bytes).map_err(|r| err(format!("{}: {r}", path.display())))?
            }
            None if spec.optional => FieldValue::Missing,
            None => {
                let looked: Vec<String> = spec
                    .from
                    .iter()
                    .map(|e| sidecar(media, e).display().to_string())
                    .collect();
                return Err(err(format!("no file {}", looked.join(" or "))));
            }
        });
    }
    Ok(out)
}

/// A field's bytes as its kind says, or what is wrong with them.
fn parse(kind: FieldKind, bytes: Vec<u8>) -> Result<FieldValue, String> {
    let text = |b: &[u8]| -> Result<String, String> {
        std::str::from_utf8(b)
            .map(str::to_owned)
            .map_err(|e| format!("not UTF-8 text: {e}"))
    };
    Ok(match kind {
        FieldKind::Text => FieldValue::Text(text(&bytes)?),
        FieldKind::Json => {
            FieldValue::Json(serde_json::from_slice(&bytes).map_err(|e| format!("not JSON: {e}"))?)
        }
        FieldKind::Int => {
            let t = text(&bytes).map_err(|_| "an integer that is not text".to_owned())?;
            FieldValue::Int(t.trim().parse().map_err(|_| {
                format!(
                    "{:?} is not an integer",
                    t.chars().take(40).collect::<String>()
                )
            })?)
        }
        FieldKind::Bytes => FieldValue::Bytes(bytes),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(fields: &[(&str, &[u8])]) -> RawSample {
        RawSample {
            shard: "s-0.tar".into(),
            key: "k1".into(),
            epoch: 0,
            fields: fields
                .iter()
                .map(|(e, b)| ((*e).to_owned(), b.to_vec()))
                .collect(),
        }
    }

    #[test]
    fn each_kind_reads_its_bytes_and_names_what_is_wrong() {
        let raw = sample(&[
            ("jpg", b"\xff\xd8"),
            ("txt", "a café".as_bytes()),
            ("json", br#"{"key": "k1", "n": [1, 2]}"#),
            ("cls", b" 7\n"),
        ]);
        let specs = [
            FieldSpec::new("caption", "txt"),
            FieldSpec::new("meta", "json"),
            FieldSpec::new("label", "cls"),
            FieldSpec::new("raw", "jpg"),
            FieldSpec::new("alt", "alt.txt").optional(true),
        ];
        assert_eq!(
            read(&raw, &specs).unwrap(),
            [
                FieldValue::Text("a café".into()),
                FieldValue::Json(serde_json::json!({"key": "k1", "n": [1, 2]})),
                FieldValue::Int(7),
                FieldValue::Bytes(b"\xff\xd8".to_vec()),
                FieldValue::Missing,
            ]
        );
        let missing = read(&raw, &[FieldSpec::new("alt", "alt.txt")]).unwrap_err();
        assert!(
            missing.to_string().contains("alt.txt (field \"alt\")")
                && missing.to_string().contains("cls, jpg, json, txt"),
            "{missing}"
        );
        let bad = sample(&[("json", b"{oops"), ("txt", b"\xff\xfe")]);
        let e = read(&bad, &[FieldSpec::new("meta", "json")]).unwrap_err();
        assert!(e.to_string().contains("field \"meta\": not JSON"), "{e}");
        let e = read(&bad, &[FieldSpec::new("caption", "txt")]).unwrap_err();
        assert!(e.to_string().contains("not UTF-8"), "{e}");
        let e = read(&bad, &[FieldSpec::new("n", "txt").kind(FieldKind::Int)]).unwrap_err();
        assert!(e.to_string().contains("not text"), "{e}");
    }

    #[test]
    fn front_ends_write_fields_as_a_table() {
        let f = fields_from_value(serde_json::json!({
            "caption": "txt",
            "meta": {"from": ["json", "meta.json"], "optional": true},
            "raw": {"from": "cls", "kind": "bytes"},
            "alt": ["text", "txt"],
        }))
        .unwrap();
        let by = |n: &str| f.iter().find(|s| s.name == n).unwrap().clone();
        assert_eq!(by("caption"), FieldSpec::new("caption", "txt"));
        assert_eq!(by("meta").from, ["json", "meta.json"]);
        assert!(by("meta").optional && by("meta").kind == FieldKind::Json);
        assert_eq!(by("raw").kind, FieldKind::Bytes);
        assert_eq!(by("alt").kind, FieldKind::Text);
        assert_eq!(FieldKind::of_extension("seg.TXT"), FieldKind::Text);
        assert_eq!(FieldKind::of_extension(".json"), FieldKind::Json);
        for (bad, says) in [
            (serde_json::json!(["txt"]), "must map"),
            (serde_json::json!({"c": 3}), "not 3"),
            (serde_json::json!({"c": []}), "not []"),
            (serde_json::json!({"c": {"kind": "text"}}), "needs \"from\""),
            (
                serde_json::json!({"c": {"from": "txt", "kind": "str"}}),
                "kind must be",
            ),
            (
                serde_json::json!({"c": {"from": "txt", "optional": 1}}),
                "true or false",
            ),
            (
                serde_json::json!({"c": {"from": "txt", "opt": true}}),
                "unknown key",
            ),
            (serde_json::json!({"": "txt"}), "needs a name"),
        ] {
            let e = fields_from_value(bad.clone()).unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn names_are_checked() {
        assert!(check(&[FieldSpec::new("a", "txt"), FieldSpec::new("b", "json")]).is_ok());
        let twice = check(&[FieldSpec::new("a", "txt"), FieldSpec::new("a", "json")]);
        assert!(twice.unwrap_err().contains("named twice"));
        assert!(check(&[FieldSpec::new("", "txt")]).is_err());
        assert!(check(&[FieldSpec::new("a", ".")]).is_err());
    }
}
