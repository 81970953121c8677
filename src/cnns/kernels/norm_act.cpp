// Fused normalisation + activation (+ residual) passes for channels_last CPU training.
//
// Written by hand because no library has them: ATen's batch norm, ReLU, SiLU and add each make their own
// pass over memory (forward: statistics, normalise, activate, add; backward: activation gradient, two
// reductions, input gradient), and on CPUs whose bfloat16 matrix units make the convolutions fast those
// passes are most of a training step. Here a training norm+act is three passes forward (moments, one
// apply) and two backward (one reduction that also writes the pre-activation gradient, one apply), aiming
// at memory speed.
//
// Every kernel sees a channels_last activation as a (G, R, C) row-major array: G independent groups of
// statistics (1 for batch norm, N for group norm: a sample), R rows (pixels), C contiguous channels. The
// passes are float loops over C that the compiler vectorises, with explicit vector loops where it did worse
// (the statistics sums, and in the AVX-512 build the bfloat16 loads and stores; setup.py builds x86-64-v3 and
// x86-64-v4 with AVX512-BF16); threads split rows with parallel_for (parallel.h) on torch.get_num_threads()
// threads. `forward` and `backward` at the end compute the float64 per-channel statistics and coefficients
// between the passes. The C entry points take raw pointers and sizes: cnns/kernels/norm_act.py checks the
// operands and allocates every result.

#include "vectors.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

using namespace cnns_kernels;

enum Act : int64_t { kNone = 0, kRelu = 1, kSilu = 2 };

