// Attention over a paged KV cache for steps of a few query tokens a row (decode, verify), on
// CPU, reading each row's keys and values straight from its pages.
//
// XLA's path gathers every row's pages of the attention window into a contiguous [B, K, S, D]
// copy, masks the slots each query may not see and multiplies; its scores product (q k^T,
// contracting the keys' minor dim) ran at 4 GB/s and a batch-32 float32 decode step spent a
// quarter of its time there. Here each (row, KV head) reads only the tokens its queries see, in
// place.
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

// One (row, KV head): its `group` query heads against the row's first `length` tokens. `scores`
// holds group x length floats.
template <typename Q, typename KV>
void attend(const Q* q, const KV* k_pages, const KV* v_pages, const int32_t* table,
            int64_t length, const Shape& s, int64_t kv_head, float scale, float* scores,
            float* out) {
  const int64_t group = s.H / s.K;
  const int64_t vectors = (s.D + kLanes - 1) / kLanes;
  // The group's queries as float32, scaled once, each padded to whole vectors with zeros.
  thread_local std::vector<float> queries;
  queries.resize(group * vectors * kLanes);
  for (int64_t g = 0; g < group; ++g)
    for (int64_t j = 0; j < vectors; ++j)
      _mm512_storeu_ps(queries.data() + (g * vectors + j) * kLanes,
                       _mm512_mul_ps(load(q + (kv_head * group + g) * s.D + j * kLanes,
                                          tail_mask(s.D - j * kLanes)),
                                     _mm512_set1_ps(scale)));
  auto query = [&](int64_t g, int64_t j) {
    return _mm512_loadu_ps(queries.data() + (g * vectors + j) * kLanes);
  };
  auto token = [&](const KV* pages, int64_t t) {
    const int64_t page = std::clamp<int64_t>(table[t / s.G], 0, s.P - 1);
    return pages + ((page * s.K + kv_head) * s.G + t % s.G) * s.D;
  };
  // Scores, each a dot product over D.
  for (int64_t t = 0; t < length; ++t) {
    const KV* key = token(k_pages, t);
    for (int64_t g = 0; g < group; ++g) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t j = 0; j < vectors; ++j)
        acc = _mm512_fmadd_ps(query(g, j),
                              load(key + j * kLanes, tail_mask(s.D - j * kLanes)), acc);
      scores[g * length + t] = _mm512_reduce_add_ps(acc);
    }
  }
  // Softmax per query head, then the values weighted by it.
  for (int64_t g = 0; g < group; ++g) {
    float* row = scores + g * length;
    float peak = -INFINITY;
    for (int64_t t = 0; t < length; ++t) peak = std::max(peak, row[t]);
    __m512 total = _mm512_setzero_ps();
    for (int64_t t = 0; t < length; t += kLanes) {
      const __mmask16 mask = tail_mask(length - t);
      const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, row + t),
                                           _mm512_set1_ps(peak)));
      _mm512_mask_storeu_ps(row + t, mask, e);
      total = _mm512_add_ps(total, _mm512_maskz_mov_ps(mask, e));
    }
    const float inverse = 1.0f / _mm512_reduce_add_ps(total);
    for (int64_t t = 0; t < length; ++t) row[t] *= inverse;
  }
  for (int64_t g = 0; g < group; ++g) {
    for (int64_t j = 0; j < vectors; ++j) {
      const __mmask16 mask = tail_mask(s.D - j * kLanes);
      __m512 acc = _mm512_setzero_ps();
      for (int64_t t = 0; t < length; ++t)
        acc = _mm512_fmadd_ps(_mm512_set1_ps(scores[g * length + t]),
                              load(token(v_pages, t) + j * kLanes, mask), acc);
      _mm512_mask_storeu_ps(out + (kv_head * group + g) * s.D + j * kLanes, mask, acc);
    }
  }
}

template <typename Q, typename KV>
void attend_all(ffi::ThreadPool& pool, const Q* q, const KV* k_pages, const KV* v_pages,
                const int32_t* lengths, const int32_t* q_lens, const int32_t* tables,
                const Shape& s, float scale, float* out) {
  const int64_t group = s.H / s.K;
  // Units are (row, KV head) pairs; four chunks a thread even out threads that start late.
  infer_cpu::run_in_chunks(pool, s.B * s.K, 4 * pool.num_threads(), [&](int64_t first,
                                                                        int64_t last) {
    std::vector<float> scores;
    for (int64_t u = first; u < last; ++u) {
      const int64_t b = u / s.K, kv_head = u % s.K;
      const int64_t start = int64_t(lengths[b]) - q_lens[b];
      for (int64_t t = 0; t < s.T; ++t) {
        // Tokens this query sees, within the row's table; a padding query reads slot 0.
        const int64_t seen =
            t < q_lens[b] ? std::clamp<int64_t>(start + t + 1, 1, s.n * s.G) : 1;
        scores.resize(group * seen);
        const int64_t at = (b * s.T + t) * s.H * s.D;
        attend(q + at, k_pages, v_pages, tables + b * s.n, seen, s, kv_head, scale,
               scores.data(), out + at);
      }
    }
  });
}

template <typename Q>
ffi::Error dispatch_pages(ffi::ThreadPool& pool, const Q* q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                          const int32_t* lengths, const int32_t* q_lens, const int32_t* tables,
                          const Shape& s, float scale, float* out) {
  if (k.element_type() == ffi::DataType::F32) {
    attend_all(pool, q, static_cast<const float*>(k.untyped_data()),
               static_cast<const float*>(v.untyped_data()), lengths, q_lens, tables, s, scale,
               out);
    return ffi::Error::Success();
  }
  if (k.element_type() == ffi::DataType::BF16) {
    attend_all(pool, q, static_cast<const uint16_t*>(k.untyped_data()),
               static_cast<const uint16_t*>(v.untyped_data()), lengths, q_lens, tables, s, scale,
               out);
    return ffi::Error::Success();
  }
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
