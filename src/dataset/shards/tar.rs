//! A tar reader that walks headers and never trusts them: the members of a POSIX (ustar),
//! GNU or pax archive, as names and byte ranges, read from a stream or a file.
//!
//! Only what sample shards need: regular files' names, data offsets and sizes (GNU long names
//! and pax `path`/`size` records honoured; directories, links and other entries skipped).
//! Every header is checked (its checksum, its octal fields) and every declared size is checked
//! against what follows it: an archive that ends inside a member, a header that is not one, or
//! a member larger than the limit is a [`TarError`] naming where, never a panic, an
//! allocation sized by the header, or a read past the end.

use std::io::{self, Read, Seek, SeekFrom};

const BLOCK: u64 = 512;
/// The longest GNU long name or pax header read (they are names and a few fields).
const META_LIMIT: u64 = 1 << 20;

/// Why an archive could not be read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TarError {
    /// Reading failed.
    #[error("reading at byte {at}: {source}")]
    Io {
        /// Where.
        at: u64,
        /// The I/O error.
        source: io::Error,
    },
    /// The archive ends inside a header or a member (cut off, or a header that lies about
    /// its size).
    #[error("truncated at byte {at}: {what}")]
    Truncated {
        /// Where the data ran out.
        at: u64,
        /// What was being read.
        what: String,
        /// The member whose data ran out, if the header was read.
        member: Option<String>,
    },
    /// A block that should be a header is not one (garbage, or not a tar file).
    #[error("byte {at}: not a tar header ({reason})")]
    BadHeader {
        /// The header's offset.
        at: u64,
        /// What is wrong with it.
        reason: String,
    },
    /// A member declares more bytes than the limit.
    #[error("member {name:?} at byte {at} declares {size} bytes, over the limit of {limit}")]
    TooLarge {
        /// The member.
        name: String,
        /// Its header's offset.
        at: u64,
        /// The declared size.
        size: u64,
        /// The limit.
        limit: u64,
    },
}

/// One regular file of an archive.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Member {
    /// Its path in the archive.
    pub name: String,
    /// The offset of its first header (with long-name or pax headers, the first of those).
    pub header: u64,
    /// The offset of its data.
    pub offset: u64,
    /// Its size in bytes.
    pub size: u64,
}

impl TarError {
    /// The member the error is about, when its header was read.
    pub fn member(&self) -> Option<&str> {
        match self {
            TarError::Truncated { member, .. } => member.as_deref(),
            TarError::TooLarge { name, .. } => Some(name),
            _ => None,
        }
    }

    /// The offset where the error was found.
    pub fn at(&self) -> u64 {
        match self {
            TarError::Io { at, .. }
            | TarError::Truncated { at, .. }
            | TarError::BadHeader { at, .. }
            | TarError::TooLarge { at, .. } => *at,
        }
    }
}

impl Member {
    /// The offset just past its data and padding: where the next header starts.
    pub fn end(&self) -> u64 {
        self.offset.saturating_add(padded(self.size))
    }
}

/// `size` rounded up to whole blocks; saturating, so a header's size near 2^64 (base-256
/// allows it) reads as "past the end of any archive" instead of overflowing.
fn padded(size: u64) -> u64 {
    size.div_ceil(BLOCK).saturating_mul(BLOCK)
}

/// What the reader reads from: a stream it can skip forward in. Files seek (and know their
/// length, so a lying header is caught without reading); other streams read and discard.
pub trait Input: Read {
    /// Skips `n` bytes; returns how many were there to skip.
    fn skip(&mut self, n: u64) -> io::Result<u64>;
}

/// A seekable input of known length (a local file, bytes in memory).
#[derive(Debug)]
pub struct Seekable<R> {
    inner: R,
    pos: u64,
    len: u64,
}

impl<R: Read + Seek> Seekable<R> {
    /// `inner` from its current position (taken as 0) to its end.
    pub fn new(mut inner: R) -> io::Result<Self> {
        let start = inner.stream_position()?;
        let len = inner.seek(SeekFrom::End(0))? - start;
        inner.seek(SeekFrom::Start(start))?;
        Ok(Self { inner, pos: 0, len })
    }
}

impl<R: Read> Read for Seekable<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.pos += n as u64;
        Ok(n)
    }
}

impl<R: Read + Seek> Input for Seekable<R> {
    fn skip(&mut self, n: u64) -> io::Result<u64> {
        let n = n.min(self.len.saturating_sub(self.pos));
        self.inner.seek(SeekFrom::Current(n as i64))?;
        self.pos += n;
        Ok(n)
    }
}

