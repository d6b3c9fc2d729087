#!/usr/bin/env bash
# The test command (README, CI): unit, integration, property and doc tests of every crate.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
cargo test --workspace --locked "$@"
