// Decodes only the region of a JPEG that a crop needs and writes the crop, resized and optionally flipped,
// as uint8 HWC straight into a caller's buffer (one image of a batch): one call per image, the GIL released.
//
// Why: decoding the whole image caps a core's throughput, and a training crop covers 5-100 % of the image
// (and is resized down, often by 2x or more). libjpeg-turbo can decode less: jpeg_crop_scanline restricts
// the IDCT and colour conversion to a column range (widened to iMCU boundaries), jpeg_skip_scanlines skips
// rows above the region without their IDCT, and decoding stops after the last row the resize reads
// (jpeg_abort_decompress). Where the crop is at least 2x (4x) the output in both dimensions the DCT itself
// scales by 1/2 (1/4): the SIMD scaled IDCTs, a quarter (a sixteenth) of the pixels to convert and resize.
// None of TorchCodec, simplejpeg or Pillow decodes a region; PyTurboJPEG's crop needs libturbojpeg 3.
//
// The resize is PIL's (and torchvision's uint8 antialias=True): the triangle filter widened by the downscale
// factor, separable, weights in fixed point (14 bits) normalised per output pixel, uint8 between the passes.
// The filter reads only pixels of the box (rounded outwards to whole pixels): for an integer box that is
// torchvision's crop-then-resize (training's random resized crop). With read_around it reads the pixels
// around the box too, as resizing the whole image then cropping does (evaluation's resize + centre crop).
// The vertical pass runs first, over whole rows, so that the horizontal pass, which gathers, runs on the
// output's rows only; libjpeg writes RGB (3 bytes a pixel, as little to write and to read as can be), and the
// horizontal pass spreads each pixel over a 32-bit lane as it loads it; each pass multiplies two taps at a time
// (pmaddwd). The flip costs nothing: the horizontal pass takes its outputs' weights in reverse.
//
// Errors: libjpeg's error_exit longjmps back into the guarded step that called it (each guarded step is a
// function holding no object with a destructor) and is thrown as JpegError from there. Its warnings
// ("premature end of data segment", "corrupt JPEG data") are errors too: the loader then gives the file to
// its general decoder, which decides as it does for every other image. A file that does not end with the
// EOI marker may be truncated after the region: it is decoded to its end (entropy decoding only for the rows
// past the region) so that truncation is reported wherever it is.
//
// The entry points at the end have a plain C ABI (cnns/kernels/jpeg.py loads them with ctypes, which releases
// the GIL for each call): each returns a status that names the exception to raise, with its message.

#include <cstddef>  // jpeglib.h uses size_t and FILE without including their headers
#include <cstdio>

#include <jpeglib.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csetjmp>
#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#ifndef JCS_EXTENSIONS
#error "libjpeg-turbo's jpeglib.h is needed (JCS_EXT_RGB)"
#endif

namespace {

class JpegError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class UnsupportedJpeg : public JpegError {
 public:
  using JpegError::JpegError;
};

// A header declaring more pixels than the caller allows (its message: "height width").
class TooManyPixels : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Fixed-point weights of 14 bits (PIL has 22 in int32): a weight (at most 1) fits an int16, so two taps take
// one multiply-add (pmaddwd); rounding 14-bit weights moves a result by at most taps * 2^-15 * 255, < 0.05.
constexpr int kBits = 14;
constexpr int kChannels = 3;  // libjpeg writes RGB; the horizontal pass widens a pixel to a 32-bit lane
constexpr int kMargin = 2;

struct ErrorManager {
  jpeg_error_mgr pub;
  std::jmp_buf jump;
  char message[JMSG_LENGTH_MAX];
};

void fail(j_common_ptr cinfo) {
  auto* errors = reinterpret_cast<ErrorManager*>(cinfo->err);
  (*cinfo->err->format_message)(cinfo, errors->message);
  std::longjmp(errors->jump, 1);
}

void on_message(j_common_ptr cinfo, int level) {
  if (level < 0) fail(cinfo);  // a warning: corrupt or truncated data
}

struct Decoder {
  jpeg_decompress_struct cinfo;
  ErrorManager errors;
  bool created = false;

  Decoder() {
    cinfo.err = jpeg_std_error(&errors.pub);
    errors.pub.error_exit = fail;
    errors.pub.emit_message = on_message;
    errors.message[0] = '\0';
  }
  ~Decoder() {
    if (created) jpeg_destroy_decompress(&cinfo);
  }
  Decoder(const Decoder&) = delete;
  Decoder& operator=(const Decoder&) = delete;

