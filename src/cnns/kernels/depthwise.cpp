// Backward of a depthwise convolution (one input channel per group) for channels_last CPU training.
//
// Written by hand because the library's kernels are pathological for the shapes of EfficientNet on CPUs
// with bfloat16 arithmetic: oneDNN's input gradient of a strided depthwise convolution and its weight
// gradient of a 5x5 one run far below memory speed (many times slower than the same layer's forward, in
// bfloat16 and to a lesser degree in float32), and ATen's own fallback is slower still
// (docs/performance-history.md has the timings per shape).
// Depthwise arithmetic is light (k*k multiply-adds per value), so written as a loop over contiguous channels
// it can run near the speed of reading its operands.
//
// Layouts: x (N, H, W, C), grad (N, Ho, Wo, C), both channels_last views' storage, float32 or bfloat16;
// the weight arrives as (k, k, C) float32 (one vector of C per tap), and the results are a float32 weight
// gradient (k, k, C) and an input gradient in grad's dtype. Threads split rows with parallel_for (parallel.h).
// The C entry points at the end take raw pointers and sizes; cnns/kernels/depthwise.py checks the operands
// (layouts, dtypes, the geometry) and allocates the results.

#include "vectors.h"

#include <algorithm>
#include <vector>

namespace {

using namespace cnns_kernels;

struct Geometry {
  int64_t N, H, W, C, Ho, Wo, stride_h, stride_w, pad_h, pad_w;
  // The input row (or column) that tap k of output row o reads; may fall in the padding.
  int64_t input_row(int64_t o, int64_t k) const { return o * stride_h - pad_h + k; }
  int64_t input_col(int64_t o, int64_t k) const { return o * stride_w - pad_w + k; }
};

// ---------------------------------------------------------------------------------------------------------
// Weight gradient: dw[kh][kw][c] = sum over n, oh, ow of grad[n, oh, ow, c] * x[n, oh*s - p + kh, ow*s - p + kw, c].
//
// Per output row and block of kLanes channels, the K input rows it reads are first widened to float32 into a
// zero-padded slab (each input value is converted once per output row that reads it, not once per tap),
// then K*K accumulators held in registers take one multiply-add per tap with the slab operand read from L1.
// Each thread sums into its own (K, K, C) buffer; the buffers are added at the end.

template <int K, typename T>
void weight_gradient_rows(const T* grad, const T* x, const Geometry& d, int64_t row_begin, int64_t row_end,
                          float* acc_out, std::vector<float>& slab) {
  const int64_t C = d.C, Wp = (d.Wo - 1) * d.stride_w + K;  // slab columns: every column a tap reads
  const int64_t vector_end = C - C % kLanes;
  slab.assign(K * Wp * kLanes, 0.0f);
  for (int64_t row = row_begin; row < row_end; ++row) {
    const int64_t n = row / d.Ho, oh = row % d.Ho;
    const T* g_row = grad + row * d.Wo * C;
    for (int64_t c0 = 0; c0 < vector_end; c0 += kLanes) {
      // The slab: K input rows x Wp columns x kLanes channels, zero where the taps read padding.
      for (int kh = 0; kh < K; ++kh) {
        const int64_t ih = d.input_row(oh, kh);
        float* s = slab.data() + kh * Wp * kLanes;
        const bool inside = ih >= 0 && ih < d.H;
        const T* x_row = x + ((n * d.H + ih) * d.W) * C + c0;
        for (int64_t j = 0; j < Wp; ++j) {
          const int64_t iw = j - d.pad_w;
          store_vector(s + j * kLanes, inside && iw >= 0 && iw < d.W ? load_vector(x_row + iw * C) : vfloat{});
        }
      }
      vfloat acc[K * K];
      for (int t = 0; t < K * K; ++t) acc[t] = load_vector(acc_out + t * C + c0);
      for (int64_t ow = 0; ow < d.Wo; ++ow) {
        const vfloat g = load_vector(g_row + ow * C + c0);
        const float* s = slab.data() + ow * d.stride_w * kLanes;
        for (int kh = 0; kh < K; ++kh)
          for (int kw = 0; kw < K; ++kw) acc[kh * K + kw] += g * load_vector(s + (kh * Wp + kw) * kLanes);
      }
      for (int t = 0; t < K * K; ++t) store_vector(acc_out + t * C + c0, acc[t]);
    }
    // Channels past the last full vector, one at a time.
    for (int64_t c = vector_end; c < C; ++c)
      for (int kh = 0; kh < K; ++kh) {
        const int64_t ih = d.input_row(oh, kh);
        if (ih < 0 || ih >= d.H) continue;
        const T* x_row = x + ((n * d.H + ih) * d.W) * C + c;
        for (int kw = 0; kw < K; ++kw) {
          float sum = 0.0f;
          for (int64_t ow = 0; ow < d.Wo; ++ow) {
            const int64_t iw = d.input_col(ow, kw);
            if (iw >= 0 && iw < d.W) sum += to_float(g_row[ow * C + c]) * to_float(x_row[iw * C]);
          }
          acc_out[(kh * K + kw) * C + c] += sum;
        }
      }
  }
}

template <int K, typename T>
void weight_gradient_impl(int64_t threads, const T* g, const T* xp, const Geometry& d, float* o) {
  threads = std::max<int64_t>(threads, 1);
  std::vector<float> partial(threads * K * K * d.C, 0.0f);
  const int64_t rows = d.N * d.Ho;
  // Row tasks of at least a few thousand taps each; parallel_for gives each thread contiguous rows.
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(1, d.Wo * d.C / kLanes));
  parallel_for(threads, 0, rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> slab;
    float* acc = partial.data() + thread_index() * K * K * d.C;
    weight_gradient_rows<K, T>(g, xp, d, begin, end, acc, slab);
  });
  std::fill(o, o + K * K * d.C, 0.0f);
  for (int64_t t = 0; t < threads; ++t)
    for (int64_t i = 0; i < K * K * d.C; ++i) o[i] += partial[t * K * K * d.C + i];
}

