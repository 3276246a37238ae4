//! The `tether-proxy` binary's command line: the same flags as `tether
//! proxy`, clap's errors naming the bad flag. (It proxying a request end to
//! end over mTLS is tested with the rest of the mesh, in
//! tests/e2e/proxy_binary.rs.)

use std::process::{Command, Output};

fn tether_proxy(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tether-proxy"))
        .args(args)
        .env_remove("TETHER_PROXY_THREADS")
        .env_remove("TETHER_PROXY_WORKLOAD")
        .output()
        .expect("tether-proxy runs")
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[test]
fn help_lists_the_proxy_flags_and_no_subcommands() {
    let out = tether_proxy(&["--help"]);
    assert!(out.status.success(), "{}", text(&out));
    let help = text(&out);
    for flag in [
        "--control",
        "--outbound",
        "--inbound",
        "--app",
        "--identity",
        "--trust-root",
        "--threads",
        "--max-connections",
        "--tap",
    ] {
        assert!(help.contains(flag), "{flag} missing from:\n{help}");
    }
    assert!(help.starts_with("Tether's sidecar proxy"), "{help}");
    assert!(!help.contains("Commands:"), "{help}");
}

#[test]
fn version_is_the_workspace_version() {
    let out = tether_proxy(&["--version"]);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        format!("tether-proxy {}", env!("CARGO_PKG_VERSION"))
    );
}

#[test]
fn bad_flags_are_refused_by_name() {
    let cases: &[(&[&str], &str)] = &[
        (&["--outbound", "127.0.0.1:0"], "--control"),
        (
            &["--control", "127.0.0.1:1", "--no-such-flag"],
            "--no-such-flag",
        ),
        (&["--control", "127.0.0.1:1", "--threads", "0"], "--threads"),
        (
            &["--control", "127.0.0.1:1", "--outbound", "nowhere"],
            "--outbound",
        ),
        (
            &["--control", "127.0.0.1:1", "--identity", "web.demo"],
            "--identity-token-file",
        ),
        // `tether proxy`'s subcommand word is not a flag of this binary.
        (&["proxy", "--control", "127.0.0.1:1"], "'proxy'"),
    ];
    for (args, named) in cases {
        let out = tether_proxy(args);
        let text = text(&out);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {text}");
        assert!(text.contains(named), "{args:?} should name {named}: {text}");
        assert!(
            !text.contains("listening"),
            "{args:?} must not start: {text}"
        );
    }
}

#[test]
fn a_token_file_that_cannot_be_read_is_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.token");
    let trust_root = dir.path().join("ca.crt");
    let out = tether_proxy(&[
        "--control",
        "127.0.0.1:1",
        "--outbound",
        "127.0.0.1:0",
        "--admin",
        "127.0.0.1:0",
        "--identity",
        "web.demo.serviceaccount.identity.cluster.local",
        "--identity-token-file",
        missing.to_str().unwrap(),
        "--trust-root",
        trust_root.to_str().unwrap(),
    ]);
    let text = text(&out);
    assert!(!out.status.success(), "{text}");
    assert!(text.contains("--identity-token-file"), "{text}");
}