// exp for the sigmoid, written so that the compiler vectorises it (std::exp stays a scalar libm call):
// Cephes' expf, 2^n times a degree-7 polynomial of the remainder, within 2 float ulps over the clamped range.
inline float exp_vectorisable(float x) {
  x = std::min(std::max(x, -87.3f), 88.7f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

inline float sigmoid(float z) { return 1.0f / (1.0f + exp_vectorisable(-z)); }

// The same exp and sigmoid on kLanes values: the compiler kept loops that call the scalar ones scalar, which
// left EfficientNet's batch norm + SiLU passes slower than ATen's.
inline vfloat floor_vector(vfloat v) {
#if defined(__AVX512F__)
  return reinterpret_cast<vfloat>(
      _mm512_roundscale_ps(reinterpret_cast<__m512>(v), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC));
#elif defined(__AVX2__)
  return reinterpret_cast<vfloat>(_mm256_floor_ps(reinterpret_cast<__m256>(v)));
#else
  for (int i = 0; i < kLanes; ++i) v[i] = std::floor(v[i]);
  return v;
#endif
}

typedef int32_t vint __attribute__((vector_size(kLanes * sizeof(int32_t))));

inline vfloat exp_vector(vfloat x) {
#if defined(__AVX512F__)
  // The same steps in fewer instructions: min/max for the clamp, and 2^n by vscalefps instead of building the
  // exponent bits (the pass is bound by instruction throughput, not memory, on a CPU that splits 512-bit ops).
  x = reinterpret_cast<vfloat>(_mm512_min_ps(_mm512_max_ps(reinterpret_cast<__m512>(x), _mm512_set1_ps(-87.3f)),
                                             _mm512_set1_ps(88.7f)));
#else
  const vfloat lo = vfloat{} - 87.3f, hi = vfloat{} + 88.7f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
#endif
  const vfloat n = floor_vector(x * 1.44269504088896341f + 0.5f);
  const vfloat r = x - n * 0.693359375f + n * 2.12194440e-4f;
  vfloat p = vfloat{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
#if defined(__AVX512F__)
  return reinterpret_cast<vfloat>(_mm512_scalef_ps(reinterpret_cast<__m512>(p), reinterpret_cast<__m512>(n)));
#else
  const vint bits = (__builtin_convertvector(n, vint) + 127) << 23;
  return p * reinterpret_cast<vfloat>(bits);
#endif
}

// 1 / d within a float ulp or two: a 14-bit estimate and one Newton step, where a vector division held the SiLU
// passes to the divider's throughput.
inline vfloat reciprocal(vfloat d) {
#if defined(__AVX512F__)
  const vfloat r = reinterpret_cast<vfloat>(_mm512_rcp14_ps(reinterpret_cast<__m512>(d)));
  return r * (2.0f - d * r);
#else
  return 1.0f / d;
#endif
}

// For bfloat16 results (8 significant bits) a cheaper exp and sigmoid: a degree-4 polynomial (relative error
// below 4e-5) and the 14-bit reciprocal estimate. The SiLU passes are bound by instruction throughput on a CPU
// that splits 512-bit operations, and fewer instructions per value is what makes them faster there.
inline vfloat exp_vector_coarse(vfloat x) {
#if defined(__AVX512F__)
  const __m512 v = _mm512_min_ps(_mm512_max_ps(reinterpret_cast<__m512>(x), _mm512_set1_ps(-87.3f)),
                                 _mm512_set1_ps(88.7f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const vfloat r = reinterpret_cast<vfloat>(_mm512_fnmadd_ps(n, _mm512_set1_ps(0.69314718056f), v));
  const vfloat p = 1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6.0f + r * (1.0f / 24.0f))));
  return reinterpret_cast<vfloat>(_mm512_scalef_ps(reinterpret_cast<__m512>(p), n));
#else
  return exp_vector(x);
#endif
}

template <bool kPrecise>
inline vfloat sigmoid(vfloat z) {
  if constexpr (kPrecise) return reciprocal(1.0f + exp_vector(-z));
#if defined(__AVX512F__)
  return reinterpret_cast<vfloat>(_mm512_rcp14_ps(reinterpret_cast<__m512>(1.0f + exp_vector_coarse(-z))));
#else
  return reciprocal(1.0f + exp_vector(-z));
#endif
}

// max(z, 0) as std::max(z, 0.f) computes it: a NaN stays a NaN, as torch's ReLU keeps it.
inline vfloat relu(vfloat z) {
  const vfloat zero{};
  return z < zero ? zero : z;
}

inline void add_to(float* p, vfloat v) {
  v += load_vector(p);
  std::memcpy(p, &v, sizeof(v));
}

// Rows per block: a block's float sums stay short (float error grows with the terms added) before they are
// added into double accumulators; small enough that a (G, R) of one sample still splits over threads.
constexpr int64_t kBlockRows = 256;
// Narrow layers (16 channels in ResNet-20) would run a vector loop of one or two iterations per row, all
// overhead: consecutive rows are contiguous, so the passes take k rows at a time as one "super-row" of
// k * C values, with the per-channel coefficients tiled k times, k making it at least this long.
constexpr int64_t kMinWidth = 256;

// How a (G, R, C) array is walked: tasks of about kBlockRows rows (a multiple of k), super-rows of k rows.
struct Walk {
  int64_t G, R, C, k, block_rows, blocks;
  Walk(int64_t groups, int64_t rows, int64_t channels)
      : G(groups), R(rows), C(channels), k(std::max<int64_t>(1, kMinWidth / std::max<int64_t>(1, C))),
        block_rows(((kBlockRows + k - 1) / k) * k), blocks((R + block_rows - 1) / block_rows) {}
  int64_t width() const { return k * C; }
  // A task's first row within its group and its row count.
  int64_t first_row(int64_t task) const { return (task % blocks) * block_rows; }
  int64_t rows(int64_t task) const { return std::min(R - first_row(task), block_rows); }
  // body(g, offset of the super-row's first value, its length), for the super-rows of a task.
  template <typename F>
  void super_rows(int64_t task, const F& body) const {
    const int64_t g = task / blocks, r_end = first_row(task) + rows(task);
    for (int64_t r = first_row(task); r < r_end; r += k)
      body(g, (g * R + r) * C, std::min(k, r_end - r) * C);
  }
};

// The (G, C) coefficients of group g tiled k times: coefficient j applies to value j of a super-row.
inline void tile(const float* src, const Walk& w, std::vector<float>& out) {
  out.resize(w.width());
  for (int64_t j = 0; j < w.k; ++j) std::memcpy(out.data() + j * w.C, src, w.C * sizeof(float));
}

// Folds a super-row accumulator (k * C) into per-channel doubles.
inline void fold(const std::vector<float>& acc, const Walk& w, double* out) {
  for (int64_t c = 0; c < w.C; ++c) {
    double sum = 0.0;
    for (int64_t j = 0; j < w.k; ++j) sum += acc[j * w.C + c];
    out[c] = sum;
  }
}

// Rows read at a time by column_moments: few enough that their cache lines stay in L1 while every column
// chunk passes over them (more rows per tile evict them before the last chunk has read them).
constexpr int64_t kTileRows = 8;
// Vectors per column chunk: 2 * kChunk sums in registers, half the register file (32 AVX-512, 16 AVX2).
constexpr int kChunk = kLanes == 16 ? 8 : 4;

// Adds sum(d) and sum(d * d), d = x - k, down `rows` rows (`stride` values apart) to a and b, for the
// columns [c0, c0 + V * kLanes). The 2V sums stay in registers over a tile of rows: summing into memory row
// by row, as the other passes can afford, made this read-only pass store-bound.
template <int V, typename T>
inline void column_moments(const T* __restrict__ x, int64_t stride, int64_t rows, int64_t c0,
                           const float* __restrict__ k, float* __restrict__ a, float* __restrict__ b) {
  // Unrolled so that the arrays become registers (rolled, GCC zeroed a stack copy of them on every call).
  vfloat sum[V], squares[V];
#pragma GCC unroll 16
  for (int v = 0; v < V; ++v) sum[v] = squares[v] = vfloat{};
  for (int64_t r = 0; r < rows; ++r) {
    const T* row = x + r * stride + c0;
#pragma GCC unroll 16
    for (int v = 0; v < V; ++v) {
      const vfloat d = load_vector(row + v * kLanes) - load_vector(k + c0 + v * kLanes);
      sum[v] += d;
      squares[v] += d * d;
    }
  }
#pragma GCC unroll 16
  for (int v = 0; v < V; ++v) {
    add_to(a + c0 + v * kLanes, sum[v]);
    add_to(b + c0 + v * kLanes, squares[v]);
  }
}

// column_moments over the columns [0, width) of `rows` rows, tile by tile; the last width % kLanes scalar.
template <typename T>
void block_moments(const T* x, int64_t stride, int64_t rows, int64_t width, const float* k, float* a, float* b) {
  for (int64_t r0 = 0; r0 < rows; r0 += kTileRows) {
    const T* tile = x + r0 * stride;
    const int64_t n = std::min(kTileRows, rows - r0);
    int64_t c = 0;
    for (; c + kChunk * kLanes <= width; c += kChunk * kLanes) column_moments<kChunk>(tile, stride, n, c, k, a, b);
    for (; c + kLanes <= width; c += kLanes) column_moments<1>(tile, stride, n, c, k, a, b);
    for (int64_t r = 0; r < n; ++r)
      for (int64_t j = c; j < width; ++j) {
        const float d = to_float(tile[r * stride + j]) - k[j];
        a[j] += d;
        b[j] += d * d;
      }
  }
}

// Per (group, channel): the mean and the sum of squared deviations (M2), float64.
// Each block of rows sums x - K and (x - K)^2 in float, K being the group's first row (the shifted-data
// algorithm: exact enough when the mean is far larger than the spread), and the blocks are added in double.
template <typename T>
void moments_impl(int64_t threads, const T* __restrict__ data, const Walk& w, double* pm, double* pv) {
  const int64_t G = w.G, R = w.R, C = w.C, blocks = w.blocks;
  std::vector<double> s1(G * blocks * C, 0.0), s2(G * blocks * C, 0.0);
  double* p1 = s1.data();
  double* p2 = s2.data();
  parallel_for(threads, 0, G * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> a(w.width()), b(w.width()), first(C), shift;
    for (int64_t task = begin; task < end; ++task) {
      const T* group = data + (task / blocks) * R * C;
      for (int64_t c = 0; c < C; ++c) first[c] = to_float(group[c]);
      tile(first.data(), w, shift);
      std::fill(a.begin(), a.end(), 0.f);
      std::fill(b.begin(), b.end(), 0.f);
      // The block as whole super-rows, then the rows left over: a prefix of one super-row.
      const T* block = data + ((task / blocks) * R + w.first_row(task)) * C;
      const int64_t whole = w.rows(task) / w.k, left = w.rows(task) % w.k;
      block_moments(block, w.width(), whole, w.width(), shift.data(), a.data(), b.data());
      if (left) block_moments(block + whole * w.width(), w.width(), 1, left * C, shift.data(), a.data(), b.data());
      fold(a, w, p1 + task * C);
      fold(b, w, p2 + task * C);
    }
  });
  std::vector<double> sa(C), sb(C);
  for (int64_t g = 0; g < G; ++g) {
    std::fill(sa.begin(), sa.end(), 0.0);
    std::fill(sb.begin(), sb.end(), 0.0);
    for (int64_t block = 0; block < blocks; ++block)  // row by row: contiguous (a column walk strides)
      for (int64_t c = 0; c < C; ++c) {
        sa[c] += p1[(g * blocks + block) * C + c];
        sb[c] += p2[(g * blocks + block) * C + c];
      }
    const T* first = data + g * R * C;
    for (int64_t c = 0; c < C; ++c) {
      const double shifted_mean = sa[c] / double(R);
      pm[g * C + c] = double(to_float(first[c])) + shifted_mean;
      pv[g * C + c] = std::max(0.0, sb[c] - sa[c] * shifted_mean);
    }
  }
}

// y = act(x * scale + shift [+ residual]), scale and shift per (group, channel).
// residual may be null.
template <typename T>
void affine_act_impl(int64_t threads, const T* px, const Walk& w, const float* ps, const float* pt, const T* pr,
                     int64_t act, T* py) {
  parallel_for(threads, 0, w.G * w.blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> st, tt;
    int64_t tiled = -1;  // the group whose coefficients st, tt hold
    for (int64_t task = begin; task < end; ++task) {
      w.super_rows(task, [&](int64_t g, int64_t off, int64_t len) {
        if (g != tiled) { tile(ps + g * w.C, w, st); tile(pt + g * w.C, w, tt); tiled = g; }
        const float* __restrict__ s = st.data();
        const float* __restrict__ t = tt.data();
        const T* __restrict__ xr = px + off;
        T* __restrict__ yr = py + off;
        // The first vectors' worth explicitly where kVectorLoops, the rest scalar.
        int64_t i = 0;
        const int64_t vectors = kVectorLoops ? len - len % kLanes : 0;
        if (pr != nullptr) {
          const T* __restrict__ rr = pr + off;
          for (; i < vectors; i += kLanes) {
            const vfloat z = load_vector(xr + i) * load_vector(s + i) + load_vector(t + i) + load_vector(rr + i);
            store_vector(yr + i, act == kRelu ? relu(z) : z);
          }
          if (act == kRelu) {
            for (; i < len; ++i)
              yr[i] = from_float<T>(std::max(to_float(xr[i]) * s[i] + t[i] + to_float(rr[i]), 0.f));
          } else {
            for (; i < len; ++i) yr[i] = from_float<T>(to_float(xr[i]) * s[i] + t[i] + to_float(rr[i]));
          }
          return;
        }
        if (act == kSilu) {
          for (; i < vectors; i += kLanes) {
            const vfloat z = load_vector(xr + i) * load_vector(s + i) + load_vector(t + i);
            store_vector(yr + i, z * sigmoid<std::is_same_v<T, float>>(z));
          }
        } else {
          for (; i < vectors; i += kLanes) {
            const vfloat z = load_vector(xr + i) * load_vector(s + i) + load_vector(t + i);
            store_vector(yr + i, act == kRelu ? relu(z) : z);
          }
        }
        if (act == kRelu) {
          for (; i < len; ++i) yr[i] = from_float<T>(std::max(to_float(xr[i]) * s[i] + t[i], 0.f));
        } else if (act == kSilu) {
          for (; i < len; ++i) {
            const float z = to_float(xr[i]) * s[i] + t[i];
            yr[i] = from_float<T>(z * sigmoid(z));
          }
        } else {
          for (; i < len; ++i) yr[i] = from_float<T>(to_float(xr[i]) * s[i] + t[i]);
        }
      });
    }
  });
}

