#!/usr/bin/env bash
# Demo app direct vs through outbound + inbound proxies, in one run.
# Extra arguments go to the harness: --rate R --seconds S --concurrency C
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -q -p tether -p tether-bench
exec target/release/proxy-latency --tether target/release/tether "$@"