/// A stream that can only be read forward (an HTTP body): skipping reads and discards.
#[derive(Debug)]
pub struct Forward<R>(pub R);

impl<R: Read> Read for Forward<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.0.read(buf)
    }
}

impl<R: Read> Input for Forward<R> {
    fn skip(&mut self, n: u64) -> io::Result<u64> {
        io::copy(&mut (&mut self.0).take(n), &mut io::sink())
    }
}

/// Walks an archive's headers: [`next`](Self::next) gives each regular file's [`Member`]
/// (its data skipped, not read).
#[derive(Debug)]
pub struct Walker<I> {
    input: I,
    pos: u64,
    max_member: u64,
    done: bool,
}

impl<I: Input> Walker<I> {
    /// A walker over `input` (at the archive's first byte), refusing members larger than
    /// `max_member` bytes.
    pub fn new(input: I, max_member: u64) -> Self {
        Self {
            input,
            pos: 0,
            max_member,
            done: false,
        }
    }

    /// The next regular file, `None` at the end of the archive (two zero blocks, or the end
    /// of the input at a header boundary, as webdataset and Python's `tarfile` accept).
    /// After an error the walker is done.
    pub fn next_member(&mut self) -> Result<Option<Member>, TarError> {
        if self.done {
            return Ok(None);
        }
        let r = self.walk();
        if !matches!(r, Ok(Some(_))) {
            self.done = true;
        }
        r
    }

    fn walk(&mut self) -> Result<Option<Member>, TarError> {
        let mut long_name: Option<String> = None;
        let mut pax_size: Option<u64> = None;
        let mut first_header: Option<u64> = None;
        loop {
            let at = self.pos;
            let mut block = [0u8; BLOCK as usize];
            let got = self.read_full(&mut block)?;
            if got == 0 && first_header.is_none() {
                return Ok(None);
            }
            if got < BLOCK as usize {
                return Err(TarError::Truncated {
                    at: self.pos,
                    what: format!("a header at byte {at} has {got} of 512 bytes"),
                    member: None,
                });
            }
            if block.iter().all(|&b| b == 0) {
                if first_header.is_some() {
                    return Err(TarError::BadHeader {
                        at,
                        reason: "an end-of-archive block after a long-name or pax header".into(),
                    });
                }
                return Ok(None);
            }
            let header = Header::parse(&block, at)?;
            first_header.get_or_insert(at);
            let size = match (header.kind, pax_size.take()) {
                (b'0' | 0 | b'7', Some(s)) => s,
                _ => header.size,
            };
            let data = self.pos;
            match header.kind {
                b'L' | b'x' => {
                    if size > META_LIMIT {
                        return Err(TarError::TooLarge {
                            name: "(long name or pax header)".into(),
                            at,
                            size,
                            limit: META_LIMIT,
                        });
                    }
                    let bytes = self.read_member(size, at, "a long-name or pax header")?;
                    if header.kind == b'L' {
                        let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
                        long_name = Some(String::from_utf8_lossy(&bytes[..end]).into_owned());
                    } else {
                        for (k, v) in pax_records(&bytes, at)? {
                            match k {
                                "path" => long_name = Some(v.to_owned()),
                                "size" => {
                                    pax_size = Some(v.parse().map_err(|_| TarError::BadHeader {
                                        at,
                                        reason: format!("pax size {v:?} is not a number"),
                                    })?)
                                }
                                _ => {}
                            }
                        }
                    }
                    self.skip_padding(size, at)?;
                }
                b'0' | 0 | b'7' => {
                    let name = long_name.take().unwrap_or(header.name);
                    if size > self.max_member {
                        return Err(TarError::TooLarge {
                            name,
                            at,
                            size,
                            limit: self.max_member,
                        });
                    }
                    self.skip_data(size, at, &name)?;
                    return Ok(Some(Member {
                        name,
                        header: first_header.unwrap_or(at),
                        offset: data,
                        size,
                    }));
                }
                _ => {
                    // Directories, links, devices, global pax headers: no sample data.
                    let what = format!("entry {:?}", header.name);
                    self.skip_data(size, at, &what)?;
                    long_name = None;
                    first_header = None;
                }
            }
        }
    }

    /// Reads until `buf` is full or the input ends; returns how much was read.
    fn read_full(&mut self, buf: &mut [u8]) -> Result<usize, TarError> {
        let mut got = 0;
        while got < buf.len() {
            match self.input.read(&mut buf[got..]) {
                Ok(0) => break,
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(source) => {
                    return Err(TarError::Io {
                        at: self.pos + got as u64,
                        source,
                    })
                }
            }
        }
        self.pos += got as u64;
        Ok(got)
    }

