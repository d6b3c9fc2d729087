#!/usr/bin/env python3
"""Decode floors: flowgate's CPU cost per item beside the fastest C decoders of the same work,
interleaved, so that "flowgate's share" of a decode is a measured ratio.

    scripts/floors.py audio --list /tmp/ds/audio.txt [--formats flac,wav,mp3,aac] [--reps 5]
    scripts/floors.py video --list /tmp/ds/video.txt [--reps 3]
    scripts/floors.py images --list /tmp/ds/heavy.txt [--reps 5]

audio: for each format (the FLAC clips of LIST converted once with the `ffmpeg` command into
DIR/floors-FORMAT/ beside them: WAV s16, MP3 at 64 kbit/s, AAC in M4A at 64 kbit/s), each
repetition runs `bench audio --workers 1` (one decode worker: the same clips cropped or padded
to 4 s, mono f32, in batches of 32) and `tools/floors/audio_floor.c` (built here with gcc:
libFLAC for FLAC, a hand-written reader for 16-bit WAV, FFmpeg's libavcodec for every format),
which decodes the same first 64,000 samples of each clip to mono f32 on one thread with nothing
around it (CPU time of the decode calls only; process start-up is not counted for the floors,
while flowgate's figure is its whole process: start-up, pipeline, batches). Reported: CPU ms per
clip of each, and floor / flowgate (1.0: flowgate costs no more than the bare decoder).

video: `bench video --workers 1` (8 frames sampled uniformly, shorter side 128, center crop
112) beside the `ffmpeg` command getting 8 frames at the same positions (the middles of 8 equal
spans, by packet count) the plain way (one thread, decode everything, `select` the 8 frames,
scale and crop them, raw output to /dev/null),
CPU ms per clip.

images: `bench images --workers 1` (shorter side 256, center crop 224, u8 NCHW, in batches of
32) beside `tools/floors/jpeg_floor.c` (built here with gcc against libjpeg-turbo, the library
flowgate decodes JPEG with): `entropy`, the Huffman decoding of every block and nothing else
(rows skipped with `jpeg_skip_scanlines`, which decodes and drops them), the part no exact
decode can skip; and `full`, the whole image decoded to RGB at full size. CPU ms per image,
floors without process start-up, flowgate's with it.

Needs `cargo build --release -p flowgate-tools --features video --bin bench` (or $FLOWGATE_BENCH), gcc, pkg-config
and the FFmpeg and libFLAC development files (`scripts/setup.sh --floors` installs them).
Prints a Markdown table; `--json FILE` keeps every run.
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BENCH = os.environ.get("FLOWGATE_BENCH", os.path.join(ROOT, "target", "release", "bench"))
FLOOR = os.path.join(ROOT, "target", "floors", "audio_floor")
JPEG_FLOOR = os.path.join(ROOT, "target", "floors", "jpeg_floor")
ENCODE = {
    "flac": None,
    "wav": ("wav", ["-c:a", "pcm_s16le"]),
    "mp3": ("mp3", ["-c:a", "libmp3lame", "-b:a", "64k"]),
    "aac": ("m4a", ["-c:a", "aac", "-b:a", "64k"]),
}


def build_floor():
    src = os.path.join(ROOT, "tools", "floors", "audio_floor.c")
    flags = subprocess.run(
        ["pkg-config", "--cflags", "--libs", "libavformat", "libavcodec", "libavutil", "flac"],
        check=True, capture_output=True, text=True).stdout.split()
    os.makedirs(os.path.dirname(FLOOR), exist_ok=True)
    subprocess.run(["gcc", "-O2", "-o", FLOOR, src, *flags], check=True)


def build_jpeg_floor():
    src = os.path.join(ROOT, "tools", "floors", "jpeg_floor.c")
    os.makedirs(os.path.dirname(JPEG_FLOOR), exist_ok=True)
    subprocess.run(["gcc", "-O2", "-o", JPEG_FLOOR, src, "-ljpeg"], check=True)


def last_json(cmd):
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:3])} exited {p.returncode}: {p.stderr[-400:]}")
    return json.loads(next(l for l in reversed(p.stdout.splitlines()) if l.startswith("{")))


def warm(paths):
    for path in paths:
        with open(path, "rb") as f:
            f.read()


def converted(lst, fmt):
    """LIST's clips in `fmt` (converted once, kept beside them); the list file of them."""
    if ENCODE[fmt] is None:
        return lst
    ext, codec = ENCODE[fmt]
    paths = open(lst).read().split()
    out = os.path.join(os.path.dirname(os.path.dirname(paths[0])), f"floors-{fmt}")
    os.makedirs(out, exist_ok=True)
    made = []
    for p in paths:
        dst = os.path.join(out, os.path.splitext(os.path.basename(p))[0] + "." + ext)
        if not os.path.exists(dst):
            subprocess.run(["ffmpeg", "-nostdin", "-loglevel", "error", "-y", "-i", p, *codec,
                            dst], check=True)
        made.append(dst)
    new = os.path.join(out, "list.txt")
    with open(new, "w") as f:
        f.write("\n".join(made) + "\n")
    return new


def span(xs, fmt="{:.3f}"):
    return f"{fmt.format(statistics.median(xs))} ({fmt.format(min(xs))}–{fmt.format(max(xs))})"


