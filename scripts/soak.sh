#!/usr/bin/env bash
# Soak test (not in CI): a pipeline with the tuner on, injected read/decode failures and stalls,
# a panicking stage, random resizes from a chaos thread, and a checkpoint + drop + rebuild +
# resume every third epoch, for a fixed time. Reports items delivered, failed, lost (must be
# 0) and duplicated (must be 0), RSS growth after the warm-up (target < 5%) and the thread
# count at the start and end (equal). Exits non-zero if any of those fails.
#   scripts/soak.sh [SECONDS=600] [more examples/soak.rs flags, e.g. --fault-rate 0.05]
# The JSON line also goes to target/soak.json.
# RSS is judged with MALLOC_ARENA_MAX=2 unless set: each rebuilt pipeline starts new threads, and
# glibc gives new threads new malloc arenas (up to 8 per core) that keep freed memory, so RSS
# climbs with no leak. The heap in use (counted by the example's allocator) is the leak signal.
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_TO_RUN=${1:-600}
shift || true
export MALLOC_ARENA_MAX=${MALLOC_ARENA_MAX:-2}
cargo build --release --locked --example soak
mkdir -p target
./target/release/examples/soak --seconds "$SECONDS_TO_RUN" "$@" | tee target/soak.json