// The backward reduction pass. gz = dL/dz, z the pre-activation (x * scale + shift [+ residual]), in the
// activation's dtype (as ATen's activation backward hands it on); also the residual's gradient. From the
// stored gz, per (group, channel): s1 = sum gz and s2 = sum gz * (x - mean), float64 over blocks.
// ReLU reads its mask from the output y (py, null for the other activations); SiLU recomputes z from x (no
// residual with SiLU). Without an activation gz is grad itself: pz is not written (the caller passes grad).
// The sums per (group, channel) go to sum1 and sum2, (G, C) float64.
template <typename T>
void backward_reduce_impl(int64_t threads, const T* pg, const T* px, const T* py, const Walk& w, const float* ps,
                          const float* pt, const float* pm, int64_t act, T* pz, double* sum1, double* sum2) {
  const int64_t G = w.G, C = w.C, blocks = w.blocks;
  std::vector<double> s1(G * blocks * C), s2(G * blocks * C);
  double* q1 = s1.data();
  double* q2 = s2.data();
  parallel_for(threads, 0, G * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> a(w.width()), b(w.width()), st, tt, mt;
    int64_t tiled = -1;
    for (int64_t task = begin; task < end; ++task) {
      std::fill(a.begin(), a.end(), 0.f);
      std::fill(b.begin(), b.end(), 0.f);
      w.super_rows(task, [&](int64_t g, int64_t off, int64_t len) {
        if (g != tiled) {
          tile(ps + g * C, w, st); tile(pt + g * C, w, tt); tile(pm + g * C, w, mt); tiled = g;
        }
        const float* __restrict__ s = st.data();
        const float* __restrict__ t = tt.data();
        const float* __restrict__ m = mt.data();
        const T* __restrict__ gr = pg + off;
        const T* __restrict__ xr = px + off;
        T* __restrict__ zr = pz + off;
        float* __restrict__ sa = a.data();
        float* __restrict__ sb = b.data();
        int64_t i = 0;
        const int64_t vectors = kVectorLoops ? len - len % kLanes : 0;
        if (act == kRelu) {
          const T* __restrict__ yr = py + off;
          for (; i < vectors; i += kLanes) {
            const vfloat zero{};
            const vfloat v = load_vector(yr + i) > zero ? load_vector(gr + i) : zero;
            store_vector(zr + i, v);
            add_to(sa + i, v);
            add_to(sb + i, v * (load_vector(xr + i) - load_vector(m + i)));
          }
          for (; i < len; ++i) {
            // Both operands read unconditionally: a conditional load keeps the loop scalar.
            const float gv = to_float(gr[i]), yv = to_float(yr[i]);
            const float v = yv > 0.f ? gv : 0.f;
            zr[i] = from_float<T>(v);
            sa[i] += v;
            sb[i] += v * (to_float(xr[i]) - m[i]);
          }
        } else if (act == kSilu) {
          for (; i < vectors; i += kLanes) {
            const vfloat xv = load_vector(xr + i);
            const vfloat z = xv * load_vector(s + i) + load_vector(t + i);
            const vfloat sg = sigmoid<std::is_same_v<T, float>>(z);
            // Rounded to the activations' dtype as ATen's SiLU backward hands it on (stored, then reread).
            store_vector(zr + i, load_vector(gr + i) * sg * (1.f + z * (1.f - sg)));
            const vfloat v = load_vector(zr + i);
            add_to(sa + i, v);
            add_to(sb + i, v * (xv - load_vector(m + i)));
          }
          for (; i < len; ++i) {
            const float z = to_float(xr[i]) * s[i] + t[i];
            const float sg = sigmoid(z);
            const float v = to_float(from_float<T>(to_float(gr[i]) * sg * (1.f + z * (1.f - sg))));
            zr[i] = from_float<T>(v);
            sa[i] += v;
            sb[i] += v * (to_float(xr[i]) - m[i]);
          }
        } else {
          for (; i < vectors; i += kLanes) {
            const vfloat v = load_vector(gr + i);
            add_to(sa + i, v);
            add_to(sb + i, v * (load_vector(xr + i) - load_vector(m + i)));
          }
          for (; i < len; ++i) {
            const float v = to_float(gr[i]);
            sa[i] += v;
            sb[i] += v * (to_float(xr[i]) - m[i]);
          }
        }
      });
      fold(a, w, q1 + task * C);
      fold(b, w, q2 + task * C);
    }
  });
  // The blocks' sums per group, block by block: contiguous rows of C.
  std::fill(sum1, sum1 + G * C, 0.0);
  std::fill(sum2, sum2 + G * C, 0.0);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t block = 0; block < blocks; ++block)
      for (int64_t c = 0; c < C; ++c) {
        sum1[g * C + c] += q1[(g * blocks + block) * C + c];
        sum2[g * C + c] += q2[(g * blocks + block) * C + c];
      }
}

