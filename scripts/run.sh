#!/usr/bin/env bash
# The main job (README): generate a sample dataset (once), then run the self-tuning image
# classification pipeline file over it from a cold start (`flowgate run`), with the live view,
# the tuner's decisions, a per-stage summary and a JSON line.
# Extra arguments go to `flowgate run` (for example --quiet). The same images are written as
# WebDataset tar shards too: FLOWGATE_CONFIG=examples/configs/shards.toml runs over those.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
DATA=target/sample-data
IMAGES=${FLOWGATE_IMAGES:-600}
CONFIG=${FLOWGATE_CONFIG:-examples/configs/image_classification.toml}
cargo build --release --locked -p flowgate-cli --bin flowgate
if [ ! -s "$DATA/images.txt" ] || [ "$(wc -l < "$DATA/images.txt")" -ne "$IMAGES" ] \
  || [ ! -s "$DATA/shards.txt" ]; then
  ./target/release/flowgate gen-data --out "$DATA" --images "$IMAGES" --shards 100
fi
exec ./target/release/flowgate run "$CONFIG" "$@"
