#!/usr/bin/env bash
# The fault harness's long run (not in CI; the short one is in the test command): both
# datasets of python/tests/test_faults.py (tar shards on S3; local shards mixed with Parquet
# on S3) with SAMPLES items per epoch, ROUNDS times each: ranks under torchrun behind the
# fault proxy, an object rewritten on the store mid-run, a rank killed with SIGKILL (at a step
# drawn from FLOWGATE_FAULT_SEED, random per round unless set), the
# merged checkpoint resumed at another world size through DataLoader workers. Each run
# prints one JSON line of figures (items, lost, repeated, faults injected); they are
# collected in target/soak-faults.jsonl. Exits non-zero if any run fails.
#   scripts/soak-faults.sh [SAMPLES=1999] [ROUNDS=3]
# Needs what the test command installs (scripts/setup.sh --test, the Python virtualenv with
# torch and the package).
set -euo pipefail
cd "$(dirname "$0")/.."
SAMPLES=${1:-1999}
ROUNDS=${2:-3}
VENV=${FLOWGATE_PYVENV:-$HOME/.cache/flowgate/pyvenv}
mkdir -p target
: > target/soak-faults.jsonl
for round in $(seq 1 "$ROUNDS"); do
  log=target/soak-faults-round$round.log
  # A kill step drawn anew each round (printed with the figures: kill_step).
  FLOWGATE_FAULT_SEED=${FLOWGATE_FAULT_SEED:-$RANDOM} \
  FLOWGATE_SOAK_SAMPLES=$SAMPLES "$VENV/bin/python" -m pytest -q -s python/tests/test_faults.py \
    > "$log" 2>&1 || { tail -50 "$log" >&2; echo "round $round failed: $log" >&2; exit 1; }
  # pytest prints a passing test's dot before its line: take the JSON wherever it starts.
  grep -o '{"items".*' "$log" >> target/soak-faults.jsonl
  echo "round $round of $ROUNDS passed" >&2
done
cat target/soak-faults.jsonl
