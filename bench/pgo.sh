#!/usr/bin/env bash
# Builds the sidecar with profile-guided optimisation (PGO) on top of the
# release-lto profile, then lays its machine code out again with BOLT from a
# second profile: an instrumented tether-proxy carries the proxy-cost
# benchmark's traffic (bench/proxy-latency.sh: HTTP/1.1 and gRPC apps
# through plaintext and mTLS pairs, HTTP/2 between the proxies, at 1k and
# 5k req/s and at full speed), LLVM merges what it counted, and the
# sidecar is built again from that profile (target/pgo/tether-proxy-pgo).
# BOLT then instruments that binary, the same traffic runs through it, and
# BOLT moves hot blocks and functions together and cold ones out of the way
# (target/pgo/tether-proxy, the result). `--no-bolt` stops after PGO;
# `--cpu LEVEL` builds for a newer x86-64 level, everything under
# target/pgo-LEVEL, target/pgo-generate-LEVEL and target/pgo-use-LEVEL.
# Measure it against the plain LTO build in one run with
#   target/release/proxy-latency --tether-proxy target/pgo/tether-proxy \
#     --compare target/release-lto/tether-proxy
# Needs llvm-profdata matching rustc's LLVM: rustup's llvm-tools component,
# added here when missing; and llvm-bolt (Debian's bolt-<LLVM major>, installed
# here when missing). Both builds use target directories of their own
# (target/pgo-generate, target/pgo-use): RUSTFLAGS differ, and sharing one
# would rebuild everything each time. From scratch: ~25 min per build on a
# 2-core machine; BOLT itself takes seconds.
set -euo pipefail
bolt=1
cpu=""
usage="usage: bench/pgo.sh [--no-bolt] [--cpu x86-64-v2|x86-64-v3|x86-64-v4]"
while [ $# -gt 0 ]; do
  case "$1" in
    --no-bolt) bolt=0 ;;
    --cpu)
      [ $# -ge 2 ] && [ -n "$2" ] || { echo "$usage" >&2; exit 2; }
      cpu=$2
      shift
      ;;
    *) echo "$usage" >&2; exit 2 ;;
  esac
  shift
done
# --cpu builds for a newer x86-64 level (x86-64-v3: AVX2, BMI2 and kin,
# Haswell and Zen on): ~7% fewer instructions per request, most of it
# copies of 129-256 bytes made inline (docs/performance.md). Such a build
# refuses to start, naming what is missing, on a CPU below its level
# (crates/proxy-cli/src/cpu.rs). Its builds, profiles and result live apart
# (target/pgo-LEVEL, target/pgo-generate-LEVEL, target/pgo-use-LEVEL).
cpu_flags=""
suffix=""
case "$cpu" in
  "") ;;
  x86-64-v2 | x86-64-v3 | x86-64-v4)
    cpu_flags=" -Ctarget-cpu=$cpu"
    suffix="-$cpu"
    ;;
  *) echo "bench/pgo.sh: --cpu $cpu: not an x86-64 level (x86-64-v2, x86-64-v3, x86-64-v4)" >&2; exit 2 ;;
esac
# The training runs execute the build here: a level this machine lacks
# would fail them after the first ~25 min build, so it is refused now.
if [ -n "$cpu" ]; then
  features() { rustc --print cfg "$@" | sed -n 's/^target_feature="\(.*\)"$/\1/p'; }
  lacking=$(comm -23 <(features -C "target-cpu=$cpu" | sort) <(features -C target-cpu=native | sort) | tr '\n' ' ')
  if [ -n "$lacking" ]; then
    echo "bench/pgo.sh: this machine's CPU lacks what --cpu $cpu needs (${lacking% }): its training runs could not run the build" >&2
    exit 1
  fi
fi
cd "$(dirname "$0")/.."
root=$PWD
host=$(rustc -vV | sed -n 's/^host: //p')
profdata() {
  find "$(rustc --print sysroot)/lib/rustlib" -name llvm-profdata -type f 2>/dev/null | head -1
}
if [ -z "$(profdata)" ]; then
  echo "llvm-profdata is missing: rustup component add llvm-tools" >&2
  rustup component add llvm-tools
