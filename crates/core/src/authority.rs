//! Service authorities: how a request names the logical service it wants.

use std::fmt;

use crate::truncate::for_log;

/// The port assumed when an authority names none (plain HTTP).
pub const DEFAULT_PORT: u16 = 80;

/// A service, identified by name and namespace.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceKey {
    pub name: String,
    pub namespace: String,
}

impl ServiceKey {
    pub fn new(name: impl Into<String>, namespace: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            namespace: namespace.into(),
        }
    }

    /// The fully qualified name, e.g. `web.demo.svc.cluster.local`.
    pub fn fqdn(&self, cluster_domain: &str) -> String {
        format!("{}.{}.svc.{}", self.name, self.namespace, cluster_domain)
    }
}

impl fmt::Display for ServiceKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// A service and one of its ports: what a `Destination.Get` resolves.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ServiceAuthority {
    pub service: ServiceKey,
    pub port: u16,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AuthorityError {
    #[error("authority is empty")]
    Empty,
    #[error("invalid port in authority {}", for_log(.0))]
    InvalidPort(String),
    #[error("unclosed or misplaced `[` in authority {}", for_log(.0))]
    InvalidBrackets(String),
    #[error(
        "{} is not a service name: expected name.namespace.svc.{cluster_domain}[:port]",
        for_log(authority)
    )]
    NotAService {
        authority: String,
        cluster_domain: String,
    },
}

/// Splits `host[:port]` into host and port (default 80). IPv6 literals in
/// brackets are kept whole.
pub fn split_host_port(authority: &str) -> Result<(&str, u16), AuthorityError> {
    if authority.is_empty() {
        return Err(AuthorityError::Empty);
    }
    // An IPv6 literal: `[` only first, closed once, followed by nothing
    // or a port (`[::1` would otherwise split into host `[:` and port 1).
    let bracketed = authority.starts_with('[');
    let closed = authority.find(']');
    let well_formed = match closed {
        Some(end) => {
            bracketed
                && authority[1..].find('[').is_none()
                && authority.rfind(']') == Some(end)
                && matches!(authority.as_bytes().get(end + 1), None | Some(b':'))
        }
        None => !authority.contains('['),
    };
    if !well_formed {
        return Err(AuthorityError::InvalidBrackets(authority.to_string()));
    }
    let (host, port) = match authority.rfind(':') {
        Some(i) if !authority[i..].contains(']') => (&authority[..i], Some(&authority[i + 1..])),
        _ => (authority, None),
    };
    let port = match port {
        None => DEFAULT_PORT,
        Some(p) => p
            .parse::<u16>()
            .ok()
            .filter(|p| *p != 0)
            .ok_or_else(|| AuthorityError::InvalidPort(authority.to_string()))?,
    };
    if host.is_empty() {
        return Err(AuthorityError::Empty);
    }
    Ok((host, port))
}

/// Parses a service authority. Accepted forms, all with an optional port:
/// `name.namespace.svc.<cluster_domain>`, `name.namespace.svc`, and
/// `name.namespace`. A trailing dot is ignored.
pub fn parse_service_authority(
    authority: &str,
    cluster_domain: &str,
) -> Result<ServiceAuthority, AuthorityError> {
    let (host, port) = split_host_port(authority)?;
    let host = host.trim_end_matches('.').to_ascii_lowercase();
    let not_a_service = || AuthorityError::NotAService {
        authority: authority.to_string(),
        cluster_domain: cluster_domain.to_string(),
    };
    let labels: Vec<&str> = host.split('.').collect();
    let domain_ok = match labels.len() {
        2 => true,
        3 => labels[2] == "svc",
        n if n > 3 => labels[2] == "svc" && labels[3..].join(".") == cluster_domain,
        _ => false,
    };
    if !domain_ok || !is_dns_label(labels[0]) || !is_dns_label(labels[1]) {
        return Err(not_a_service());
    }
    Ok(ServiceAuthority {
        service: ServiceKey::new(labels[0], labels[1]),
        port,
    })
}