  [[noreturn]] void raise() const { throw JpegError(std::string("cannot decode JPEG: ") + errors.message); }
};

// ---- guarded steps: each returns false where libjpeg reported an error (the message is in errors) ----

// The decompressor is made once per thread and kept (see `thread_decoder`): each image first ends whatever
// the last one left (jpeg_abort_decompress: the image's memory pool freed, the state back to the start; also
// after an error), as libjpeg allows for reusing an object.
bool guarded_read_header(Decoder& d, const uint8_t* data, size_t size) {
  if (setjmp(d.errors.jump)) return false;
  if (d.created) {
    jpeg_abort_decompress(&d.cinfo);
  } else {
    jpeg_create_decompress(&d.cinfo);
    d.created = true;
  }
  jpeg_mem_src(&d.cinfo, data, static_cast<unsigned long>(size));
  jpeg_read_header(&d.cinfo, TRUE);
  return true;
}

// Starts decompression at scale 1/denom (scaled_width: the whole scaled width), cropped to the columns
// [*xoffset, *xoffset + *width), which libjpeg widens to iMCU boundaries.
bool guarded_start(Decoder& d, unsigned denom, JDIMENSION* scaled_width, JDIMENSION* xoffset, JDIMENSION* width) {
  if (setjmp(d.errors.jump)) return false;
  d.cinfo.scale_num = 1;
  d.cinfo.scale_denom = denom;
  d.cinfo.out_color_space = JCS_EXT_RGB;  // grayscale and YCbCr alike
  jpeg_start_decompress(&d.cinfo);
  *scaled_width = d.cinfo.output_width;
  if (*width < d.cinfo.output_width) {
    jpeg_crop_scanline(&d.cinfo, xoffset, width);
  } else {
    *xoffset = 0;
    *width = d.cinfo.output_width;
  }
  return true;
}

// Rows [first, first + count) of the (scaled, cropped) output into rows[0 .. count); then either stops
// (jpeg_abort_decompress) or, with to_end, reads on to the end of the data so that a truncation is seen.
bool guarded_read_rows(Decoder& d, JDIMENSION first, JDIMENSION count, JSAMPROW* rows, JSAMPROW scratch,
                       bool to_end) {
  if (setjmp(d.errors.jump)) return false;
  if (first > 0 && jpeg_skip_scanlines(&d.cinfo, first) != first) {
    std::snprintf(d.errors.message, sizeof d.errors.message, "could not skip to row %u", first);
    return false;
  }
  for (JDIMENSION done = 0; done < count;) {
    const JDIMENSION got = jpeg_read_scanlines(&d.cinfo, rows + done, count - done);
    if (got == 0) {
      std::snprintf(d.errors.message, sizeof d.errors.message, "no rows after row %u", first + done);
      return false;
    }
    done += got;
  }
  if (!to_end) {
    jpeg_abort_decompress(&d.cinfo);
    return true;
  }
  // Skipping to the very last row would skip without decoding: skip to the row before it, read it.
  const JDIMENSION remaining = d.cinfo.output_height - d.cinfo.output_scanline;
  if (remaining > 1) jpeg_skip_scanlines(&d.cinfo, remaining - 1);
  while (d.cinfo.output_scanline < d.cinfo.output_height) jpeg_read_scanlines(&d.cinfo, &scratch, 1);
  jpeg_finish_decompress(&d.cinfo);
  return true;
}

// ---- the resize's weights ----

// One axis: output i reads source pixels start[i] .. start[i] + count[i] with weights[i * width ..].
struct Taps {
  std::vector<int32_t> start, count, weights;
  int width = 0;
  int lo = 0, hi = 0;  // all outputs together read [lo, hi)
};

// PIL's precompute_coeffs for the source interval [in0, in1) resized to out_size pixels, reading only source
// pixels in [bound0, bound1).
Taps make_taps(double in0, double in1, int bound0, int bound1, int out_size, int bits) {
  Taps t;
  const double scale = (in1 - in0) / out_size;
  const double filterscale = std::max(scale, 1.0);
  const double support = filterscale;  // the triangle's support (1) widened by the downscale factor
  t.width = static_cast<int>(std::ceil(support)) * 2 + 2;  // enough for any output; trimmed below
  t.start.resize(out_size);
  t.count.resize(out_size);
  t.weights.assign(static_cast<size_t>(out_size) * t.width, 0);
  std::vector<double> k(t.width);
  t.lo = bound1;
  t.hi = bound0;
  for (int i = 0; i < out_size; ++i) {
    const double center = in0 + (i + 0.5) * scale;
    const int xmin = std::max(static_cast<int>(std::floor(center - support + 0.5)), bound0);
    const int xmax = std::min(static_cast<int>(std::floor(center + support + 0.5)), bound1);
    int n = std::min(std::max(xmax - xmin, 0), t.width);
    double total = 0;
    for (int x = 0; x < n; ++x) {
      const double w = std::max(0.0, 1.0 - std::abs((x + xmin - center + 0.5) / filterscale));
      k[x] = w;
      total += w;
    }
    int first = xmin;
    if (total <= 0) {  // cannot happen for a box inside the image; the nearest pixel then
      first = std::min(std::max(static_cast<int>(std::floor(center)), bound0), bound1 - 1);
      n = 1;
      k[0] = total = 1;
    }
    t.start[i] = first;
    t.count[i] = n;
    for (int x = 0; x < n; ++x) {
      t.weights[static_cast<size_t>(i) * t.width + x] =
          static_cast<int32_t>(std::lround(k[x] / total * (1 << bits)));
    }
    t.lo = std::min(t.lo, first);
    t.hi = std::max(t.hi, first + n);
  }
  // Keep only as many taps per output as the widest needs, rounded up to a pair.
  const int widest = *std::max_element(t.count.begin(), t.count.end());
  const int width = (widest + 1) / 2 * 2;
  for (int i = 0; i < out_size; ++i) {
    std::copy_n(t.weights.begin() + static_cast<size_t>(i) * t.width, width,
                t.weights.begin() + static_cast<size_t>(i) * width);
  }
  t.weights.resize(static_cast<size_t>(out_size) * width);
  t.width = width;
  return t;
}

void reverse_outputs(Taps& t) {
  std::reverse(t.start.begin(), t.start.end());
  std::reverse(t.count.begin(), t.count.end());
  const size_t n = t.start.size();
  for (size_t i = 0; i < n / 2; ++i) {
    std::swap_ranges(t.weights.begin() + i * t.width, t.weights.begin() + (i + 1) * t.width,
                     t.weights.begin() + (n - 1 - i) * t.width);
  }
}

inline uint8_t clip8(int32_t acc, int bits) {
  return static_cast<uint8_t>(std::min(std::max(acc >> bits, 0), 255));
}

// The vertical pass: output row y of dst (n bytes) combines rows start[y] .. of the region, from byte col0.
// Taps in pairs (an odd count's last pair has a zero weight and reads its last row again).
void vertical_pass(const JSAMPROW* rows, int row0, int col0, const Taps& ty, int n, uint8_t* dst) {
  const int out_h = static_cast<int>(ty.start.size());
  constexpr int32_t half = 1 << (kBits - 1);
  std::vector<const uint8_t*> src(ty.width);
  std::vector<int32_t> pair(ty.width / 2);
  for (int y = 0; y < out_h; ++y) {
    const int count = ty.count[y];
    const int pairs = (count + 1) / 2;
    const int32_t* w = ty.weights.data() + static_cast<size_t>(y) * ty.width;  // zero past count
    for (int k = 0; k < 2 * pairs; ++k) src[k] = rows[ty.start[y] - row0 + std::min(k, count - 1)] + col0;
    for (int k = 0; k < pairs; ++k) {
      pair[k] = static_cast<int32_t>((static_cast<uint32_t>(w[2 * k + 1]) << 16) |
                                     (static_cast<uint32_t>(w[2 * k]) & 0xFFFFu));
    }
    uint8_t* out = dst + static_cast<size_t>(y) * n;
    int x = 0;
#if defined(__AVX2__)
    // 32 bytes at a time: the bytes of two rows interleaved (within each 128-bit lane), then widened to int16
    // pairs against zero, pmaddwd with their two weights: three shuffles per 16 bytes and pair, not four. The
    // two packs (within lanes) put the four sums' bytes back in order.
    const __m256i zero = _mm256_setzero_si256();
    for (; x + 32 <= n; x += 32) {
      __m256i acc0 = _mm256_set1_epi32(half), acc1 = acc0, acc2 = acc0, acc3 = acc0;
      for (int k = 0; k < pairs; ++k) {
        const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src[2 * k] + x));
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src[2 * k + 1] + x));
        const __m256i weights = _mm256_set1_epi32(pair[k]);
        const __m256i low = _mm256_unpacklo_epi8(a, b), high = _mm256_unpackhi_epi8(a, b);
        acc0 = _mm256_add_epi32(acc0, _mm256_madd_epi16(_mm256_unpacklo_epi8(low, zero), weights));   // 0-3, 16-19
        acc1 = _mm256_add_epi32(acc1, _mm256_madd_epi16(_mm256_unpackhi_epi8(low, zero), weights));   // 4-7, 20-23
        acc2 = _mm256_add_epi32(acc2, _mm256_madd_epi16(_mm256_unpacklo_epi8(high, zero), weights));  // 8-11, 24-27
        acc3 = _mm256_add_epi32(acc3, _mm256_madd_epi16(_mm256_unpackhi_epi8(high, zero), weights));  // 12-15, 28-31
      }
      const __m256i words01 = _mm256_packs_epi32(_mm256_srai_epi32(acc0, kBits), _mm256_srai_epi32(acc1, kBits));
      const __m256i words23 = _mm256_packs_epi32(_mm256_srai_epi32(acc2, kBits), _mm256_srai_epi32(acc3, kBits));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + x), _mm256_packus_epi16(words01, words23));
    }
    // 16 bytes at a time: the bytes of two rows interleaved as int16 pairs, pmaddwd with their two weights.
    for (; x + 16 <= n; x += 16) {
      __m256i low = _mm256_set1_epi32(half), high = low;
      for (int k = 0; k < pairs; ++k) {
        const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src[2 * k] + x));
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src[2 * k + 1] + x));
        const __m256i weights = _mm256_set1_epi32(pair[k]);
        low = _mm256_add_epi32(low, _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm_unpacklo_epi8(a, b)), weights));
        high = _mm256_add_epi32(high, _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm_unpackhi_epi8(a, b)), weights));
      }
      // int32 -> int16 packs within 128-bit lanes: put the four 64-bit quarters back in order, then -> uint8.
      __m256i words = _mm256_packs_epi32(_mm256_srai_epi32(low, kBits), _mm256_srai_epi32(high, kBits));
      words = _mm256_permute4x64_epi64(words, 0xD8);
      const __m128i bytes = _mm_packus_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + x), bytes);
    }