// dx = a * gz + b * x + d, coefficients per (group, channel): the input gradient of any affine
// normalisation once its reductions are known (see cnns/kernels/norm_act.py for a, b, d).
template <typename T>
void input_gradient_impl(int64_t threads, const T* pz, const T* px, const Walk& w, const float* pa, const float* pb,
                         const float* pc, T* pd) {
  parallel_for(threads, 0, w.G * w.blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> at_, bt, dt;
    int64_t tiled = -1;
    for (int64_t task = begin; task < end; ++task) {
      w.super_rows(task, [&](int64_t g, int64_t off, int64_t len) {
        if (g != tiled) { tile(pa + g * w.C, w, at_); tile(pb + g * w.C, w, bt); tile(pc + g * w.C, w, dt); tiled = g; }
        const float* __restrict__ ca = at_.data();
        const float* __restrict__ cb = bt.data();
        const float* __restrict__ cd = dt.data();
        const T* __restrict__ zr = pz + off;
        const T* __restrict__ xr = px + off;
        T* __restrict__ dr = pd + off;
        int64_t i = 0;
        if (kVectorLoops)
          for (; i + kLanes <= len; i += kLanes)
            store_vector(dr + i, load_vector(ca + i) * load_vector(zr + i) + load_vector(cb + i) * load_vector(xr + i) +
                                     load_vector(cd + i));
        for (; i < len; ++i) dr[i] = from_float<T>(ca[i] * to_float(zr[i]) + cb[i] * to_float(xr[i]) + cd[i]);
      });
    }
  });
}