fi
llvm_profdata=$(profdata)
[ -x "$llvm_profdata" ] || { echo "no llvm-profdata under $(rustc --print sysroot)" >&2; exit 1; }

out="target/pgo$suffix"
raw="$root/$out/raw"
merged="$root/$out/tether-proxy.profdata"
mkdir -p "$root/$out"
# A run that fails leaves no result behind for a bench to measure.
rm -f "$root/$out/tether-proxy" "$root/$out/tether-proxy-pgo"

echo "pgo: building the harness (release)..." >&2
cargo build --release -q -p tether -p tether-bench

# --target: RUSTFLAGS then reach only the sidecar's code, not build scripts
# and proc macros (which would be instrumented and write profiles too).
echo "pgo: building the instrumented sidecar (target/pgo-generate$suffix)..." >&2
RUSTFLAGS="-Cprofile-generate=$raw$cpu_flags" CARGO_TARGET_DIR="$root/target/pgo-generate$suffix" \
  cargo build --profile release-lto -q -p tether-proxy-cli --target "$host"

# HTTP/1.1 apps (nginx behind, the HAProxy comparison's traffic) and gRPC
# apps (HTTP/2 on both edges): a path left out of training is laid out as
# cold code, so each kind of traffic the sidecar carries is in the profile.
# The bench tells a tether-proxy binary by its file name.
train() {
  local binary=$1 stage=$2
  for protocol in http1 grpc; do
    echo "pgo: $stage training run, $protocol (bench/proxy-latency, 1 repetition)..." >&2
    target/release/proxy-latency --tether target/release/tether \
      --tether-proxy "$binary" --protocol "$protocol" --reps 1 --seconds 3 \
      >"$root/$out/training-$stage-$protocol.txt"
  done
}

