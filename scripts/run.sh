#!/usr/bin/env bash
# The main job (README): a loader-shaped pipeline with live stats. Extra arguments go to it.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
cargo run --release --locked --example demo -- "$@"
