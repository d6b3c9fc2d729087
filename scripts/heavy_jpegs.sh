#!/usr/bin/env bash
# High-quality JPEGs for the image benchmarks' hard case: each image of a list (e.g. the
# generated photos of `flowgate gen-data`) rescaled so its longer side is 500-1000 px (seeded),
# given fresh sensor-like noise after the scaling (so the entropy-coded data stays as dense as a
# photo's), and written at the mjpeg encoder's best quality (-q:v 1, about libjpeg quality 97)
# with full-resolution chroma (4:4:4). Writes OUT/heavy/NNNNNN.jpg and OUT/heavy.txt.
#   scripts/heavy_jpegs.sh LIST OUT [SEED]
set -euo pipefail
list=$1 out=$2 seed=${3:-0}
mkdir -p "$out/heavy"
: > "$out/heavy.txt"
RANDOM=$seed
i=0
while read -r src; do
  [ -n "$src" ] || continue
  long=$((500 + RANDOM % 501))
  dst=$(printf '%s/heavy/%06d.jpg' "$out" "$i")
  ffmpeg -nostdin -loglevel error -y -i "$src" \
    -vf "scale='if(gt(iw,ih),$long,-2)':'if(gt(iw,ih),-2,$long)',noise=alls=6:all_seed=$i,format=yuvj444p" \
    -q:v 1 "$dst"
  realpath "$dst" >> "$out/heavy.txt"
  i=$((i + 1))
done < "$list"
echo "$i images in $out/heavy ($(du -sh "$out/heavy" | cut -f1))"
