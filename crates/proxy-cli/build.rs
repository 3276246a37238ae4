//! Compiles the CPU guard (csrc/cpu_guard.c, see src/cpu.rs) for plain
//! x86-64, with the list of features the Rust code is compiled to use, so
//! a build for a newer level refuses to start on a CPU without them.

use std::env;
use std::fmt::Write as _;
use std::path::PathBuf;

/// What every x86-64 CPU has (and flags that are not instruction sets).
const BASELINE: &[&str] = &["fxsr", "sse", "sse2", "x87", "crt-static"];

/// The features the guard reads from the CPU: those of the x86-64 levels
/// v2, v3 and v4.
const CHECKED: &[&str] = &[
    "sse3",
    "ssse3",
    "sse4.1",
    "sse4.2",
    "popcnt",
    "cmpxchg16b",
    "avx",
    "avx2",
    "fma",
    "f16c",
    "bmi1",
    "bmi2",
    "lzcnt",
    "movbe",
    "xsave",
    "avx512f",
    "avx512dq",
    "avx512cd",
    "avx512bw",
    "avx512vl",
];

fn main() {
    println!("cargo:rerun-if-changed=csrc/cpu_guard.c");
    println!("cargo:rerun-if-changed=build.rs");
    let arch = env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_default();
    let os = env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    if arch != "x86_64" || os != "linux" {
        return;
    }
    let enabled = env::var("CARGO_CFG_TARGET_FEATURE").unwrap_or_default();
    let enabled: Vec<&str> = enabled.split(',').filter(|f| !f.is_empty()).collect();
    // A feature the guard cannot read would go unchecked: such a build
    // (`-C target-cpu=native`, a CPU model's name) could die of SIGILL
    // with no word of why, so it is not built.
    let unknown: Vec<&str> = enabled
        .iter()
        .copied()
        .filter(|f| !BASELINE.contains(f) && !CHECKED.contains(f))
        .collect();
    if !unknown.is_empty() {
        panic!(
            "tether-proxy-cli: the Rust code is compiled to use CPU features the start-up CPU \
             check cannot read: {}. Build for an x86-64 level instead (-C target-cpu=x86-64-v2, \
             x86-64-v3 or x86-64-v4), or teach crates/proxy-cli/csrc/cpu_guard.c (and CHECKED in \
             build.rs) to read them.",
            unknown.join(", ")
        );
    }
    let mut list = String::new();
    for feature in CHECKED.iter().filter(|f| enabled.contains(f)) {
        let _ = write!(list, "\"{feature}\", ");
    }
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    std::fs::write(
        out.join("tether_cpu_required.h"),
        format!("#define TETHER_CPU_REQUIRED {list}\n"),
    )
    .expect("write tether_cpu_required.h");
    // cc puts CFLAGS from the environment after these, and an -m<feature>
    // there survives -march anyway: cpu_guard.c refuses to compile when
    // one is in force (#error), rather than use what it guards against.
    cc::Build::new()
        .file("csrc/cpu_guard.c")
        .include(&out)
        .flag("-march=x86-64")
        .flag("-mtune=generic")
        .flag_if_supported("-mgeneral-regs-only")
        .warnings(true)
        .compile("tether_cpu_guard");
}
