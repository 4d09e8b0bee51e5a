//! Which linears an adapter wraps: name patterns over their state-dict module names.

/// Whether `pattern` selects the module `name`. `*` matches any run of characters (dots
/// included); a pattern matches the whole name or a dot-separated suffix of it, so
/// `linear_qkv` and `layers.*.linear_qkv` select `transformer.layers.3.linear_qkv`.
pub fn matches(pattern: &str, name: &str) -> bool {
    glob(pattern, name)
        || name
            .match_indices('.')
            .any(|(i, _)| glob(pattern, &name[i + 1..]))
}

/// `pattern` (with `*` wildcards) against all of `text`.
fn glob(pattern: &str, text: &str) -> bool {
    let Some((head, rest)) = pattern.split_once('*') else {
        return pattern == text;
    };
    let Some(tail) = text.strip_prefix(head) else {
        return false;
    };
    (0..=tail.len())
        .filter(|&i| tail.is_char_boundary(i))
        .any(|i| glob(rest, &tail[i..]))
}

#[cfg(test)]
mod tests {
    use super::matches;

    #[test]
    fn patterns_match_whole_names_or_dotted_suffixes_with_star_wildcards() {
        let name = "transformer.layers.13.linear_qkv";
        assert!(matches(name, name));
        assert!(matches("linear_qkv", name));
        assert!(matches("13.linear_qkv", name));
        assert!(matches("layers.*.linear_qkv", name));
        assert!(matches("*qkv", name));
        assert!(matches("*", name));
        assert!(!matches("qkv", name), "suffixes start at a dot");
        assert!(!matches("layers.1.linear_qkv", name));
        assert!(!matches("linear_qkv_fc1", name));
        assert!(matches("transformer.*.linear_*", name));
        assert!(!matches("transformer.*.linear_fc*", name));
    }
}
