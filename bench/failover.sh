#!/usr/bin/env bash
# Failover under load: a crash the registry learns of late (several delays;
# retries on, and off as a baseline) and a hung (black-holing) gateway in
# balanced mode, one run each. Arguments go to the harness:
# --rps R --crash-at S --detect S[,S...] --freeze S --seconds S
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -q -p tether -p tether-bench
exec target/release/failover --tether target/release/tether "$@"
