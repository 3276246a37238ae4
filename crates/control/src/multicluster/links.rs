//! Links: the remote clusters this control plane merges into answers.
//!
//! As flags, `--link name=west,export=10.0.2.2:8087,gateway=10.0.2.2:4180,priority=1`
//! (optionally `,trust-root=PATH`); as a file (`--links FILE`):
//!
//! ```yaml
//! links:
//!   - name: west
//!     export: 10.0.2.2:8087      # the remote control plane's export API
//!     gateway: 10.0.2.2:4180     # its gateway (default: what it advertises)
//!     priority: 1                # 1 is the best remote tier
//!     trust_root: ./west-ca.crt  # default: this cluster's ca.crt
//! ```

use std::net::SocketAddr;
use std::path::PathBuf;

use serde::Deserialize;

#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Link {
    pub name: String,
    pub export: String,
    #[serde(default)]
    pub gateway: Option<SocketAddr>,
    #[serde(default = "one")]
    pub priority: u32,
    #[serde(default)]
    pub trust_root: Option<PathBuf>,
}

fn one() -> u32 {
    1
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LinksFile {
    links: Vec<Link>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{source_name}: {message}")]
pub struct LinkError {
    pub source_name: String,
    pub message: String,
}

impl Link {
    fn validate(&self) -> Result<(), String> {
        if !tether_core::authority::is_dns_label(&self.name) {
            return Err(format!(
                "field `name`: {:?} is not a valid cluster name",
                self.name
            ));
        }
        if tether_core::authority::split_host_port(&self.export).is_err()
            || !self.export.contains(':')
        {
            return Err(format!(
                "field `export`: {:?} is not host:port",
                self.export
            ));
        }
        if self.priority == 0 {
            return Err("field `priority`: must be at least 1 (0 is the local cluster)".into());
        }
        Ok(())
    }
}

/// Parses one `--link` flag.
pub fn parse_flag(flag: &str) -> Result<Link, LinkError> {
    let err = |message: String| LinkError {
        source_name: format!("--link {flag}"),
        message,
    };
    let (mut name, mut export, mut gateway, mut priority, mut trust_root) =
        (None, None, None, 1, None);
    for part in flag.split(',').filter(|p| !p.is_empty()) {
        let (k, v) = part
            .split_once('=')
            .ok_or_else(|| err(format!("{part:?}: expected key=value")))?;
        match k {
            "name" => name = Some(v.to_string()),
            "export" => export = Some(v.to_string()),
            "gateway" => {
                gateway = Some(
                    v.parse()
                        .map_err(|_| err(format!("field `gateway`: {v:?} is not ip:port")))?,
                )
            }
            "priority" => {
                priority = v
                    .parse()
                    .map_err(|_| err(format!("field `priority`: {v:?} is not a number")))?
            }
            "trust-root" => trust_root = Some(PathBuf::from(v)),
            other => {
                return Err(err(format!(
                    "unknown field `{other}` (name, export, gateway, priority, trust-root)"
                )))
            }
        }
    }
    let link = Link {
        name: name.ok_or_else(|| err("missing field `name`".into()))?,
        export: export.ok_or_else(|| err("missing field `export`".into()))?,
        gateway,
        priority,
        trust_root,
    };
    link.validate().map_err(err)?;
    Ok(link)
}

/// Parses a links file.
pub fn parse_file(text: &str, source_name: &str) -> Result<Vec<Link>, LinkError> {
    let err = |message: String| LinkError {
        source_name: source_name.to_string(),
        message,
    };
    tether_core::yaml::refuse_anchors(text).map_err(err)?;
    let file: LinksFile = serde_yaml::from_str(text).map_err(|e| err(e.to_string()))?;
    for (i, l) in file.links.iter().enumerate() {
        l.validate().map_err(|m| err(format!("links[{i}]: {m}")))?;
        if file.links[..i].iter().any(|o| o.name == l.name) {
            return Err(err(format!(
                "links[{i}]: cluster {:?} is linked twice",
                l.name
            )));
        }
    }
    Ok(file.links)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_and_files_parse_with_named_errors() {
        let l =
            parse_flag("name=west,export=10.0.2.2:8087,gateway=10.0.2.2:4180,priority=2").unwrap();
        assert_eq!(l.priority, 2);
        assert_eq!(l.gateway, Some("10.0.2.2:4180".parse().unwrap()));
        assert!(parse_flag("name=west")
            .unwrap_err()
            .message
            .contains("missing field `export`"));
        assert!(parse_flag("name=west,export=x:1,priority=0")
            .unwrap_err()
            .message
            .contains("priority"));
        assert!(parse_flag("name=west,export=x:1,colour=red")
            .unwrap_err()
            .message
            .contains("unknown field `colour`"));
        let links = parse_file(
            "links:\n  - name: west\n    export: west.example:8087\n",
            "links.yaml",
        )
        .unwrap();
        assert_eq!(links[0].priority, 1);
        let e = parse_file("links:\n  - name: West\n    export: a:1\n", "links.yaml").unwrap_err();
        assert!(
            e.to_string()
                .starts_with("links.yaml: links[0]: field `name`"),
            "{e}"
        );
        let e = parse_file("links:\n  - name: a\n    exprt: a:1\n", "links.yaml").unwrap_err();
        assert!(e.message.contains("unknown field `exprt`"), "{e}");
    }
}
