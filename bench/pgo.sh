#!/usr/bin/env bash
# Builds the sidecar with profile-guided optimisation (PGO) on top of the
# release-lto profile: an instrumented tether-proxy carries the proxy-cost
# benchmark's traffic (bench/proxy-latency.sh: HTTP/1.1 and gRPC apps
# through plaintext and mTLS pairs, HTTP/2 between the proxies, at 1k and
# 5k req/s and at full speed), LLVM merges what it counted, and the
# sidecar is built again from that profile. Result: target/pgo/tether-proxy.
# Measure it against the plain LTO build in one run with
#   target/release/proxy-latency --tether-proxy target/pgo/tether-proxy \
#     --compare target/release-lto/tether-proxy
# Needs llvm-profdata matching rustc's LLVM: rustup's llvm-tools component,
# added here when missing. Both builds use target directories of their own
# (target/pgo-generate, target/pgo-use): RUSTFLAGS differ, and sharing one
# would rebuild everything each time. From scratch: ~25 min per build on a
# 2-core machine.
set -euo pipefail
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

raw="$root/target/pgo/raw"
merged="$root/target/pgo/tether-proxy.profdata"
mkdir -p "$root/target/pgo"

echo "pgo: building the harness (release)..." >&2
cargo build --release -q -p tether -p tether-bench

# --target: RUSTFLAGS then reach only the sidecar's code, not build scripts
# and proc macros (which would be instrumented and write profiles too).
echo "pgo: building the instrumented sidecar (target/pgo-generate)..." >&2
RUSTFLAGS="-Cprofile-generate=$raw" CARGO_TARGET_DIR="$root/target/pgo-generate" \
  cargo build --profile release-lto -q -p tether-proxy-cli --target "$host"

rm -rf "$raw"
# HTTP/1.1 apps (nginx behind, the HAProxy comparison's traffic) and gRPC
# apps (HTTP/2 on both edges): a path left out of training is laid out as
# cold code, so each kind of traffic the sidecar carries is in the profile.
for protocol in http1 grpc; do
  echo "pgo: training run, $protocol (bench/proxy-latency, 1 repetition)..." >&2
  target/release/proxy-latency --tether target/release/tether \
    --tether-proxy "target/pgo-generate/$host/release-lto/tether-proxy" \
    --protocol "$protocol" --reps 1 --seconds 3 >"$root/target/pgo/training-$protocol.txt"
done
shopt -s nullglob
profiles=("$raw"/*.profraw)
[ ${#profiles[@]} -gt 0 ] || { echo "pgo: the training run wrote no profile under $raw" >&2; exit 1; }
"$llvm_profdata" merge -o "$merged" "${profiles[@]}"
echo "pgo: merged ${#profiles[@]} profiles into $merged" >&2

echo "pgo: building the optimised sidecar (target/pgo-use)..." >&2
RUSTFLAGS="-Cprofile-use=$merged" CARGO_TARGET_DIR="$root/target/pgo-use" \
  cargo build --profile release-lto -q -p tether-proxy-cli --target "$host"
cp "target/pgo-use/$host/release-lto/tether-proxy" target/pgo/tether-proxy
echo "pgo: built target/pgo/tether-proxy" >&2
