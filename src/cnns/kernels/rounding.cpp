// Stochastic rounding of float32 to bfloat16, the last pass of every 16.16 weight update on a CPU
// (cnns.stochastic_rounding.stochastic_round).
//
// No library has it. Written with torch operators (cnns.optim's fallback, used on GPUs and where this is not
// built) the noise comes from the CPU generator, which is sequential (mt19937): most of the pass's time, on
// one thread, and three more passes over memory (docs/performance.md, "Fused normalisation", has the
// figures). Here the noise is a counter-based hash of (key, element index), so any thread computes any
// element's noise and one parallel pass reads the float32 values and writes the bfloat16 ones. The hash is
// SplitMix64's output function over its Weyl sequence (Steele, Lea and Flood 2014; the sequence passes
// BigCrush as a generator): 64 bits per block of 4 elements, 16 bits each. The key is one draw from the
// optimiser's generator per call, so the stream restarts from a checkpoint's generator state and does not
// depend on the thread count.
//
// Rounding: bfloat16 is the top half of a float32's bits. Adding 16 uniform bits to the low half carries into
// the top half with probability (low half) / 2^16, which is the stochastic rounding of the magnitude; a finite
// value can carry at most into the infinity pattern, infinities have a zero low half, and NaNs are written as
// quiet NaNs of the same sign (a NaN whose payload sat in the low half alone would otherwise become infinity).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "vectors.h"

#include <cstdint>

namespace {

constexpr uint64_t kGamma = 0x9E3779B97F4A7C15ull;

inline uint64_t mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

inline uint16_t round_with(uint32_t bits, uint32_t noise16) {
  const uint16_t carried = static_cast<uint16_t>((bits + noise16) >> 16);
  const bool nan = (bits & 0x7FFFFFFFu) > 0x7F800000u;
  return nan ? static_cast<uint16_t>((bits >> 16) | 0x0040u) : carried;
}

at::Tensor stochastic_round_bfloat16(const at::Tensor& x, int64_t key) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "stochastic_round_bfloat16 takes a contiguous float32 CPU tensor");
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(at::kBFloat16));
  const uint32_t* in = reinterpret_cast<const uint32_t*>(x.data_ptr<float>());
  uint16_t* rounded = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t n = x.numel();
  const uint64_t base = static_cast<uint64_t>(key);
  // Block b holds elements 4b .. 4b+3 and takes the sequence's (b+1)-th value.
  at::parallel_for(0, (n + 3) / 4, 4096, [&](int64_t first, int64_t last) {
    const int64_t full = std::min(last, n / 4);
    for (int64_t b = first; b < full; ++b) {
      const uint64_t noise = mix(base + static_cast<uint64_t>(b + 1) * kGamma);
      for (int j = 0; j < 4; ++j) {
        rounded[4 * b + j] = round_with(in[4 * b + j], static_cast<uint32_t>(noise >> (16 * j)) & 0xFFFFu);
      }
    }
    for (int64_t b = std::max(first, full); b < last; ++b) {  // the last, partial block
      const uint64_t noise = mix(base + static_cast<uint64_t>(b + 1) * kGamma);
      for (int64_t i = 4 * b; i < n; ++i) {
        rounded[i] = round_with(in[i], static_cast<uint32_t>(noise >> (16 * (i - 4 * b))) & 0xFFFFu);
      }
    }
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Stochastic rounding of float32 to bfloat16 with counter-based noise (cnns).";
  m.def("stochastic_round_bfloat16", &stochastic_round_bfloat16, "float32 -> bfloat16, noise from (key, index)");
  m.def("parallel_threads", &cnns_kernels::parallel_threads, "threads at::parallel_for runs this many tasks on");
}
