/* The decode floor for flowgate's image benchmark: the same JPEGs decoded by libjpeg-turbo (the
 * library flowgate's JPEG path calls) on one thread, with nothing around it (no pipeline, no
 * resize, no batches). Files are read into memory before the clock starts.
 *
 *   jpeg_floor entropy LIST   # entropy decoding alone: every row but the last skipped with
 *                             # jpeg_skip_scanlines (which decodes the Huffman data and drops
 *                             # it, no IDCT, no colour conversion), the last row decoded: the
 *                             # part of any exact decode that no crop or scale choice skips
 *   jpeg_floor full LIST      # the whole image to RGB at full size (libjpeg's defaults)
 *
 * LIST holds one path per line. Prints one JSON line: images, CPU seconds, CPU ms per image,
 * and a checksum of what was decoded (so the work cannot be skipped). Built by
 * scripts/floors.py. */

#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <jpeglib.h>

static double cpu_now(void) {
  struct timespec t;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return t.tv_sec + t.tv_nsec / 1e9;
}

struct err {
  struct jpeg_error_mgr pub;
  jmp_buf jump;
};

static void on_error(j_common_ptr c) { longjmp(((struct err *)c->err)->jump, 1); }
static void quiet(j_common_ptr c, int level) { (void)c, (void)level; }

static unsigned char *slurp(const char *path, unsigned long *len) {
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  fseek(f, 0, SEEK_END);
  *len = (unsigned long)ftell(f);
  fseek(f, 0, SEEK_SET);
  unsigned char *b = malloc(*len);
  if (b && fread(b, 1, *len, f) != *len) {
    free(b);
    b = NULL;
  }
  fclose(f);
  return b;
}

int main(int argc, char **argv) {
  if (argc != 3 || (strcmp(argv[1], "entropy") && strcmp(argv[1], "full"))) {
    fprintf(stderr, "usage: jpeg_floor entropy|full LIST\n");
    return 2;
  }
  int entropy = !strcmp(argv[1], "entropy");
  FILE *list = fopen(argv[2], "r");
  if (!list) {
    perror(argv[2]);
    return 1;
  }
  /* Every file in memory first: the clock covers decoding only. */
  size_t n = 0, cap = 1024;
  unsigned char **data = malloc(cap * sizeof *data);
  unsigned long *lens = malloc(cap * sizeof *lens);
  char line[4096];
  while (fgets(line, sizeof line, list)) {
    line[strcspn(line, "\r\n")] = 0;
    if (!line[0]) continue;
    if (n == cap) {
      cap *= 2;
      data = realloc(data, cap * sizeof *data);
      lens = realloc(lens, cap * sizeof *lens);
    }
    if (!(data[n] = slurp(line, &lens[n]))) {
      fprintf(stderr, "cannot read %s\n", line);
      return 1;
    }
    n++;
  }
  fclose(list);

  struct jpeg_decompress_struct c;
  struct err e;
  c.err = jpeg_std_error(&e.pub);
  e.pub.error_exit = on_error;
  e.pub.emit_message = quiet;
  jpeg_create_decompress(&c);
  unsigned long long sum = 0;
  unsigned char *row = NULL;
  size_t row_cap = 0;
  double t0 = cpu_now();
  for (size_t i = 0; i < n; i++) {
    if (setjmp(e.jump)) {
      jpeg_abort_decompress(&c);
      fprintf(stderr, "image %zu failed\n", i);
      return 1;
    }
    jpeg_mem_src(&c, data[i], lens[i]);
    jpeg_read_header(&c, TRUE);
    c.out_color_space = JCS_RGB;
    jpeg_start_decompress(&c);
    size_t pitch = (size_t)c.output_width * 3;
    if (pitch > row_cap) row = realloc(row, row_cap = pitch);
    if (entropy && c.output_height > 1) jpeg_skip_scanlines(&c, c.output_height - 1);
    while (c.output_scanline < c.output_height) {
      jpeg_read_scanlines(&c, &row, 1);
      sum += row[pitch / 2];
    }
    jpeg_finish_decompress(&c);
  }
  double cpu = cpu_now() - t0;
  jpeg_destroy_decompress(&c);
  printf("{\"mode\":\"%s\",\"images\":%zu,\"cpu_seconds\":%.4f,\"cpu_ms_per_image\":%.4f,"
         "\"checksum\":%llu}\n",
         argv[1], n, cpu, n ? 1000 * cpu / n : 0.0, sum);
  return 0;
}