#endif
    for (; x < n; ++x) {
      int32_t acc = half;
      for (int k = 0; k < 2 * pairs; ++k) acc += w[k] * src[k][x];
      out[x] = clip8(acc, kBits);
    }
  }
}

// The horizontal pass: each of `rows` RGB rows of src (pixel 0 is column tx.lo) -> out_w RGB pixels of dst.
// Every output takes tx.width taps, in pairs, the ones past its own count with zero weights (src holds the
// pixels they read). Integer arithmetic throughout: every branch below gives the same bytes.
void horizontal_pass(const uint8_t* src, int src_stride, int rows, const Taps& tx, uint8_t* dst) {
  const int out_w = static_cast<int>(tx.start.size());
  const int pairs = tx.width / 2;
  // packed[i * pairs + k]: output i's taps 2k and 2k + 1 as the two int16 halves of an int32.
  std::vector<int32_t> packed(static_cast<size_t>(out_w) * pairs);
  for (int i = 0; i < out_w; ++i) {
    for (int k = 0; k < pairs; ++k) {
      const int32_t* w = tx.weights.data() + static_cast<size_t>(i) * tx.width + 2 * k;
      packed[static_cast<size_t>(i) * pairs + k] =
          static_cast<int32_t>((static_cast<uint32_t>(w[1]) << 16) | (static_cast<uint32_t>(w[0]) & 0xFFFFu));
    }
  }
#if defined(__AVX2__)
  // lanes[(i / 2) * pairs * 8 + 8k ..]: pair k of output i's weights four times, then of output i + 1's.
  std::vector<int32_t> lanes(static_cast<size_t>((out_w + 1) / 2) * pairs * 8, 0);
  for (int i = 0; i < out_w; ++i) {
    for (int k = 0; k < pairs; ++k) {
      int32_t* lane = lanes.data() + static_cast<size_t>(i / 2) * pairs * 8 + 8 * k + 4 * (i % 2);
      std::fill_n(lane, 4, packed[static_cast<size_t>(i) * pairs + k]);
    }
  }
#endif
  std::vector<int32_t> offset(out_w);
  for (int i = 0; i < out_w; ++i) offset[i] = (tx.start[i] - tx.lo) * kChannels;
  const size_t out_stride = static_cast<size_t>(out_w) * 3;
  constexpr int32_t half = 1 << (kBits - 1);
  for (int y = 0; y < rows; ++y) {
    const uint8_t* line = src + static_cast<size_t>(y) * src_stride;
    uint8_t* out = dst + y * out_stride;
    const bool last_row = y == rows - 1;
    int i = 0;
#if defined(__AVX2__)
    // Two outputs at once, one per 128-bit lane; two RGB pixels (an 8-byte load, its last 2 bytes unused) -> the
    // int16 pairs (r0, r1), (g0, g1), (b0, b1) that pmaddwd combines with the pair of weights, and a zero pair
    // in the fourth 32-bit lane (its sum, the rounding half alone, is dropped at the store).
    const __m256i spread = _mm256_setr_epi8(0, -128, 3, -128, 1, -128, 4, -128, 2, -128, 5, -128, -128, -128, -128,
                                            -128, 0, -128, 3, -128, 1, -128, 4, -128, 2, -128, 5, -128, -128, -128,
                                            -128, -128);
    // Four outputs at once where 16 bytes may be stored (12 of them pixels, the 4 past them written again next):
    // the two pairs' results packed together, put in order, their X bytes dropped, one store.
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 0, 0, 0, 0);
    const __m128i rgb = _mm_setr_epi8(0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, -128, -128, -128, -128);
    for (; i + 4 <= out_w && (!last_row || 3 * i + 16 <= 3 * out_w); i += 4) {
      const uint8_t* p0 = line + offset[i];
      const uint8_t* p1 = line + offset[i + 1];
      const uint8_t* p2 = line + offset[i + 2];
      const uint8_t* p3 = line + offset[i + 3];
      const int32_t* weights01 = lanes.data() + static_cast<size_t>(i / 2) * pairs * 8;
      const int32_t* weights23 = weights01 + static_cast<size_t>(pairs) * 8;
      __m256i acc01 = _mm256_set1_epi32(half), acc23 = acc01;
      for (int k = 0; k < pairs; ++k) {
        const __m256i two01 = _mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p0 + 2 * kChannels * k))),
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p1 + 2 * kChannels * k)), 1);
        const __m256i two23 = _mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p2 + 2 * kChannels * k))),
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p3 + 2 * kChannels * k)), 1);
        const __m256i w01 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(weights01 + 8 * k));
        const __m256i w23 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(weights23 + 8 * k));
        acc01 = _mm256_add_epi32(acc01, _mm256_madd_epi16(_mm256_shuffle_epi8(two01, spread), w01));
        acc23 = _mm256_add_epi32(acc23, _mm256_madd_epi16(_mm256_shuffle_epi8(two23, spread), w23));
      }
      // Per 128-bit lane: (output i, i + 2) in lane 0 and (i + 1, i + 3) in lane 1, RGB and a zero byte each.
      __m256i bytes = _mm256_packs_epi32(_mm256_srai_epi32(acc01, kBits), _mm256_srai_epi32(acc23, kBits));
      bytes = _mm256_permutevar8x32_epi32(_mm256_packus_epi16(bytes, bytes), order);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 3 * i),
                       _mm_shuffle_epi8(_mm256_castsi256_si128(bytes), rgb));
    }
    for (; i + 2 < out_w || (i + 2 == out_w && !last_row); i += 2) {
      const uint8_t* p0 = line + offset[i];
      const uint8_t* p1 = line + offset[i + 1];
      const int32_t* weights = lanes.data() + static_cast<size_t>(i / 2) * pairs * 8;
      __m256i acc = _mm256_set1_epi32(half);
      for (int k = 0; k < pairs; ++k) {
        const __m256i two = _mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p0 + 2 * kChannels * k))),
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p1 + 2 * kChannels * k)), 1);
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(weights + 8 * k));
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_shuffle_epi8(two, spread), w));
      }
      acc = _mm256_srai_epi32(acc, kBits);
      acc = _mm256_packus_epi16(_mm256_packs_epi32(acc, acc), acc);
      const uint32_t first = static_cast<uint32_t>(_mm256_cvtsi256_si32(acc));
      const uint32_t second = static_cast<uint32_t>(_mm_cvtsi128_si32(_mm256_extracti128_si256(acc, 1)));
      std::memcpy(out + 3 * i, &first, 4);  // its fourth byte is the next pixel's first, written next
      std::memcpy(out + 3 * i + 3, &second, 4);
    }