// ---------------------------------------------------------------------------------------------------------
// Input gradient: dx[n, ih, iw, c] = sum over the taps (kh, kw) whose output (oh, ow) reads (ih, iw) of
// grad[n, oh, ow, c] * w[kh][kw][c]. Gathered per input value, so each is written once: with stride s only
// about K*K/s^2 taps reach a value, and the lists of taps per row and column are computed once.

struct Tap {
  int64_t k, o;  // kernel index and the output row (or column) it comes from
};

std::vector<std::vector<Tap>> taps_reaching(int64_t size, int64_t out_size, int64_t kernel, int64_t stride,
                                            int64_t pad) {
  std::vector<std::vector<Tap>> taps(size);
  for (int64_t i = 0; i < size; ++i)
    for (int64_t k = 0; k < kernel; ++k) {
      const int64_t t = i + pad - k;
      if (t >= 0 && t % stride == 0 && t / stride < out_size) taps[i].push_back({k, t / stride});
    }
  return taps;
}

template <typename T>
void input_gradient_impl(int64_t threads, const T* g, const float* w, const Geometry& d, int64_t kernel, T* out) {
  const auto row_taps = taps_reaching(d.H, d.Ho, kernel, d.stride_h, d.pad_h);
  const auto col_taps = taps_reaching(d.W, d.Wo, kernel, d.stride_w, d.pad_w);
  const int64_t C = d.C, vector_end = C - C % kLanes;
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(1, d.W * C / kLanes));
  parallel_for(threads, 0, d.N * d.H, grain, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t n = row / d.H, ih = row % d.H;
      for (int64_t iw = 0; iw < d.W; ++iw) {
        T* o = out + (row * d.W + iw) * C;
        for (int64_t c0 = 0; c0 < vector_end; c0 += kLanes) {
          vfloat acc{};
          for (const Tap& r : row_taps[ih])
            for (const Tap& q : col_taps[iw])
              acc += load_vector(g + ((n * d.Ho + r.o) * d.Wo + q.o) * C + c0) *
                     load_vector(w + (r.k * kernel + q.k) * C + c0);
          store_vector(o + c0, acc);
        }
        for (int64_t c = vector_end; c < C; ++c) {
          float acc = 0.0f;
          for (const Tap& r : row_taps[ih])
            for (const Tap& q : col_taps[iw])
              acc += to_float(g[((n * d.Ho + r.o) * d.Wo + q.o) * C + c]) * w[(r.k * kernel + q.k) * C + c];
          o[c] = from_float<T>(acc);
        }
      }
    }
  });
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------
// The C entry points. grad (N, Ho, Wo, C) and x (N, H, W, C) in one dtype (Dtype: 0 float32, 1 bfloat16 bits).

extern "C" {

// (K, K, C) float32 weight gradient into out, K in 3, 5, 7 (depthwise.py checks K and the geometry).
void cnns_depthwise_weight_gradient(int64_t threads, int dtype, const void* grad, const void* x, int64_t N, int64_t H,
                                    int64_t W, int64_t C, int64_t Ho, int64_t Wo, int64_t kernel, int64_t stride_h,
                                    int64_t stride_w, int64_t pad_h, int64_t pad_w, float* out) {
  const Geometry d{N, H, W, C, Ho, Wo, stride_h, stride_w, pad_h, pad_w};
  const auto run = [&](auto element) {
    using T = decltype(element);
    const T* g = static_cast<const T*>(grad);
    const T* xp = static_cast<const T*>(x);
    switch (kernel) {
      case 3: weight_gradient_impl<3, T>(threads, g, xp, d, out); break;
      case 5: weight_gradient_impl<5, T>(threads, g, xp, d, out); break;
      case 7: weight_gradient_impl<7, T>(threads, g, xp, d, out); break;
    }
  };
  if (dtype == kBFloat16) run(uint16_t{}); else run(float{});
}

// (N, H, W, C) input gradient in grad's dtype into dx, from the (K, K, C) float32 weight.
void cnns_depthwise_input_gradient(int64_t threads, int dtype, const void* grad, const float* weight, int64_t N,
                                   int64_t H, int64_t W, int64_t C, int64_t Ho, int64_t Wo, int64_t kernel,
                                   int64_t stride_h, int64_t stride_w, int64_t pad_h, int64_t pad_w, void* dx) {
  const Geometry d{N, H, W, C, Ho, Wo, stride_h, stride_w, pad_h, pad_w};
  if (dtype == kBFloat16)
    input_gradient_impl<uint16_t>(threads, static_cast<const uint16_t*>(grad), weight, d, kernel,
                                  static_cast<uint16_t*>(dx));
  else
    input_gradient_impl<float>(threads, static_cast<const float*>(grad), weight, d, kernel, static_cast<float*>(dx));
}

int64_t cnns_parallel_threads(int64_t threads, int64_t tasks) { return parallel_threads(threads, tasks); }

}  // extern "C"
