//! `--threads` / `TETHER_PROXY_THREADS`: the data path's runtime size.

use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};

use crate::support::{run_tether, tether};

/// Starts `tether proxy` (its control plane need not exist) with `flags`
/// and `env`, and returns the runtime line it logs at start.
async fn runtime_line(flags: &[&str], env: &[(&str, &str)]) -> String {
    let mut child = tokio::process::Command::new(tether())
        .args([
            "proxy",
            "--control",
            "127.0.0.1:1",
            "--outbound",
            "127.0.0.1:0",
            "--admin",
            "127.0.0.1:0",
            // Without an identity the proxy must be told to speak plaintext
            // to its control plane, or it refuses to start.
            "--insecure-control-plane",
        ])
        .args(flags)
        .envs(env.iter().copied())
        .env_remove("RUST_LOG")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let found = tokio::time::timeout(Duration::from_secs(10), async {
        while let Some(line) = lines.next_line().await.unwrap() {
            if line.contains("data-path runtime") {
                return line;
            }
        }
        panic!("the proxy exited without logging its runtime");
    })
    .await
    .expect("the proxy logs its runtime at start");
    let _ = child.kill().await;
    found
}

#[tokio::test]
async fn threads_flag_and_environment_size_the_runtime() {
    let line = runtime_line(&["--threads", "3"], &[]).await;
    assert!(line.contains("3 worker threads"), "{line}");
    let line = runtime_line(&[], &[("TETHER_PROXY_THREADS", "2")]).await;
    assert!(line.contains("2 worker threads"), "{line}");
    // The flag wins over the environment.
    let line = runtime_line(&["--threads", "1"], &[("TETHER_PROXY_THREADS", "2")]).await;
    assert!(line.contains("1 worker threads"), "{line}");
}

#[test]
fn zero_threads_is_refused_by_name() {
    let (ok, out) = run_tether(&["proxy", "--control", "127.0.0.1:1", "--threads", "0"]);
    assert!(!ok);
    assert!(out.contains("--threads"), "{out}");
}
