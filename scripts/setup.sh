#!/usr/bin/env bash
# Prepares a fresh machine for flowgate's commands. Both README commands call it.
# Today the engine needs only a Rust toolchain; media decoding (FFmpeg, libjpeg-turbo) and the
# local S3 server for integration tests will be installed here when those features land.
set -euo pipefail
if ! command -v cargo >/dev/null 2>&1; then
  echo "flowgate needs a Rust toolchain (cargo); install it from https://rustup.rs" >&2
  exit 1
fi
