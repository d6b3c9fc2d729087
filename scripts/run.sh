#!/usr/bin/env bash
# The main job (README): generate a sample dataset (once), then run a self-tuning image loader
# over it from a cold start, printing throughput, live stage stats and the tuner's decisions.
# Extra arguments go to the demo (for example --epochs 5 --step-ms 10 --trace trace.jsonl).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
DATA=${FLOWGATE_DATA:-target/sample-data}
IMAGES=${FLOWGATE_IMAGES:-600}
cargo build --release --locked --example make_dataset --example demo
if [ ! -s "$DATA/images.txt" ] || [ "$(wc -l < "$DATA/images.txt")" -ne "$IMAGES" ]; then
  echo "generating $IMAGES sample images in $DATA ..."
  ./target/release/examples/make_dataset --out "$DATA" --images "$IMAGES"
fi
exec ./target/release/examples/demo --images "$DATA/images.txt" "$@"