/// An RFC 1123 label, as Kubernetes requires of names and namespaces.
pub fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_accepted_form() {
        for a in [
            "web.demo.svc.cluster.local:8080",
            "web.demo.svc.cluster.local.:8080",
            "web.demo.svc:8080",
            "web.demo:8080",
            "WEB.demo:8080",
        ] {
            let got = parse_service_authority(a, "cluster.local").unwrap();
            assert_eq!(got.service, ServiceKey::new("web", "demo"), "{a}");
            assert_eq!(got.port, 8080, "{a}");
        }
        let got = parse_service_authority("web.demo.svc.cluster.local", "cluster.local").unwrap();
        assert_eq!(got.port, 80);
    }

    #[test]
    fn rejects_what_is_not_a_service() {
        for a in [
            "localhost:8080",
            "10.0.0.1:80",
            "web.demo.svc.other.domain:80",
            "web.demo.pod.cluster.local:80",
            "web_x.demo:80",
        ] {
            assert!(
                matches!(
                    parse_service_authority(a, "cluster.local"),
                    Err(AuthorityError::NotAService { .. })
                ),
                "{a}"
            );
        }
        assert_eq!(
            parse_service_authority("web.demo:0", "cluster.local"),
            Err(AuthorityError::InvalidPort("web.demo:0".into()))
        );
        assert_eq!(
            parse_service_authority("web.demo:x", "cluster.local"),
            Err(AuthorityError::InvalidPort("web.demo:x".into()))
        );
        assert_eq!(
            parse_service_authority("", "cluster.local"),
            Err(AuthorityError::Empty)
        );
    }

    #[test]
    fn errors_do_not_echo_huge_authorities() {
        let huge = format!("{}:80", "x".repeat(1 << 20));
        let e = parse_service_authority(&huge, "cluster.local").unwrap_err();
        assert!(e.to_string().len() < 256, "{e}");
        let huge = format!("web.demo:{}", "9".repeat(1 << 20));
        let e = parse_service_authority(&huge, "cluster.local").unwrap_err();
        assert!(e.to_string().len() < 256, "{e}");
    }

    mod properties {
        use super::super::*;
        use proptest::prelude::*;

        /// Authorities close to valid ones (so parsing gets past the
        /// first check), and arbitrary text.
        fn authority() -> impl Strategy<Value = String> {
            prop_oneof![
                any::<String>(),
                "[a-zA-Z0-9._\\[\\]:-]{0,40}",
                (
                    "[a-z0-9-]{0,64}",
                    "[a-z0-9-]{0,64}",
                    prop::sample::select(vec![
                        "",
                        ".svc",
                        ".svc.cluster.local",
                        ".svc.cluster.local.",
                        ".svc.other"
                    ]),
                    prop::option::of("[0-9]{0,7}|[^0-9]{0,3}"),
                )
                    .prop_map(|(n, ns, suffix, port)| match port {
                        Some(p) => format!("{n}.{ns}{suffix}:{p}"),
                        None => format!("{n}.{ns}{suffix}"),
                    }),
            ]
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(256))]

            #[test]
            fn parsing_never_panics_and_accepts_only_services(a in authority()) {
                match parse_service_authority(&a, "cluster.local") {
                    Ok(got) => {
                        prop_assert!(is_dns_label(&got.service.name));
                        prop_assert!(is_dns_label(&got.service.namespace));
                        prop_assert!(got.port != 0);
                        // What was accepted parses again from its own name.
                        let again = format!("{}:{}", got.service.fqdn("cluster.local"), got.port);
                        prop_assert_eq!(parse_service_authority(&again, "cluster.local"), Ok(got));
                    }
                    Err(e) => prop_assert!(e.to_string().len() < 256),
                }
            }

            #[test]
            fn splitting_never_panics(a in any::<String>()) {
                if let Ok((host, port)) = split_host_port(&a) {
                    prop_assert!(!host.is_empty() && port != 0);
                    prop_assert!(a.starts_with(host));
                }
            }
        }
    }

    #[test]
    fn splits_ipv6() {
        assert_eq!(split_host_port("[::1]:81").unwrap(), ("[::1]", 81));
        assert_eq!(split_host_port("[::1]").unwrap(), ("[::1]", 80));
        for bad in [
            "[::1",
            "::1]:80",
            "[::1]x",
            "[::1]]:80",
            "[[::1]]",
            "a[b]",
            "[::1]:80]",
        ] {
            assert!(
                matches!(
                    split_host_port(bad),
                    Err(AuthorityError::InvalidBrackets(_))
                ),
                "{bad:?} was split"
            );
        }
    }
}
