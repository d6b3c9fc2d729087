#!/usr/bin/env bash
# Checks the wheel of scripts/wheel.sh as a PyTorch user without Rust meets it: a fresh
# virtualenv (in target/, removed at the end), with cargo and rustc off PATH, `pip install` of
# the wheel (binary packages only: numpy from PyPI, nothing built from source), then:
#   - `import flowgate`, its version and build_info(); the JPEG decoder must be libjpeg-turbo;
#   - a batch of sample JPEGs decoded through flowgate.ImageLoader, its shape checked;
#   - ldd: the extension module finds libjpeg inside the wheel (flowgate_loader.libs/), not in
#     the system's library directories.
# The wheel: the one flowgate_loader-*.whl in dist/ (FLOWGATE_WHEEL_DIR=DIR to change). The
# JPEGs: FLOWGATE_WHEEL_DATA=DIR (a folder written by `flowgate gen-data`), else
# target/wheel-check-data, written by `flowgate gen-data` (cargo, before cargo leaves PATH)
# where it is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DIST=${FLOWGATE_WHEEL_DIR:-dist}
PYTHON=${PYTHON:-python3}

shopt -s nullglob
wheels=("$DIST"/flowgate_loader-*.whl)
if ((${#wheels[@]} != 1)); then
  echo "check-wheel: expected one flowgate_loader-*.whl in $DIST/, found ${#wheels[@]}" \
       "(scripts/wheel.sh builds it)" >&2
  exit 1
fi
WHEEL=$(cd "$(dirname "${wheels[0]}")" && pwd)/$(basename "${wheels[0]}")
echo "check-wheel: $(basename "$WHEEL") ($(du -h "$WHEEL" | cut -f1))"
case $(basename "$WHEEL") in
  *-abi3-manylinux_*) ;;
  *) echo "check-wheel: not an abi3 manylinux wheel" >&2; exit 1 ;;
esac

DATA=${FLOWGATE_WHEEL_DATA:-target/wheel-check-data}
if [ ! -s "$DATA/images.txt" ]; then
  echo "check-wheel: writing sample JPEGs into $DATA (flowgate gen-data)"
  cargo run --quiet --locked -p flowgate-cli --bin flowgate -- gen-data --out "$DATA" --images 12
fi
DATA=$(cd "$DATA" && pwd)

# PATH without Rust: no ~/.cargo/bin ($CARGO_HOME/bin), no rustup toolchains.
CLEAN_PATH=$(printf '%s' "$PATH" | tr ':' '\n' \
  | grep -v -e '/\.cargo/bin' -e '/\.rustup/' ${CARGO_HOME:+-e "^$CARGO_HOME/bin"} \
  | grep -v '^$' | paste -sd: -)
if PATH=$CLEAN_PATH command -v cargo >/dev/null || PATH=$CLEAN_PATH command -v rustc >/dev/null; then
  echo "check-wheel: cargo or rustc is still on PATH without ~/.cargo/bin: $CLEAN_PATH" >&2
  exit 1
fi

mkdir -p target
VENV=$(mktemp -d "$ROOT/target/wheel-check.XXXXXX")
trap 'rm -rf "$VENV"' EXIT
# Out of the repository, so that nothing of python/ can shadow the installed package.
cd "$VENV"
run() { env -u PYTHONPATH -u CARGO_HOME -u RUSTUP_HOME -u VIRTUAL_ENV PATH="$VENV/bin:$CLEAN_PATH" "$@"; }
run "$PYTHON" -m venv "$VENV"
run pip install --quiet --disable-pip-version-check --only-binary :all: "$WHEEL"
run pip list --disable-pip-version-check 2>/dev/null | grep -i -e '^flowgate' -e '^numpy'

SO=$(run python -c 'import flowgate._native as m; print(m.__file__)')
echo "check-wheel: ldd $(basename "$SO"):"
ldd "$SO" | sed 's/^/  /'
if ldd "$SO" | grep -q 'not found'; then
  echo "check-wheel: the extension module has libraries it cannot find" >&2
  exit 1
fi
JPEG_LIB=$(ldd "$SO" | awk '/libjpeg/ { print $3 }')
JPEG_LIB=$(readlink -f "$JPEG_LIB")  # .../site-packages/flowgate/../flowgate_loader.libs/...
case $JPEG_LIB in
  "$VENV"/lib/python*/site-packages/flowgate_loader.libs/libjpeg*) ;;
  *) echo "check-wheel: libjpeg resolves to '${JPEG_LIB}', not inside the wheel" >&2; exit 1 ;;
esac
echo "check-wheel: libjpeg from the wheel: ${JPEG_LIB#"$VENV"/}"

run python - "$DATA/images.txt" <<'EOF'
import shutil
import sys

import numpy as np

import flowgate

assert shutil.which("cargo") is None and shutil.which("rustc") is None, "Rust on PATH"
print("no cargo or rustc on PATH; flowgate from", flowgate.__file__)
info = flowgate.build_info()
print(flowgate.__version__, info)
assert info["version"] == flowgate.__version__, info
assert info["jpeg"] == "libjpeg-turbo", f"JPEG decodes with {info['jpeg']}, not libjpeg-turbo"
assert "image" in info["features"], info
# The libjpeg this process has loaded: the wheel's copy.
maps = {line.split()[-1] for line in open("/proc/self/maps") if "libjpeg" in line}
assert maps and all("/flowgate_loader.libs/" in m for m in maps), maps

paths = open(sys.argv[1]).read().split()[:8]
loader = flowgate.ImageLoader(paths, batch_size=4, resize=64, crop=56, shuffle=False)
batches = [np.asarray(b) for b in loader]
shapes = [b.shape for b in batches]
print("batches:", shapes, batches[0].dtype)
assert shapes == [(4, 3, 56, 56), (4, 3, 56, 56)], shapes
assert batches[0].dtype == np.uint8
assert all(b.std() > 0 for b in batches), "blank images"
print("check-wheel: OK")
EOF
