/* The decode floor for flowgate's audio benchmark: the same clips, the same output (the first
 * SAMPLES samples, mixed to mono f32), decoded on one thread by the fastest C decoders at hand,
 * with nothing else around them (no pipeline, no batches). flowgate's CPU milliseconds per clip
 * over this program's is the share of the decode cost that is flowgate's own.
 *
 *   audio_floor libflac LIST SAMPLES   # FLAC through libFLAC (the reference decoder)
 *   audio_floor libav LIST SAMPLES     # any format through FFmpeg's libavformat + libavcodec
 *   audio_floor wav LIST SAMPLES       # 16-bit PCM WAV by hand: read, find the chunks, convert
 *
 * LIST holds one path per line. Prints one JSON line: clips, samples decoded, CPU seconds,
 * CPU ms per clip, and a checksum of the output (so the work cannot be skipped and two
 * decoders' outputs can be compared). Built by scripts/floors.sh. */

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <FLAC/stream_decoder.h>
#include <libavcodec/avcodec.h>
#include <libavformat/avformat.h>
#include <libavutil/samplefmt.h>

static float *out;      /* the clip being decoded: mono f32 */
static long want, have; /* samples asked for, samples so far */

static double cpu_now(void) {
  struct timespec t;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return t.tv_sec + t.tv_nsec / 1e9;
}

/* ---- libFLAC ---- */

static FLAC__StreamDecoderWriteStatus flac_write(const FLAC__StreamDecoder *d,
                                                 const FLAC__Frame *frame,
                                                 const FLAC__int32 *const buffer[], void *ctx) {
  (void)d;
  (void)ctx;
  unsigned ch = frame->header.channels, n = frame->header.blocksize;
  float scale = 1.0f / ((float)(1u << (frame->header.bits_per_sample - 1)) * (float)ch);
  for (unsigned i = 0; i < n && have < want; i++, have++) {
    FLAC__int32 s = 0;
    for (unsigned c = 0; c < ch; c++) s += buffer[c][i];
    out[have] = (float)s * scale;
  }
  return have < want ? FLAC__STREAM_DECODER_WRITE_STATUS_CONTINUE
                     : FLAC__STREAM_DECODER_WRITE_STATUS_ABORT;
}

static void flac_error(const FLAC__StreamDecoder *d, FLAC__StreamDecoderErrorStatus status,
                       void *ctx) {
  (void)d;
  (void)ctx;
  fprintf(stderr, "libFLAC: %s\n", FLAC__StreamDecoderErrorStatusString[status]);
}

static int decode_libflac(FLAC__StreamDecoder *dec, const char *path) {
  if (FLAC__stream_decoder_init_file(dec, path, flac_write, NULL, flac_error, NULL) !=
      FLAC__STREAM_DECODER_INIT_STATUS_OK)
    return -1;
  FLAC__stream_decoder_process_until_end_of_stream(dec);
  FLAC__stream_decoder_finish(dec);
  return 0;
}

/* ---- WAV by hand: the least any WAV reader can do ---- */

static unsigned le16(const unsigned char *p) { return p[0] | p[1] << 8; }
static unsigned long le32(const unsigned char *p) {
  return p[0] | p[1] << 8 | p[2] << 16 | (unsigned long)p[3] << 24;
}

static int decode_wav(const char *path, unsigned char **buf, size_t *cap) {
  FILE *f = fopen(path, "rb");
  if (!f) return -1;
  /* Only the header and the samples asked for are read (as a decoder that stops early). */
  size_t need = 4096 + (size_t)want * 2 * 2; /* up to stereo */
  if (*cap < need) {
    *buf = realloc(*buf, need);
    *cap = need;
  }
  size_t n = fread(*buf, 1, need, f);
  fclose(f);
  const unsigned char *b = *buf;
  if (n < 12 || memcmp(b, "RIFF", 4) || memcmp(b + 8, "WAVE", 4)) return -1;
  unsigned ch = 1, bits = 16;
  for (size_t at = 12; at + 8 <= n;) {
    unsigned long len = le32(b + at + 4);
    if (!memcmp(b + at, "fmt ", 4) && at + 24 <= n) {
      ch = le16(b + at + 10);
      bits = le16(b + at + 22);
    } else if (!memcmp(b + at, "data", 4)) {
      if (bits != 16 || ch == 0) return -1;
      const unsigned char *d = b + at + 8;
      size_t frames = (n - (at + 8)) / (2 * ch);
      if (len / (2 * ch) < frames) frames = len / (2 * ch);
      float scale = 1.0f / (32768.0f * ch);
      for (size_t i = 0; i < frames && have < want; i++, have++) {
        int s = 0;
        for (unsigned c = 0; c < ch; c++) s += (int16_t)le16(d + 2 * (i * ch + c));
        out[have] = s * scale;
      }
      return 0;
    }
    at += 8 + len + (len & 1);
  }
  return -1;
}

/* ---- libavformat + libavcodec ---- */