#endif
    for (; i < out_w; ++i) {  // the rest one at a time, the image's last pixel three bytes only
      const uint8_t* p = line + offset[i];
      const int32_t* w = tx.weights.data() + static_cast<size_t>(i) * tx.width;
      int32_t acc[3] = {half, half, half};
      for (int k = 0; k < 2 * pairs; ++k) {
        for (int c = 0; c < 3; ++c) acc[c] += w[k] * p[kChannels * k + c];
      }
      for (int c = 0; c < 3; ++c) out[3 * i + c] = clip8(acc[c], kBits);
    }
  }
}

// ---- the calls ----

struct Bytes {
  const uint8_t* data;
  size_t size;
};

void check_colour_space(const jpeg_decompress_struct& cinfo) {
  if (cinfo.jpeg_color_space == JCS_CMYK || cinfo.jpeg_color_space == JCS_YCCK) {
    throw UnsupportedJpeg("CMYK/YCCK JPEG: not decoded by the region decoder");
  }
  if (cinfo.num_components != 1 && cinfo.num_components != 3) {
    throw UnsupportedJpeg("JPEG with " + std::to_string(cinfo.num_components) +
                          " components: not decoded by the region decoder");
  }
}

void read_header_into(Decoder& d, Bytes bytes) {
  if (!guarded_read_header(d, bytes.data, bytes.size)) d.raise();
  check_colour_space(d.cinfo);
}

