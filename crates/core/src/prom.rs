//! A reader of the Prometheus text exposition format, enough for Tether's
//! operator tools to read Tether's own metrics (counters, gauges, histograms).

use std::collections::BTreeMap;

#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

impl Sample {
    pub fn label(&self, key: &str) -> Option<&str> {
        self.labels.get(key).map(String::as_str)
    }
}

/// Parses the samples of a scrape; comment lines and lines that do not
/// parse are skipped (a scrape is read, not validated).
pub fn parse(text: &str) -> Vec<Sample> {
    text.lines().filter_map(parse_line).collect()
}

fn parse_line(line: &str) -> Option<Sample> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let (name, rest) = match line.find('{') {
        Some(i) => (&line[..i], &line[i..]),
        None => {
            let i = line.find(' ')?;
            (&line[..i], &line[i..])
        }
    };
    let mut labels = BTreeMap::new();
    let rest = if let Some(body) = rest.strip_prefix('{') {
        let mut chars = body.char_indices().peekable();
        let mut end = None;
        loop {
            // key
            let start = chars.peek()?.0;
            let mut key_end = start;
            for (i, c) in chars.by_ref() {
                if c == '=' {
                    key_end = i;
                    break;
                }
                if c == '}' {
                    end = Some(i);
                    break;
                }
            }
            if end.is_some() {
                break;
            }
            let key = body[start..key_end].trim().trim_start_matches(',').trim();
            if chars.next()?.1 != '"' {
                return None;
            }
            let mut value = String::new();
            while let Some((_, c)) = chars.next() {
                match c {
                    '\\' => match chars.next()?.1 {
                        'n' => value.push('\n'),
                        other => value.push(other),
                    },
                    '"' => break,
                    c => value.push(c),
                }
            }
            labels.insert(key.to_string(), value);
            match chars.next()? {
                (_, ',') => {
                    if let Some((i, '}')) = chars.peek().copied() {
                        end = Some(i);
                        break;
                    }
                }
                (i, '}') => {
                    end = Some(i);
                    break;
                }
                _ => return None,
            }
        }
        &body[end? + 1..]
    } else {
        rest
    };
    let value = rest.split_whitespace().next()?;
    let value = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        v => v.parse().ok()?,
    };
    Some(Sample {
        name: name.to_string(),
        labels,
        value,
    })
}

/// Estimates quantile `q` (0..1) from cumulative histogram buckets
/// `(upper bound, count)`, interpolating linearly within a bucket as
/// Prometheus' `histogram_quantile` does.
pub fn histogram_quantile(q: f64, buckets: &[(f64, f64)]) -> Option<f64> {
    let mut buckets = buckets.to_vec();
    buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    let total = buckets.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let rank = q * total;
    let mut prev = (0.0, 0.0);
    for &(le, count) in &buckets {
        if count >= rank {
            if le.is_infinite() {
                return Some(prev.0);
            }
            let in_bucket = count - prev.1;
            let frac = if in_bucket > 0.0 {
                (rank - prev.1) / in_bucket
            } else {
                1.0
            };
            return Some(prev.0 + (le - prev.0) * frac);
        }
        prev = (le, count);
    }
    Some(prev.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_labels_and_values() {
        let text = "# HELP x y\n# TYPE a counter\na_total{dir=\"out\",authority=\"web.demo:80\"} 12\nb 3.5\nc{q=\"a\\\"b\"} +Inf\n";
        let s = parse(text);
        assert_eq!(s.len(), 3);
        assert_eq!(s[0].name, "a_total");
        assert_eq!(s[0].label("authority"), Some("web.demo:80"));
        assert_eq!(s[0].value, 12.0);
        assert_eq!(s[1].value, 3.5);
        assert_eq!(s[2].label("q"), Some("a\"b"));
        assert!(s[2].value.is_infinite());
    }

    #[test]
    fn quantiles_interpolate() {
        let b = [(0.01, 50.0), (0.1, 100.0), (f64::INFINITY, 100.0)];
        assert!((histogram_quantile(0.5, &b).unwrap() - 0.01).abs() < 1e-9);
        assert!((histogram_quantile(0.75, &b).unwrap() - 0.055).abs() < 1e-9);
        assert_eq!(histogram_quantile(0.5, &[(1.0, 0.0)]), None);
    }
}
