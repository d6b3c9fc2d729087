#!/usr/bin/env bash
# The test command (README, CI): unit, integration, property and doc tests of every crate, with
# the optional media features on (S3 against a real local server, video through FFmpeg), then
# the image decoder's tests again through libjpeg-turbo. scripts/setup.sh installs what they
# need.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh --test
cargo test --workspace --locked --features flowgate/s3,flowgate/video,flowgate/prometheus,flowgate/cuda "$@"
cargo test --locked --features turbojpeg --lib media::image