// One decompressor per thread, reused from image to image: making one (jpeg_create_decompress) allocates and
// clears libjpeg's permanent state every time.
Decoder& thread_decoder() {
  thread_local Decoder d;
  return d;
}

bool ends_with_eoi(Bytes bytes) {
  return bytes.size >= 2 && bytes.data[bytes.size - 2] == 0xFF && bytes.data[bytes.size - 1] == 0xD9;
}

// A buffer kept by each thread between images, grown to the largest asked for, not cleared: a fresh one
// per image would be fresh pages from the kernel, zeroed, faulted in, every time.
class Buffer {
 public:
  uint8_t* get(size_t size) {
    if (size > size_) {
      data_.reset(new uint8_t[size]);
      size_ = size;
    }
    return data_.get();
  }

 private:
  std::unique_ptr<uint8_t[]> data_;
  size_t size_ = 0;
};

thread_local Buffer region_buffer, column_buffer;

using Clock = std::chrono::steady_clock;

int64_t nanoseconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(b - a).count();
}

// The DCT scale's denominator: 4 (2) where the box is at least 4x (2x) the output in both dimensions.
unsigned dct_denominator(double box_h, double box_w, int out_h, int out_w) {
  for (unsigned denom : {4u, 2u}) {
    if (box_h >= denom * out_h && box_w >= denom * out_w) return denom;
  }
  return 1;
}

struct Timings {
  int64_t decode = 0, resize = 0, flip = 0;
};

