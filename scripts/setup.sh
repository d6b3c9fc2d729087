#!/usr/bin/env bash
# Prepares a fresh machine for flowgate's commands; both README commands call it.
#   scripts/setup.sh          system libraries for the media features (Debian/Ubuntu: apt-get)
#   scripts/setup.sh --test   the same, plus the local S3 server the integration tests start
#                             (s3s-fs 0.14.1, built once per machine into
#                             ~/.cache/flowgate/tools/bin, as the test virtualenv is) and python3
#                             with venv for the Python package's tests
#   scripts/setup.sh --floors the system libraries, plus libFLAC's headers and gcc for the
#                             decode floors of scripts/floors.py
# Idempotent: what is there already is left alone.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v cargo >/dev/null 2>&1; then
  echo "flowgate needs a Rust toolchain (cargo); install it from https://rustup.rs" >&2
  exit 1
fi

# FFmpeg 5.1 (feature `video`, ffmpeg-next 9 binds it with bindgen, hence clang), libjpeg-turbo's
# headers (feature `turbojpeg`, on by default), pkg-config; the ffmpeg command writes the sample
# clips.
PKGS=(pkg-config clang libclang-dev libavcodec-dev libavformat-dev libavutil-dev libswscale-dev
      libswresample-dev libavfilter-dev libavdevice-dev libjpeg-dev ffmpeg fonts-dejavu-core)
if [ "${1:-}" = "--floors" ]; then PKGS+=(libflac-dev gcc); fi
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "flowgate's media features need: ${missing[*]} (install them with your package manager)" >&2
    exit 1
  fi
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO=sudo; fi
  echo "setup: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  if ! $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null; then
    $SUDO apt-get update -q >/dev/null
    $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
  fi
fi

# The Python package's tests (--test) need python3 with venv and pip (Debian splits them out).
if [ "${1:-}" = "--test" ] && ! python3 -c 'import venv, ensurepip' >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1; then
    SUDO=""
    if [ "$(id -u)" -ne 0 ]; then SUDO=sudo; fi
    echo "setup: installing python3-venv python3-pip"
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get install -y -q --no-install-recommends python3 python3-venv python3-pip >/dev/null \
      || { $SUDO apt-get update -q >/dev/null
           $SUDO apt-get install -y -q --no-install-recommends python3 python3-venv python3-pip >/dev/null; }
  else
    echo "the Python tests need python3 with the venv module" >&2
    exit 1
  fi
fi

TOOLS="$HOME/.cache/flowgate/tools"
if [ "${1:-}" = "--test" ] && [ ! -x "$TOOLS/bin/s3s-fs" ]; then
  echo "setup: building the local S3 server (s3s-fs 0.14.1) into $TOOLS (once per machine)"
  cargo install s3s-fs@0.14.1 --features binary --locked --root "$TOOLS" --quiet
fi