static void mix_frame(const AVFrame *f) {
  int ch = f->ch_layout.nb_channels, n = f->nb_samples;
  enum AVSampleFormat fmt = f->format;
  int planar = av_sample_fmt_is_planar(fmt);
  enum AVSampleFormat packed = av_get_packed_sample_fmt(fmt);
  for (int i = 0; i < n && have < want; i++, have++) {
    float s = 0;
    for (int c = 0; c < ch; c++) {
      const uint8_t *base = planar ? f->extended_data[c] : f->extended_data[0];
      int k = planar ? i : i * ch + c;
      switch (packed) {
        case AV_SAMPLE_FMT_S16: s += ((const int16_t *)base)[k] / 32768.0f; break;
        case AV_SAMPLE_FMT_S32: s += ((const int32_t *)base)[k] / 2147483648.0f; break;
        case AV_SAMPLE_FMT_FLT: s += ((const float *)base)[k]; break;
        case AV_SAMPLE_FMT_DBL: s += (float)((const double *)base)[k]; break;
        case AV_SAMPLE_FMT_U8: s += (((const uint8_t *)base)[k] - 128) / 128.0f; break;
        default: break;
      }
    }
    out[have] = s / ch;
  }
}

static int decode_libav(const char *path, AVPacket *pkt, AVFrame *frame) {
  AVFormatContext *fmt = NULL;
  if (avformat_open_input(&fmt, path, NULL, NULL) < 0) return -1;
  /* No avformat_find_stream_info: these containers' headers give the codec parameters, and
   * probing would decode ahead. */
  int si = -1;
  for (unsigned i = 0; i < fmt->nb_streams && si < 0; i++)
    if (fmt->streams[i]->codecpar->codec_type == AVMEDIA_TYPE_AUDIO) si = (int)i;
  if (si < 0) {
    avformat_close_input(&fmt);
    return -1;
  }
  const AVCodec *codec = avcodec_find_decoder(fmt->streams[si]->codecpar->codec_id);
  AVCodecContext *cx = avcodec_alloc_context3(codec);
  avcodec_parameters_to_context(cx, fmt->streams[si]->codecpar);
  cx->thread_count = 1;
  if (avcodec_open2(cx, codec, NULL) < 0) {
    avcodec_free_context(&cx);
    avformat_close_input(&fmt);
    return -1;
  }
  while (have < want && av_read_frame(fmt, pkt) >= 0) {
    if (pkt->stream_index == si && avcodec_send_packet(cx, pkt) >= 0)
      while (have < want && avcodec_receive_frame(cx, frame) >= 0) mix_frame(frame);
    av_packet_unref(pkt);
  }
  avcodec_free_context(&cx);
  avformat_close_input(&fmt);
  return 0;
}

int main(int argc, char **argv) {
  if (argc != 4 ||
      (strcmp(argv[1], "libflac") && strcmp(argv[1], "libav") && strcmp(argv[1], "wav"))) {
    fprintf(stderr, "usage: audio_floor libflac|libav|wav LIST SAMPLES\n");
    return 2;
  }
  int flac = !strcmp(argv[1], "libflac"), wav = !strcmp(argv[1], "wav");
  unsigned char *wbuf = NULL;
  size_t wcap = 0;
  want = atol(argv[3]);
  out = calloc(want, sizeof(float));
  FILE *list = fopen(argv[2], "r");
  if (!list || !out) {
    perror(argv[2]);
    return 1;
  }
  FLAC__StreamDecoder *dec = FLAC__stream_decoder_new();
  FLAC__stream_decoder_set_md5_checking(dec, false);
  AVPacket *pkt = av_packet_alloc();
  AVFrame *frame = av_frame_alloc();
  char path[4096];
  long clips = 0, failed = 0, samples = 0;
  double checksum = 0, cpu = 0;
  while (fgets(path, sizeof path, list)) {
    path[strcspn(path, "\r\n")] = 0;
    if (!*path) continue;
    have = 0;
    double t0 = cpu_now();
    int rc = flac  ? decode_libflac(dec, path)
             : wav ? decode_wav(path, &wbuf, &wcap)
                   : decode_libav(path, pkt, frame);
    cpu += cpu_now() - t0; /* the checksum below is not the decoder's work */
    if (rc < 0) failed++;
    for (long i = 0; i < have; i++) checksum += out[i] < 0 ? -out[i] : out[i];
    samples += have;
    clips++;
  }
  printf("{\"decoder\":\"%s\",\"clips\":%ld,\"failed\":%ld,\"samples\":%ld,"
         "\"cpu_seconds\":%.4f,\"cpu_ms_per_clip\":%.4f,\"checksum\":%.3f}\n",
         flac ? "libFLAC" : wav ? "wav" : "libav", clips, failed, samples, cpu,
         clips ? cpu * 1e3 / clips : 0.0, checksum);
  free(wbuf);
  FLAC__stream_decoder_delete(dec);
  av_packet_free(&pkt);
  av_frame_free(&frame);
  return failed ? 1 : 0;
}