// The box's region of the JPEG whose header `d` has read, resized into out. t0: when the call began (its
// decode time runs from there).
Timings decode_box(Decoder& d, Bytes bytes, uint8_t* out, int out_h, int out_w, double top, double left,
                   double box_h, double box_w, bool flip, bool read_around, Clock::time_point t0) {
  const double height = d.cinfo.image_height, width = d.cinfo.image_width;
  constexpr double kSlack = 1e-6;  // a box computed in floating point may pass the edge by a rounding error
  if (!(box_h > 0 && box_w > 0 && top >= -kSlack && left >= -kSlack && top + box_h <= height + kSlack &&
        left + box_w <= width + kSlack)) {
    throw std::invalid_argument("crop box (top " + std::to_string(top) + ", left " + std::to_string(left) +
                                ", height " + std::to_string(box_h) + ", width " + std::to_string(box_w) +
                                ") is not inside the " + std::to_string(d.cinfo.image_height) + " x " +
                                std::to_string(d.cinfo.image_width) + " image");
  }
  const unsigned denom = dct_denominator(box_h, box_w, out_h, out_w);
  // The scaled image's pixel i covers source pixels [i * denom, (i + 1) * denom).
  const int scaled_h = static_cast<int>((d.cinfo.image_height + denom - 1) / denom);
  const int scaled_w = static_cast<int>((d.cinfo.image_width + denom - 1) / denom);
  const double y0 = std::max(top, 0.0) / denom, y1 = std::min(top + box_h, height) / denom;
  const double x0 = std::max(left, 0.0) / denom, x1 = std::min(left + box_w, width) / denom;
  auto inner = [](double v) { return static_cast<int>(std::floor(v + kSlack)); };
  auto outer = [](double v) { return static_cast<int>(std::ceil(v - kSlack)); };
  // The filter reads the box's pixels (rounded outwards), or with read_around every pixel of the image its
  // support reaches, as resizing the whole image and then cropping does.
  const Taps ty = make_taps(y0, y1, read_around ? 0 : std::max(inner(y0), 0),
                            read_around ? scaled_h : std::min(outer(y1), scaled_h), out_h, kBits);
  Taps tx = make_taps(x0, x1, read_around ? 0 : std::max(inner(x0), 0),
                      read_around ? scaled_w : std::min(outer(x1), scaled_w), out_w, kBits);

  // libjpeg's chroma upsampling treats the cropped columns' edges as the image's: a margin of kMargin
  // columns each side keeps the columns the resize reads as the whole image's decoding has them.
  const int crop0 = std::max(tx.lo - kMargin, 0), crop1 = std::min(tx.hi + kMargin, scaled_w);
  JDIMENSION xoffset = crop0, crop_w = crop1 - crop0, libjpeg_w = 0;
  if (!guarded_start(d, denom, &libjpeg_w, &xoffset, &crop_w)) d.raise();
  if (static_cast<int>(libjpeg_w) != scaled_w || static_cast<int>(d.cinfo.output_height) != scaled_h) {
    throw JpegError("libjpeg scaled the image to " + std::to_string(d.cinfo.output_height) + " x " +
                    std::to_string(libjpeg_w) + ", not the expected " + std::to_string(scaled_h) +
                    " x " + std::to_string(scaled_w));
  }
  const JDIMENSION row0 = ty.lo, rows = ty.hi - ty.lo;
  const size_t stride = static_cast<size_t>(crop_w) * kChannels;
  uint8_t* region = region_buffer.get(stride * (rows + 1));  // + a row for reading past the region
  std::vector<JSAMPROW> pointers(rows);
  for (JDIMENSION r = 0; r < rows; ++r) pointers[r] = region + r * stride;
  if (!guarded_read_rows(d, row0, rows, pointers.data(), region + rows * stride, !ends_with_eoi(bytes))) d.raise();
  const Clock::time_point t1 = Clock::now();

  if (flip) reverse_outputs(tx);
  const Clock::time_point t2 = Clock::now();

  const int n = (tx.hi - tx.lo) * kChannels;
  // + the pixels that the last outputs' zero-weight taps read, + the 2 bytes past a pair's 8-byte load
  uint8_t* columns =
      column_buffer.get(static_cast<size_t>(out_h) * n + static_cast<size_t>(tx.width) * kChannels + 2);
  vertical_pass(pointers.data(), static_cast<int>(row0), static_cast<int>(tx.lo - xoffset) * kChannels, ty, n,
                columns);
  horizontal_pass(columns, n, out_h, tx, out);
  const Clock::time_point t3 = Clock::now();
  return {nanoseconds(t0, t1), nanoseconds(t2, t3), nanoseconds(t1, t2)};
}

Timings decode_resized(Bytes bytes, uint8_t* out, int out_h, int out_w, double top, double left, double box_h,
                       double box_w, bool flip, bool read_around) {
  const Clock::time_point t0 = Clock::now();
  Decoder& d = thread_decoder();
  read_header_into(d, bytes);
  return decode_box(d, bytes, out, out_h, out_w, top, left, box_h, box_w, flip, read_around, t0);
}

// ---- the training crop's draw (cnns.data.image_loader.training_crop and sample_generator), to the bit ----

uint64_t splitmix64(uint64_t value) {
  value += 0x9E3779B97F4A7C15ull;
  value = (value ^ (value >> 30)) * 0xBF58476D1CE4E5B9ull;
  value = (value ^ (value >> 27)) * 0x94D049BB133111EBull;
  return value ^ (value >> 31);
}

// numpy's PCG64 (XSL-RR output of a 128-bit LCG), with the draws numpy's Generator makes of it: random() and
// uniform() (53 bits of one 64-bit output), integers(0, n) for n <= 2^32 (Lemire's method on 32-bit halves of
// the outputs, the unused half kept for the next 32-bit draw, as numpy's has_uint32 / uinteger).
class Pcg64 {
  using u128 = unsigned __int128;

 public:
  Pcg64(u128 state, u128 increment) : state_(state), increment_(increment) {}

