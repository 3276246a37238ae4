//! YAML from files an attacker (or an unlucky operator) may write.
//!
//! Anchors and aliases are refused before parsing: serde_yaml expands each
//! alias by copying what it names, so a 20 KB file of aliases to a long
//! list becomes gigabytes (a "billion laughs"), on every replica at once
//! and again at every restart. Tether's files never need them.

/// An error naming the first line with an anchor (`&name`) or an alias
/// (`*name`) outside quotes and comments.
pub fn refuse_anchors(text: &str) -> Result<(), String> {
    for (n, line) in text.lines().enumerate() {
        if let Some(what) = anchor_in(line.as_bytes()) {
            return Err(format!(
                "line {}: YAML {what} are not accepted (they can expand a small file into gigabytes); write the value out",
                n + 1
            ));
        }
    }
    Ok(())
}

fn anchor_in(line: &[u8]) -> Option<&'static str> {
    let starts_token =
        |i: usize| i == 0 || matches!(line[i - 1], b' ' | b'\t' | b'[' | b'{' | b',');
    let mut quote: Option<u8> = None;
    let mut i = 0;
    while i < line.len() {
        let c = line[i];
        match quote {
            Some(b'"') if c == b'\\' => i += 1,
            Some(q) if c == q => {
                if q == b'\'' && line.get(i + 1) == Some(&b'\'') {
                    i += 1; // '' is an escaped quote
                } else {
                    quote = None;
                }
            }
            Some(_) => {}
            None if c == b'#' && starts_token(i) => return None,
            None if (c == b'"' || c == b'\'') && starts_token(i) => quote = Some(c),
            None if (c == b'&' || c == b'*')
                && starts_token(i)
                && line.get(i + 1).is_some_and(|b| !b.is_ascii_whitespace()) =>
            {
                return Some(if c == b'&' { "anchors" } else { "aliases" });
            }
            None => {}
        }
        i += 1;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn anchors_and_aliases_are_refused_quoted_text_is_not() {
        for bad in [
            "x: &a [0, 0]",
            "y: [*a, *a]",
            "y: {k: *a}",
            "- *a",
            "&a\n",
            "ok: 1\nz: *a",
        ] {
            assert!(refuse_anchors(bad).is_err(), "{bad}");
        }
        assert!(refuse_anchors("ok: 1\nz: *a")
            .unwrap_err()
            .starts_with("line 2:"));
        for fine in [
            "name: web # a *comment with &stuff",
            "zone: \"*a\"",
            "zone: '&a and ''*b'''",
            "x: a*b&c",
            "x: 3 * 4",
            "kind: Service\nname: web\nports: [{port: 80}]",
        ] {
            assert!(refuse_anchors(fine).is_ok(), "{fine}");
        }
    }

    #[test]
    fn an_alias_bomb_is_refused_before_it_is_parsed() {
        let list = vec!["0"; 4000].join(",");
        let aliases = vec!["*a"; 4000].join(",");
        let bomb = format!(
            "kind: Service\nname: web\nports: [{{port: 80}}]\nx: &a [{list}]\ny: [{aliases}]\n"
        );
        assert!(refuse_anchors(&bomb).unwrap_err().contains("anchors"));
    }
}
