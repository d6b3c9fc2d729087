#!/usr/bin/env bash
# Soak test (not in CI): a pipeline with the tuner on, injected read/decode failures and stalls,
# a panicking stage, random resizes from a chaos thread, and a checkpoint + drop + rebuild +
# resume every third epoch, for a fixed time. Reports items delivered, failed, lost (must be
# 0) and duplicated (must be 0), RSS growth after the warm-up (target < 5%) and the thread
# count at the start and end (equal). Exits non-zero if any of those fails.
#   scripts/soak.sh [SECONDS=600] [more tools/src/bin/soak.rs flags, e.g. --fault-rate 0.05]
# The JSON line also goes to target/soak.json.
# The heap in use (counted by the example's allocator) is the leak signal; RSS also counts what
# the allocator keeps (a dropped pipeline hands its freed memory back with malloc_trim).
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_TO_RUN=${1:-600}
shift || true
cargo build --release --locked -p flowgate-tools --bin soak
mkdir -p target
./target/release/soak --seconds "$SECONDS_TO_RUN" "$@" | tee target/soak.json
