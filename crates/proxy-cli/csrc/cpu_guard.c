/*
 * The CPU a build needs, checked before any Rust code runs.
 *
 * A sidecar compiled for a newer x86-64 level (-C target-cpu=x86-64-v3,
 * `bench/pgo.sh --cpu x86-64-v3`) dies of SIGILL, with no word of why, on a
 * CPU without the features it uses, and takes its pod's traffic with it.
 * tether_cpu_guard() runs from the executable's .preinit_array (the Rust
 * side puts it there, crates/proxy-cli/src/cpu.rs): before ld.so runs any
 * .init_array entry (std's, crtbegin's, a dependency's), and before main.
 * When a feature is missing it names them on stderr and exits 2.
 *
 * It is C so that it stays plain x86-64 whatever the Rust code is compiled
 * for: Rust cannot switch a target feature off for one function, and a
 * guard written in Rust came out using AVX itself. build.rs compiles this
 * file with -march=x86-64 (and -mgeneral-regs-only where the compiler has
 * it) and writes the features the Rust code is compiled to use
 * (CARGO_CFG_TARGET_FEATURE) into tether_cpu_required.h. CFLAGS come after
 * those flags, and an -m<feature> in them survives -march anyway: the
 * check below stops such a build rather than let the guard use what it
 * guards against.
 */
#if defined(__SSE3__) || defined(__SSSE3__) || defined(__SSE4_1__) || defined(__SSE4_2__) ||    \
    defined(__AVX__) || defined(__AVX2__) || defined(__AVX512F__) || defined(__FMA__) ||        \
    defined(__F16C__) || defined(__BMI__) || defined(__BMI2__) || defined(__LZCNT__) ||         \
    defined(__POPCNT__) || defined(__MOVBE__) || defined(__ADX__) || defined(__XSAVE__)
#error "cpu_guard.c must be compiled for plain x86-64, but CFLAGS enable a newer instruction set (-march=native, -mavx2, ...): build without those flags"
#endif

#include <cpuid.h>
#include <stddef.h>
#include <string.h>
#include <unistd.h>

#include "tether_cpu_required.h" /* TETHER_CPU_REQUIRED, a list of strings */

static const char *const required[] = {TETHER_CPU_REQUIRED NULL};

/* XCR0: which register states the kernel saves. Only called when CPUID
 * reports OSXSAVE (XGETBV exists then). */
static unsigned int xcr0(void) {
    unsigned int lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    (void)hi;
    return lo;
}

/* What the CPU reports, read once per check: CPUID traps to the
 * hypervisor in a VM, and a check asks about up to 20 features. */
struct cpu {
    unsigned int leaf1_ecx, leaf7_ebx, ext1_ecx, vendor_ebx, xcr0;
};

static struct cpu read_cpu(void) {
    unsigned int a, b, c, d;
    struct cpu cpu = {0, 0, 0, 0, 0};
    if (__get_cpuid(0, &a, &b, &c, &d)) cpu.vendor_ebx = b;
    if (__get_cpuid(1, &a, &b, &c, &d)) cpu.leaf1_ecx = c;
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) cpu.leaf7_ebx = b;
    if (__get_cpuid(0x80000001u, &a, &b, &c, &d)) cpu.ext1_ecx = c;
    if ((cpu.leaf1_ecx >> 27) & 1u) cpu.xcr0 = xcr0(); /* OSXSAVE */
    return cpu;
}

