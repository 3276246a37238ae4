#!/usr/bin/env bash
# Memory discovery streams leave behind: control plane after N streams
# close, proxy and control plane after requests for P distinct Host ports.
#   --streams N (≤50000) --ports P (≤20000)
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -q -p tether -p tether-bench
exec target/release/stream-memory --tether target/release/tether "$@"
