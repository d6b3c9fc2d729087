//! Shard patterns: brace ranges and lists, comma-separated specs.

use flowgate_actors::error::PipelineError;

/// The most names a pattern may expand to: a million shards (LAION-5B is 231,000 shards of
/// 10,000 samples). More is a typo (`{0..99999999999}`), refused before anything is
/// allocated.
pub const MAX_NAMES: u64 = 1 << 20;

fn too_many(pattern: &str, n: u128) -> PipelineError {
    PipelineError::config(format!(
        "{pattern:?} names {n} paths; at most {MAX_NAMES} (shards::MAX_NAMES)"
    ))
}

/// Expands shell-style brace ranges and lists: `shard-{000..002}.tar` → `shard-000.tar`,
/// `shard-001.tar`, `shard-002.tar` (numbers keep the first bound's zero padding);
/// `{a,b}.tar` → `a.tar`, `b.tar`. Several braces multiply. A pattern without braces is
/// itself. An unclosed brace or a range whose end is below its start is an error, and so is
/// a pattern of more than [`MAX_NAMES`] names.
pub fn expand_braces(pattern: &str) -> Result<Vec<String>, PipelineError> {
    let Some(open) = pattern.find('{') else {
        return Ok(vec![pattern.to_owned()]);
    };
    let close = pattern[open..]
        .find('}')
        .map(|c| c + open)
        .ok_or_else(|| PipelineError::config(format!("{pattern:?}: a '{{' without '}}'")))?;
    let (head, body, tail) = (
        &pattern[..open],
        &pattern[open + 1..close],
        &pattern[close + 1..],
    );
    let choices: Vec<String> = if let Some((a, b)) = body.split_once("..") {
        let (lo, hi) = (a.parse::<u64>(), b.parse::<u64>());
        let (Ok(lo), Ok(hi)) = (lo, hi) else {
            return Err(PipelineError::config(format!(
                "{pattern:?}: {{{body}}} is not a range of numbers"
            )));
        };
        if hi < lo {
            return Err(PipelineError::config(format!(
                "{pattern:?}: the range {{{body}}} ends below its start"
            )));
        }
        if hi - lo >= MAX_NAMES {
            return Err(too_many(pattern, (hi - lo) as u128 + 1));
        }
        let width = a.len();
        (lo..=hi).map(|i| format!("{i:0width$}")).collect()
    } else {
        body.split(',').map(str::to_owned).collect()
    };
    let rest = expand_braces(tail)?;
    let n = choices.len() as u128 * rest.len() as u128;
    if n > MAX_NAMES as u128 {
        return Err(too_many(pattern, n));
    }
    Ok(choices
        .iter()
        .flat_map(|c| rest.iter().map(move |r| format!("{head}{c}{r}")))
        .collect())
}

/// The paths a spec names: brace patterns, several separated by commas outside braces.
pub(super) fn expand_spec(spec: &str) -> Result<Vec<String>, PipelineError> {
    let mut paths = Vec::new();
    let (mut depth, mut start) = (0i32, 0);
    for (i, c) in spec.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                paths.extend(expand_braces(&spec[start..i])?);
                if paths.len() as u64 > MAX_NAMES {
                    return Err(too_many(spec, paths.len() as u128));
                }
                start = i + 1;
            }
            _ => {}
        }
    }
    paths.extend(expand_braces(&spec[start..])?);
    if paths.len() as u64 > MAX_NAMES {
        return Err(too_many(spec, paths.len() as u128));
    }
    paths.retain(|p| !p.is_empty());
    Ok(paths)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn braces_expand_like_the_shell() {
        assert_eq!(
            expand_braces("s-{008..011}.tar").unwrap(),
            ["s-008.tar", "s-009.tar", "s-010.tar", "s-011.tar"]
        );
        assert_eq!(
            expand_braces("{a,b}/{0..1}").unwrap(),
            ["a/0", "a/1", "b/0", "b/1"]
        );
        assert_eq!(expand_braces("plain.tar").unwrap(), ["plain.tar"]);
        assert!(expand_braces("x-{3..1}").is_err());
        assert!(expand_braces("x-{1..").is_err());
        assert!(expand_braces("x-{a..b}").is_err());
        // A typo's range, or ranges that multiply past the bound: errors naming the count,
        // before anything is allocated.
        let e = expand_braces("s-{0..99999999999}.tar").unwrap_err();
        assert!(e.to_string().contains("100000000000 paths"), "{e}");
        let e = expand_braces("{0..1023}/{0..1024}").unwrap_err();
        assert!(e.to_string().contains("1049600 paths"), "{e}");
        assert_eq!(expand_braces("{0..1023}/{0..1023}").unwrap().len(), 1 << 20);
        let many = ["a{0..999999}"; 2].join(",");
        assert!(expand_spec(&many)
            .unwrap_err()
            .to_string()
            .contains("2000000 paths"));
    }
}
