#!/usr/bin/env bash
# Soak: constant load through a small mesh while control-plane replicas,
# endpoints, the registry, certificates and hostile clients do their worst.
# Prints PASS/FAIL lines and exits non-zero on FAIL. Arguments go to the
# harness: --minutes N (default 2) --rps R (default 200) --leaf-lifetime S (default 30)
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -q -p tether -p tether-bench
exec target/release/soak --tether target/release/tether "$@"
