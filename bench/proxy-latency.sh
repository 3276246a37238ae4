#!/usr/bin/env bash
# Proxy cost: a backend direct, through an HAProxy pair (the peer to beat),
# through a Tether pair in plaintext and over mTLS, interleaved in one run;
# prints Tether/HAProxy ratios with PASS/FAIL against issue 14's goals.
# Installs haproxy (and nginx-light, the backend) with apt-get when missing.
# Extra arguments go to the harness: --rates R1,R2 --seconds S --reps N
#   --concurrency C --proxy-arg ARG (repeatable, for every Tether proxy)
#   --compare-threads N (an extra mTLS pair with --threads N; repeatable)
#   --compare BINARY (an extra mTLS pair of another tether build, e.g. before a change; repeatable;
#     target/release/tether compares `tether proxy` with the tether-proxy binary the pairs run)
#   --tether-proxy PATH (the proxy-only binary the Tether pairs run; default target/release-lto/tether-proxy,
#     the sidecar as it ships: built with --profile release-lto, ~10 min from scratch the first time)
#   --perf DIR (perf record the proxies during the first repetition, into DIR/*.data)
#   --syscalls (count the pairs' system calls per request, by kind, during the first repetition)
#   --compare-h1 (an extra mTLS pair speaking HTTP/1.1 between the proxies: what HTTP/2 costs)
#   --haproxy-mtls (an extra HAProxy pair with mTLS and HTTP/2 between its proxies, as Tether's: informational ratios)
#   --allocs (count each proxy's heap allocations and timers per request, with uprobes, during the first repetition)
#   --protocol http2|grpc (the load speaks HTTP/2 or gRPC to the demo app; no HAProxy pairs)
#   --netns (root: every route in a client pod and a server pod, network namespaces joined through the node by
#     veths; the Tether pods behind `tether init`'s iptables redirect, the load dialing the service's cluster IP)
#   --haproxy-sidecar (with --netns: an extra plaintext HAProxy pair run as sidecars, behind the same redirect;
#     every Tether pair is checked against it too, informational)
#   --pgo (build the sidecar with profile-guided optimisation and BOLT, bench/pgo.sh, ~25 min from scratch; its pairs run
#     that build, and an extra mTLS pair runs the release-lto build it started from)
set -euo pipefail
cd "$(dirname "$0")/.."
pgo=()
args=()
for a in "$@"; do
  if [ "$a" = "--pgo" ]; then
    pgo=(--tether-proxy target/pgo/tether-proxy --compare target/release-lto/tether-proxy)
  else
    args+=("$a")
  fi
done
cargo build --release -q -p tether -p tether-bench -p tether-proxy-cli
echo "building the sidecar (cargo build --profile release-lto -p tether-proxy-cli)..." >&2
cargo build --profile release-lto -q -p tether-proxy-cli
if [ ${#pgo[@]} -gt 0 ]; then
  bench/pgo.sh
fi
# A later --tether-proxy in the arguments wins.
exec target/release/proxy-latency --tether target/release/tether \
  --tether-proxy target/release-lto/tether-proxy "${pgo[@]}" "${args[@]}"
