//! The tar walker on arbitrary bytes, as a file (seeking) and as a stream (reading forward):
//! no panic, no allocation sized by a header beyond the limits, every member inside the input,
//! and both walkers agree.
#![no_main]

use flowgate::dataset::shards::tar::{Forward, Seekable, Walker};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let walk = |seek: bool| {
        let mut out = Vec::new();
        let r = if seek {
            let mut w = Walker::new(Seekable::new(std::io::Cursor::new(data)).unwrap(), 1 << 20);
            loop {
                match w.next_member() {
                    Ok(Some(m)) => out.push(m),
                    Ok(None) => break Ok(()),
                    Err(e) => break Err(e.to_string()),
                }
            }
        } else {
            let mut w = Walker::new(Forward(data), 1 << 20);
            loop {
                match w.next_member() {
                    Ok(Some(m)) => out.push(m),
                    Ok(None) => break Ok(()),
                    Err(e) => break Err(e.to_string()),
                }
            }
        };
        (out, r.is_ok())
    };
    let (a, ok_a) = walk(true);
    let (b, ok_b) = walk(false);
    assert_eq!(a, b);
    assert_eq!(ok_a, ok_b);
    for m in &a {
        assert!(m.offset + m.size <= data.len() as u64, "{m:?} past {}", data.len());
    }
});