// The per-channel arithmetic between the passes, in float64 loops over (G, C), in the same C++ call: as ~20
// small torch operators per call, their dispatch cost more than the passes of a late ResNet layer or a
// CIFAR one.

// The parameter (C float32 values) as float64, or `fill` where the norm has none (null).
std::vector<double> per_channel(const float* p, int64_t C, double fill) {
  std::vector<double> out(C, fill);
  if (p != nullptr)
    for (int64_t c = 0; c < C; ++c) out[c] = p[c];
  return out;
}

// Forward: y = act(norm(x) [+ residual]) over the (G, R, C) rows of x, G = 1 for batch norm (groups = 0), N for
// group norm. Writes y, the per (G, C) mean and 1/std in float64 and the float32 scale and shift that made y
// (the backward's inputs), and each channel's moments (mean_c, m2_c) for batch norm's running statistics.
template <typename T>
void forward_impl(int64_t threads, const T* x, const Walk& w, const float* weight, const float* bias, const T* residual,
                  int64_t groups, double eps, int64_t act, T* y, double* pm, double* pi, float* ps, float* pt,
                  double* pm_c, double* pv_c) {
  const int64_t G = w.G, R = w.R, C = w.C;
  moments_impl<T>(threads, x, w, pm_c, pv_c);
  if (groups) {
    // Channel moments -> group moments (Chan et al.'s pairwise combination), broadcast to the group's channels.
    const int64_t per = C / groups;
    for (int64_t g = 0; g < G; ++g)
      for (int64_t k = 0; k < groups; ++k) {
        const int64_t c0 = g * C + k * per;
        double group_mean = 0.0, m2 = 0.0;
        for (int64_t c = c0; c < c0 + per; ++c) group_mean += pm_c[c];
        group_mean /= double(per);
        for (int64_t c = c0; c < c0 + per; ++c)
          m2 += pv_c[c] + double(R) * (pm_c[c] - group_mean) * (pm_c[c] - group_mean);
        const double inv = 1.0 / std::sqrt(m2 / double(R * per) + eps);
        for (int64_t c = c0; c < c0 + per; ++c) { pm[c] = group_mean; pi[c] = inv; }
      }
  } else {
    for (int64_t c = 0; c < G * C; ++c) {
      pm[c] = pm_c[c];
      pi[c] = 1.0 / std::sqrt(pv_c[c] / double(R) + eps);
    }
  }
  const std::vector<double> wd = per_channel(weight, C, 1.0), bd = per_channel(bias, C, 0.0);
  for (int64_t i = 0; i < G * C; ++i) {
    const double s = wd[i % C] * pi[i];
    ps[i] = float(s);
    pt[i] = float(bd[i % C] - pm[i] * s);
  }
  affine_act_impl<T>(threads, x, w, ps, pt, residual, act, y);
}