rm -rf "$raw"
train "target/pgo-generate$suffix/$host/release-lto/tether-proxy" pgo
shopt -s nullglob
profiles=("$raw"/*.profraw)
[ ${#profiles[@]} -gt 0 ] || { echo "pgo: the training run wrote no profile under $raw" >&2; exit 1; }
"$llvm_profdata" merge -o "$merged" "${profiles[@]}"
echo "pgo: merged ${#profiles[@]} profiles into $merged" >&2

echo "pgo: building the optimised sidecar (target/pgo-use$suffix)..." >&2
# --emit-relocs keeps the link's relocations in the binary: BOLT needs them to
# move functions. Passed to the final link only (cargo rustc), so the
# dependencies' build fingerprints stay the same.
RUSTFLAGS="-Cprofile-use=$merged$cpu_flags" CARGO_TARGET_DIR="$root/target/pgo-use$suffix" \
  cargo rustc --profile release-lto -q -p tether-proxy-cli --bin tether-proxy --target "$host" \
  -- -Clink-arg=-Wl,--emit-relocs
pgo_binary="$root/$out/tether-proxy-pgo"
cp "target/pgo-use$suffix/$host/release-lto/tether-proxy" "$pgo_binary"
if [ "$bolt" = 0 ]; then
  cp "$pgo_binary" "$out/tether-proxy"
  echo "pgo: built $out/tether-proxy (PGO, no BOLT)" >&2
  exit 0
fi

# BOLT reads any compiler's output; the version of rustc's LLVM is the one
# tried first, then any llvm-bolt installed.
llvm_major=$(rustc -vV | sed -n 's/^LLVM version: \([0-9]*\).*/\1/p')
find_bolt() {
  for dir in "/usr/lib/llvm-$llvm_major/bin" /usr/lib/llvm-*/bin; do
    if [ -x "$dir/llvm-bolt" ] && [ -x "$dir/merge-fdata" ]; then
      echo "$dir"
      return
    fi
  done
}
bolt_dir=$(find_bolt)
if [ -z "$bolt_dir" ]; then
  echo "pgo: llvm-bolt is missing: installing Debian's bolt-$llvm_major" >&2
  { apt-get install -y -q "bolt-$llvm_major" || {
    apt-get update -q && apt-get install -y -q "bolt-$llvm_major"; }; } >/dev/null 2>&1 || true
  bolt_dir=$(find_bolt)
fi
if [ -z "$bolt_dir" ]; then
  echo "pgo: no llvm-bolt (bolt-$llvm_major could not be installed); $out/tether-proxy-pgo is" \
    "the PGO build without it, or run bench/pgo.sh --no-bolt" >&2
  exit 1
fi

# BOLT's instrumented binary writes its counts when it exits; every proxy
# of the training runs writes its own file (-append-pid).
bolt_raw="$root/$out/bolt-raw"
bolt_merged="$root/$out/tether-proxy.fdata"
instrumented="$root/$out/bolt-instrumented/tether-proxy"
rm -rf "$bolt_raw" && mkdir -p "$bolt_raw" "$(dirname "$instrumented")"
echo "pgo: instrumenting the PGO sidecar with BOLT..." >&2
"$bolt_dir/llvm-bolt" "$pgo_binary" -o "$instrumented" -instrument \
  -instrumentation-file="$bolt_raw/tether-proxy" -instrumentation-file-append-pid \
  >"$root/$out/bolt-instrument.log" 2>&1 \
  || { tail -5 "$root/$out/bolt-instrument.log" >&2; exit 1; }
train "$instrumented" bolt
profiles=("$bolt_raw"/*.fdata)
[ ${#profiles[@]} -gt 0 ] || { echo "pgo: the BOLT training run wrote no profile under $bolt_raw" >&2; exit 1; }
"$bolt_dir/merge-fdata" "${profiles[@]}" >"$bolt_merged" 2>"$root/$out/bolt-merge.log" \
  || { echo "pgo: merge-fdata failed:" >&2; tail -5 "$root/$out/bolt-merge.log" >&2; exit 1; }
echo "pgo: merged ${#profiles[@]} BOLT profiles into $bolt_merged" >&2
# Hot blocks in profile order (ext-tsp), functions called together placed
# together (cdsort), cold blocks moved to .text.cold, identical functions
# folded. The debug sections are dropped: symbols stay, so a backtrace
# names functions (a folded one may show as its twin), without file:line.
# Not -use-gnu-stack: it takes the PT_GNU_STACK header for BOLT's segment,
# and without that header glibc makes thread stacks executable.
bolted="$root/$out/bolted/tether-proxy"
mkdir -p "$(dirname "$bolted")"
"$bolt_dir/llvm-bolt" "$pgo_binary" -o "$bolted" -data="$bolt_merged" \
  -reorder-blocks=ext-tsp -reorder-functions=cdsort -split-functions -split-all-cold \
  -split-eh -icf -dyno-stats >"$root/$out/bolt-optimise.log" 2>&1 \
  || { tail -5 "$root/$out/bolt-optimise.log" >&2; exit 1; }
readelf -lW "$bolted" | grep -q 'GNU_STACK.* RW ' \
  || { echo "pgo: $bolted lost its non-executable stack (PT_GNU_STACK RW)" >&2; exit 1; }
# The laid-out binary carries traffic once (plaintext and mTLS pairs, a
# second at a low rate) before it is the result.
echo "pgo: smoke run of the BOLT layout..." >&2
target/release/proxy-latency --tether target/release/tether --tether-proxy "$bolted" \
  --rates 500 --seconds 1 --reps 1 >"$root/$out/smoke.txt" 2>&1 \
  || { echo "pgo: the BOLT layout failed its smoke run: $out/smoke.txt" >&2; exit 1; }
cp "$bolted" "$out/tether-proxy"
echo "pgo: built $out/tether-proxy (PGO + BOLT; PGO only: $out/tether-proxy-pgo)" >&2
