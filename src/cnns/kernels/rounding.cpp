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

#include "parallel.h"

#include <algorithm>
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

}  // namespace

// The C entry points (cnns/kernels/rounding.py checks the operands and allocates the result).
extern "C" {

// n float32 values (their bits) rounded stochastically into n bfloat16 values (their bits), noise stream `key`.
void cnns_stochastic_round_bfloat16(int64_t threads, const uint32_t* in, int64_t n, int64_t key, uint16_t* rounded) {
  const uint64_t base = static_cast<uint64_t>(key);
  // Block b holds elements 4b .. 4b+3 and takes the sequence's (b+1)-th value.
  cnns_kernels::parallel_for(threads, 0, (n + 3) / 4, 4096, [&](int64_t first, int64_t last) {
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
}

int64_t cnns_parallel_threads(int64_t threads, int64_t tasks) { return cnns_kernels::parallel_threads(threads, tasks); }

}  // extern "C"
