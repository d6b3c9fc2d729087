//! A shard's samples: its members grouped by key, WebDataset's convention.

use std::sync::Arc;

use super::tar::{Input, Member, Walker};

/// One field of a sample: a member's extension and its bytes' place in the shard.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FieldAt {
    /// The extension (everything after the first dot of the file name), lower-cased: `jpg`,
    /// `cls`, `seg.png`.
    pub ext: String,
    /// The data's offset in the shard.
    pub offset: u64,
    /// Its size in bytes.
    pub size: u64,
}

/// One sample of a shard: the consecutive members that share a key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    /// The key: the member's path up to the first dot of its file name.
    pub key: String,
    /// Its fields, in archive order.
    pub fields: Vec<FieldAt>,
    /// Why the sample cannot be read (the shard is cut off or corrupt here, a field twice):
    /// reading it is that error, counted by the failure budget.
    pub problem: Option<Arc<str>>,
}

impl Entry {
    /// The byte range `[start, end)` covering every field's data.
    pub fn span(&self) -> (u64, u64) {
        let start = self.fields.iter().map(|f| f.offset).min().unwrap_or(0);
        let end = self
            .fields
            .iter()
            .map(|f| f.offset + f.size)
            .max()
            .unwrap_or(start);
        (start, end)
    }
}

/// WebDataset's split of a member's path into (key, extension): the key is the path up to the
/// first dot of the file name, the extension the rest, lower-cased. `None` for a name with no
/// dot in its file name (not a sample field).
pub fn split_name(name: &str) -> Option<(&str, String)> {
    let file_start = name.rfind('/').map_or(0, |i| i + 1);
    let dot = name[file_start..].find('.')? + file_start;
    if dot == file_start {
        // A hidden file (`.DS_Store`, `dir/.x`): not a field of any sample.
        return None;
    }
    Some((&name[..dot], name[dot + 1..].to_ascii_lowercase()))
}

/// Every sample of the archive `input` reads (see [`Walker`]). An archive that fails part way
/// keeps the samples before the failure and ends with one entry holding the error (its key
/// the one being read, or `@byte N` if none); an empty input is one such entry too.
pub(crate) fn index(input: impl Input, max_member: u64) -> Vec<Entry> {
    let mut walker = Walker::new(input, max_member);
    let mut out: Vec<Entry> = Vec::new();
    let mut open: Option<Entry> = None;
    let mut members = 0usize;
    loop {
        match walker.next_member() {
            Ok(Some(m)) => {
                members += 1;
                add(&mut out, &mut open, m);
            }
            Ok(None) => {
                out.extend(open.take());
                if members == 0 && out.is_empty() {
                    // No member at all: say so once, rather than yield nothing silently.
                    out.push(Entry {
                        key: "@byte 0".into(),
                        fields: Vec::new(),
                        problem: Some(
                            "the shard holds no samples (empty or only end blocks)".into(),
                        ),
                    });
                }
                return out;
            }
            Err(e) => {
                // The sample the failing member belongs to is the damaged one; a sample
                // before it that was open is complete as far as anyone can tell.
                let failing = e.member().and_then(split_name).map(|(k, _)| k.to_owned());
                let key = match (open.take(), failing) {
                    (Some(o), Some(k)) if o.key != k => {
                        out.push(o);
                        k
                    }
                    (Some(o), _) => o.key,
                    (None, Some(k)) => k,
                    (None, None) => format!("@byte {}", e.at()),
                };
                out.push(Entry {
                    key,
                    fields: Vec::new(),
                    problem: Some(e.to_string().into()),
                });
                return out;
            }
        }
    }
}

fn add(out: &mut Vec<Entry>, open: &mut Option<Entry>, m: Member) {
    let Some((key, ext)) = split_name(&m.name) else {
        return;
    };
    let field = FieldAt {
        ext,
        offset: m.offset,
        size: m.size,
    };
    match open {
        Some(e) if e.key == key => {
            if e.fields.iter().any(|f| f.ext == field.ext) && e.problem.is_none() {
                e.problem = Some(format!("the field {:?} appears twice", field.ext).into());
            }
            e.fields.push(field);
        }
        _ => {
            out.extend(open.take());
            *open = Some(Entry {
                key: key.to_owned(),
                fields: vec![field],
                problem: None,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::tar::{write_archive, Forward};
    use super::*;

    #[test]
    fn keys_and_extensions_follow_webdataset() {
        assert_eq!(
            split_name("a/b/000123.jpg"),
            Some(("a/b/000123", "jpg".into()))
        );
        assert_eq!(split_name("x.seg.PNG"), Some(("x", "seg.png".into())));
        assert_eq!(split_name("dir.v2/x.cls"), Some(("dir.v2/x", "cls".into())));
        assert_eq!(split_name("README"), None);
        assert_eq!(split_name("d/.hidden"), None);
    }

    #[test]
    fn consecutive_members_of_a_key_make_a_sample() {
        let mut a = Vec::new();
        let m = |n: &str, d: &[u8]| (n.to_string(), d.to_vec());
        write_archive(
            &mut a,
            [
                m("k1.jpg", b"J1"),
                m("k1.cls", b"3"),
                m("k2.jpg", b"J2"),
                m("k2.jpg", b"again"),
                m("notes", b"x"),
                m("k3.cls", b"4"),
            ],
        )
        .unwrap();
        let e = index(Forward(&a[..]), 1 << 20);
        let keys: Vec<&str> = e.iter().map(|e| e.key.as_str()).collect();
        assert_eq!(keys, ["k1", "k2", "k3"]);
        assert_eq!(e[0].fields.len(), 2);
        assert!(e[0].problem.is_none());
        assert!(e[1].problem.as_deref().unwrap().contains("twice"));
        let (s, end) = e[0].span();
        assert_eq!(&a[s as usize..s as usize + 2], b"J1");
        assert_eq!(&a[end as usize - 1..end as usize], b"3");
        // Cut inside k2's second member: k1 kept, then an entry naming k2 with the error.
        let cut = e[1].fields[1].offset as usize + 2;
        let t = index(Forward(&a[..cut]), 1 << 20);
        assert_eq!(t.len(), 2);
        assert_eq!(t[1].key, "k2");
        assert!(
            t[1].problem.as_deref().unwrap().contains("truncated"),
            "{t:?}"
        );
        let empty = index(Forward(&[][..]), 1 << 20);
        assert!(empty[0].problem.as_deref().unwrap().contains("no samples"));
    }
}
