#!/usr/bin/env bash
# The test command (README, CI): unit, integration, property and doc tests of every crate (the
# library, actors, tuner, the `flowgate` command, the tools), with the optional features on (S3
# against a real local server, video through FFmpeg, the CUDA uploader's no-GPU behaviour,
# Prometheus), then the image decoder's tests again through the pure-Rust JPEG path
# (zune-jpeg; the default build uses libjpeg-turbo), then the Python package: installed with
# pip into a virtualenv and tested with pytest, with PyTorch (CPU) for the DLPack and `torchrun`
# tests. scripts/setup.sh installs what they need.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh --test
# A CI run builds once from a clean clone: incremental caches would only take disk.
if [ "${CI:-}" = true ]; then export CARGO_INCREMENTAL=0; fi
# Every optional part on: the library's S3 (with the local test server), video, CUDA (its
# no-GPU behaviour), pipeline files and the dataset generator; the command's Prometheus
# endpoint.
FEATURES=flowgate/s3,flowgate/test-util,flowgate/video,flowgate/cuda,flowgate/spec,flowgate/synth,flowgate/parquet
FEATURES=$FEATURES,flowgate-cli/s3,flowgate-cli/video,flowgate-cli/prometheus,flowgate-cli/parquet,flowgate-tools/video
cargo test --workspace --locked --features "$FEATURES" "$@"
# The image decoder's tests again, on the pure-Rust JPEG path (what a build without
# libjpeg-turbo runs), in the same build: FLOWGATE_JPEG_DECODER picks the decoder.
FLOWGATE_JPEG_DECODER=zune-jpeg cargo test --workspace --locked --features "$FEATURES" --lib \
  media::image
# Lean builds still compile: images without libjpeg-turbo, and pipeline files without media
# decoders (the cfg-gated parts agree).
cargo check --locked --lib --no-default-features --features image
cargo check --locked --lib --no-default-features --features spec
# Python: a virtualenv kept per machine (PyTorch is ~4 GB with the CUDA packages PyPI's wheel
# depends on; installed once), the package built by maturin through pip (with VideoLoader),
# pytest; multi-rank tests run under torchrun (gloo, CPU), remote decode on a local Ray
# runtime.
VENV=${FLOWGATE_PYVENV:-$HOME/.cache/flowgate/pyvenv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/pip" install --quiet --upgrade "maturin>=1.5,<2" "numpy>=1.22" "pytest>=7" "pyarrow>=15"
"$VENV/bin/python" -c "import torch" 2>/dev/null || "$VENV/bin/pip" install --quiet "torch==2.15.0"
# torchvision (its ImageFolder is what `labels="folder"` is held against; --no-deps: it
# would pull a second torch) and Pillow.
"$VENV/bin/python" -c "import torchvision" 2>/dev/null || "$VENV/bin/pip" install --quiet --no-deps "torchvision==0.29.2" "pillow>=9"
# Ray, for the remote mode's tests (python/tests/test_ray.py starts a local runtime).
"$VENV/bin/python" -c "import ray" 2>/dev/null || "$VENV/bin/pip" install --quiet "ray==2.60.0"
# The package's distribution name is flowgate-loader (PyPI's "flowgate" is another project's);
# an older build installed as "flowgate" would share its files: removed first.
"$VENV/bin/pip" uninstall --quiet --yes flowgate > /dev/null 2>&1 || true
# The package's lints, then the package built with the `pytest` profile (python/Cargo.toml:
# unoptimised but for the hot paths; a release build doubles its compile time). Building and
# checking the release wheel is scripts/wheel.sh and scripts/check-wheel.sh, not this command.
PYFEATURES=video,s3,cuda
cargo clippy --locked --manifest-path python/Cargo.toml --profile pytest --features "$PYFEATURES" \
  --quiet -- -D warnings
MATURIN_PEP517_ARGS="--profile pytest --features $PYFEATURES" "$VENV/bin/pip" install --quiet \
  --force-reinstall --no-deps ./python
# The `flowgate` command the workspace's tests built (with the test features), for the
# Python tests that run it (the sample data, a pipeline file) instead of a build of its own.
FLOWGATE_CLI="$PWD/target/debug/flowgate" "$VENV/bin/python" -m pytest -q --durations=15 python/tests
