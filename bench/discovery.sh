#!/usr/bin/env bash
# Discovery under churn: registry change → subscriber latency, control-plane
# RSS/CPU, memory per subscriber. Arguments go to the harness:
#   --endpoints N (≤100000) --services S --subscribers M (≤20000) --churn R (≤500/s)
#   --seconds T --settle T (time to converge after the churn)
#   --per-file N (endpoints per registry file, default 5000: a change rewrites one file)
#   --baseline OLD-TETHER (run the same load on an older binary first; prints NEW/OLD)
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -q -p tether -p tether-bench
exec target/release/discovery --tether target/release/tether --load target/release/discovery-load "$@"
