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
#   python.jsonl      the Python path (scripts/gpu_train.py): a mixed-precision training step
#                     of a small CNN fed by ImageLoader(device="cuda") vs CPU batches and
#                     .cuda(non_blocking=True): images/s, GPU idle fraction, H2D GB/s against
#                     torch's pinned peak; and the Python device tests (python-tests.txt).
#                     Needs a python3 with CUDA-enabled torch on the GPU machine (it reaches no
#                     package registry): the wheel built by --build is installed with
#                     --no-index into a venv that sees the system's torch; skipped (and said
#                     so in summary.json) where there is none.
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
  # The Python package with the CUDA uploader (no video: the GPU machine may lack FFmpeg).
  VENV=${FLOWGATE_VENV:-$HOME/.cache/flowgate/pyvenv}
  if [ -x "$VENV/bin/pip" ]; then
    MATURIN_PEP517_ARGS="--features cuda" "$VENV/bin/pip" wheel --quiet --no-deps \
      --wheel-dir "$BIN" ./python \
      || echo "the wheel did not build: the Python path will be skipped" >&2
  fi
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

echo "== python"
: > "$OUTDIR/python.jsonl"
python=skipped
wheel=$(ls "$BIN"/flowgate-*.whl 2>/dev/null | head -n1 || true)
if [ -n "$wheel" ] && python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  PYV=${TMPDIR:-/tmp}/flowgate-gpu-venv
  python3 -m venv --system-site-packages "$PYV" \
    && "$PYV/bin/pip" install --quiet --no-index --no-deps --force-reinstall "$wheel" \
    && python=ran || status=1
  if [ "$python" = ran ]; then
    SMALL=${TMPDIR:-/tmp}/flowgate-gpu-small  # the Python tests' dataset (conftest.py)
    [ -s "$SMALL/audio.txt" ] || timeout 60 "$BIN/flowgate" gen-data --out "$SMALL" --images 40 --audio 8 > /dev/null
    FLOWGATE_REQUIRE_GPU=1 FLOWGATE_TEST_DATA=$SMALL timeout 180 "$PYV/bin/python" -m pytest -q \
      python/tests/test_device.py > "$OUTDIR/python-tests.txt" 2>&1 || { python=fail; status=1; }
    timeout 240 "$PYV/bin/python" scripts/gpu_train.py "$DATA/images.txt" \
      >> "$OUTDIR/python.jsonl" 2>> "$OUTDIR/python.err" || { python=fail; status=1; }
  fi
else
  echo '{"skipped": "no flowgate wheel in gpu-bin/ or no python3 with CUDA-enabled torch"}' >> "$OUTDIR/python.jsonl"
fi
cat "$OUTDIR/python.jsonl"

python3 - "$OUTDIR" "$tests" "$(( $(date +%s) - start ))" "$python" <<'PY'
import json, sys, pathlib
out, tests, secs = pathlib.Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
def lines(name):
    p = out / name
    return [json.loads(l) for l in p.read_text().splitlines() if l.strip()] if p.exists() else []
upload, e2e, py = lines("upload.jsonl"), lines("e2e.jsonl"), lines("python.jsonl")
ratios = [u["direct_vs_pinned"] for u in upload if u.get("direct_vs_pinned") is not None]
summary = {
    "gpu": (out / "gpu.txt").read_text().strip() if (out / "gpu.txt").exists() else None,
    "device_tests": tests,
    "seconds": secs,
    "upload": upload,
    "uploader_vs_pinned_min": min(ratios) if ratios else None,
    "uploader_target_met": bool(ratios) and min(ratios) >= 0.85,
    "e2e": e2e,
    "python": sys.argv[4],
    "python_train": py,
}
(out / "summary.json").write_text(json.dumps(summary, indent=1))
print(json.dumps({k: summary[k] for k in ("device_tests", "seconds", "uploader_vs_pinned_min", "uploader_target_met")}))
PY
exit $status
