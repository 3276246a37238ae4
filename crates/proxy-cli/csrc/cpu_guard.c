/*
 * The CPU a build needs, checked before any Rust code runs.
 *
 * A sidecar compiled for a newer x86-64 level (-C target-cpu=x86-64-v3,
 * `bench/pgo.sh --cpu x86-64-v3`) dies of SIGILL, with no word of why, on a
 * CPU without the features it uses, and takes its pod's traffic with it.
 * tether_cpu_guard() runs from the binary's .init_array (the Rust side puts
 * it there, crates/proxy-cli/src/cpu.rs) and exits 2, naming what is
 * missing, before std's runtime or main start.
 *
 * It is C so that it stays plain x86-64 whatever the Rust code is compiled
 * for: Rust cannot switch a target feature off for one function, and a
 * guard written in Rust came out using AVX itself. build.rs compiles this
 * file with -march=x86-64 and writes the list of features the Rust code was
 * compiled to use (CARGO_CFG_TARGET_FEATURE) into tether_cpu_required.h.
 */
#include <cpuid.h>
#include <stddef.h>
#include <string.h>
#include <unistd.h>

#include "tether_cpu_required.h" /* TETHER_CPU_REQUIRED, a list of strings */

static const char *const required[] = {TETHER_CPU_REQUIRED NULL};

/* Whether the kernel saves the SSE and AVX registers (XCR0 bits 1 and 2):
 * without that, AVX instructions fault even where CPUID lists them. Only
 * called when CPUID reports OSXSAVE (XGETBV exists then). */
static int avx_state_enabled(void) {
    unsigned int lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    (void)hi;
    return (lo & 6u) == 6u;
}

int tether_cpu_has(const char *feature) {
    unsigned int a, b, c, d;
    unsigned int leaf1_ecx = 0, leaf7_ebx = 0, ext1_ecx = 0;
    if (__get_cpuid(1, &a, &b, &c, &d)) leaf1_ecx = c;
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) leaf7_ebx = b;
    if (__get_cpuid(0x80000001u, &a, &b, &c, &d)) ext1_ecx = c;
#define BIT(word, n) (((word) >> (n)) & 1u)
    int avx = BIT(leaf1_ecx, 28) && BIT(leaf1_ecx, 27) && avx_state_enabled();
    if (!strcmp(feature, "sse3")) return BIT(leaf1_ecx, 0);
    if (!strcmp(feature, "ssse3")) return BIT(leaf1_ecx, 9);
    if (!strcmp(feature, "fma")) return BIT(leaf1_ecx, 12) && avx;
    if (!strcmp(feature, "cmpxchg16b")) return BIT(leaf1_ecx, 13);
    if (!strcmp(feature, "sse4.1")) return BIT(leaf1_ecx, 19);
    if (!strcmp(feature, "sse4.2")) return BIT(leaf1_ecx, 20);
    if (!strcmp(feature, "movbe")) return BIT(leaf1_ecx, 22);
    if (!strcmp(feature, "popcnt")) return BIT(leaf1_ecx, 23);
    if (!strcmp(feature, "xsave")) return BIT(leaf1_ecx, 26);
    if (!strcmp(feature, "avx")) return avx;
    if (!strcmp(feature, "f16c")) return BIT(leaf1_ecx, 29) && avx;
    if (!strcmp(feature, "bmi1")) return BIT(leaf7_ebx, 3);
    if (!strcmp(feature, "avx2")) return BIT(leaf7_ebx, 5) && avx;
    if (!strcmp(feature, "bmi2")) return BIT(leaf7_ebx, 8);
    if (!strcmp(feature, "lzcnt")) return BIT(ext1_ecx, 5);
#undef BIT
    return 0;
}

/* The features this build was compiled to use that the CPU lacks: up to
 * `cap` of them into `out`; returns how many there are. */
size_t tether_cpu_missing(const char **out, size_t cap) {
    size_t n = 0;
    for (size_t i = 0; required[i] != NULL; i++) {
        if (!tether_cpu_has(required[i])) {
            if (n < cap) out[n] = required[i];
            n++;
        }
    }
    return n;
}

static size_t append(char *buf, size_t cap, size_t len, const char *s) {
    size_t n = strlen(s);
    if (len >= cap) return len;
    if (n > cap - len) n = cap - len;
    memcpy(buf + len, s, n);
    return len + n;
}

/* The refusal, naming `missing`, into `buf` (cut at `cap` bytes); returns
 * its length. */
size_t tether_cpu_refusal(const char *const *missing, size_t n, char *buf, size_t cap) {
    size_t len = append(buf, cap, 0, "tether: this build needs CPU features this machine lacks: ");
    for (size_t i = 0; i < n; i++) {
        if (i > 0) len = append(buf, cap, len, ", ");
        len = append(buf, cap, len, missing[i]);
    }
    return append(buf, cap, len,
                  ". It was compiled for a newer x86-64 level (e.g. `bench/pgo.sh --cpu x86-64-v3`); "
                  "run a build for plain x86-64 here (`cargo build --release`, or `bench/pgo.sh` "
                  "without --cpu).\n");
}

void tether_cpu_guard(void) {
    const char *missing[32];
    size_t n = tether_cpu_missing(missing, 32);
    if (n == 0) return;
    if (n > 32) n = 32;
    char buf[1024];
    size_t len = tether_cpu_refusal(missing, n, buf, sizeof buf);
    ssize_t written = write(2, buf, len);
    (void)written;
    _exit(2);
}
