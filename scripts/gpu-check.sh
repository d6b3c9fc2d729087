#!/usr/bin/env bash
# GPU checks for a machine with an NVIDIA GPU that may reach no package registry.
#
#   scripts/gpu-check.sh --build      # on an ordinary machine: release binaries with
#                                     # --features cuda (CUDA is loaded at run time), stripped,
#                                     # into gpu-bin/ (git-ignored; ~20 MiB together)
#   scripts/gpu-check.sh [RESULTS]    # on the GPU machine, from the repository root with
#                                     # gpu-bin/ copied along: runs everything below and
#                                     # writes RESULTS (default: gpu-results/) in under 8 min
#
# What it runs and writes (one JSON file per step, plus summary.json):
#   device-tests.txt  the device tests with FLOWGATE_REQUIRE_GPU=1 (real uploads read back)
#   upload.jsonl      upload_bench: H2D GB/s from pageable memory, plain pinned memory, the
#                     uploader with a staging copy and the uploader from its pinned pool, for
#                     batches of 1-64 MiB (target: uploader >= 85% of pinned)
#   e2e.jsonl         an image pipeline into the GPU with a 10 ms spin-kernel step, and the
#                     fraction of GPU time spent waiting for data (target < 5% when the loader
#                     outruns the step)
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=gpu-bin

if [ "${1:-}" = "--build" ]; then
  ./scripts/setup.sh
  cargo build --release --locked -p flowgate-cli -p flowgate-tools --features flowgate-cli/cuda,flowgate-tools/cuda --bin flowgate --bin upload_bench
  tests=$(cargo test --release --locked --features cuda --test device --no-run \
            --message-format=json 2>/dev/null \
          | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "device":
        print(m["executable"])' | tail -n1)
  mkdir -p "$BIN"
  cp target/release/flowgate "$BIN/flowgate"
  cp target/release/upload_bench "$BIN/upload_bench"
  cp "$tests" "$BIN/device-tests"
  strip "$BIN"/* 2>/dev/null || true
  du -ch "$BIN"/* | tail -n1
  exit 0
fi

OUTDIR=${1:-gpu-results}
mkdir -p "$OUTDIR"
for b in flowgate upload_bench device-tests; do
  [ -x "$BIN/$b" ] || { echo "missing $BIN/$b: run scripts/gpu-check.sh --build first" >&2; exit 2; }
done
start=$(date +%s)
status=0

{ command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max --format=csv,noheader; } \
  > "$OUTDIR/gpu.txt" 2>&1 || true

echo "== device tests"
if FLOWGATE_REQUIRE_GPU=1 timeout 120 "$BIN/device-tests" --test-threads 1 --nocapture \
     > "$OUTDIR/device-tests.txt" 2>&1; then tests=pass; else tests=fail; status=1; fi
tail -n 3 "$OUTDIR/device-tests.txt"

echo "== upload bandwidth"
timeout 180 "$BIN/upload_bench" --backend cuda --sizes 1,4,16,64 --reps 40 \
  > "$OUTDIR/upload.jsonl" 2> "$OUTDIR/upload.err" || status=1
cat "$OUTDIR/upload.jsonl"

echo "== end to end"
DATA=${TMPDIR:-/tmp}/flowgate-gpu-data
if [ ! -s "$DATA/images.txt" ]; then
  timeout 120 "$BIN/flowgate" gen-data --out "$DATA" --images 1500 > /dev/null
fi
: > "$OUTDIR/e2e.jsonl"
for step in 10 5; do
  timeout 120 "$BIN/upload_bench" --e2e --backend cuda --list "$DATA/images.txt" \
    --step-ms "$step" --epochs 2 >> "$OUTDIR/e2e.jsonl" 2>> "$OUTDIR/e2e.err" || status=1
done
cat "$OUTDIR/e2e.jsonl"

python3 - "$OUTDIR" "$tests" "$(( $(date +%s) - start ))" <<'PY'
import json, sys, pathlib
out, tests, secs = pathlib.Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
def lines(name):
    p = out / name
    return [json.loads(l) for l in p.read_text().splitlines() if l.strip()] if p.exists() else []
upload, e2e = lines("upload.jsonl"), lines("e2e.jsonl")
ratios = [u["direct_vs_pinned"] for u in upload if u.get("direct_vs_pinned") is not None]
summary = {
    "gpu": (out / "gpu.txt").read_text().strip() if (out / "gpu.txt").exists() else None,
    "device_tests": tests,
    "seconds": secs,
    "upload": upload,
    "uploader_vs_pinned_min": min(ratios) if ratios else None,
    "uploader_target_met": bool(ratios) and min(ratios) >= 0.85,
    "e2e": e2e,
}
(out / "summary.json").write_text(json.dumps(summary, indent=1))
print(json.dumps({k: summary[k] for k in ("device_tests", "seconds", "uploader_vs_pinned_min", "uploader_target_met")}))
PY
exit $status