    fn read_member(&mut self, size: u64, at: u64, what: &str) -> Result<Vec<u8>, TarError> {
        let mut bytes = vec![0u8; size as usize];
        let got = self.read_full(&mut bytes)?;
        if got < bytes.len() {
            return Err(TarError::Truncated {
                at: self.pos,
                what: format!("{what} at byte {at} declares {size} bytes, {got} follow"),
                member: None,
            });
        }
        Ok(bytes)
    }

    fn skip_exact(
        &mut self,
        n: u64,
        at: u64,
        member: Option<&str>,
        what: &dyn Fn() -> String,
    ) -> Result<(), TarError> {
        let skipped = self.input.skip(n).map_err(|source| TarError::Io {
            at: self.pos,
            source,
        })?;
        self.pos += skipped;
        if skipped < n {
            return Err(TarError::Truncated {
                at: self.pos,
                what: format!("{} (header at byte {at})", what()),
                member: member.map(str::to_owned),
            });
        }
        Ok(())
    }

    fn skip_data(&mut self, size: u64, at: u64, name: &str) -> Result<(), TarError> {
        let padded = padded(size);
        self.skip_exact(size, at, Some(name), &|| {
            format!("member {name:?} declares {size} bytes, the archive ends before")
        })?;
        // A final member's padding may be cut (some writers omit it); only data counts.
        let _ = self.input.skip(padded - size).map(|n| self.pos += n);
        Ok(())
    }

    fn skip_padding(&mut self, size: u64, at: u64) -> Result<(), TarError> {
        let pad = padded(size) - size;
        self.skip_exact(pad, at, None, &|| {
            "the padding of a long-name or pax header".into()
        })
    }
}

struct Header {
    name: String,
    size: u64,
    kind: u8,
}

impl Header {
    fn parse(b: &[u8; 512], at: u64) -> Result<Header, TarError> {
        let bad = |reason: String| TarError::BadHeader { at, reason };
        let stored = octal(&b[148..156]).ok_or_else(|| bad("no checksum".into()))?;
        let sum: u64 = b
            .iter()
            .enumerate()
            .map(|(i, &x)| {
                if (148..156).contains(&i) {
                    32
                } else {
                    x as u64
                }
            })
            .sum();
        if stored != sum {
            return Err(bad(format!(
                "checksum {stored} stored, {sum} computed: garbage or a corrupt header"
            )));
        }
        let size = if b[124] & 0x80 != 0 {
            // GNU base-256: the rest of the field, big-endian.
            if b[124] != 0x80 || b[125..128].iter().any(|&x| x != 0) {
                return Err(bad("a base-256 size over 2^64".into()));
            }
            b[128..136]
                .iter()
                .fold(0u64, |acc, &x| (acc << 8) | x as u64)
        } else {
            octal(&b[124..136]).ok_or_else(|| bad("the size is not an octal number".into()))?
        };
        let field = |r: std::ops::Range<usize>| {
            let f = &b[r];
            let end = f.iter().position(|&x| x == 0).unwrap_or(f.len());
            String::from_utf8_lossy(&f[..end]).into_owned()
        };
        let mut name = field(0..100);
        if &b[257..262] == b"ustar" {
            let prefix = field(345..500);
            if !prefix.is_empty() {
                name = format!("{prefix}/{name}");
            }
        }
        Ok(Header {
            name,
            size,
            kind: b[156],
        })
    }
}

/// An octal field (spaces and NULs around it allowed); `None` if it holds anything else.
fn octal(f: &[u8]) -> Option<u64> {
    let s = std::str::from_utf8(f).ok()?;
    let s = s.trim_matches(|c: char| c == ' ' || c == '\0');
    if s.is_empty() {
        return Some(0);
    }
    u64::from_str_radix(s, 8).ok()
}

/// The `LEN key=value\n` records of a pax header.
fn pax_records(bytes: &[u8], at: u64) -> Result<Vec<(&str, &str)>, TarError> {
    let bad = || TarError::BadHeader {
        at,
        reason: "a malformed pax record".into(),
    };
    let mut out = Vec::new();
    let mut rest = bytes;
    while !rest.is_empty() && rest[0] != 0 {
        let space = rest.iter().position(|&b| b == b' ').ok_or_else(bad)?;
        let len: usize = std::str::from_utf8(&rest[..space])
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(bad)?;
        if len <= space + 1 || len > rest.len() || rest[len - 1] != b'\n' {
            return Err(bad());
        }
        let record = std::str::from_utf8(&rest[space + 1..len - 1]).map_err(|_| bad())?;
        let (k, v) = record.split_once('=').ok_or_else(bad)?;
        out.push((k, v));
        rest = &rest[len..];
    }
    Ok(out)
}

