#!/usr/bin/env bash
# The main job (README): generate a sample dataset (once), then run the self-tuning image
# pipeline file over it from a cold start (`flowgate run`) for 30 seconds while its simulated
# training step changes (fast, slow, fast: the tuner adds decode workers while the loop waits
# and gives them back when batches pile up), with the live view, the tuner's decisions and
# their reasons, a per-stage summary and a JSON line; then the tuner's timeline as a picture
# (`flowgate plot`, target/tuning-demo.png).
# Extra arguments go to `flowgate run` (for example --quiet). The same images are written as
# WebDataset tar shards too: FLOWGATE_CONFIG=examples/configs/shards.toml runs over those.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
DATA=target/sample-data
IMAGES=${FLOWGATE_IMAGES:-600}
CONFIG=${FLOWGATE_CONFIG:-examples/configs/tuning_demo.toml}
cargo build --release --locked -p flowgate-cli --bin flowgate
if [ ! -s "$DATA/images.txt" ] || [ "$(wc -l < "$DATA/images.txt")" -ne "$IMAGES" ] \
  || [ ! -s "$DATA/shards.txt" ]; then
  ./target/release/flowgate gen-data --out "$DATA" --images "$IMAGES" --shards 100
fi
TRACE=target/tuning-demo.jsonl
rm -f "$TRACE"
status=0
./target/release/flowgate run "$CONFIG" "$@" || status=$?
if [ -s "$TRACE" ]; then
  ./target/release/flowgate plot "$TRACE" -o target/tuning-demo.png >&2 \
    && echo "the tuner's timeline: target/tuning-demo.png (flowgate plot $TRACE)" >&2
fi
exit "$status"
