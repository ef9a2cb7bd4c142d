// Attention over a paged KV cache on CPU (decode and verify steps, prefill chunks), reading each
// row's keys and values straight from its pages.
//
// XLA's path gathers every row's pages of the attention window into a contiguous [B, K, S, D]
// copy, masks the slots each query may not see and multiplies; its scores product (q k^T,
// contracting the keys' minor dim) ran at 4 GB/s and a batch-32 float32 decode step spent a
// quarter of its time there. Here each (row, KV head) reads only the tokens its queries see, in
// place, once for all of its queries (`python -m experiments.attention_cpu` times the two).
// A prefill chunk's new tokens are taken kQueryBlock at a time, each block a unit of work that
// reads only the tokens its last query sees: the causal triangle is skipped a block at a time,
// and a one-row chunk still splits between threads.
//
//   out[b, t, h] = sum_s softmax_s(scale * q[b, t, h] . k[b, s]) v[b, s],  s < seen(b, t)
//
// A row holds lengths[b] tokens after this step, the last q_lens[b] of them its new ones, so new
// token t sees seen(b, t) = lengths[b] - q_lens[b] + t + 1 tokens (causal order); a padding query
// (t >= q_lens[b]) sees slot 0, as the masked attention it replaces does, and its output is
// never used.
//
// q [B, T, H, D] (float32 or bfloat16), pages [P, K, G, D] (float32 or bfloat16, head-major: a
// page's G tokens of one KV head are contiguous), lengths, q_lens [B] and page_tables [B, n]
// int32; out [B, T, H, D] float32. Query head h reads KV head h / (H / K).

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

#if !defined(__AVX512F__) || !defined(__AVX512BW__)
#error "kernels_cpu/attention.cc needs AVX-512 F and BW; attention.py falls back to XLA without it"
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int kLanes = 16;

// Register arrays are indexed by loop counters; unrolled early, GCC keeps them in registers.
#define UNROLL _Pragma("GCC unroll 16")

inline __mmask16 tail_mask(int64_t remaining) {
  return remaining >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << remaining) - 1);
}

inline __m512 load(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }

inline __m512 load(const uint16_t* p, __mmask16 mask) {
  // bfloat16 is the top half of a float32.
  __m256i half = _mm256_maskz_loadu_epi16(mask, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

// e^x for 16 lanes: 2^n * e^r with n = round(x / ln 2) and |r| <= ln(2) / 2, e^r by its Taylor
// series to r^7 (relative error under 1e-7 there). x <= 0 here (scores minus their maximum).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));  // e^-87 is a normal float; lower is 0 anyway
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  const __m512 rr = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, rr, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, rr, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, rr, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, rr, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, rr, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, rr, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, rr, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

struct Shape {
  int64_t B, T, H, D, P, K, G, n;  // rows, queries a row, query heads, head dim, pages, KV heads,
                                   // page size, table width
};

// Lane i of the result is the sum of the 16 lanes of v[i]: 16 dot products finished at once,
// 45 shuffles and adds where one horizontal sum each took about as many per vector.
inline __m512 sum16(const __m512 (&v)[kLanes]) {
  __m512 w[8], x[4], y[2];
  // Each 128-bit lane of w[i]: v[2i] and v[2i+1] halved, interleaved (a, b, a, b).
  UNROLL for (int i = 0; i < 8; ++i)
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  // Each 128-bit lane of x[i]: that lane's sums of v[4i], ..., v[4i + 3].
  UNROLL for (int i = 0; i < 4; ++i)
    x[i] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // Then the four 128-bit lanes added, two at a time.
  UNROLL for (int i = 0; i < 2; ++i)
    y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(y[0], y[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// Per-thread scratch of one (row, KV head).
struct Scratch {
  std::vector<int64_t> offsets;  // [tokens] where each visible token sits in the pages
  std::vector<float> queries;    // [queries, VEC * 16] scaled, zero-padded
  std::vector<float> scores;     // [queries, tokens rounded up to 16]
  std::vector<int64_t> seen;     // [queries] tokens each query sees
  std::vector<float> inverse;    // [queries] 1 / the total of each query's weights
};

// New tokens of a row taken together as one unit of work (a decode step, a verify step of up to
// 15 drafts: one block a row).
constexpr int64_t kQueryBlock = 16;

// One (row, KV head) and new tokens [t0, t1): their queries ((t1 - t0) tokens x `group` query
// heads, query i = (t - t0) * group + g) against the row's tokens they see, each key and value
// read from the pages once for all of them. VEC = vectors of 16 lanes in a head (D <= 16 VEC).
// Queries that see fewer tokens (earlier new tokens) skip the rest: a slot past what a query
// sees is never multiplied into its output, so an unused slot's contents (NaN in the tests)
// cannot leak.
template <int VEC, typename Q, typename KV>
void attend_row(const Q* q, const KV* k_pages, const KV* v_pages, const int32_t* table,
                int64_t start, int64_t valid, const Shape& s, int64_t kv_head, int64_t t0,
                int64_t t1, float scale, Scratch& w, float* out) {
  const int64_t group = s.H / s.K;
  const int64_t nq = (t1 - t0) * group;
  const __mmask16 tail = tail_mask(s.D - (VEC - 1) * kLanes);
  auto mask = [&](int j) { return j == VEC - 1 ? tail : __mmask16(0xFFFF); };
  // Tokens each query sees (a padding query: slot 0), and the most any does.
  w.seen.resize(nq);
  int64_t tokens = 1;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t seen = t < valid ? std::clamp<int64_t>(start + t + 1, 1, s.n * s.G) : 1;
    for (int64_t g = 0; g < group; ++g) w.seen[(t - t0) * group + g] = seen;
    tokens = std::max(tokens, seen);
  }
  const int64_t padded = (tokens + kLanes - 1) / kLanes * kLanes;
  // Every token's place, looked up once; the padding past `tokens` repeats token 0, which
  // every row has (its scores are dropped).
  w.offsets.resize(padded);
  for (int64_t i = 0, slot = 0; i < tokens; ++slot) {
    const int64_t page = std::clamp<int64_t>(table[slot], 0, s.P - 1);
    const int64_t base = (page * s.K + kv_head) * s.G * s.D;
    for (int64_t u = 0; u < s.G && i < tokens; ++u, ++i) w.offsets[i] = base + u * s.D;
  }
  std::fill(w.offsets.begin() + tokens, w.offsets.end(), w.offsets[0]);
  w.queries.resize(nq * VEC * kLanes);
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t g = 0; g < group; ++g)
      UNROLL for (int j = 0; j < VEC; ++j)
        _mm512_storeu_ps(w.queries.data() + (((t - t0) * group + g) * VEC + j) * kLanes,
                         _mm512_mul_ps(load(q + (t * s.H + kv_head * group + g) * s.D
                                              + j * kLanes, mask(j)),
                                       _mm512_set1_ps(scale)));
  // Scores, 16 tokens at a time: the tokens' keys stay in L1 while each query takes them.
  // A row's tokens sit a page at a time at scattered places, where the hardware's prefetchers
  // stop: the next tokens' keys and values are fetched ahead by hand.
  constexpr int64_t kLines = (VEC * kLanes * int64_t(sizeof(KV)) + 63) / 64;  // lines a token
  auto fetch = [&](const KV* pages, int64_t t) {
    const char* line = reinterpret_cast<const char*>(pages + w.offsets[t]);
    UNROLL for (int64_t l = 0; l < kLines; ++l) _mm_prefetch(line + 64 * l, _MM_HINT_T0);
  };
  for (int64_t t = 0; t < std::min<int64_t>(padded, kLanes); ++t) fetch(k_pages, t);
  w.scores.resize(nq * padded);
  for (int64_t c = 0; c < padded; c += kLanes) {
    for (int64_t t = c + kLanes; t < std::min(padded, c + 2 * kLanes); ++t) fetch(k_pages, t);
    for (int64_t i = 0; i < nq; ++i) {
      __m512 qv[VEC];
      UNROLL for (int j = 0; j < VEC; ++j)
        qv[j] = _mm512_loadu_ps(w.queries.data() + (i * VEC + j) * kLanes);
      __m512 acc[kLanes];
      UNROLL for (int u = 0; u < kLanes; ++u) {
        const KV* key = k_pages + w.offsets[c + u];
        __m512 a = _mm512_mul_ps(qv[0], load(key, mask(0)));
        UNROLL for (int j = 1; j < VEC; ++j)
          a = _mm512_fmadd_ps(qv[j], load(key + j * kLanes, mask(j)), a);
        acc[u] = a;
      }
      _mm512_storeu_ps(w.scores.data() + i * padded + c, sum16(acc));
    }
  }
  // Softmax weights per query over the tokens it sees, left unnormalized: the sum of the
  // values is divided by their total once.
  w.inverse.resize(nq);
  for (int64_t i = 0; i < nq; ++i) {
    float* row = w.scores.data() + i * padded;
    const int64_t seen = w.seen[i];
    __m512 peak = _mm512_set1_ps(-INFINITY);
    for (int64_t t = 0; t < seen; t += kLanes)
      peak = _mm512_mask_max_ps(peak, tail_mask(seen - t), peak, _mm512_loadu_ps(row + t));
    const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(peak));
    __m512 total = _mm512_setzero_ps();
    for (int64_t t = 0; t < seen; t += kLanes) {
      const __mmask16 m = tail_mask(seen - t);
      const __m512 e = _mm512_maskz_mov_ps(m, exp16(_mm512_sub_ps(_mm512_loadu_ps(row + t), top)));
      _mm512_storeu_ps(row + t, e);
      total = _mm512_add_ps(total, e);
    }
    w.inverse[i] = 1.0f / _mm512_reduce_add_ps(total);
  }
  // Values: each token's read once for a set of queries whose sums stay in registers.
  for (int64_t t = 0; t < std::min<int64_t>(tokens, kLanes); ++t) fetch(v_pages, t);
  constexpr int kSet = VEC >= 24 ? 1 : 24 / VEC;
  for (int64_t i0 = 0; i0 < nq; i0 += kSet) {
    const int64_t count = std::min<int64_t>(kSet, nq - i0);
    int64_t fewest = tokens;
    for (int64_t i = i0; i < i0 + count; ++i) fewest = std::min(fewest, w.seen[i]);
    __m512 acc[kSet][VEC];
    UNROLL for (int r = 0; r < kSet; ++r)
      UNROLL for (int j = 0; j < VEC; ++j) acc[r][j] = _mm512_setzero_ps();
    auto add_token = [&](int64_t t, bool every) {
      if (t + kLanes < tokens) fetch(v_pages, t + kLanes);
      const KV* value = v_pages + w.offsets[t];
      __m512 vv[VEC];
      UNROLL for (int j = 0; j < VEC; ++j) vv[j] = load(value + j * kLanes, mask(j));
      UNROLL for (int r = 0; r < kSet; ++r) {
        if (r >= count || (!every && t >= w.seen[i0 + r])) continue;
        const __m512 p = _mm512_set1_ps(w.scores[(i0 + r) * padded + t]);
        UNROLL for (int j = 0; j < VEC; ++j) acc[r][j] = _mm512_fmadd_ps(p, vv[j], acc[r][j]);
      }
    };
    for (int64_t t = 0; t < fewest; ++t) add_token(t, true);
    for (int64_t t = fewest; t < tokens; ++t) add_token(t, false);
    UNROLL for (int r = 0; r < count; ++r) {
      const int64_t i = i0 + r, t = t0 + i / group, g = i % group;
      float* o = out + (t * s.H + kv_head * group + g) * s.D;
      UNROLL for (int j = 0; j < VEC; ++j)
        _mm512_mask_storeu_ps(o + j * kLanes, mask(j),
                              _mm512_mul_ps(acc[r][j], _mm512_set1_ps(w.inverse[i])));
    }
  }
}

template <int VEC, typename Q, typename KV>
void attend_all(ffi::ThreadPool& pool, const Q* q, const KV* k_pages, const KV* v_pages,
                const int32_t* lengths, const int32_t* q_lens, const int32_t* tables,
                const Shape& s, float scale, float* out) {
  // Units are (query block, row, KV head), the last blocks (which see the most tokens) first so
  // that the cheap ones even out the threads at the end; four chunks a thread even out threads
  // that start late.
  const int64_t blocks = (s.T + kQueryBlock - 1) / kQueryBlock;
  infer_cpu::run_in_chunks(pool, blocks * s.B * s.K, 4 * pool.num_threads(),
                           [&](int64_t first, int64_t last) {
    thread_local Scratch scratch;
    for (int64_t u = first; u < last; ++u) {
      const int64_t block = blocks - 1 - u / (s.B * s.K);
      const int64_t b = u % (s.B * s.K) / s.K, kv_head = u % s.K;
      const int64_t at = b * s.T * s.H * s.D;
      const int64_t t0 = block * kQueryBlock, t1 = std::min(s.T, t0 + kQueryBlock);
      attend_row<VEC>(q + at, k_pages, v_pages, tables + b * s.n,
                      int64_t(lengths[b]) - q_lens[b], q_lens[b], s, kv_head, t0, t1, scale,
                      scratch, out + at);
    }
  });
}

// Head dims up to 16 vectors (256), each a register count of its own.
template <typename Q, typename KV>
ffi::Error attend_dims(ffi::ThreadPool& pool, const Q* q, const KV* k_pages, const KV* v_pages,
                       const int32_t* lengths, const int32_t* q_lens, const int32_t* tables,
                       const Shape& s, float scale, float* out) {
  switch ((s.D + kLanes - 1) / kLanes) {
#define INFER_ATTEND_DIMS(V) \
  case V: attend_all<V>(pool, q, k_pages, v_pages, lengths, q_lens, tables, s, scale, out); break;
    INFER_ATTEND_DIMS(1) INFER_ATTEND_DIMS(2) INFER_ATTEND_DIMS(3) INFER_ATTEND_DIMS(4)
    INFER_ATTEND_DIMS(5) INFER_ATTEND_DIMS(6) INFER_ATTEND_DIMS(7) INFER_ATTEND_DIMS(8)
    INFER_ATTEND_DIMS(9) INFER_ATTEND_DIMS(10) INFER_ATTEND_DIMS(11) INFER_ATTEND_DIMS(12)
    INFER_ATTEND_DIMS(13) INFER_ATTEND_DIMS(14) INFER_ATTEND_DIMS(15) INFER_ATTEND_DIMS(16)
#undef INFER_ATTEND_DIMS
    default:
      return ffi::Error::InvalidArgument("paged_attention_cpu: head dims above 256");
  }
  return ffi::Error::Success();
}

template <typename Q>
ffi::Error dispatch_pages(ffi::ThreadPool& pool, const Q* q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                          const int32_t* lengths, const int32_t* q_lens, const int32_t* tables,
                          const Shape& s, float scale, float* out) {
  if (k.element_type() == ffi::DataType::F32)
    return attend_dims(pool, q, static_cast<const float*>(k.untyped_data()),
                       static_cast<const float*>(v.untyped_data()), lengths, q_lens, tables, s,
                       scale, out);
  // U16: bfloat16 pages as their bits, as the paged cache holds them on CPU.
  if (k.element_type() == ffi::DataType::BF16 || k.element_type() == ffi::DataType::U16)
    return attend_dims(pool, q, static_cast<const uint16_t*>(k.untyped_data()),
                       static_cast<const uint16_t*>(v.untyped_data()), lengths, q_lens, tables,
                       s, scale, out);
  return ffi::Error::InvalidArgument("paged_attention_cpu: pages must be float32 or bfloat16");
}

ffi::Error paged_attention_impl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k,
                                ffi::AnyBuffer v, ffi::Buffer<ffi::S32> lengths,
                                ffi::Buffer<ffi::S32> q_lens, ffi::Buffer<ffi::S32> page_tables,
                                ffi::Result<ffi::Buffer<ffi::F32>> out, float scale) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  const auto td = page_tables.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || td.size() != 2 || vd.size() != 4 ||
      !std::equal(kd.begin(), kd.end(), vd.begin()) || k.element_type() != v.element_type())
    return ffi::Error::InvalidArgument(
        "paged_attention_cpu: q [B, T, H, D], pages [P, K, G, D] alike, page_tables [B, n]");
  const Shape s{qd[0], qd[1], qd[2], qd[3], kd[0], kd[1], kd[2], td[1]};
  if (kd[3] != s.D || td[0] != s.B || lengths.dimensions().size() != 1 ||
      lengths.dimensions()[0] != s.B || q_lens.dimensions().size() != 1 ||
      q_lens.dimensions()[0] != s.B || s.K == 0 || s.H % s.K != 0)
    return ffi::Error::InvalidArgument("paged_attention_cpu: shapes disagree");
  // The kernel writes one float per element of q: an output of another shape would be written
  // past its end.
  const auto od = out->dimensions();
  if (!std::equal(od.begin(), od.end(), qd.begin(), qd.end()))
    return ffi::Error::InvalidArgument("paged_attention_cpu: out must be q's shape, float32");
  if (s.B == 0 || s.T == 0 || s.H == 0 || s.D == 0) return ffi::Error::Success();
  if (s.P == 0 || s.n == 0 || s.G == 0)
    return ffi::Error::InvalidArgument("paged_attention_cpu: no pages to read");
  float* o = out->typed_data();
  if (q.element_type() == ffi::DataType::F32)
    return dispatch_pages(pool, static_cast<const float*>(q.untyped_data()), k, v,
                          lengths.typed_data(), q_lens.typed_data(), page_tables.typed_data(), s,
                          scale, o);
  if (q.element_type() == ffi::DataType::BF16)
    return dispatch_pages(pool, static_cast<const uint16_t*>(q.untyped_data()), k, v,
                          lengths.typed_data(), q_lens.typed_data(), page_tables.typed_data(), s,
                          scale, o);
  return ffi::Error::InvalidArgument("paged_attention_cpu: q must be float32 or bfloat16");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(InferPagedAttentionCpu, paged_attention_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale"));