/// Writes a ustar archive of `members` (name, bytes), GNU long names where a name does not
/// fit: for `gen-data --shards`, tests and benchmarks.
pub fn write_archive<W: io::Write>(
    mut out: W,
    members: impl IntoIterator<Item = (String, Vec<u8>)>,
) -> io::Result<()> {
    fn header(name: &[u8], size: u64, kind: u8) -> [u8; 512] {
        let mut h = [0u8; 512];
        h[..name.len().min(100)].copy_from_slice(&name[..name.len().min(100)]);
        h[100..108].copy_from_slice(b"0000644\0");
        h[108..116].copy_from_slice(b"0000000\0");
        h[116..124].copy_from_slice(b"0000000\0");
        if size < 1 << 33 {
            h[124..136].copy_from_slice(format!("{size:011o}\0").as_bytes());
        } else {
            h[124] = 0x80;
            h[128..136].copy_from_slice(&size.to_be_bytes());
        }
        h[136..148].copy_from_slice(b"00000000000\0");
        h[156] = kind;
        h[257..263].copy_from_slice(b"ustar\0");
        h[263..265].copy_from_slice(b"00");
        h[148..156].fill(b' ');
        let sum: u64 = h.iter().map(|&x| x as u64).sum();
        h[148..156].copy_from_slice(format!("{sum:06o}\0 ").as_bytes());
        h
    }
    let pad = |out: &mut W, n: usize| out.write_all(&vec![0u8; (512 - n % 512) % 512]);
    for (name, data) in members {
        if name.len() > 100 {
            let long = [name.as_bytes(), b"\0"].concat();
            out.write_all(&header(b"././@LongLink", long.len() as u64, b'L'))?;
            out.write_all(&long)?;
            pad(&mut out, long.len())?;
        }
        out.write_all(&header(name.as_bytes(), data.len() as u64, b'0'))?;
        out.write_all(&data)?;
        pad(&mut out, data.len())?;
    }
    out.write_all(&[0u8; 1024])?;
    out.flush()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Cursor;

    fn walk_all(bytes: &[u8], seekable: bool) -> Result<Vec<Member>, TarError> {
        let mut out = Vec::new();
        if seekable {
            let mut w = Walker::new(Seekable::new(Cursor::new(bytes)).unwrap(), 1 << 30);
            while let Some(m) = w.next_member()? {
                out.push(m);
            }
        } else {
            let mut w = Walker::new(Forward(bytes), 1 << 30);
            while let Some(m) = w.next_member()? {
                out.push(m);
            }
        }
        Ok(out)
    }

    fn archive(members: &[(&str, &[u8])]) -> Vec<u8> {
        let mut v = Vec::new();
        write_archive(
            &mut v,
            members.iter().map(|(n, d)| (n.to_string(), d.to_vec())),
        )
        .unwrap();
        v
    }

    #[test]
    fn members_name_their_bytes_in_both_walkers() {
        let long = format!("{}/x.jpg", "d".repeat(150));
        let a = archive(&[("a.jpg", b"hello"), ("a.cls", b"7"), (&long, &[1; 700])]);
        for seekable in [true, false] {
            let m = walk_all(&a, seekable).unwrap();
            assert_eq!(m.len(), 3);
            assert_eq!(m[0].name, "a.jpg");
            assert_eq!(&a[m[0].offset as usize..][..5], b"hello");
            assert_eq!(&a[m[1].offset as usize..][..1], b"7");
            assert_eq!(m[2].name, long, "GNU long name");
            assert_eq!(m[2].size, 700);
            assert!(
                m[2].header < m[2].offset - 512,
                "the long-name header is first"
            );
            assert_eq!(m[1].end(), m[2].header);
        }
    }

    #[test]
    fn bad_archives_are_errors_naming_where() {
        let a = archive(&[("a.jpg", &[5; 1000]), ("b.jpg", &[6; 10])]);
        for seekable in [true, false] {
            // Cut inside a member's data.
            let e = walk_all(&a[..512 + 600], seekable).unwrap_err();
            assert!(
                matches!(e, TarError::Truncated { .. }) && e.to_string().contains("\"a.jpg\""),
                "{e}"
            );
            // Cut inside a header.
            let e = walk_all(&a[..1536 + 100], seekable).unwrap_err();
            assert!(e.to_string().contains("has 100 of 512"), "{e}");
            // Garbage.
            let e = walk_all(&[0x41; 4096], seekable).unwrap_err();
            assert!(matches!(e, TarError::BadHeader { .. }), "{e}");
            // A header that lies about the size: far more than the file holds.
            let mut lying = a.clone();
            let h = header_with_size(&lying[..512], 1 << 29);
            lying[..512].copy_from_slice(&h);
            let e = walk_all(&lying, seekable).unwrap_err();
            assert!(matches!(e, TarError::Truncated { .. }), "{e}");
            // Empty input: no members, no error (the shard layer reports an empty shard).
            assert!(walk_all(&[], seekable).unwrap().is_empty());
        }
        // A directory entry whose base-256 size is near 2^64: an error, not an overflow.
        let mut huge = a.clone();
        huge[156] = b'5';
        huge[124..136].copy_from_slice(&[
            0x80, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xf0,
        ]);
        huge[148..156].fill(b' ');
        let sum: u64 = huge[..512].iter().map(|&x| x as u64).sum();
        huge[148..156].copy_from_slice(format!("{sum:06o}\0 ").as_bytes());
        for seekable in [false, true] {
            let e = walk_all(&huge, seekable).unwrap_err();
            assert!(matches!(e, TarError::Truncated { .. }), "{e}");
        }
        // Over the member limit: refused before anything is read.
        let mut w = Walker::new(Forward(&a[..]), 999);
        assert!(matches!(
            w.next_member(),
            Err(TarError::TooLarge { size: 1000, .. })
        ));
        assert!(w.next_member().unwrap().is_none(), "done after an error");
    }

    fn header_with_size(h: &[u8], size: u64) -> [u8; 512] {
        let mut h: [u8; 512] = h.try_into().unwrap();
        h[124..136].copy_from_slice(format!("{size:011o}\0").as_bytes());
        h[148..156].fill(b' ');
        let sum: u64 = h.iter().map(|&x| x as u64).sum();
        h[148..156].copy_from_slice(format!("{sum:06o}\0 ").as_bytes());
        h
    }

    proptest::proptest! {
        /// Any damage to a valid archive (bytes changed, cut anywhere): no panic, both
        /// walkers agree, and every member they report lies inside the input.
        #[test]
        fn damaged_archives_never_panic_or_point_outside(
            flips in proptest::collection::vec((0usize..6000, proptest::num::u8::ANY), 0..8),
            cut in 0usize..6000,
        ) {
            let long = format!("{}/k.flac", "x".repeat(120));
            let mut a = archive(&[("k.jpg", &[7; 900]), ("k.cls", b"12"), (&long, &[3; 2000])]);
            for (at, b) in flips {
                let n = a.len();
                a[at % n] = b;
            }
            a.truncate(cut.min(a.len()));
            let seek = walk_all(&a, true);
            let fwd = walk_all(&a, false);
            proptest::prop_assert_eq!(seek.is_ok(), fwd.is_ok());
            if let (Ok(x), Ok(y)) = (&seek, &fwd) {
                proptest::prop_assert_eq!(x, y);
                for m in x {
                    proptest::prop_assert!(m.offset + m.size <= a.len() as u64);
                }
            }
        }
    }

    #[test]
    fn pax_paths_and_sizes_apply_to_the_next_member() {
        let mut a = Vec::new();
        let rec = "30 path=very/long/name.flac\n";
        let rec = format!("{} {}", rec.len(), &rec[3..]);
        let mut pax = header_with_size(&archive(&[("x", b"")])[..512], rec.len() as u64);
        pax[156] = b'x';
        pax[148..156].fill(b' ');
        let sum: u64 = pax.iter().map(|&x| x as u64).sum();
        pax[148..156].copy_from_slice(format!("{sum:06o}\0 ").as_bytes());
        a.extend_from_slice(&pax);
        a.extend_from_slice(rec.as_bytes());
        a.resize(1024, 0);
        a.extend_from_slice(&archive(&[("short", b"abc")]));
        let m = walk_all(&a, true).unwrap();
        assert_eq!(m.len(), 1);
        assert_eq!(m[0].name, "very/long/name.flac");
        assert_eq!(m[0].header, 0);
        assert_eq!(&a[m[0].offset as usize..][..3], b"abc");
    }
}
