#!/usr/bin/env bash
# The H.264 clips of the video benchmarks (docs/performance.md): N clips (default 120) of
# 480x360 at 25 fps, 4-8 s long (by index), GOP 50 with x264's default 2 B-frames (pyramid),
# one encoder thread, from FFmpeg's moving `testsrc2` pattern; with --noise, fresh temporal
# noise and a hue shift per clip (denser frames, more like camera footage). Writes
# OUT/cNNN.mp4 and OUT/video.txt, so that sessions compare loaders on the same clips.
#   scripts/bench_clips.sh OUT [N] [--noise]
set -euo pipefail
out=$1 n=${2:-120} noise=${3:-}
mkdir -p "$out"
: > "$out/video.txt"
for i in $(seq 0 $((n - 1))); do
  d=$((4 + i % 5))
  vf=null
  [ "$noise" = --noise ] && vf="noise=alls=4:allf=t+u:all_seed=$i,hue=h=$((i * 3))"
  dst=$(printf '%s/c%03d.mp4' "$out" "$i")
  ffmpeg -nostdin -loglevel error -y -f lavfi -i "testsrc2=size=480x360:rate=25:duration=$d" \
    -vf "$vf" -c:v libx264 -g 50 -bf 2 -pix_fmt yuv420p -threads 1 "$dst"
  realpath "$dst" >> "$out/video.txt"
done
echo "$n clips in $out ($(du -sh "$out" | cut -f1))"
