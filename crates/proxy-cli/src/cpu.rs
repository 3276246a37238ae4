//! The CPU a build needs, checked before anything else runs.
//!
//! A sidecar built for a newer x86-64 level (`bench/pgo.sh --cpu
//! x86-64-v3`: AVX2 and its kin; ~7% fewer instructions per request,
//! docs/performance.md) dies of `SIGILL`, with no word of why, on a CPU
//! without them, and takes its pod's traffic with it. [`cpu_guard!`] puts
//! a check in the executable's `.preinit_array`, which the loader runs
//! before any `.init_array` entry (std's, crtbegin's, a dependency's) and
//! before `main`: when the CPU lacks a feature the build was compiled to
//! use, it names them on stderr and exits 2. A baseline build checks
//! nothing. A build using a feature the check cannot read (`-C
//! target-cpu=native`) is refused by build.rs.
//!
//! The check is C (`csrc/cpu_guard.c`, compiled by build.rs with
//! `-march=x86-64`): Rust cannot switch a target feature off for one
//! function, and the first version, in Rust, used AVX itself (qemu with a
//! Nehalem CPU showed it). build.rs hands it the features the Rust code is
//! compiled to use (`CARGO_CFG_TARGET_FEATURE`).

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
extern "C" {
    /// The check: exits 2, saying why, when a feature is missing.
    pub fn tether_cpu_guard();
    fn tether_cpu_has(feature: *const std::ffi::c_char) -> std::ffi::c_int;
    fn tether_cpu_refusal(
        missing: *const *const std::ffi::c_char,
        n: usize,
        buf: *mut u8,
        cap: usize,
    ) -> usize;
}

/// Whether this CPU has `feature` (rustc's name), as the guard reads it.
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
pub fn has(feature: &std::ffi::CStr) -> bool {
    // SAFETY: a NUL-terminated string the C side only reads.
    unsafe { tether_cpu_has(feature.as_ptr()) != 0 }
}

/// The refusal the guard prints for `missing`.
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
pub fn refusal(missing: &[&std::ffi::CStr]) -> String {
    let ptrs: Vec<_> = missing.iter().map(|m| m.as_ptr()).collect();
    let mut buf = vec![0u8; 1024];
    // SAFETY: `ptrs` holds `ptrs.len()` valid strings; the C side writes at
    // most `buf.len()` bytes into `buf`.
    let n = unsafe { tether_cpu_refusal(ptrs.as_ptr(), ptrs.len(), buf.as_mut_ptr(), buf.len()) };
    buf.truncate(n.min(1024));
    String::from_utf8_lossy(&buf).into_owned()
}

/// Puts the CPU check in the executable's `.preinit_array`, so it runs
/// before every initialiser and `main` (whose code may already use the
/// features). In each binary's `main.rs` (`.preinit_array` is for
/// executables only): the static names the check, which links it in.
#[macro_export]
macro_rules! cpu_guard {
    () => {
        #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
        #[used]
        #[link_section = ".preinit_array"]
        static CPU_GUARD: unsafe extern "C" fn() = $crate::cpu::tether_cpu_guard;
    };
}

#[cfg(all(test, target_arch = "x86_64", target_os = "linux"))]
mod tests {
    use super::*;

    #[test]
    fn the_refusal_names_what_is_missing_and_what_to_run_instead() {
        let text = refusal(&[c"avx2", c"bmi2"]);
        assert!(text.starts_with("tether: "), "{text}");
        assert!(text.contains("lacks: avx2, bmi2. "), "{text}");
        assert!(text.contains("plain x86-64"), "{text}");
        assert!(text.ends_with('\n'), "{text}");
        let one = refusal(&[c"avx2"]);
        assert!(one.contains("lacks: avx2. "), "{one}");
    }

    #[test]
    fn the_refusal_is_cut_at_its_buffer_not_past_it() {
        let many = vec![c"cmpxchg16b"; 200];
        assert_eq!(refusal(&many).len(), 1024);
    }

    /// The guard's reading of CPUID agrees with std's detection on this
    /// machine, feature by feature (std asks the CPU for what this test
    /// build was not compiled to use: every feature, in the usual baseline
    /// build). F16C is stricter than std's on purpose: its instructions
    /// are VEX-encoded and need the AVX state the kernel may not save.
    #[test]
    fn cpuid_reading_agrees_with_std_detection() {
        let checks = [
            (c"sse3", std::arch::is_x86_feature_detected!("sse3")),
            (c"ssse3", std::arch::is_x86_feature_detected!("ssse3")),
            (c"sse4.1", std::arch::is_x86_feature_detected!("sse4.1")),
            (c"sse4.2", std::arch::is_x86_feature_detected!("sse4.2")),
            (c"popcnt", std::arch::is_x86_feature_detected!("popcnt")),
            (
                c"cmpxchg16b",
                std::arch::is_x86_feature_detected!("cmpxchg16b"),
            ),
            (c"avx", std::arch::is_x86_feature_detected!("avx")),
            (c"avx2", std::arch::is_x86_feature_detected!("avx2")),
            (c"fma", std::arch::is_x86_feature_detected!("fma")),
            (c"bmi1", std::arch::is_x86_feature_detected!("bmi1")),
            (c"bmi2", std::arch::is_x86_feature_detected!("bmi2")),
            (c"lzcnt", std::arch::is_x86_feature_detected!("lzcnt")),
            (c"movbe", std::arch::is_x86_feature_detected!("movbe")),
            (c"xsave", std::arch::is_x86_feature_detected!("xsave")),
            (c"avx512f", std::arch::is_x86_feature_detected!("avx512f")),
            (c"avx512dq", std::arch::is_x86_feature_detected!("avx512dq")),
            (c"avx512cd", std::arch::is_x86_feature_detected!("avx512cd")),
            (c"avx512bw", std::arch::is_x86_feature_detected!("avx512bw")),
            (c"avx512vl", std::arch::is_x86_feature_detected!("avx512vl")),
        ];
        for (name, std_says) in checks {
            assert_eq!(has(name), std_says, "{name:?}");
        }
        if has(c"f16c") {
            assert!(std::arch::is_x86_feature_detected!("f16c"));
            assert!(has(c"avx"), "F16C without the AVX state");
        }
        assert!(!has(c"no-such-feature"));
    }
}