  uint64_t next64() {
    constexpr u128 kMultiplier = (static_cast<u128>(2549297995355413924ull) << 64) | 4865540595714422341ull;
    state_ = state_ * kMultiplier + increment_;
    const uint64_t high = static_cast<uint64_t>(state_ >> 64), value = high ^ static_cast<uint64_t>(state_);
    const unsigned rotation = static_cast<unsigned>(high >> 58);
    return (value >> rotation) | (value << ((64 - rotation) & 63));
  }

  uint32_t next32() {
    if (has32_) {
      has32_ = false;
      return kept32_;
    }
    const uint64_t next = next64();
    has32_ = true;
    kept32_ = static_cast<uint32_t>(next >> 32);
    return static_cast<uint32_t>(next);
  }

  double next_double() { return static_cast<double>(next64() >> 11) * (1.0 / 9007199254740992.0); }

  // integers(0, largest + 1) for largest < 2^32
  uint32_t integer_to(uint32_t largest) {
    if (largest == 0) return 0;
    if (largest == 0xFFFFFFFFu) return next32();
    const uint32_t count = largest + 1;
    uint64_t m = static_cast<uint64_t>(next32()) * count;
    uint32_t leftover = static_cast<uint32_t>(m);
    if (leftover < count) {
      const uint32_t threshold = (0xFFFFFFFFu - largest) % count;
      while (leftover < threshold) {
        m = static_cast<uint64_t>(next32()) * count;
        leftover = static_cast<uint32_t>(m);
      }
    }
    return static_cast<uint32_t>(m >> 32);
  }

 private:
  u128 state_, increment_;
  bool has32_ = false;
  uint32_t kept32_ = 0;
};

// The draw's constants, as the Python side has them (its logarithms computed there by the same libm).
struct CropDraw {
  double area_lo, area_hi, log_aspect_lo, log_aspect_hi, aspect_lo, aspect_hi;
  int tries;
  uint64_t stream;
};

struct DrawnCrop {
  int64_t top, left, height, width;
  bool flip;
};

// training_crop(height, width, sample_generator(seed, epoch, index)) in the same double operations, in the
// same order, none of them fused (Python's float arithmetic rounds every product and sum).
__attribute__((optimize("fp-contract=off"))) DrawnCrop draw_training_crop(int64_t height, int64_t width,
                                                                          uint64_t seed, uint64_t epoch,
                                                                          uint64_t index, const CropDraw& p) {
  const uint64_t mixed = splitmix64(splitmix64(splitmix64(p.stream ^ seed) ^ epoch) ^ index);
  const uint64_t low = splitmix64(mixed), increment = splitmix64(mixed ^ ~0ull);
  Pcg64 rng((static_cast<unsigned __int128>(mixed) << 64) | low,
            (static_cast<unsigned __int128>(increment) << 1) | 1);
  const double area = static_cast<double>(height * width);
  const double area_range = p.area_hi - p.area_lo, aspect_range = p.log_aspect_hi - p.log_aspect_lo;
  for (int t = 0; t < p.tries; ++t) {
    const double target_area = area * (p.area_lo + area_range * rng.next_double());
    const double aspect = std::exp(p.log_aspect_lo + aspect_range * rng.next_double());
    const int64_t box_width = static_cast<int64_t>(std::nearbyint(std::sqrt(target_area * aspect)));
    const int64_t box_height = static_cast<int64_t>(std::nearbyint(std::sqrt(target_area / aspect)));
    if (0 < box_width && box_width <= width && 0 < box_height && box_height <= height) {
      const int64_t top = rng.integer_to(static_cast<uint32_t>(height - box_height));
      const int64_t left = rng.integer_to(static_cast<uint32_t>(width - box_width));
      return {top, left, box_height, box_width, rng.next_double() < 0.5};
    }
  }
  const double ratio = static_cast<double>(width) / static_cast<double>(height);
  int64_t box_height = height, box_width = width;
  if (ratio < p.aspect_lo) {
    box_height = static_cast<int64_t>(std::nearbyint(static_cast<double>(width) / p.aspect_lo));
  } else if (ratio > p.aspect_hi) {
    box_width = static_cast<int64_t>(std::nearbyint(static_cast<double>(height) * p.aspect_hi));
  }
  const int64_t top = (height - box_height) / 2, left = (width - box_width) / 2;  // both >= 0
  return {top, left, box_height, box_width, rng.next_double() < 0.5};
}

CropDraw crop_draw(double area_lo, double area_hi, double log_aspect_lo, double log_aspect_hi, double aspect_lo,
                   double aspect_hi, int tries, uint64_t stream) {
  return {area_lo, area_hi, log_aspect_lo, log_aspect_hi, aspect_lo, aspect_hi, tries, stream};
}

// What a call ended with, as jpeg.py's STATUS_ERRORS maps it to an exception.
enum Status : int { kOk = 0, kJpegError = 1, kUnsupportedJpeg = 2, kTooManyPixels = 3, kInvalidArgument = 4,
                    kFailed = 5 };

