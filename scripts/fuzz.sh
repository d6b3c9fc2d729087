#!/usr/bin/env bash
# Runs each fuzz target (fuzz/: image, audio, video, config) for a fixed time with cargo-fuzz.
# Not in CI. Needs a nightly toolchain (`rustup toolchain install nightly`); installs
# cargo-fuzz if missing. Seeds come from the sample dataset (target/sample-data) when present.
#   scripts/fuzz.sh [SECONDS_PER_TARGET=60] [TARGET...]
# A crash leaves its input in fuzz/artifacts/TARGET/; fix it and add the input to the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
PER=${1:-60}
shift || true
TARGETS=("$@")
if [ ${#TARGETS[@]} -eq 0 ]; then TARGETS=(image audio video config tar); fi
command -v cargo-fuzz >/dev/null 2>&1 || cargo install cargo-fuzz --locked
# Seed corpora: a few real files of each kind, and the simulator's scenarios.
seed() { # seed TARGET FILES...
  local dir="fuzz/corpus/$1"; shift
  mkdir -p "$dir"
  for f in "$@"; do [ -f "$f" ] && cp -n "$f" "$dir/" || true; done
}
seed image $(head -n 5 target/sample-data/images.txt 2>/dev/null)
seed audio $(head -n 5 target/sample-data/audio.txt 2>/dev/null)
seed video $(head -n 3 target/sample-data/video.txt 2>/dev/null)
seed config tuner/tests/scenarios/*.toml examples/configs/*.toml
# Tar: two small archives (a ustar one, and one with a long name: a GNU or PAX header).
mkdir -p fuzz/corpus/tar
[ -f fuzz/corpus/tar/scenarios.tar ] || tar -cf fuzz/corpus/tar/scenarios.tar -C tuner/tests/scenarios .
long=$(printf 'k%.0s' $(seq 1 120))
[ -f fuzz/corpus/tar/long.tar ] || (d=$(mktemp -d) && echo x > "$d/$long.cls" \
  && tar -cf fuzz/corpus/tar/long.tar -C "$d" "$long.cls" && rm -rf "$d")
status=0
for t in "${TARGETS[@]}"; do
  echo "== fuzz $t for ${PER}s"
  if ! cargo +nightly fuzz run --fuzz-dir fuzz "$t" "fuzz/corpus/$t" -- \
      -max_total_time="$PER" -rss_limit_mb=4096 -timeout=20 -max_len=262144; then
    echo "fuzz target $t found a failure: see fuzz/artifacts/$t/" >&2
    status=1
  fi
done
exit $status
