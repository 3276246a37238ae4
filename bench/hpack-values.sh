#!/usr/bin/env bash
# HPACK of header values that change with every message (a Date a second,
# a request id a request): indexed against never indexed, on an h2 client
# and server in one process.
#   --requests N (≤1000000) --reps N (≤50) --ages 1,10,30,100 (seconds)
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -q -p tether-bench --bin hpack-values
exec target/release/hpack-values "$@"
