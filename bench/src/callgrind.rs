//! `--callgrind DIR`: every proxy (Tether's and HAProxy's) runs under
//! valgrind's callgrind, and the first repetition's open-loop runs count
//! the user-space instructions each proxy executes per request.
//!
//! CPU seconds on a shared 2-core machine move by ±10% between runs, more
//! than most single changes to the request path are worth; an instruction
//! count does not move with the machine's load: two pairs of the same
//! build in one run differ by 1% at most (10 s at 200 req/s; what differs
//! is background work, per second rather than per request), so a change of
//! 2% shows, and a smaller one in the dumps' per-function counts.
//! It is not time: cache misses, the kernel's share (system calls, the
//! scheduler) and the instructions' costs are not in it. Use it to compare
//! builds (`--compare`) and to see the user-space gap to HAProxy; decide
//! goals on the CPU figures of a run without it.
//!
//! The counters are zeroed (`callgrind_control -z`) just before a run's
//! load and dumped (`-d`) just after; the dump's total over the requests
//! the load sent is the figure. The same dump says where the instructions
//! are, by the crate whose source they were compiled from (inlined code
//! counts where it was written, not where it was inlined), for a build
//! with line tables (the release profile has them; BOLT's layout loses
//! them, and its instructions then count under the binary's name). Under callgrind a proxy runs ~50× slower:
//! rates of a few hundred requests per second at most (`--rates 200`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};

/// `program argv...` as run under callgrind, its dumps in `dir`.
pub fn wrap(dir: &Path, program: &Path, argv: Vec<String>) -> (PathBuf, Vec<String>) {
    let mut wrapped = vec![
        "--tool=callgrind".to_string(),
        format!(
            "--callgrind-out-file={}",
            dir.join("callgrind.%p").display()
        ),
        // Its own messages (start, end) only: they go to the proxy's log.
        "-q".to_string(),
        program.display().to_string(),
    ];
    wrapped.extend(argv);
    (PathBuf::from("valgrind"), wrapped)
}