static int cpu_has(const struct cpu *cpu, const char *feature) {
#define BIT(word, n) (((word) >> (n)) & 1u)
    unsigned int leaf1_ecx = cpu->leaf1_ecx, leaf7_ebx = cpu->leaf7_ebx;
    /* The kernel saves SSE and AVX state (XCR0 bits 1-2); and, for AVX-512,
     * the opmask and upper ZMM state too (bits 5-7). */
    int os_avx = (cpu->xcr0 & 0x6u) == 0x6u;
    int os_avx512 = (cpu->xcr0 & 0xe6u) == 0xe6u;
    int avx = BIT(leaf1_ecx, 28) && os_avx;
    int avx512 = avx && os_avx512;
    /* std clears BMI1/BMI2 on Intel CPUs without AVX (erratum SKL052:
     * Pentium and Celeron parts report them but lack them): so does this. */
    int intel = cpu->vendor_ebx == 0x756e6547u; /* "Genu" */
    int bmi_ok = !intel || avx;
    if (!strcmp(feature, "sse3")) return BIT(leaf1_ecx, 0);
    if (!strcmp(feature, "ssse3")) return BIT(leaf1_ecx, 9);
    if (!strcmp(feature, "fma")) return BIT(leaf1_ecx, 12) && avx;
    if (!strcmp(feature, "cmpxchg16b")) return BIT(leaf1_ecx, 13);
    if (!strcmp(feature, "sse4.1")) return BIT(leaf1_ecx, 19);
    if (!strcmp(feature, "sse4.2")) return BIT(leaf1_ecx, 20);
    if (!strcmp(feature, "movbe")) return BIT(leaf1_ecx, 22);
    if (!strcmp(feature, "popcnt")) return BIT(leaf1_ecx, 23);
    if (!strcmp(feature, "xsave")) return BIT(leaf1_ecx, 26) && os_avx;
    if (!strcmp(feature, "avx")) return avx;
    /* VEX-encoded, so it needs the AVX state saved (std does not ask). */
    if (!strcmp(feature, "f16c")) return BIT(leaf1_ecx, 29) && avx;
    if (!strcmp(feature, "bmi1")) return BIT(leaf7_ebx, 3) && bmi_ok;
    if (!strcmp(feature, "avx2")) return BIT(leaf7_ebx, 5) && avx;
    if (!strcmp(feature, "bmi2")) return BIT(leaf7_ebx, 8) && bmi_ok;
    if (!strcmp(feature, "avx512f")) return BIT(leaf7_ebx, 16) && avx512;
    if (!strcmp(feature, "avx512dq")) return BIT(leaf7_ebx, 17) && avx512;
    if (!strcmp(feature, "avx512cd")) return BIT(leaf7_ebx, 28) && avx512;
    if (!strcmp(feature, "avx512bw")) return BIT(leaf7_ebx, 30) && avx512;
    if (!strcmp(feature, "avx512vl")) return BIT(leaf7_ebx, 31) && avx512;
    if (!strcmp(feature, "lzcnt")) return BIT(cpu->ext1_ecx, 5);
#undef BIT
    return 0;
}

int tether_cpu_has(const char *feature) {
    struct cpu cpu = read_cpu();
    return cpu_has(&cpu, feature);
}

#define MAX_MISSING 32
_Static_assert(sizeof required / sizeof required[0] <= MAX_MISSING + 1,
               "more features than the guard's buffer holds");

/* The features this build was compiled to use that the CPU lacks: up to
 * `cap` of them into `out`; returns how many there are. */
static size_t missing_features(const char **out, size_t cap) {
    size_t n = 0;
    if (required[0] == NULL) return 0;
    struct cpu cpu = read_cpu();
    for (size_t i = 0; required[i] != NULL; i++) {
        if (!cpu_has(&cpu, required[i])) {
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
                  ". It was compiled for a newer x86-64 level (-C target-cpu, as `bench/pgo.sh "
                  "--cpu` does); run a build for plain x86-64 here (`cargo build --release`, or "
                  "`bench/pgo.sh` without --cpu).\n");
}

void tether_cpu_guard(void) {
    const char *missing[MAX_MISSING];
    size_t n = missing_features(missing, MAX_MISSING);
    if (n == 0) return;
    if (n > MAX_MISSING) n = MAX_MISSING;
    char buf[1024];
    size_t len = tether_cpu_refusal(missing, n, buf, sizeof buf);
    ssize_t written = write(2, buf, len);
    (void)written;
    _exit(2);
}
