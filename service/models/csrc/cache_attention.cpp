// Attention of a step's query rows over the static KV cache on CPU, for service/models/attention_cpp.py.
//
// The mask is causal by position: a query at cache position p sees keys 0..p. Each query's position comes in as an
// int64 per (row, position); no [B, Hkv, G * Q, L] mask is built or read, and a task stops at the keys its row's
// last query sees (a batch's rows differ in length: past a row's own length the keys are another row's padding).
// One task per (row, KV head), spread over OpenMP threads. Each tile of 16 cached keys is read and widened to float32
// once for all the task's queries (in bf16 a verify's queries had each widened it again: 1.2-2x slower at 5-7
// positions), then every query's 16 dot products are summed across lanes at once (a 16 x 16 transpose-and-add), so
// no score needs a horizontal sum of its own. A float32 softmax with a polynomial exp that vectorises, then P.V with
// each cached value read once for all the task's queries. Scores stay in a per-thread buffer.
// Portable C++ with GCC/Clang vector types (16 floats: one AVX-512 register, two AVX2 ones), no torch headers: built
// for the machine it runs on (-O3 -march=native) in about a second. Head sizes: multiples of 16.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <vector>

namespace {

constexpr int W = 16;  // floats per vector
typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint16_t vh __attribute__((vector_size(32)));
typedef uint32_t vu __attribute__((vector_size(64)));
typedef uint16_t bf16;  // bfloat16 bits

inline vf load16(const float* p) {
  vf x;
  std::memcpy(&x, p, sizeof x);
  return x;
}

inline vf load16(const bf16* p) {  // bf16 -> float32 is exact: the bits shifted into the high half
  vh h;
  std::memcpy(&h, p, sizeof h);
  const vu bits = __builtin_convertvector(h, vu) << 16;
  vf x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

inline void store1(float* p, float x) { *p = x; }

inline void store1(bf16* p, float f) {  // round to nearest even, as torch does; NaN stays NaN
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {
    *p = static_cast<bf16>((bits >> 16) | 0x40u);
    return;
  }
  bits += 0x7fffu + ((bits >> 16) & 1u);
  *p = static_cast<bf16>(bits >> 16);
}

// e^x for x <= 0 (scores minus their row's max), -inf -> 0: e^x = 2^n e^r with n = round(x log2 e), |r| <= ln 2 / 2,
// and a degree-6 Taylor polynomial for e^r (relative error ~2e-7). Branch-free, so loops over it vectorise.
inline float exp_nonpositive(float x) {
  const float clamped = x < -87.0f ? -87.0f : x;
  const float n = std::nearbyint(clamped * 1.44269504088896341f);
  float r = clamped - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t exponent_bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n; n >= -126 after the clamp
  float scale;
  std::memcpy(&scale, &exponent_bits, sizeof scale);
  return x == -INFINITY ? 0.0f : p * scale;
}

// Halves the vectors to sum: lane t of the result is x[t] + x[t + h] where t & h == 0, else y[t - h] + y[t].
template <int H>
inline vf fold(vf x, vf y) {
  constexpr vi lo = {0 & H ? 16 + 0 - H : 0, 1 & H ? 16 + 1 - H : 1, 2 & H ? 16 + 2 - H : 2, 3 & H ? 16 + 3 - H : 3,
                     4 & H ? 16 + 4 - H : 4, 5 & H ? 16 + 5 - H : 5, 6 & H ? 16 + 6 - H : 6, 7 & H ? 16 + 7 - H : 7,
                     8 & H ? 16 + 8 - H : 8, 9 & H ? 16 + 9 - H : 9, 10 & H ? 16 + 10 - H : 10,
                     11 & H ? 16 + 11 - H : 11, 12 & H ? 16 + 12 - H : 12, 13 & H ? 16 + 13 - H : 13,
                     14 & H ? 16 + 14 - H : 14, 15 & H ? 16 + 15 - H : 15};
  constexpr vi hi = {0 & H ? 16 + 0 : 0 + H, 1 & H ? 16 + 1 : 1 + H, 2 & H ? 16 + 2 : 2 + H, 3 & H ? 16 + 3 : 3 + H,
                     4 & H ? 16 + 4 : 4 + H, 5 & H ? 16 + 5 : 5 + H, 6 & H ? 16 + 6 : 6 + H, 7 & H ? 16 + 7 : 7 + H,
                     8 & H ? 16 + 8 : 8 + H, 9 & H ? 16 + 9 : 9 + H, 10 & H ? 16 + 10 : 10 + H,
                     11 & H ? 16 + 11 : 11 + H, 12 & H ? 16 + 12 : 12 + H, 13 & H ? 16 + 13 : 13 + H,
                     14 & H ? 16 + 14 : 14 + H, 15 & H ? 16 + 15 : 15 + H};
  return __builtin_shuffle(x, y, lo) + __builtin_shuffle(x, y, hi);
}

// Lane t of the result: the sum of the lanes of a[bit-reversed t] (four rounds of `fold`, each taking one bit).
inline vf sum_lanes(vf* a) {
  for (int j = 0; j < 8; ++j) a[j] = fold<8>(a[2 * j], a[2 * j + 1]);
  for (int j = 0; j < 4; ++j) a[j] = fold<4>(a[2 * j], a[2 * j + 1]);
  for (int j = 0; j < 2; ++j) a[j] = fold<2>(a[2 * j], a[2 * j + 1]);
  return fold<1>(a[0], a[1]);
}

constexpr int64_t kAccumulators = 16;  // vectors of P.V sums kept in registers; a head is at most this many
constexpr int kBitReversed[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};

struct Shape {
  int64_t B, H, Q, L, D, P;          // rows, KV heads, query rows per KV head (G x P), keys, head size, positions
  int64_t qs[3], ks[3], vs[3], os[3];  // strides (elements) of the row, head and query/key axes; the last is 1
  int64_t ps;                          // row stride of the positions
};

// NV: vectors per head (D / 16) when fixed at compile time, else 0 (s.D / 16 at run time)
template <int NV, typename T>
void attend(const Shape& s, const T* q, const T* k, const T* v, const int64_t* pos, T* out, float scale, int threads) {
  const int64_t Q = s.Q, S = s.L, nv = NV ? NV : s.D / W;  // S: the scores' row stride
#pragma omp parallel num_threads(threads)
  {
    // P.V's last block of queries may run up to kAccumulators - 1 rows past Q: those rows' scores stay zero
    std::vector<float> scores((Q + kAccumulators) * S);
    std::vector<vf> queries(Q * nv);
    std::vector<vf> keys(W * nv);
    std::vector<int64_t> seen(Q);  // per query, the keys it sees: its position + 1, within [0, L]
#pragma omp for schedule(static)
    for (int64_t task = 0; task < s.B * s.H; ++task) {
      const int64_t b = task / s.H, h = task % s.H;
      const T* kb = k + b * s.ks[0] + h * s.ks[1];
      const T* vb = v + b * s.vs[0] + h * s.vs[1];
      // L: the keys of this task's queries (query row i is at position pos[b, i % P])
      int64_t L = 0;
      for (int64_t i = 0; i < Q; ++i) {
        const int64_t p = pos[b * s.ps + i % s.P];
        seen[i] = p < 0 ? 0 : p >= s.L ? s.L : p + 1;
        L = std::max(L, seen[i]);
      }
      for (int64_t i = 0; i < Q; ++i) {
        const T* qi = q + b * s.qs[0] + h * s.qs[1] + i * s.qs[2];
        for (int64_t c = 0; c < nv; ++c) queries[i * nv + c] = load16(qi + c * W) * scale;
      }
      // scores[i, l] = (q_i * scale) . k_l, 16 keys at a time (keys past a query's own are masked below)
      for (int64_t l0 = 0; l0 < L; l0 += W) {
        const int64_t n = L - l0 < W ? L - l0 : W;
        for (int j = 0; j < n; ++j) {  // the tile's keys in float32, converted once for all the task's queries
          const T* kl = kb + (l0 + j) * s.ks[2];
          for (int64_t c = 0; c < nv; ++c) keys[j * nv + c] = load16(kl + c * W);
        }
        for (int64_t i = 0; i < Q; ++i) {
          const vf* qi = queries.data() + i * nv;
          vf dots[W];
          for (int j = 0; j < W; ++j) {
            vf dot = {};
            if (j < n)
              for (int64_t c = 0; c < nv; ++c) dot += qi[c] * keys[j * nv + c];
            dots[kBitReversed[j]] = dot;
          }
          const vf sums = sum_lanes(dots);
          float* si = scores.data() + i * S + l0;
          if (n == W)  // one vector store: GCC's loop of lane stores made whole verify calls 5-15% slower
            std::memcpy(si, &sums, sizeof sums);
          else
            for (int j = 0; j < n; ++j) si[j] = sums[j];
        }
      }
      // softmax over each query's keys, in place, zeros past them; a query that sees no key gets zeros
      for (int64_t i = 0; i < Q; ++i) {
        float* si = scores.data() + i * S;
        const int64_t n = seen[i];
        std::fill(si + n, si + L, 0.0f);
        float top = -INFINITY;
#pragma omp simd reduction(max : top)
        for (int64_t l = 0; l < n; ++l) top = si[l] > top ? si[l] : top;
        if (top == -INFINITY) {  // no key (n = 0), or none with a finite score
          std::fill(si, si + n, 0.0f);
          continue;
        }
        float total = 0.0f;
#pragma omp simd reduction(+ : total)
        for (int64_t l = 0; l < n; ++l) {
          si[l] = exp_nonpositive(si[l] - top);
          total += si[l];
        }
        const float inv = 1.0f / total;  // >= 1: the max's own term is e^0
#pragma omp simd
        for (int64_t l = 0; l < n; ++l) si[l] *= inv;
      }
      // out[i] = sum_l p[i, l] v_l for a block of queries at a time, its accumulators in registers: each value is
      // read once per block (rows past Q have zero scores)
      const int64_t block = kAccumulators / nv < Q ? kAccumulators / nv : Q;
      for (int64_t i0 = 0; i0 < Q; i0 += block) {
        vf acc[kAccumulators] = {};
        for (int64_t l = 0; l < L; ++l) {
          const T* vl = vb + l * s.vs[2];
          for (int64_t c = 0; c < nv; ++c) {
            const vf value = load16(vl + c * W);
            for (int64_t i = 0; i < block; ++i) acc[i * nv + c] += scores[(i0 + i) * S + l] * value;
          }
        }
        for (int64_t i = 0; i < block && i0 + i < Q; ++i) {
          T* oi = out + b * s.os[0] + h * s.os[1] + (i0 + i) * s.os[2];
          for (int64_t c = 0; c < nv; ++c)
            for (int j = 0; j < W; ++j) store1(oi + c * W + j, acc[i * nv + c][j]);
        }
      }
    }
  }
}

template <int NV>
int dispatch(int dtype, const Shape& s, const void* q, const void* k, const void* v, const int64_t* pos, void* out,
             float scale, int threads) {
  switch (dtype) {
    case 0:
      attend<NV>(s, static_cast<const float*>(q), static_cast<const float*>(k), static_cast<const float*>(v), pos,
                 static_cast<float*>(out), scale, threads);
      return 0;
    case 1:
      attend<NV>(s, static_cast<const bf16*>(q), static_cast<const bf16*>(k), static_cast<const bf16*>(v), pos,
                 static_cast<bf16*>(out), scale, threads);
      return 0;
    default:
      return 1;
  }
}

}  // namespace

// dtype: 0 = float32 tensors, 1 = bfloat16 tensors. pos: int64 [B, P], each query position's place in the cache
// (query row i of a KV head is at position i % P: rows are G x P, the group's heads in turn).
// shape: B, H, Q, L, D, P, then the strides of the first three axes of q, k, v and out in turn (the last axis of each
// is contiguous), then the row stride of pos. Returns 0, or 1 for a dtype code, head size or shape it does not take.
extern "C" int specroll_cache_attention(int dtype, const int64_t* shape, const void* q, const void* k, const void* v,
                                        const int64_t* pos, void* out, float scale, int threads) {
  Shape s{shape[0], shape[1], shape[2], shape[3], shape[4], shape[5], {}, {}, {}, {}, shape[18]};
  int64_t* strides[4] = {s.qs, s.ks, s.vs, s.os};
  for (int t = 0; t < 4; ++t)
    for (int a = 0; a < 3; ++a) strides[t][a] = shape[6 + 3 * t + a];
  if (s.D <= 0 || s.D % W != 0 || s.D > W * kAccumulators || s.P <= 0 || s.Q % s.P != 0) return 1;
  switch (s.D / W) {
    case 1: return dispatch<1>(dtype, s, q, k, v, pos, out, scale, threads);
    case 2: return dispatch<2>(dtype, s, q, k, v, pos, out, scale, threads);
    case 4: return dispatch<4>(dtype, s, q, k, v, pos, out, scale, threads);
    case 8: return dispatch<8>(dtype, s, q, k, v, pos, out, scale, threads);
    default: return dispatch<0>(dtype, s, q, k, v, pos, out, scale, threads);
  }
}