fn control(command: &str, pid: u32) -> anyhow::Result<()> {
    let out = std::process::Command::new("callgrind_control")
        .args([command, &pid.to_string()])
        .output()
        .context("running callgrind_control")?;
    let said = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() || !said.contains("OK") {
        bail!(
            "callgrind_control {command} {pid} failed: {}{}",
            said.trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// Zeroes the counters of the proxies `pids`, just before a load.
pub fn zero(pids: &[u32]) -> anyhow::Result<()> {
    pids.iter().try_for_each(|pid| control("-z", *pid))
}

/// One proxy's instructions since [`zero`]: the total, and by source
/// crate (most first; they add up to the dump's closing `totals:`, which
/// the `summary:` the total is read from can exceed by a few hundredths
/// of a percent).
pub struct Count {
    pub total: u64,
    pub by_crate: Vec<(String, u64)>,
}

/// Each proxy's instructions since [`zero`]: dumps its counters and reads
/// the newest dump.
pub fn dump(dir: &Path, pids: &[u32]) -> anyhow::Result<Vec<Count>> {
    pids.iter()
        .map(|pid| {
            control("-d", *pid)?;
            let prefix = format!("callgrind.{pid}.");
            let newest = std::fs::read_dir(dir)?
                .filter_map(|e| {
                    let name = e.ok()?.file_name().into_string().ok()?;
                    let n: u32 = name.strip_prefix(&prefix)?.parse().ok()?;
                    Some((n, name))
                })
                .max()
                .with_context(|| format!("no callgrind dump of {pid} in {}", dir.display()))?;
            let file = dir.join(newest.1);
            let text = std::fs::read_to_string(&file)?;
            let total = total(&text).with_context(|| format!("no total in {}", file.display()))?;
            Ok(Count {
                total,
                by_crate: by_crate(&text),
            })
        })
        .collect()
}

/// A dump's instructions by the crate (or library) of the source file
/// they were compiled from, most first. Reads the format callgrind writes
/// (`fl=`/`fi=`/`fe=` name the file of the cost lines that follow, `ob=`
/// the object, with names compressed to `(n)` after first use; the cost
/// line after `calls=` is the call's inclusive cost, not counted here).
fn by_crate(dump: &str) -> Vec<(String, u64)> {
    let mut names = HashMap::new();
    let mut positions = 1;
    // The function's file (`fl=`), and the one its cost lines are from
    // (`fi=`/`fe=` for code inlined into it, until the next function).
    let (mut function_file, mut file, mut object) = ("", "", "");
    let mut inclusive_next = false;
    let mut counts: HashMap<String, u64> = HashMap::new();
    for line in dump.lines() {
        if let Some(v) = line.strip_prefix("positions:") {
            positions = v.split_whitespace().count().max(1);
        } else if let Some(v) = line.strip_prefix("fl=") {
            function_file = named(&mut names, 'f', v);
            file = function_file;
        } else if let Some(v) = ["fi=", "fe="].iter().find_map(|k| line.strip_prefix(k)) {
            file = named(&mut names, 'f', v);
        } else if line.starts_with("fn=") {
            file = function_file;
        } else if let Some(v) = ["cfi=", "cfl="].iter().find_map(|k| line.strip_prefix(k)) {
            named(&mut names, 'f', v);
        } else if let Some(v) = line.strip_prefix("ob=") {
            object = named(&mut names, 'o', v);
        } else if let Some(v) = line.strip_prefix("cob=") {
            named(&mut names, 'o', v);
        } else if line.starts_with("calls=") {
            inclusive_next = true;
        } else if line.starts_with(|c: char| c.is_ascii_digit() || "+-*".contains(c)) {
            if std::mem::take(&mut inclusive_next) {
                continue;
            }
            let cost = line.split_whitespace().nth(positions);
            if let Some(ir) = cost.and_then(|v| v.parse::<u64>().ok()) {
                *counts.entry(crate_of(file, object)).or_default() += ir;
            }
        }
    }
    let mut counts: Vec<_> = counts.into_iter().collect();
    counts.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    counts
}

/// A name as the dump gives it: `(n) name` defines n in `table` (files
/// share one, objects another), `(n)` alone uses it.
fn named<'a>(
    names: &mut HashMap<(char, &'a str), &'a str>,
    table: char,
    value: &'a str,
) -> &'a str {
    let Some((id, name)) = value.strip_prefix('(').and_then(|v| v.split_once(')')) else {
        return value;
    };
    let name = name.trim_start();
    if name.is_empty() {
        return names.get(&(table, id)).copied().unwrap_or("???");
    }
    names.insert((table, id), name);
    name
}

/// The crate a source file belongs to: a dependency's name without its
/// version (from the registry, or a git checkout), a workspace crate's as
/// `tether-<dir>`, Rust's own library as `std` (core, alloc, std and the
/// crates std bundles, together), C library sources as `libc` (its copies
/// apart, as `libc memcpy`); without line tables, the object's file name.
fn crate_of(file: &str, object: &str) -> String {
    if file.is_empty() || file == "???" {
        let object = object.rsplit('/').next().unwrap_or(object);
        return format!("{object} (no line tables)");
    }
    if (file.starts_with("/rustc/") && file.contains("/library/"))
        || file.starts_with("/rust/deps/")
    {
        return "std".into();
    }
    // `…/registry/src/<index>/<name>-<version>/…`
    if let Some(rest) = file.split_once("/registry/src/").map(|(_, r)| r) {
        let package = rest.split('/').nth(1).unwrap_or(rest);
        return package_name(package).to_string();
    }
    // `…/git/checkouts/<name>-<hash>/<rev>/…`
    if let Some(rest) = file.split_once("/git/checkouts/").map(|(_, r)| r) {
        let checkout = rest.split('/').next().unwrap_or(rest);
        return checkout
            .rsplit_once('-')
            .map_or(checkout, |(name, _)| name)
            .to_string();
    }
    if let Some(dir) = file
        .split_once("/crates/")
        .and_then(|(_, r)| r.split('/').next())
    {
        return format!("tether-{dir}");
    }
    if file.starts_with("./") {
        return if file.contains("memmove") || file.contains("memcpy") {
            "libc memcpy".into()
        } else {
            "libc".into()
        };
    }
    "other".into()
}

/// `name` of a `name-version` directory: up to the first `-` that a
/// digit follows (`tokio-rustls-0.26.6`, `rustls-0.24.0-alpha.1`).
fn package_name(package: &str) -> &str {
    package
        .match_indices('-')
        .map(|(i, _)| i)
        .find(|&i| package[i + 1..].starts_with(|c: char| c.is_ascii_digit()))
        .map_or(package, |i| &package[..i])
}

/// The instruction total of a callgrind dump (`summary:`, or `totals:`).
fn total(dump: &str) -> Option<u64> {
    ["summary:", "totals:"].iter().find_map(|key| {
        dump.lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn instructions_count_where_their_source_is_and_calls_do_not_count_twice() {
        let dump = "positions: line\nevents: Ir\nsummary: 175\n\
            ob=(1) /work/target/release/tether-proxy\n\
            fl=(1) /work/main/crates/proxy/src/http.rs\nfn=(1) strip\n10 20\n\
            fi=(2) /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/h2-0.4.20/src/hpack/encoder.rs\n+2 30\n\
            fe=(1)\n* 5\n\
            cfl=(3) /rustc/abc/library/core/src/ptr/mod.rs\ncfn=(2) copy\ncalls=1 7\n12 1000\n\
            fn=(3) other\n1 7\n\
            fl=(3)\nfn=(2)\n3 13\n\
            ob=(2) /usr/lib/x86_64-linux-gnu/libc.so.6\n\
            fl=(4) ./string/../sysdeps/x86_64/multiarch/memmove-vec-unaligned-erms.S\nfn=(4) memcpy\n1 40\n\
            ob=(3) /usr/sbin/haproxy\nfl=(5) ???\nfn=(5) h1_parse\n1 60\n";
        assert_eq!(
            super::by_crate(dump),
            [
                ("haproxy (no line tables)".to_string(), 60),
                ("libc memcpy".to_string(), 40),
                ("tether-proxy".to_string(), 32),
                ("h2".to_string(), 30),
                ("std".to_string(), 13),
            ]
        );
        // The breakdown adds up to the dump's closing `totals:` (which
        // `summary:` can exceed by a few hundredths of a percent).
        let total: u64 = super::by_crate(dump).iter().map(|c| c.1).sum();
        assert_eq!(total, 175);
    }

    #[test]
    fn a_source_file_is_named_by_its_crate() {
        let registry = "/root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f";
        let of = |file: &str| super::crate_of(file, "/bin/x");
        assert_eq!(
            of(&format!("{registry}/tokio-rustls-0.26.6/src/lib.rs")),
            "tokio-rustls"
        );
        assert_eq!(
            of(&format!("{registry}/rustls-0.24.0-alpha.1/src/conn.rs")),
            "rustls"
        );
        assert_eq!(
            of(&format!("{registry}/wasip2-1.0.4+wasi-0.2.12/src/lib.rs")),
            "wasip2"
        );
        assert_eq!(
            of("/opt/home-1.2/registry/src/index.crates.io-1/h2-0.4.20/src/a.rs"),
            "h2"
        );
        assert_eq!(
            of("/root/.cargo/git/checkouts/h2-a1b2c3/5d6e7f/src/lib.rs"),
            "h2"
        );
        assert_eq!(of("/rustc/59807616/library/core/src/ptr/mod.rs"), "std");
        assert_eq!(of("/rust/deps/hashbrown-0.16.1/src/map.rs"), "std");
        assert_eq!(of("/work/main/crates/proxy/src/http.rs"), "tether-proxy");
        assert_eq!(of("./malloc/./malloc/malloc.c"), "libc");
        assert_eq!(of("???"), "x (no line tables)");
    }

    #[test]
    fn a_dumps_total_is_its_summary_or_its_totals() {
        let dump = "version: 1\ncmd: x\nevents: Ir\nfn=main\n1 5\nsummary: 1234\ntotals: 1234\n";
        assert_eq!(super::total(dump), Some(1234));
        assert_eq!(super::total("events: Ir\ntotals: 77\n"), Some(77));
        assert_eq!(super::total("events: Ir\n"), None);
        assert_eq!(super::total("summary: many\n"), None);
    }
}