// Backward of `forward`: from dL/dy, the input gradient (dx null: not asked for), the weight and bias gradients
// (C, float64) and dL/dz, z the pre-activation (the residual's gradient; without an activation gz is grad and
// is not written).
template <typename T>
void backward_impl(int64_t threads, const T* grad, const T* x, const T* out, const Walk& w, const double* pm,
                   const double* pi, const float* scale, const float* shift, const float* weight, int64_t groups,
                   int64_t act, T* dx, double* pw, double* pb, T* gz) {
  const int64_t G = w.G, R = w.R, C = w.C;
  std::vector<float> mean32(G * C);
  for (int64_t i = 0; i < G * C; ++i) mean32[i] = float(pm[i]);
  std::vector<double> s1(G * C), s2(G * C);
  backward_reduce_impl<T>(threads, grad, x, out, w, scale, shift, mean32.data(), act, gz, s1.data(), s2.data());
  const T* pz = act == kNone ? grad : gz;
  const std::vector<double> wd = per_channel(weight, C, 1.0);
  const double* p1 = s1.data();
  const double* p2 = s2.data();
  std::vector<float> cg(G * C), cx(G * C), cd(G * C);
  // dx = coef_g * gz + coef_x * (x - mean) + coef_d, written as one pass with the mean folded into the shift.
  auto put = [&](int64_t i, double coef_g, double coef_x, double coef_d) {
    cg[i] = float(coef_g);
    cx[i] = float(coef_x);
    cd[i] = float(coef_d - coef_x * pm[i]);
  };
  if (groups) {
    // Per sample and group: the means of w * gz and of w * gz * xhat (the group norm backward).
    const int64_t per = C / groups;
    const double count = double(R * per);
    for (int64_t g = 0; g < G; ++g)
      for (int64_t k = 0; k < groups; ++k) {
        const int64_t c0 = g * C + k * per;
        double a = 0.0, b = 0.0;
        for (int64_t i = c0; i < c0 + per; ++i) {
          a += wd[i % C] * p1[i];
          b += wd[i % C] * p2[i] * pi[i];
        }
        a /= count;
        b /= count;
        for (int64_t i = c0; i < c0 + per; ++i) put(i, pi[i] * wd[i % C], -pi[i] * pi[i] * b, -pi[i] * a);
      }
  } else {
    const double count = double(R);
    for (int64_t c = 0; c < C; ++c)
      put(c, wd[c] * pi[c], -wd[c] * pi[c] * pi[c] * pi[c] * p2[c] / count, -wd[c] * pi[c] * p1[c] / count);
  }
  std::fill(pw, pw + C, 0.0);
  std::fill(pb, pb + C, 0.0);
  for (int64_t i = 0; i < G * C; ++i) {
    pw[i % C] += p2[i] * pi[i];
    pb[i % C] += p1[i];
  }
  if (dx != nullptr) input_gradient_impl<T>(threads, pz, x, w, cg.data(), cx.data(), cd.data(), dx);
}

}  // namespace

