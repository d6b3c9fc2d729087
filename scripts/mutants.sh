#!/usr/bin/env bash
# Mutation testing (cargo-mutants) of the code the exactly-once and memory promises rest on:
# each mutant (an operator flipped, a function's body replaced by a default) is built and the
# tests that cover the file are run; a mutant the tests do not catch ("MISSED") is a test that
# cannot fail. Results in docs/guarantees.md ("Mutation testing").
#
#   scripts/mutants.sh [channel|aggregate|checkpoint|layout|sampler|all]   (default: all)
#
# Each target runs the tests that exercise its file (unit tests in the crate; the integration
# tests that drive checkpoints); `--timeout` ends a mutant that hangs a test (counted as
# caught). On a 2-core machine: channel ~20 min, aggregate ~3 min, checkpoint ~60 min,
# layout ~60 min. Outputs under target/mutants/TARGET/mutants.out (missed.txt, caught.txt).
set -euo pipefail
cd "$(dirname "$0")/.."
command -v cargo-mutants >/dev/null || cargo install --locked cargo-mutants@27.1.0
what=${1:-all}
run() {
    local name=$1; shift
    echo "== $name" >&2
    cargo mutants --no-shuffle --output "target/mutants/$name" "$@" || true
    echo "missed: $(wc -l < "target/mutants/$name/mutants.out/missed.txt")" >&2
}
case $what in channel|all) run channel -p flowgate-actors -f actors/src/channel.rs --timeout 15 ;; esac
case $what in aggregate|all) run aggregate -p flowgate-actors -f actors/src/aggregate.rs --timeout 15 ;; esac
case $what in checkpoint|all)
    run checkpoint -p flowgate -f src/engine/checkpoint.rs --timeout 120 -- \
        --test elastic --test resume --test units ;; esac
case $what in layout|all) run layout -p flowgate -f src/sampler/layout.rs --timeout 120 -- --lib ;; esac
case $what in sampler|all)
    run sampler -p flowgate -f src/sampler/mod.rs -f src/sampler/mixture.rs \
        -f src/sampler/buckets.rs --timeout 120 -- --lib ;; esac
