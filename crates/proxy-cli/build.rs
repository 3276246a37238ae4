//! Compiles the CPU guard (csrc/cpu_guard.c, see crates/proxy-cli/src/cpu.rs)
//! for plain x86-64, with the list of features the Rust code is compiled to
//! use, so a build for a newer level refuses to start on a CPU without them.

use std::env;
use std::fmt::Write as _;
use std::path::PathBuf;

/// The features beyond baseline x86-64 that the guard can check.
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
    let mut list = String::new();
    for feature in CHECKED {
        if enabled.split(',').any(|f| f == *feature) {
            let _ = write!(list, "\"{feature}\", ");
        }
    }
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    std::fs::write(
        out.join("tether_cpu_required.h"),
        format!("#define TETHER_CPU_REQUIRED {list}\n"),
    )
    .expect("write tether_cpu_required.h");
    cc::Build::new()
        .file("csrc/cpu_guard.c")
        .include(&out)
        // Last on the command line, so it wins over any -march from CFLAGS.
        .flag("-march=x86-64")
        .flag("-mtune=generic")
        .warnings(true)
        .compile("tether_cpu_guard");
}