def audio(args):
    build_floor()
    rows = {}
    for fmt in args.formats.split(","):
        lst = converted(args.list, fmt)
        warm(open(lst).read().split())
        runs = {"flowgate": [], "libav": []}
        own = {"flac": "libFLAC", "wav": "by hand"}.get(fmt)
        if own:
            runs[own] = []
        for rep in range(args.reps):
            r = last_json([BENCH, "audio", "--list", lst, "--workers", "1"])
            runs["flowgate"].append(1000 * r["cpu_seconds"] / r["items"])
            for dec in [d for d in runs if d != "flowgate"]:
                mode = {"libFLAC": "libflac", "by hand": "wav"}.get(dec, "libav")
                r = last_json([FLOOR, mode, lst, "64000"])
                runs[dec].append(r["cpu_ms_per_clip"])
            print(f"{fmt} rep {rep + 1}: " + ", ".join(f"{k} {v[-1]:.3f} ms" for k, v in
                                                       runs.items()), file=sys.stderr)
        rows[fmt] = runs
    print(f"\nCPU ms per clip ({args.reps} interleaved repetitions; median (min–max))\n")
    print("| format | flowgate, 1 worker | libFLAC / WAV by hand | libavcodec | fastest floor / flowgate |")
    print("|---|---|---|---|---|")
    for fmt, runs in rows.items():
        floor = [min(v[k] for d, v in runs.items() if d != "flowgate")
                 for k in range(args.reps)]
        share = [a / b for a, b in zip(floor, runs["flowgate"])]
        print(f"| {fmt} | {span(runs['flowgate'])} | "
              f"{next((span(v) for d, v in runs.items() if d not in ('flowgate', 'libav')), '—')} | "
              f"{span(runs['libav'])} | "
              f"**{span(share, '{:.2f}')}** |")
    return rows


def ffmpeg_frames(path, frames, resize, crop):
    """CPU seconds of the `ffmpeg` command getting `frames` uniform frames of `path`."""
    n = int(subprocess.run(["ffprobe", "-v", "error", "-count_packets", "-select_streams",
                            "v:0", "-show_entries", "stream=nb_read_packets", "-of", "csv=p=0",
                            path], check=True, capture_output=True, text=True).stdout.strip())
    picks = sorted({min(n - 1, (2 * k + 1) * n // (2 * frames)) for k in range(frames)})
    select = "+".join(f"eq(n\\,{i})" for i in picks)
    scale = f"scale='if(lt(iw,ih),{resize},-2)':'if(lt(iw,ih),-2,{resize})'"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(["ffmpeg", "-nostdin", "-loglevel", "error", "-threads", "1", "-i", path,
                    "-filter_threads", "1", "-vf", f"select={select},{scale},crop={crop}:{crop}",
                    "-vsync", "0", "-f", "rawvideo", "-pix_fmt", "rgb24", "-y", "/dev/null"],
                   check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def video(args):
    paths = open(args.list).read().split()
    warm(paths)
    runs = {"flowgate": [], "ffmpeg": []}
    for rep in range(args.reps):
        r = last_json([BENCH, "video", "--list", args.list, "--workers", "1"])
        runs["flowgate"].append(1000 * r["cpu_seconds"] / r["items"])
        cpu = sum(ffmpeg_frames(p, 8, 128, 112) for p in paths)
        runs["ffmpeg"].append(1000 * cpu / len(paths))
        print(f"video rep {rep + 1}: flowgate {runs['flowgate'][-1]:.1f} ms, "
              f"ffmpeg {runs['ffmpeg'][-1]:.1f} ms", file=sys.stderr)
    share = [a / b for a, b in zip(runs["ffmpeg"], runs["flowgate"])]
    print(f"\nCPU ms per clip, 8 frames ({args.reps} interleaved repetitions)\n")
    print("| flowgate, 1 worker | ffmpeg command (decode all, select 8) | ffmpeg / flowgate |")
    print("|---|---|---|")
    print(f"| {span(runs['flowgate'], '{:.1f}')} | {span(runs['ffmpeg'], '{:.1f}')} | "
          f"**{span(share, '{:.2f}')}** |")
    return runs


def images(args):
    build_jpeg_floor()
    warm(open(args.list).read().split())
    runs = {"flowgate": [], "entropy": [], "full": []}
    for rep in range(args.reps):
        r = last_json([BENCH, "images", "--list", args.list, "--workers", "1"])
        runs["flowgate"].append(1000 * r["cpu_seconds"] / r["items"])
        for mode in ("entropy", "full"):
            runs[mode].append(last_json([JPEG_FLOOR, mode, args.list])["cpu_ms_per_image"])
        print(f"images rep {rep + 1}: " + ", ".join(f"{k} {v[-1]:.3f} ms" for k, v in
                                                    runs.items()), file=sys.stderr)
    share = [a / b for a, b in zip(runs["entropy"], runs["flowgate"])]
    print(f"\nCPU ms per image ({args.reps} interleaved repetitions; median (min–max))\n")
    print("| flowgate, 1 worker (decode, resize, crop, batch) | libjpeg-turbo entropy decoding "
          "alone | libjpeg-turbo full decode to RGB | entropy / flowgate |")
    print("|---|---|---|---|")
    print(f"| {span(runs['flowgate'])} | {span(runs['entropy'])} | {span(runs['full'])} | "
          f"**{span(share, '{:.2f}')}** |")
    return runs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("workload", choices=["audio", "video", "images"])
    ap.add_argument("--list", required=True)
    ap.add_argument("--formats", default="flac,wav,mp3,aac")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=os.path.join(ROOT, "target", "floors.json"))
    args = ap.parse_args()
    rows = {"audio": audio, "video": video, "images": images}[args.workload](args)
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as out:
        json.dump(rows, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
