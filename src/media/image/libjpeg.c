/* Region decoding with libjpeg-turbo's libjpeg API, for flowgate's image decoder (feature
 * `turbojpeg`). Only the rows and iMCU columns a crop needs are decoded: rows above the window
 * are skipped (entropy-decoded but not transformed), columns outside it are neither
 * transformed nor colour-converted, and rows below it are never read. libjpeg reports fatal
 * errors through a callback that must not return, so every entry point sets a jump buffer
 * here, in C, and Rust only ever sees return codes. Where the output is much smaller than the
 * crop window, the image can be decoded at 1/2, 1/4 or 1/8 scale by libjpeg's reduced-size
 * inverse DCTs (draft mode, as Pillow's `Image.draft`). Built by build.rs with the `cc` crate. */

#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jpeglib.h>
#include <jerror.h>

typedef struct {
  struct jpeg_error_mgr pub;
  jmp_buf jump;
  char message[JMSG_LENGTH_MAX];
  int warning; /* the first warning that means damaged data, 0 if none */
} fg_error;

typedef struct {
  struct jpeg_decompress_struct cinfo;
  fg_error err;
  int started; /* between a header and the end of a decode */
} fg_jpeg;

static void fg_error_exit(j_common_ptr cinfo) {
  fg_error *err = (fg_error *)cinfo->err;
  (*cinfo->err->format_message)(cinfo, err->message);
  longjmp(err->jump, 1);
}

/* Warnings: "extraneous bytes before marker" is harmless (Pillow and PyTorch load such files);
 * every other warning means the pixels are not the image (a bad Huffman code, a premature end
 * of data), so the first one is kept and the decode fails. */
static void fg_emit_message(j_common_ptr cinfo, int level) {
  fg_error *err = (fg_error *)cinfo->err;
  if (level >= 0) return;
  cinfo->err->num_warnings++;
  if (err->warning == 0 && cinfo->err->msg_code != JWRN_EXTRANEOUS_DATA) {
    err->warning = cinfo->err->msg_code;
    (*cinfo->err->format_message)(cinfo, err->message);
  }
}

/* Ends the current decode, if any; keeps the message of the last failure. */
static void fg_reset(fg_jpeg *d) {
  if (d->started) jpeg_abort_decompress(&d->cinfo);
  d->started = 0;
  d->err.warning = 0;
}

fg_jpeg *fg_jpeg_new(void) {
  fg_jpeg *d = calloc(1, sizeof(fg_jpeg));
  if (!d) return NULL;
  d->cinfo.err = jpeg_std_error(&d->err.pub);
  d->err.pub.error_exit = fg_error_exit;
  d->err.pub.emit_message = fg_emit_message;
  if (setjmp(d->err.jump)) {
    free(d);
    return NULL;
  }
  jpeg_create_decompress(&d->cinfo);
  return d;
}

void fg_jpeg_free(fg_jpeg *d) {
  if (!d) return;
  jpeg_destroy_decompress(&d->cinfo);
  free(d);
}

/* Ends a decode whose header was read, without decoding. */
void fg_jpeg_abort(fg_jpeg *d) { fg_reset(d); }

const char *fg_jpeg_message(const fg_jpeg *d) { return d->err.message; }

/* Return codes. */
#define FG_OK 0
#define FG_ERROR 1       /* libjpeg failed: fg_jpeg_message says why */
#define FG_UNSUPPORTED 2 /* CMYK/YCCK: the caller decodes another way */

/* Reads the header of `len` bytes at `data` (which must stay valid until the decode ends) and
 * prepares RGB output: the image's size in `*width`, `*height`. */
int fg_jpeg_header(fg_jpeg *d, const unsigned char *data, unsigned long len,
                   unsigned *width, unsigned *height) {
  fg_reset(d);
  d->err.message[0] = 0;
  if (setjmp(d->err.jump)) {
    fg_reset(d);
    return FG_ERROR;
  }
  jpeg_mem_src(&d->cinfo, data, len);
  d->started = 1;
  jpeg_read_header(&d->cinfo, TRUE);
  if (d->cinfo.jpeg_color_space == JCS_CMYK || d->cinfo.jpeg_color_space == JCS_YCCK) {
    fg_reset(d);
    return FG_UNSUPPORTED;
  }
  d->cinfo.out_color_space = JCS_RGB;
  *width = d->cinfo.image_width;
  *height = d->cinfo.image_height;
  return FG_OK;
}

/* Decodes rows [y0, y1) and at least columns [x0, x1) of the image whose header was read,
 * scaled by 1/`denom` in the DCT domain (1, 2, 4 or 8; coordinates are of the scaled image,
 * ceil(width / denom) wide), as interleaved RGB rows of `*out_w` pixels starting at column
 * `*out_x` (the window widened to iMCU boundaries), into `out` (`cap` bytes). */
int fg_jpeg_decode(fg_jpeg *d, unsigned denom, unsigned x0, unsigned y0, unsigned x1,
                   unsigned y1, unsigned char *out, size_t cap, unsigned *out_x,
                   unsigned *out_w) {
  if (setjmp(d->err.jump)) {
    fg_reset(d);
    return FG_ERROR;
  }
  j_decompress_ptr c = &d->cinfo;
  c->scale_num = 1;
  c->scale_denom = denom;
  jpeg_start_decompress(c);
  if (x1 > c->output_width) x1 = c->output_width;
  if (y1 > c->output_height) y1 = c->output_height;
  if (x0 >= x1 || y0 >= y1) {
    strcpy(d->err.message, "empty decode window");
    fg_reset(d);
    return FG_ERROR;
  }
  JDIMENSION xoff = x0, w = x1 - x0;
  if (xoff > 0 || w < c->output_width) jpeg_crop_scanline(c, &xoff, &w);
  size_t pitch = (size_t)c->output_width * 3; /* output_width is now the cropped width */
  if (pitch * (y1 - y0) > cap) {
    strcpy(d->err.message, "decode buffer too small");
    fg_reset(d);
    return FG_ERROR;
  }
  if (y0 > 0) jpeg_skip_scanlines(c, y0);
  while (c->output_scanline < y1) {
    JSAMPROW row = out + pitch * (c->output_scanline - y0);
    jpeg_read_scanlines(c, &row, 1);
    if (d->err.warning) break;
  }
  *out_x = xoff;
  *out_w = c->output_width;
  int warned = d->err.warning != 0;
  if (y1 == c->output_height && !warned) {
    jpeg_finish_decompress(c);
    d->started = 0;
    warned = d->err.warning != 0;
  }
  fg_reset(d);
  return warned ? FG_ERROR : FG_OK;
}
