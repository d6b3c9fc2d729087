/* The decode floor for flowgate's audio benchmark: the same clips, the same output (the first
 * SAMPLES samples, mixed to mono f32), decoded on one thread by the fastest C decoders at hand,
 * with nothing else around them (no pipeline, no batches). flowgate's CPU milliseconds per clip
 * over this program's is the share of the decode cost that is flowgate's own.
 *
 *   audio_floor libflac LIST SAMPLES   # FLAC through libFLAC (the reference decoder)
 *   audio_floor libav LIST SAMPLES     # any format through FFmpeg's libavformat + libavcodec
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
  if (argc != 4 || (strcmp(argv[1], "libflac") && strcmp(argv[1], "libav"))) {
    fprintf(stderr, "usage: audio_floor libflac|libav LIST SAMPLES\n");
    return 2;
  }
  int flac = !strcmp(argv[1], "libflac");
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
  double checksum = 0;
  double t0 = cpu_now();
  while (fgets(path, sizeof path, list)) {
    path[strcspn(path, "\r\n")] = 0;
    if (!*path) continue;
    have = 0;
    int rc = flac ? decode_libflac(dec, path) : decode_libav(path, pkt, frame);
    if (rc < 0) failed++;
    for (long i = 0; i < have; i++) checksum += out[i] < 0 ? -out[i] : out[i];
    samples += have;
    clips++;
  }
  double cpu = cpu_now() - t0;
  printf("{\"decoder\":\"%s\",\"clips\":%ld,\"failed\":%ld,\"samples\":%ld,"
         "\"cpu_seconds\":%.4f,\"cpu_ms_per_clip\":%.4f,\"checksum\":%.3f}\n",
         flac ? "libFLAC" : "libav", clips, failed, samples, cpu,
         clips ? cpu * 1e3 / clips : 0.0, checksum);
  FLAC__stream_decoder_delete(dec);
  av_packet_free(&pkt);
  av_frame_free(&frame);
  return failed ? 1 : 0;
}
