// Vector helpers shared by the hand-written CPU kernels (norm_act.cpp, depthwise.cpp): element access by
// storage type (float32, or bfloat16 as its bits), and a vector of the build's widest float registers with
// bfloat16 loads and rounding stores. Each kernel source is compiled twice by setup.py (x86-64-v3 and
// x86-64-v4), so these pick their instructions from the build's ISA. No torch header: the kernels take raw
// pointers and sizes through a plain C ABI (cnns/kernels/__init__.py loads them), so they compile in seconds.

#pragma once

#include "parallel.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace cnns_kernels {

// Element access by storage type: float, or the bits of a bfloat16 (uint16_t, so that the compiler sees plain
// integers it can vectorise; c10::BFloat16's struct and its NaN branch kept the loops scalar).
inline float to_float(float v) { return v; }
inline float to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

template <typename T> inline T from_float(float v);
template <> inline float from_float<float>(float v) { return v; }
template <> inline uint16_t from_float<uint16_t>(float v) {
  // Round to nearest even, as c10::BFloat16's constructor and every ATen kernel do; NaN stays a NaN.
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return v != v ? uint16_t(0x7FC0) : uint16_t(rounded);
}

// The storage type of an activation, as its C entry point names it (cnns/kernels/__init__.py's DTYPE_CODES).
enum Dtype : int { kFloat32 = 0, kBFloat16 = 1 };

// A vector of the build's widest float registers (16 floats with AVX-512, 8 otherwise), as a GCC/Clang vector
// extension so that one source builds for every ISA and the compiler keeps such values in registers, which
// the plain loops above cannot promise for an accumulator that lives across rows.
#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef float vfloat __attribute__((vector_size(kLanes * sizeof(float))));
typedef uint16_t vbits __attribute__((vector_size(kLanes * sizeof(uint16_t))));
typedef uint32_t vwide __attribute__((vector_size(kLanes * sizeof(uint32_t))));

inline vfloat load_vector(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
// kLanes bfloat16 values widened to float32: zero-extend to 32 bits, shift into the high half. One instruction
// each on x86 (GCC's generic conversion of the vector extension split it into halves and re-joined them).
inline vfloat load_vector(const uint16_t* p) {
#if defined(__AVX512F__)
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return reinterpret_cast<vfloat>(_mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
#elif defined(__AVX2__)
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return reinterpret_cast<vfloat>(_mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
#else
  vbits bits;
  std::memcpy(&bits, p, sizeof(bits));
  const vwide wide = __builtin_convertvector(bits, vwide) << 16;
  vfloat v;
  std::memcpy(&v, &wide, sizeof(v));
  return v;
#endif
}
// Stores kLanes floats as bfloat16, rounded to nearest even with NaN kept a NaN, as from_float does: one
// AVX512-BF16 conversion (the AVX-512 build requires it), where the five-instruction integer rounding below
// held compute-bound passes back (the compiler's vectorisation of from_float shuffled masks between 32-lane
// halves; docs/performance-history.md has the timings). It differs from from_float only on subnormal floats, which
// it flushes to zero.
inline void store_vector(float* p, vfloat v) { std::memcpy(p, &v, sizeof(v)); }
inline void store_vector(uint16_t* p, vfloat v) {
#if defined(__AVX512BF16__)
  const __m256bh packed = _mm512_cvtneps_pbh(reinterpret_cast<__m512>(v));
  std::memcpy(p, &packed, sizeof(packed));
#elif defined(__AVX512F__)
  const __m512 f = reinterpret_cast<__m512>(v);
  const __m512i bits = _mm512_castps_si512(f);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC00000));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
#else
  for (int i = 0; i < kLanes; ++i) p[i] = from_float<uint16_t>(v[i]);
#endif
}

// Whether the passes run explicit vector loops before their scalar tails: with AVX-512, where the stores above
// are one instruction sequence; elsewhere the compiler's vectorisation of the scalar loops is kept.
#if defined(__AVX512F__)
constexpr bool kVectorLoops = true;
#else
constexpr bool kVectorLoops = false;
#endif

}  // namespace cnns_kernels