// The C entry points. Activations are (G, R, C) contiguous rows in one dtype (Dtype: 0 float32, 1 bfloat16 as its
// bits), passed as void*; per (group, channel) coefficients are (G, C) float32, statistics (G, C) float64.
// `threads`: torch.get_num_threads().
extern "C" {

#define CNNS_DISPATCH(dtype, call)                                                        \
  do {                                                                                    \
    if ((dtype) == kBFloat16) { using T = uint16_t; call; } else { using T = float; call; } \
  } while (0)

// Per (group, channel) mean and sum of squared deviations, float64.
void cnns_norm_moments(int64_t threads, int dtype, const void* x, int64_t G, int64_t R, int64_t C, double* mean,
                       double* m2) {
  const Walk w(G, R, C);
  CNNS_DISPATCH(dtype, moments_impl<T>(threads, static_cast<const T*>(x), w, mean, m2));
}

// y = act(x * scale + shift [+ residual]); residual null or laid out as x (then act is none or ReLU).
void cnns_norm_affine_act(int64_t threads, int dtype, const void* x, int64_t G, int64_t R, int64_t C,
                          const float* scale, const float* shift, const void* residual, int64_t act, void* y) {
  const Walk w(G, R, C);
  CNNS_DISPATCH(dtype, affine_act_impl<T>(threads, static_cast<const T*>(x), w, scale, shift,
                                          static_cast<const T*>(residual), act, static_cast<T*>(y)));
}

// The pre-activation gradient gz (not written without an activation) and its two per-channel sums.
void cnns_norm_backward_reduce(int64_t threads, int dtype, const void* grad, const void* x, const void* out,
                               int64_t G, int64_t R, int64_t C, const float* scale, const float* shift,
                               const float* mean, int64_t act, void* gz, double* sum1, double* sum2) {
  const Walk w(G, R, C);
  CNNS_DISPATCH(dtype, backward_reduce_impl<T>(threads, static_cast<const T*>(grad), static_cast<const T*>(x),
                                               static_cast<const T*>(out), w, scale, shift, mean, act,
                                               static_cast<T*>(gz), sum1, sum2));
}

// dx = a * gz + b * x + d.
void cnns_norm_input_gradient(int64_t threads, int dtype, const void* gz, const void* x, int64_t G, int64_t R,
                              int64_t C, const float* a, const float* b, const float* d, void* dx) {
  const Walk w(G, R, C);
  CNNS_DISPATCH(dtype, input_gradient_impl<T>(threads, static_cast<const T*>(gz), static_cast<const T*>(x), w, a, b,
                                              d, static_cast<T*>(dx)));
}

// act(norm(x) [+ residual]) with its statistics and coefficients; weight and bias: C float32 values or null.
void cnns_norm_forward(int64_t threads, int dtype, const void* x, int64_t G, int64_t R, int64_t C, const float* weight,
                       const float* bias, const void* residual, int64_t groups, double eps, int64_t act, void* y,
                       double* mean, double* invstd, float* scale, float* shift, double* mean_c, double* m2_c) {
  const Walk w(G, R, C);
  CNNS_DISPATCH(dtype, forward_impl<T>(threads, static_cast<const T*>(x), w, weight, bias,
                                       static_cast<const T*>(residual), groups, eps, act, static_cast<T*>(y), mean,
                                       invstd, scale, shift, mean_c, m2_c));
}

// Input (dx null: not asked for), weight and bias (C float64) and pre-activation gradients of forward.
void cnns_norm_backward(int64_t threads, int dtype, const void* grad, const void* x, const void* out, int64_t G,
                        int64_t R, int64_t C, const double* mean, const double* invstd, const float* scale,
                        const float* shift, const float* weight, int64_t groups, int64_t act, void* dx,
                        double* grad_weight, double* grad_bias, void* gz) {
  const Walk w(G, R, C);
  CNNS_DISPATCH(dtype, backward_impl<T>(threads, static_cast<const T*>(grad), static_cast<const T*>(x),
                                        static_cast<const T*>(out), w, mean, invstd, scale, shift, weight, groups, act,
                                        static_cast<T*>(dx), grad_weight, grad_bias, static_cast<T*>(gz)));
}

int64_t cnns_parallel_threads(int64_t threads, int64_t tasks) { return parallel_threads(threads, tasks); }

}  // extern "C"
