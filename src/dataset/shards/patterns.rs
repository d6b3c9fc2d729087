//! Shard patterns: brace ranges and lists, comma-separated specs.

use crate::PipelineError;

/// Expands shell-style brace ranges and lists: `shard-{000..002}.tar` → `shard-000.tar`,
/// `shard-001.tar`, `shard-002.tar` (numbers keep the first bound's zero padding);
/// `{a,b}.tar` → `a.tar`, `b.tar`. Several braces multiply. A pattern without braces is
/// itself. An unclosed brace or a range whose end is below its start is an error.
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
        let width = a.len();
        (lo..=hi).map(|i| format!("{i:0width$}")).collect()
    } else {
        body.split(',').map(str::to_owned).collect()
    };
    let rest = expand_braces(tail)?;
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
                start = i + 1;
            }
            _ => {}
        }
    }
    paths.extend(expand_braces(&spec[start..])?);
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
    }
}
