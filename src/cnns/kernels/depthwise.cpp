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
// gradient (k, k, C) and an input gradient in grad's dtype. Threads split rows with at::parallel_for.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "vectors.h"

#include <algorithm>
#include <vector>

namespace {

using namespace cnns_kernels;

struct Geometry {
  int64_t N, H, W, C, Ho, Wo, stride_h, stride_w, pad_h, pad_w;
  Geometry(const at::Tensor& grad, int64_t h, int64_t w, int64_t sh, int64_t sw, int64_t ph, int64_t pw)
      : N(grad.size(0)), H(h), W(w), C(grad.size(3)), Ho(grad.size(1)), Wo(grad.size(2)), stride_h(sh),
        stride_w(sw), pad_h(ph), pad_w(pw) {}
  // The input row (or column) that tap k of output row o reads; may fall in the padding.
  int64_t input_row(int64_t o, int64_t k) const { return o * stride_h - pad_h + k; }
  int64_t input_col(int64_t o, int64_t k) const { return o * stride_w - pad_w + k; }
};

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 4 && t.is_contiguous(), name, " must be a contiguous (N, H, W, C) tensor");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16");
}

void check_geometry(const Geometry& d, int64_t kernel) {
  TORCH_CHECK(d.stride_h >= 1 && d.stride_w >= 1 && d.pad_h >= 0 && d.pad_w >= 0 && kernel >= 1 &&
                  d.pad_h < kernel && d.pad_w < kernel,
              "bad stride or padding");
  TORCH_CHECK(d.Ho == (d.H + 2 * d.pad_h - kernel) / d.stride_h + 1 &&
                  d.Wo == (d.W + 2 * d.pad_w - kernel) / d.stride_w + 1,
              "grad's spatial size does not match the convolution");
}

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
at::Tensor weight_gradient_impl(const at::Tensor& grad, const at::Tensor& x, const Geometry& d) {
  const int threads = at::get_num_threads();
  std::vector<float> partial(int64_t(threads) * K * K * d.C, 0.0f);
  const T* g = data_of<T>(grad);
  const T* xp = data_of<T>(x);
  const int64_t rows = d.N * d.Ho;
  // Row tasks of at least a few thousand taps each; at::parallel_for gives each thread contiguous rows.
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(1, d.Wo * d.C / kLanes));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> slab;
    float* acc = partial.data() + int64_t(at::get_thread_num()) * K * K * d.C;
    weight_gradient_rows<K, T>(g, xp, d, begin, end, acc, slab);
  });
  at::Tensor out = at::zeros({K, K, d.C}, x.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  for (int t = 0; t < threads; ++t)
    for (int64_t i = 0; i < K * K * d.C; ++i) o[i] += partial[int64_t(t) * K * K * d.C + i];
  return out;
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
at::Tensor input_gradient_impl(const at::Tensor& grad, const at::Tensor& weight, const Geometry& d,
                               int64_t kernel) {
  at::Tensor dx = at::empty({d.N, d.H, d.W, d.C}, grad.options());
  const auto row_taps = taps_reaching(d.H, d.Ho, kernel, d.stride_h, d.pad_h);
  const auto col_taps = taps_reaching(d.W, d.Wo, kernel, d.stride_w, d.pad_w);
  const T* g = data_of<T>(grad);
  const float* w = weight.data_ptr<float>();
  T* out = data_of<T>(dx);
  const int64_t C = d.C, vector_end = C - C % kLanes;
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(1, d.W * C / kLanes));
  at::parallel_for(0, d.N * d.H, grain, [&](int64_t begin, int64_t end) {
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
  return dx;
}

// ---------------------------------------------------------------------------------------------------------
// Entry points.

// (K, K, C) float32 weight gradient of a depthwise convolution with a square K x K kernel, K in 3, 5, 7.
at::Tensor weight_gradient(const at::Tensor& grad, const at::Tensor& x, int64_t kernel, int64_t stride_h,
                           int64_t stride_w, int64_t pad_h, int64_t pad_w) {
  check_rows(grad, "grad");
  check_rows(x, "x");
  TORCH_CHECK(x.scalar_type() == grad.scalar_type(), "x and grad must have one dtype");
  TORCH_CHECK(x.size(0) == grad.size(0) && x.size(3) == grad.size(3), "x and grad must agree in N and C");
  const Geometry d(grad, x.size(1), x.size(2), stride_h, stride_w, pad_h, pad_w);
  check_geometry(d, kernel);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  switch (kernel) {
    case 3: return bf16 ? weight_gradient_impl<3, uint16_t>(grad, x, d) : weight_gradient_impl<3, float>(grad, x, d);
    case 5: return bf16 ? weight_gradient_impl<5, uint16_t>(grad, x, d) : weight_gradient_impl<5, float>(grad, x, d);
    case 7: return bf16 ? weight_gradient_impl<7, uint16_t>(grad, x, d) : weight_gradient_impl<7, float>(grad, x, d);
    default: TORCH_CHECK(false, "depthwise weight gradient: kernel sizes 3, 5 and 7 only, not ", kernel);
  }
}

// (N, H, W, C) input gradient in grad's dtype, from the (K, K, C) float32 weight, for an (H, W) input.
at::Tensor input_gradient(const at::Tensor& grad, const at::Tensor& weight, int64_t H, int64_t W,
                          int64_t stride_h, int64_t stride_w, int64_t pad_h, int64_t pad_w) {
  check_rows(grad, "grad");
  TORCH_CHECK(weight.dim() == 3 && weight.size(0) == weight.size(1) && weight.is_contiguous() &&
                  weight.scalar_type() == at::kFloat && weight.size(2) == grad.size(3),
              "the weight must be a contiguous (K, K, C) float32 tensor");
  const int64_t kernel = weight.size(0);
  const Geometry d(grad, H, W, stride_h, stride_w, pad_h, pad_w);
  check_geometry(d, kernel);
  return grad.scalar_type() == at::kBFloat16 ? input_gradient_impl<uint16_t>(grad, weight, d, kernel)
                                             : input_gradient_impl<float>(grad, weight, d, kernel);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Depthwise convolution backward over channels_last (N, H, W, C) activations (cnns).";
  m.def("weight_gradient", &weight_gradient, "(K, K, C) float32 weight gradient");
  m.def("input_gradient", &input_gradient, "(N, H, W, C) input gradient");
  m.def("parallel_threads", &cnns_kernels::parallel_threads, "threads at::parallel_for runs this many tasks on");
}