// Runs body, turning the exception it throws into a status and its message (cut to message_size - 1 bytes).
template <typename Body>
int guarded_call(char* message, int64_t message_size, const Body& body) {
  auto report = [&](int status, const std::exception& e) {
    if (message != nullptr && message_size > 0) {
      std::strncpy(message, e.what(), static_cast<size_t>(message_size - 1));
      message[message_size - 1] = '\0';
    }
    return status;
  };
  try {
    body();
    return kOk;
  } catch (const UnsupportedJpeg& e) {
    return report(kUnsupportedJpeg, e);
  } catch (const JpegError& e) {
    return report(kJpegError, e);
  } catch (const TooManyPixels& e) {
    return report(kTooManyPixels, e);
  } catch (const std::invalid_argument& e) {
    return report(kInvalidArgument, e);
  } catch (const std::exception& e) {
    return report(kFailed, e);
  }
}

}  // namespace

// ---- the C entry points: bytes as (pointer, size), out a contiguous uint8 [out_h, out_w, 3] buffer ----

extern "C" {

// (height, width, components) from the JPEG header into dims.
int cnns_jpeg_header(const uint8_t* data, int64_t size, int64_t* dims, char* message, int64_t message_size) {
  return guarded_call(message, message_size, [&] {
    Decoder& d = thread_decoder();
    read_header_into(d, Bytes{data, static_cast<size_t>(size)});
    dims[0] = d.cinfo.image_height;
    dims[1] = d.cinfo.image_width;
    dims[2] = d.cinfo.num_components;
  });
}

// Decode the box's region, resize, flip, write into out; the nanoseconds (decode, resize, flip) into timings.
int cnns_jpeg_decode_resized_into(const uint8_t* data, int64_t size, uint8_t* out, int64_t out_h, int64_t out_w,
                                  double top, double left, double box_h, double box_w, int flip, int read_around,
                                  int64_t* timings, char* message, int64_t message_size) {
  return guarded_call(message, message_size, [&] {
    const Timings t = decode_resized(Bytes{data, static_cast<size_t>(size)}, out, static_cast<int>(out_h),
                                     static_cast<int>(out_w), top, left, box_h, box_w, flip != 0, read_around != 0);
    timings[0] = t.decode;
    timings[1] = t.resize;
    timings[2] = t.flip;
  });
}

// The training crop (top, left, height, width, flip) drawn for an image of (height, width), into crop.
int cnns_jpeg_training_crop(int64_t height, int64_t width, uint64_t seed, uint64_t epoch, uint64_t index,
                            double area_lo, double area_hi, double log_aspect_lo, double log_aspect_hi,
                            double aspect_lo, double aspect_hi, int tries, uint64_t stream, int64_t* crop,
                            char* message, int64_t message_size) {
  return guarded_call(message, message_size, [&] {
    if (height < 1 || width < 1 || height > 0xFFFFFFFFll || width > 0xFFFFFFFFll) {
      throw std::invalid_argument("image size out of range");
    }
    const DrawnCrop c = draw_training_crop(
        height, width, seed, epoch, index,
        crop_draw(area_lo, area_hi, log_aspect_lo, log_aspect_hi, aspect_lo, aspect_hi, tries, stream));
    crop[0] = c.top;
    crop[1] = c.left;
    crop[2] = c.height;
    crop[3] = c.width;
    crop[4] = c.flip;
  });
}

// The header read once, the training crop drawn from its size, the crop's region decoded, resized and flipped
// into out: one call per training image. TooManyPixels, before anything is decoded, where the header declares
// more than max_pixels pixels. The nanoseconds (header + draw, decode, resize, flip) into timings.
int cnns_jpeg_decode_training_into(const uint8_t* data, int64_t size, uint8_t* out, int64_t out_h, int64_t out_w,
                                   uint64_t seed, uint64_t epoch, uint64_t index, double area_lo, double area_hi,
                                   double log_aspect_lo, double log_aspect_hi, double aspect_lo, double aspect_hi,
                                   int tries, uint64_t stream, int64_t max_pixels, int64_t* timings, char* message,
                                   int64_t message_size) {
  return guarded_call(message, message_size, [&] {
    const Bytes bytes{data, static_cast<size_t>(size)};
    const CropDraw draw = crop_draw(area_lo, area_hi, log_aspect_lo, log_aspect_hi, aspect_lo, aspect_hi, tries,
                                    stream);
    const Clock::time_point t0 = Clock::now();
    Decoder& d = thread_decoder();
    read_header_into(d, bytes);
    const int64_t height = d.cinfo.image_height, width = d.cinfo.image_width;
    if (height * width > max_pixels) throw TooManyPixels(std::to_string(height) + " " + std::to_string(width));
    const DrawnCrop c = draw_training_crop(height, width, seed, epoch, index, draw);
    const Clock::time_point drawn = Clock::now();
    const Timings t = decode_box(d, bytes, out, static_cast<int>(out_h), static_cast<int>(out_w),
                                 static_cast<double>(c.top), static_cast<double>(c.left),
                                 static_cast<double>(c.height), static_cast<double>(c.width), c.flip, false, drawn);
    timings[0] = nanoseconds(t0, drawn);
    timings[1] = t.decode;
    timings[2] = t.resize;
    timings[3] = t.flip;
  });
}

}  // extern "C"
