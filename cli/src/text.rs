//! Numbers and lines for people: byte sizes, clock times, progress bars, lines cut to a width.

/// `s` cut to `n` characters (a cut line ends in `…`).
pub(crate) fn cut(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        return s.to_owned();
    }
    let mut out: String = s.chars().take(n.saturating_sub(1)).collect();
    out.push('…');
    out
}

/// `[#####.....]` for `pct` percent, `n` cells wide.
pub(crate) fn bar(pct: f64, n: usize) -> String {
    let full = ((pct / 100.0) * n as f64).round().clamp(0.0, n as f64) as usize;
    format!("[{}{}]", "#".repeat(full), ".".repeat(n - full))
}

/// Seconds as `M:SS` (or `H:MM:SS`).
pub(crate) fn clock(secs: f64) -> String {
    let s = secs.max(0.0).round() as u64;
    if s >= 3600 {
        format!("{}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60)
    } else {
        format!("{}:{:02}", s / 60, s % 60)
    }
}

/// Bytes in the unit that reads best.
pub(crate) fn bytes(b: u64) -> String {
    flowgate::tuner::bytes_in_words(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_and_cuts() {
        assert_eq!(bytes(512), "512 B");
        assert_eq!(bytes(3 << 20), "3.0 MiB");
        assert_eq!(bytes(11546 << 20), "11.3 GiB");
        assert_eq!(clock(75.4), "1:15");
        assert_eq!(clock(3725.0), "1:02:05");
        assert_eq!(cut("abcdef", 4), "abc…");
        assert_eq!(cut("abc", 4), "abc");
        assert_eq!(bar(50.0, 4), "[##..]");
    }
}
