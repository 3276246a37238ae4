#!/usr/bin/env bash
# Failover under load, with retries on and off, in one run.
# Arguments go to the harness: --rps R --crash-at S --detect S --seconds S
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -q -p tether -p tether-bench
exec target/release/failover --tether target/release/tether "$@"
