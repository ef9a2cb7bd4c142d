// Products of a few rows of activations with a weight, on CPU, reading the weight once.
//
// Decode and verify steps multiply a few rows by every weight, so they are bound by reading the
// weights. XLA:CPU reads them at near the machine's streaming rate only in its one-row float32
// GEMV; it hands 2-8 rows, and bfloat16 weights at any row count, to GEMM paths that stream a
// half to a third as fast (`python -m experiments.dense_cpu`; figures in the README). This
// kernel streams each weight once and multiplies every row against it as it passes. From 9 rows
// (batched decode, verify steps) an [in, out] product is bound by its multiplies instead, and
// the kernel keeps register tiles of 12 rows x 32 columns over blocks of weight rows, the shape
// of a GEMM's inner kernel (`kn_strips`).
//
//   out[m, n] = sum_k x[m, k] * w[k, n]   (layout "kn": the model's projections, [in, out])
//   out[m, n] = sum_k x[m, k] * w[n, k]   (layout "nk": the tied vocabulary projection)
//
// x and w are float32 or bfloat16 (the same dtype); out is float32. bfloat16 is multiplied in
// pairs by VDPBF16PS where the CPU has it (AVX512-BF16), else widened to float32 in registers (a
// shift or a mask); products accumulate in float32. bfloat16 products of `tiles_from` rows or
// more go to AMX tiles where the CPU has them (`kn_tiles`, `nk_tiles`), and so does every
// product with a weight stored in the tiles' layout at load (rank 4, `kn_packed`). A float32
// weight stored as strips at load (rank 3, `kn_strips_packed`) takes the register tiles at every
// row count, with the [K, N] weight's bits.
//
// Each output element is summed in an order fixed by K and the layout alone, never by the number
// of rows or the split between threads, so a row's result is the same bits whether it is
// multiplied alone or among others (tests/kernels/test_dense_cpu.py checks); AMX tiles round
// differently, so that holds among the row counts below `tiles_from` and among those from it.

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if !defined(__AVX512F__) || !defined(__AVX512BW__)
#error "kernels_cpu/dense.cc needs AVX-512 F and BW; dense.py falls back to XLA without it"
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int kLanes = 16;

// Tiles load 64-byte rows; buffers they read start on a cache line.
template <typename T>
struct AlignedAllocator {
  using value_type = T;
  AlignedAllocator() = default;
  template <typename U>
  AlignedAllocator(const AlignedAllocator<U>&) {}
  T* allocate(size_t n) {
    return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64)));
  }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
  bool operator==(const AlignedAllocator&) const { return true; }
  bool operator!=(const AlignedAllocator&) const { return false; }
};

// Register tiles are arrays indexed by loop counters; unrolled early, GCC keeps them in
// registers instead of storing every accumulator to the stack on each step.
#define UNROLL _Pragma("GCC unroll 16")

inline __mmask16 tail_mask(int64_t remaining) {
  return remaining >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << remaining) - 1);
}

// The same for 32 16-bit lanes.
inline __mmask32 tail_mask32(int64_t remaining) {
  return remaining >= 2 * kLanes ? __mmask32(0xFFFFFFFFu)
                                 : __mmask32((uint64_t(1) << remaining) - 1);
}

inline __m512 load(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }

inline __m512 load(const uint16_t* p, __mmask16 mask) {
  // bfloat16 is the top half of a float32: widen each to 32 bits and shift it up.
  __m256i half = _mm256_maskz_loadu_epi16(mask, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

// Layout "kn": R rows against KB whole weight rows at a time, read front to back.
//
// A register tile that walks down a narrow column strip reads 64-128 bytes of each weight row at
// a stride the hardware prefetchers do not follow; that ran at a third of the speed of XLA's
// GEMV. Here the running sums live in memory (a block's partial sums, R x N floats, in cache),
// loaded and stored once per KB rows. Each sum still takes its terms in order of k, one FMA at a
// time.
template <int R, int KB, bool kMasked>
inline void kn_vector(const __m512 (&xv)[R][KB], const float* row, float* out, int64_t ldp,
                      int64_t N, int64_t c, __mmask16 mask) {
  __m512 acc[R];
  UNROLL for (int r = 0; r < R; ++r)
    acc[r] = kMasked ? _mm512_maskz_loadu_ps(mask, out + r * ldp + c)
                     : _mm512_loadu_ps(out + r * ldp + c);
  UNROLL for (int kk = 0; kk < KB; ++kk) {
    // The next pass's rows, fetched into L2 while this pass computes: with more rows a pass
    // takes longer than the hardware prefetchers look ahead. Measured interleaved in one
    // process: into L2 beat into L1 by 8-30% (a pass of a 1536-column weight is larger than
    // L1), and 1 pass ahead beat 0, 2, 3, 4, 8 and 16. Past the end of the weight a prefetch is
    // harmless.
    _mm_prefetch(reinterpret_cast<const char*>(row + (KB + kk) * N + c), _MM_HINT_T1);
    const __m512 wv = kMasked ? load(row + kk * N + c, mask) : load(row + kk * N + c);
    UNROLL for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(xv[r][kk], wv, acc[r]);
  }
  UNROLL for (int r = 0; r < R; ++r) {
    if (kMasked)
      _mm512_mask_storeu_ps(out + r * ldp + c, mask, acc[r]);
    else
      _mm512_storeu_ps(out + r * ldp + c, acc[r]);
  }
}

// float32 "kn" rows.
template <int R, int KB>
void kn_rows(const float* x, const float* w, float* out, int64_t K, int64_t N, int64_t ldp,
             int64_t k0) {
  __m512 xv[R][KB];
  UNROLL for (int r = 0; r < R; ++r)
    UNROLL for (int kk = 0; kk < KB; ++kk) xv[r][kk] = _mm512_set1_ps(x[r * K + k0 + kk]);
  const float* row = w + k0 * N;
  int64_t c = 0;
  // Full vectors unmasked: masked stores are slow on some x86 cores (AMD Zen 4 among them).
  for (; c + kLanes <= N; c += kLanes) kn_vector<R, KB, false>(xv, row, out, ldp, N, c, 0);
  if (c < N) kn_vector<R, KB, true>(xv, row, out, ldp, N, c, tail_mask(N - c));
}

// The R rows' partial sums of 32 columns from c, as two vectors of 16 each, and back.
template <int R>
inline void load_sums(const float* out, int64_t ldp, int64_t c, __m512 (&a)[R], __m512 (&b)[R]) {
  UNROLL for (int r = 0; r < R; ++r) {
    a[r] = _mm512_loadu_ps(out + r * ldp + c);
    b[r] = _mm512_loadu_ps(out + r * ldp + c + kLanes);
  }
}

template <int R>
inline void store_sums(float* out, int64_t ldp, int64_t c, const __m512 (&a)[R],
                       const __m512 (&b)[R]) {
  UNROLL for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(out + r * ldp + c, a[r]);
    _mm512_storeu_ps(out + r * ldp + c + kLanes, b[r]);
  }
}

// bfloat16 "kn" rows on CPUs without AVX512-BF16 (kn_rows_dot below where it has it), 32
// columns a step from one 64-byte load: each 32-bit lane holds a column
// (low half) and the next one (high half), widened by a shift and by a mask, with no shuffle.
// The partial sums keep that order, per 32 columns 16 even then 16 odd (`add_blocks` puts the
// columns back in order); their rows are padded to 32 columns, so the last group is stored whole.
template <int R, int KB>
void kn_rows_paired(const float* x, const uint16_t* w, float* out, int64_t K, int64_t N,
                    int64_t ldp, int64_t k0) {
  __m512 xv[R][KB];
  UNROLL for (int r = 0; r < R; ++r)
    UNROLL for (int kk = 0; kk < KB; ++kk) xv[r][kk] = _mm512_set1_ps(x[r * K + k0 + kk]);
  const uint16_t* row = w + k0 * N;
  const __m512i high = _mm512_set1_epi32(int(0xFFFF0000u));
  for (int64_t c = 0; c < N; c += 2 * kLanes) {
    const __mmask32 mask = tail_mask32(N - c);
    __m512 even[R], odd[R];
    load_sums<R>(out, ldp, c, even, odd);
    UNROLL for (int kk = 0; kk < KB; ++kk) {
      _mm_prefetch(reinterpret_cast<const char*>(row + (KB + kk) * N + c), _MM_HINT_T1);  // as kn_vector
      const __m512i pairs = _mm512_maskz_loadu_epi16(mask, row + kk * N + c);
      const __m512 e = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
      const __m512 o = _mm512_castsi512_ps(_mm512_and_si512(pairs, high));
      UNROLL for (int r = 0; r < R; ++r) {
        even[r] = _mm512_fmadd_ps(xv[r][kk], e, even[r]);
        odd[r] = _mm512_fmadd_ps(xv[r][kk], o, odd[r]);
      }
    }
    store_sums<R>(out, ldp, c, even, odd);
  }
}

// Weight rows per pass. Each pass loads and stores the R rows of partial sums once, so the more
// weight rows per pass, the less of that traffic per weight byte: passes of 8 rows beat 2, 3, 4
// and 6 at 3-5 rows, and 12 and 16 too in float32 (interleaved in one process). The broadcast
// values that do not fit in registers are read from the stack, in cache.
constexpr int kKnRowsPerPass = 8;

#if defined(__AVX512BF16__)
// bfloat16 "kn" rows where the CPU multiplies bfloat16 pairs itself (VDPBF16PS), two weight rows
// at a time: the same 32 columns of rows k and k + 1, interleaved word by word (an unpack within
// each 128-bit lane), form pairs (w[k][c], w[k + 1][c]) that one instruction multiplies by
// (x[k], x[k + 1]) and adds to column c's sum: half the multiply instructions of widening to
// float32, and no widening. Each lane adds its pair in a fixed order, so every sum's order is
// still fixed by K. The unpack leaves columns in the order {0-3, 8-11, 16-19, 24-27} (`lo`) and
// {4-7, 12-15, 20-23, 28-31} (`hi`) of each 32; the partial sums keep it (`add_blocks` undoes
// it). `x` holds the rows as bfloat16; a row k + 1 past `last` counts as zeros.
template <int R, int KP>
void kn_rows_dot(const uint16_t* x, const uint16_t* w, float* out, int64_t K, int64_t N,
                 int64_t ldp, int64_t k0, int64_t last) {
  __m512bh xv[R][KP];
  UNROLL for (int r = 0; r < R; ++r)
    UNROLL for (int p = 0; p < KP; ++p) {
      const int64_t k = k0 + 2 * p;
      const uint32_t high = k + 1 < last ? x[r * K + k + 1] : 0;
      xv[r][p] = (__m512bh)_mm512_set1_epi32(int(x[r * K + k] | (high << 16)));
    }
  const uint16_t* row = w + k0 * N;
  const bool whole = k0 + 2 * KP <= last;
  for (int64_t c = 0; c < N; c += 2 * kLanes) {
    const __mmask32 mask = tail_mask32(N - c);
    __m512 lo[R], hi[R];
    load_sums<R>(out, ldp, c, lo, hi);
    UNROLL for (int p = 0; p < KP; ++p) {
      // The next pass's rows, into L2, as kn_vector.
      _mm_prefetch(reinterpret_cast<const char*>(row + (2 * KP + 2 * p) * N + c), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(row + (2 * KP + 2 * p + 1) * N + c),
                   _MM_HINT_T1);
      const __m512i a = _mm512_maskz_loadu_epi16(mask, row + 2 * p * N + c);
      const __m512i b = whole ? _mm512_maskz_loadu_epi16(mask, row + (2 * p + 1) * N + c)
                              : _mm512_setzero_si512();
      const __m512bh wl = (__m512bh)_mm512_unpacklo_epi16(a, b);
      const __m512bh wh = (__m512bh)_mm512_unpackhi_epi16(a, b);
      UNROLL for (int r = 0; r < R; ++r) {
        lo[r] = _mm512_dpbf16_ps(lo[r], xv[r][p], wl);
        hi[r] = _mm512_dpbf16_ps(hi[r], xv[r][p], wh);
      }
    }
    store_sums<R>(out, ldp, c, lo, hi);
  }
}
#endif

template <int R, typename T>
void kn_block(const float* x, const uint16_t* x16, const T* w, float* out, int64_t K, int64_t N,
              int64_t ldp, int64_t k0, int64_t k1) {
  for (int r = 0; r < R; ++r) std::fill(out + r * ldp, out + (r + 1) * ldp, 0.0f);
  int64_t k = k0;
  constexpr int KB = kKnRowsPerPass;
  if constexpr (std::is_same_v<T, uint16_t>) {
#if defined(__AVX512BF16__)
    for (; k + KB <= k1; k += KB) kn_rows_dot<R, KB / 2>(x16, w, out, K, N, ldp, k, k1);
    for (; k < k1; k += 2) kn_rows_dot<R, 1>(x16, w, out, K, N, ldp, k, k1);
#else
    for (; k + KB <= k1; k += KB) kn_rows_paired<R, KB>(x, w, out, K, N, ldp, k);
    for (; k < k1; ++k) kn_rows_paired<R, 1>(x, w, out, K, N, ldp, k);
#endif
  } else {
    for (; k + KB <= k1; k += KB) kn_rows<R, KB>(x, w, out, K, N, ldp, k);
    for (; k < k1; ++k) kn_rows<R, 1>(x, w, out, K, N, ldp, k);
  }
}

// Layout "nk": R rows times NB weight rows [n, n + NB), each a dot product over K.
template <int R, int NB, typename T>
void nk_tile(const float* x, const T* w, float* out, int64_t K, int64_t N, int64_t n) {
  __m512 acc[R][NB];
  UNROLL for (int r = 0; r < R; ++r)
    UNROLL for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += kLanes) {
    const __mmask16 mask = tail_mask(K - k);
    __m512 wv[NB];
    // The same place in the rows two tiles on, into L2 (as kn_vector): the tiles' rows are one
    // contiguous run, which this loop reads NB rows at a time, a pattern the hardware
    // prefetchers follow too late.
    UNROLL for (int j = 0; j < NB; ++j)
      _mm_prefetch(reinterpret_cast<const char*>(w + (n + j + 2 * NB) * K + k), _MM_HINT_T1);
    UNROLL for (int j = 0; j < NB; ++j) wv[j] = load(w + (n + j) * K + k, mask);
    UNROLL for (int r = 0; r < R; ++r) {
      const __m512 xv = load(x + r * K + k, mask);
      UNROLL for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_fmadd_ps(xv, wv[j], acc[r][j]);
    }
  }
  UNROLL for (int r = 0; r < R; ++r)
    UNROLL for (int j = 0; j < NB; ++j) out[r * N + n + j] = _mm512_reduce_add_ps(acc[r][j]);
}

#if defined(__AVX512BF16__)
// Layout "nk" with bfloat16 rows and weights, where the CPU multiplies bfloat16 pairs itself
// (VDPBF16PS: 32 products a step with no widening). Each lane sums its pairs in a fixed order,
// as the float32 tile does.
template <int R, int NB>
void nk_tile_bf16(const uint16_t* x, const uint16_t* w, float* out, int64_t K, int64_t N,
                  int64_t n) {
  __m512 acc[R][NB];
  UNROLL for (int r = 0; r < R; ++r)
    UNROLL for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 2 * kLanes) {
    const __mmask32 mask = tail_mask32(K - k);
    __m512bh wv[NB];
    UNROLL for (int j = 0; j < NB; ++j)  // as in nk_tile
      _mm_prefetch(reinterpret_cast<const char*>(w + (n + j + 2 * NB) * K + k), _MM_HINT_T1);
    UNROLL for (int j = 0; j < NB; ++j)
      wv[j] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + (n + j) * K + k);
    UNROLL for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + r * K + k);
      UNROLL for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv, wv[j]);
    }
  }
  UNROLL for (int r = 0; r < R; ++r)
    UNROLL for (int j = 0; j < NB; ++j) out[r * N + n + j] = _mm512_reduce_add_ps(acc[r][j]);
}
#endif

// The rows as float32 (`x`; null for bfloat16 products where the CPU multiplies bfloat16 pairs)
// and, for bfloat16 products, as they came (`x16`), the weight, the output and their sizes.
template <typename T>
struct Operands {
  const float* x;
  const uint16_t* x16;
  const T* w;
  float* out;
  int64_t M, K, N;
  int64_t ldp = 0;  // "kn": the row stride of the partial sums (N padded to 32 columns)
  // AMX tiles: the bfloat16 rows padded with zeros to whole tiles, [M to 16, K to 32].
  const uint16_t* x_tiles = nullptr;
  int64_t k_tiles = 0;  // K padded to 32
};

// Weight rows per "nk" tile: as many as leave the R x nb accumulators and the nb weight vectors
// in the 32 registers. kNkUnit is a multiple of each.
template <int R>
constexpr int nk_rows_per_tile() {
  return R <= 2 ? 8 : (R <= 4 ? 6 : (R <= 6 ? 4 : 3));
}

// R rows (R <= 8) starting at row m, against weight rows [n, n + count): rows of K ("kn", a
// block's partial sums for every column) or rows of N ("nk", whole outputs).
template <int R, typename T>
void tile(const Operands<T>& o, bool nk, int64_t m, int64_t n, int64_t count) {
  const float* x = o.x ? o.x + m * o.K : nullptr;  // null: bfloat16 rows read as they came
  if (!nk) {
    kn_block<R, T>(x, o.x16 ? o.x16 + m * o.K : nullptr, o.w, o.out + m * o.ldp, o.K, o.N, o.ldp,
                   n, n + count);
    return;
  }
  float* out = o.out + m * o.N;
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, uint16_t>) {
    constexpr int nb = nk_rows_per_tile<R>();
    const uint16_t* x16 = o.x16 + m * o.K;
    int64_t j = n;
    for (; j + nb <= n + count; j += nb) nk_tile_bf16<R, nb>(x16, o.w, out, o.K, o.N, j);
    for (; j < n + count; ++j) nk_tile_bf16<R, 1>(x16, o.w, out, o.K, o.N, j);
    return;
  }
#endif
  constexpr int nb = nk_rows_per_tile<R>();
  int64_t j = n;
  for (; j + nb <= n + count; j += nb) nk_tile<R, nb, T>(x, o.w, out, o.K, o.N, j);
  for (; j < n + count; ++j) nk_tile<R, 1, T>(x, o.w, out, o.K, o.N, j);
}

// Up to 8 rows at a time keep the accumulators in registers; more rows take further passes over
// the same tile, which is then in cache.
constexpr int kMaxTileRows = 8;

template <typename T>
void all_rows(const Operands<T>& o, bool nk, int64_t n, int64_t count) {
  for (int64_t m = 0; m < o.M; m += kMaxTileRows) {
    switch (std::min<int64_t>(o.M - m, kMaxTileRows)) {
      case 1: tile<1>(o, nk, m, n, count); break;
      case 2: tile<2>(o, nk, m, n, count); break;
      case 3: tile<3>(o, nk, m, n, count); break;
      case 4: tile<4>(o, nk, m, n, count); break;
      case 5: tile<5>(o, nk, m, n, count); break;
      case 6: tile<6>(o, nk, m, n, count); break;
      case 7: tile<7>(o, nk, m, n, count); break;
      default: tile<8>(o, nk, m, n, count); break;
    }
  }
}

// A unit of work: kKnBlockRows rows of a [K, N] weight ("kn"), or kNkUnit rows of a [N, K] one
// ("nk").
//
// A "kn" block is a contiguous run of whole weight rows, read front to back, so each thread
// streams memory the hardware prefetchers follow (splitting the columns instead left each thread
// half-rows, short runs with gaps, and ran at two thirds of the speed). Each block sums its rows
// into partial sums of its own, and the blocks' partials are added in block order: the order of
// every sum is fixed by K alone, whatever the threads and rows.
constexpr int64_t kKnBlockRows = 96;
constexpr int64_t kNkUnit = 24;

// How each 32 columns of a "kn" product's partial sums are ordered: as the columns; 16 even
// columns, then 16 odd ones (kn_rows_paired); or as VDPBF16PS's unpacked pairs (kn_rows_dot).
enum class Order { kColumns, kEvenOdd, kUnpacked };

template <typename T>
constexpr Order partials_order() {
  if constexpr (!std::is_same_v<T, uint16_t>) return Order::kColumns;
#if defined(__AVX512BF16__)
  return Order::kUnpacked;
#else
  return Order::kEvenOdd;
#endif
}

// Where output columns 0-15 and 16-31 are among a strip's two vectors of sums in `order` (16+:
// the second vector).
inline void column_order(Order order, __m512i& first, __m512i& second) {
  if (order == Order::kEvenOdd) {
    first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    second = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  } else {  // kUnpacked; kColumns needs no permutation
    first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  }
}

// Stores 32 sums (two vectors in `kOrder`) as output columns [c, min(c + 32, N)).
template <Order kOrder>
inline void store_ordered(float* row, int64_t c, int64_t N, __m512 a, __m512 b) {
  if constexpr (kOrder != Order::kColumns) {
    __m512i first, second;
    column_order(kOrder, first, second);
    const __m512 low = _mm512_permutex2var_ps(a, first, b);
    b = _mm512_permutex2var_ps(a, second, b);
    a = low;
  }
  if (c + 2 * kLanes <= N) {
    _mm512_storeu_ps(row + c, a);
    _mm512_storeu_ps(row + c + kLanes, b);
  } else {
    _mm512_mask_storeu_ps(row + c, tail_mask(N - c), a);
    if (N - c > kLanes) _mm512_mask_storeu_ps(row + c + kLanes, tail_mask(N - c - kLanes), b);
  }
}

// The same for two vectors in partials_order<T>().
template <typename T>
inline void store_columns(float* row, int64_t c, int64_t N, __m512 a, __m512 b) {
  store_ordered<partials_order<T>()>(row, c, N, a, b);
}

// out [M, N] = the blocks' partial sums [blocks, M, ldp] added in block order, each 32 columns
// put back in column order.
template <typename T>
void add_blocks(const float* partials, int64_t blocks, int64_t M, int64_t N, int64_t ldp,
                float* out) {
  auto sum = [&](int64_t m, int64_t c) {
    const float* p = partials + m * ldp + c;
    __m512 s = _mm512_loadu_ps(p);
    for (int64_t b = 1; b < blocks; ++b) s = _mm512_add_ps(s, _mm512_loadu_ps(p + b * M * ldp));
    return s;
  };
  // ldp is N padded to 32 columns: whole vectors to load.
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = 0; c < N; c += 2 * kLanes)
      store_columns<T>(out + m * N, c, N, sum(m, c), sum(m, c + kLanes));
}

// "kn" products of many rows (kTiledRows or more) are bound by their multiplies, not by reading
// the weight, and there the passes above lose to their own traffic: every pass loads and stores
// all rows' partial sums for 8 weight rows, every 8 rows re-read the block, and the blocks'
// partial sums are added afterwards on one thread. Here each thread takes 32-column strips of
// the output; a strip's sums are computed a block of weight rows at a time for up to
// kTiledTileRows rows at once, in registers, then added to the strip's running total in block
// order. Each sum takes the same terms in the same order as kn_block's partial sums (the same
// pairs in bfloat16) and the blocks are added in the same order as add_blocks, so a row's bits
// are the same whichever path its row count takes.
// From 9 rows, one more than the passes keep in registers (5-8 rows: the same speed either way).
constexpr int kTiledRows = 9;
constexpr int kTiledTileRows = 12;  // 24 accumulators of 16 lanes, two weight vectors, a broadcast

// The next block's weight, fetched into L2 a line at a time in address order while this block
// computes. Loads down a 32-column strip touch one line in each of 96 rows, a pattern memory
// serves slowly; these requests arrive row by row, as a stream's do. Built with
// -DINFER_DENSE_NO_LINE_WALK the kernel goes without it: `python -m experiments.dense_cpu
// --variants=no_line_walk --rows=12,32,128 --layouts=kn` times the two builds side by side.
struct LineWalk {
  const char* row = nullptr;  // the row segment being fetched
  int64_t stride = 0;         // bytes from one weight row to the next
  int64_t lines = 0;          // lines in each row's segment
  int64_t line = 0;
  int64_t left = 0;           // lines still to fetch

  void next() {
    if (left <= 0) return;
    _mm_prefetch(row + 64 * line, _MM_HINT_T1);
    --left;
    if (++line == lines) {
      line = 0;
      row += stride;
    }
  }
};

// Rows [0, R) of the strip at column c, over the weight rows [k0, k1) of one block: `total`
// ([R, 32], the strip's sums so far in partials_order) gets this block's sums added (`first`:
// set to them); after the `last` block the totals go to `out` ([R, N]) in column order. The
// strip's weight row k starts at wc + k * ldw: a [K, N] weight's (wc = w + c, ldw = N), or a
// strip stored whole (`kn_strips_packed`: ldw = 32).
template <int R, bool kMasked, typename T>
inline void kn_strip(const float* x, const uint16_t* x16, const T* wc, int64_t ldw, float* total,
                     int64_t total_stride, float* out, int64_t K, int64_t N, int64_t k0,
                     int64_t k1, int64_t c, LineWalk* walk, bool first, bool last) {
  __m512 a[R], b[R];  // the partial sums of columns [c, c + 32), in the block's Order
  UNROLL for (int r = 0; r < R; ++r) a[r] = b[r] = _mm512_setzero_ps();
  // Two lines of the next block a step: as many steps as the block has lines for its strips.
  // A copy in registers: updated through the pointer, each step would wait on the last's store.
  LineWalk ahead = walk ? *walk : LineWalk{};
  auto fetch_ahead = [&] {
    ahead.next();
    ahead.next();
  };
  if constexpr (std::is_same_v<T, float>) {
    const __mmask16 m0 = kMasked ? tail_mask(N - c) : __mmask16(0xFFFF);
    const __mmask16 m1 = kMasked ? (N - c > kLanes ? tail_mask(N - c - kLanes) : 0) : m0;
    for (int64_t k = k0; k < k1; ++k) {
      fetch_ahead();
      const float* row = wc + k * ldw;
      const __m512 w0 = kMasked ? load(row, m0) : load(row);
      const __m512 w1 = kMasked ? load(row + kLanes, m1) : load(row + kLanes);
      UNROLL for (int r = 0; r < R; ++r) {
        const __m512 xv = _mm512_set1_ps(x[r * K + k]);
        a[r] = _mm512_fmadd_ps(xv, w0, a[r]);
        b[r] = _mm512_fmadd_ps(xv, w1, b[r]);
      }
    }
  } else {
    const __mmask32 mask = kMasked ? tail_mask32(N - c) : __mmask32(0xFFFFFFFFu);
    auto load_row = [&](int64_t k) {
      return kMasked ? _mm512_maskz_loadu_epi16(mask, wc + k * ldw)
                     : _mm512_loadu_si512(wc + k * ldw);
    };
#if defined(__AVX512BF16__)
    // Pairs (k, k + 1) from k0, as kn_rows_dot; an odd last row is paired with zeros.
    int64_t k = k0;
    for (; k + 2 <= k1; k += 2) {
      fetch_ahead();
      const __m512i lo = load_row(k), hi = load_row(k + 1);
      const __m512bh wl = (__m512bh)_mm512_unpacklo_epi16(lo, hi);
      const __m512bh wh = (__m512bh)_mm512_unpackhi_epi16(lo, hi);
      UNROLL for (int r = 0; r < R; ++r) {
        uint32_t pair;
        std::memcpy(&pair, x16 + r * K + k, sizeof(pair));  // x[r][k] low, x[r][k + 1] high
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(int(pair));
        a[r] = _mm512_dpbf16_ps(a[r], xv, wl);
        b[r] = _mm512_dpbf16_ps(b[r], xv, wh);
      }
    }
    if (k < k1) {
      const __m512i lo = load_row(k), zero = _mm512_setzero_si512();
      const __m512bh wl = (__m512bh)_mm512_unpacklo_epi16(lo, zero);
      const __m512bh wh = (__m512bh)_mm512_unpackhi_epi16(lo, zero);
      UNROLL for (int r = 0; r < R; ++r) {
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(int(x16[r * K + k]));
        a[r] = _mm512_dpbf16_ps(a[r], xv, wl);
        b[r] = _mm512_dpbf16_ps(b[r], xv, wh);
      }
    }
#else
    // Even and odd columns widened by a shift and a mask, as kn_rows_paired.
    const __m512i high = _mm512_set1_epi32(int(0xFFFF0000u));
    for (int64_t k = k0; k < k1; ++k) {
      fetch_ahead();
      const __m512i pairs = load_row(k);
      const __m512 e = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
      const __m512 od = _mm512_castsi512_ps(_mm512_and_si512(pairs, high));
      UNROLL for (int r = 0; r < R; ++r) {
        const __m512 xv = _mm512_set1_ps(x[r * K + k]);
        a[r] = _mm512_fmadd_ps(xv, e, a[r]);
        b[r] = _mm512_fmadd_ps(xv, od, b[r]);
      }
    }
#endif
  }
  if (walk) *walk = ahead;
  UNROLL for (int r = 0; r < R; ++r) {
    if (!first) {
      a[r] = _mm512_add_ps(_mm512_loadu_ps(total + r * total_stride), a[r]);
      b[r] = _mm512_add_ps(_mm512_loadu_ps(total + r * total_stride + kLanes), b[r]);
    }
    if (last) {
      store_columns<T>(out + r * N, c, N, a[r], b[r]);
    } else {
      _mm512_storeu_ps(total + r * total_stride, a[r]);
      _mm512_storeu_ps(total + r * total_stride + kLanes, b[r]);
    }
  }
}

// The same for `rows` <= R rows.
template <int R = kTiledTileRows, typename T>
void kn_strip_rows(const float* x, const uint16_t* x16, const T* wc, int64_t ldw, float* total,
                   int64_t total_stride, float* out, int64_t K, int64_t N, int64_t k0, int64_t k1,
                   int64_t c, int64_t rows, LineWalk* walk, bool first, bool last) {
  if constexpr (R > 1) {
    if (rows < R) {
      kn_strip_rows<R - 1, T>(x, x16, wc, ldw, total, total_stride, out, K, N, k0, k1, c, rows,
                              walk, first, last);
      return;
    }
  }
  if (c + 2 * kLanes <= N)
    kn_strip<R, false, T>(x, x16, wc, ldw, total, total_stride, out, K, N, k0, k1, c, walk,
                          first, last);
  else
    kn_strip<R, true, T>(x, x16, wc, ldw, total, total_stride, out, K, N, k0, k1, c, walk,
                         first, last);
}

// Output columns [32 s0, 32 s1) of every row, over all of K, a block of weight rows at a time.
template <typename T>
void kn_strips(const Operands<T>& o, int64_t s0, int64_t s1) {
  const int64_t c0 = s0 * 2 * kLanes, c1 = std::min(o.N, s1 * 2 * kLanes);
  const int64_t width = (s1 - s0) * 2 * kLanes;
  thread_local std::vector<float> total;  // the strips' running sums, [M, width]
  if (int64_t(total.size()) < o.M * width) total.resize(o.M * width);
  const int64_t lines = ((c1 - c0) * int64_t(sizeof(T)) + 63) / 64;
  for (int64_t k0 = 0; k0 < o.K; k0 += kKnBlockRows) {
    const int64_t k1 = std::min(o.K, k0 + kKnBlockRows);
    LineWalk walk{reinterpret_cast<const char*>(o.w + k1 * o.N + c0), o.N * int64_t(sizeof(T)),
                  lines, 0, (std::min(o.K, k1 + kKnBlockRows) - k1) * lines};
#if defined(INFER_DENSE_NO_LINE_WALK)
    LineWalk* line_walk = nullptr;
#else
    LineWalk* line_walk = &walk;
#endif
    for (int64_t c = c0; c < c1; c += 2 * kLanes) {
      for (int64_t m = 0; m < o.M; m += kTiledTileRows) {
        kn_strip_rows<kTiledTileRows, T>(
            o.x ? o.x + m * o.K : nullptr, o.x16 ? o.x16 + m * o.K : nullptr, o.w + c, o.N,
            total.data() + m * width + (c - c0), width, o.out + m * o.N, o.K, o.N, k0, k1, c,
            std::min<int64_t>(kTiledTileRows, o.M - m), m == 0 ? line_walk : nullptr, k0 == 0,
            k1 == o.K);
      }
    }
  }
}

// float32 "kn" weights stored as strips at load (`kernels_cpu.dense.pack`): [N / 32, K, 32],
// packed[t, k, j] = w[k, 32 t + j], each strip's K rows of 32 columns one contiguous run. Read
// down a [K, N] weight, a strip's rows lie N * 4 bytes apart (6 KB for the MLP's 1,536
// columns), each on a page of its own, and a block of 96 of them ran at about half the FMA
// rate even in cache; stored whole it runs at 70% of it (scratch, one thread, 32 rows: 149
// against 110 GFLOP/s in cache, 99 against 68 streamed from memory). Every row count takes
// kn_strip here, whose sums take kn_block's order, so a row's bits are those of the [K, N]
// weight's paths at any row count. The next block of the stream, this strip's or the next
// one's, is fetched into L2 while this block computes.
void kn_strips_packed(const Operands<float>& o, int64_t s0, int64_t s1) {
  constexpr int64_t kStrip = 2 * kLanes;
  thread_local std::vector<float> total;  // one strip's running sums, [M, 32]
  if (int64_t(total.size()) < o.M * kStrip) total.resize(o.M * kStrip);
  const int64_t stream_rows = (o.N / kStrip) * o.K;  // the weight's rows of 32, strip after strip
  for (int64_t s = s0; s < s1; ++s) {
    const float* strip = o.w + s * o.K * kStrip;
    for (int64_t k0 = 0; k0 < o.K; k0 += kKnBlockRows) {
      const int64_t k1 = std::min(o.K, k0 + kKnBlockRows);
      const int64_t ahead = std::min(kKnBlockRows, stream_rows - (s * o.K + k1));
      LineWalk walk{reinterpret_cast<const char*>(strip + k1 * kStrip),
                    kStrip * int64_t(sizeof(float)), 2, 0, 2 * ahead};
#if defined(INFER_DENSE_NO_LINE_WALK)
      LineWalk* line_walk = nullptr;
#else
      LineWalk* line_walk = &walk;
#endif
      for (int64_t m = 0; m < o.M; m += kTiledTileRows)
        kn_strip_rows<kTiledTileRows, float>(
            o.x + m * o.K, nullptr, strip, kStrip, total.data() + m * kStrip, kStrip,
            o.out + m * o.N, o.K, o.N, k0, k1, s * kStrip,
            std::min<int64_t>(kTiledTileRows, o.M - m), m == 0 ? line_walk : nullptr, k0 == 0,
            k1 == o.K);
    }
  }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && !defined(INFER_DENSE_NO_AMX)
#define INFER_DENSE_AMX 1
// bfloat16 "kn" products on AMX tiles (Intel Xeon from Sapphire Rapids). A TDPBF16PS multiplies
// a 16 x 32 tile of rows by a 32 x 16 tile of weight (stored as 16 rows of 16 column pairs: the
// VNNI layout) into 16 x 16 float32 sums, 16,384 operations an instruction, where kn_strip's
// VDPBF16PS does 32: from 9 rows, where kn_strip is bound by its multiplies, tiles are 1.3-2.4x
// faster at 9-48 rows (`python -m experiments.dense_cpu --variants=no_amx`). The weight is
// stored [in, out], so each unit first packs a strip of 128 columns into pairs
// (w[k][c], w[k + 1][c]) in a buffer of its own, row by row, the interleave kn_strip does in
// registers; the tiles then read it from cache. That packing reads the weight at about half the
// speed of the few-row passes (measured), so fewer rows stay on them, and even 16-48 rows run
// at 7-11 GB/s, far from the read floor: the model's weights are stored packed at load
// instead (`kn_packed`); this path is for the weights that are not (K or N off 32, or under
// INFER_TILED_WEIGHTS=0).
// (Packing each weight whole first, 32 rows a unit read front to back, then multiplying the
// strips from it, was slower still at 9-32 rows: 24-28 ms against 19-27 for 30 layers.)
//
// Each sum takes its terms in order of k, 32 at a time, over all of K in one tile, whatever the
// rows and threads, so a row's bits do not depend on the others. They are not the bits of the
// VDPBF16PS paths: the AMX unit rounds its pairs' sums its own way (measured: 89-115 of 256 sums
// equal to any sequential float32 model), so a row's bits differ between products of fewer
// rows than `tiles_from` and of more: the caller picks (0 keeps the VDPBF16PS paths).
constexpr int kTileRows = 16;      // rows of a tile of x and of sums
constexpr int kTileDepth = 32;     // bfloat16 values of K a tile step: 64 bytes of a row
constexpr int64_t kTileStrip = 128;  // output columns a unit: four 32-column groups
constexpr int64_t kPackAhead = 96;   // weight rows between a row packed and a row prefetched

// Linux hands the 8 KB of tile state only to a process that asks for it (ARCH_REQ_XCOMP_PERM
// for XFEATURE_XTILEDATA); without it the first tile instruction faults.
bool tiles_permitted() {
  static const bool permitted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return permitted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// Every tile 16 rows of 64 bytes: sums (0-3), x (4, 5) and packed weight (6, 7).
void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = kTileRows;
    config.bytes_per_row[t] = 64;
  }
  _tile_loadconfig(&config);
}

// Packs weight columns [c, c + 32 * groups) of rows [0, K) as, per 32-column group, `steps`
// pairs of tiles in `pack` ([groups][steps][2][16 pairs][32]): tile 0 the group's columns
// {0-3, 8-11, 16-19, 24-27}, tile 1 the rest, each row two weight rows interleaved (the unpack of
// kn_strip, Order::kUnpacked). Rows and columns past the weight's are zeros. Each weight row's
// strip is read whole before the next: a 32-column group a pass read memory at half the speed.
void pack_pairs(const uint16_t* w, int64_t K, int64_t N, int64_t c, int groups, int64_t steps,
                uint16_t* pack) {
  const __m512i zero = _mm512_setzero_si512();
  const int64_t group_size = steps * 2 * kTileRows * 32;
  for (int64_t s = 0; s < steps; ++s) {
    for (int p = 0; p < kTileRows; ++p) {
      const int64_t k = s * kTileDepth + 2 * p;
      const uint16_t* row = w + k * N;
#if !defined(INFER_DENSE_NO_PACK_AHEAD)
      // The same columns kPackAhead rows on, into L2: 0-8% faster at 9-128 rows than without
      // (`--variants=no_pack_ahead`, median of 5; 7-14% at 16-32 rows in two scratch runs).
      // Scratch builds: 32, 64 or 192 rows ahead did as well or a little less, 8-32 rows ahead
      // into L1 and the next strip's columns hardly at all.
      if (k + kPackAhead + 1 < K)
        for (int g = 0; g < groups; ++g)
          for (int64_t ahead = kPackAhead; ahead < kPackAhead + 2; ++ahead)
            _mm_prefetch(reinterpret_cast<const char*>(row + ahead * N + c + 32 * g),
                         _MM_HINT_T1);
#endif
      for (int g = 0; g < groups; ++g) {
        const int64_t col = c + 32 * g;
        const __mmask32 mask = tail_mask32(N - col);
        const __m512i a = k < K ? _mm512_maskz_loadu_epi16(mask, row + col) : zero;
        const __m512i b = k + 1 < K ? _mm512_maskz_loadu_epi16(mask, row + N + col) : zero;
        uint16_t* lo_tile = pack + g * group_size + s * 2 * kTileRows * 32;
        _mm512_store_si512(lo_tile + p * 32, _mm512_unpacklo_epi16(a, b));
        _mm512_store_si512(lo_tile + (kTileRows + p) * 32, _mm512_unpackhi_epi16(a, b));
      }
    }
  }
}

// The sum tiles of kChunks chunks of 16 rows (tiles 0-1, and 2-3 for a second chunk): zeroed,
// and stored one after another as [2 * kChunks][16][16].
template <int kChunks>
inline void zero_sums() {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (kChunks == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
}

template <int kChunks>
inline void store_sums_tiles(float* sums) {
  constexpr int64_t tile_floats = kTileRows * kTileRows;
  _tile_stored(0, sums, 64);
  _tile_stored(1, sums + tile_floats, 64);
  if constexpr (kChunks == 2) {
    _tile_stored(2, sums + 2 * tile_floats, 64);
    _tile_stored(3, sums + 3 * tile_floats, 64);
  }
}

// Sums of rows [m, m + 16 * kChunks) against 32 weight columns in pair layout, 16 in each of
// `first` and `second` (16 pairs x 16 columns a step, `step` values from one step to the next),
// into `sums` ([kChunks][2][16][16]: per chunk of 16 rows, the two tiles of columns).
template <int kChunks>
void tile_sums(const Operands<uint16_t>& o, int64_t m, const uint16_t* first,
               const uint16_t* second, int64_t step, int64_t steps, float* sums) {
  const int64_t stride = o.k_tiles * int64_t(sizeof(uint16_t));
  zero_sums<kChunks>();
  for (int64_t s = 0; s < steps; ++s) {
    _tile_loadd(4, o.x_tiles + m * o.k_tiles + s * kTileDepth, stride);
    _tile_loadd(6, first + s * step, 64);
    _tile_loadd(7, second + s * step, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (kChunks == 2) {
      _tile_loadd(5, o.x_tiles + (m + kTileRows) * o.k_tiles + s * kTileDepth, stride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  store_sums_tiles<kChunks>(sums);
}

// Every row against 32 weight columns from column c (two 16-column tiles, see tile_sums), 32
// rows at a time, the sums stored as output columns [c, c + 32) in `order`.
template <Order kOrder>
void group_rows(const Operands<uint16_t>& o, int64_t c, const uint16_t* first,
                const uint16_t* second, int64_t step, int64_t steps) {
  alignas(64) float sums[2][2][kTileRows][kTileRows];
  for (int64_t m = 0; m < o.M; m += 2 * kTileRows) {
    if (m + kTileRows < o.M)
      tile_sums<2>(o, m, first, second, step, steps, &sums[0][0][0][0]);
    else
      tile_sums<1>(o, m, first, second, step, steps, &sums[0][0][0][0]);
    for (int64_t r = 0; r < std::min<int64_t>(2 * kTileRows, o.M - m); ++r) {
      const int64_t chunk = r / kTileRows, row = r % kTileRows;
      store_ordered<kOrder>(o.out + (m + r) * o.N, c, o.N, _mm512_load_ps(sums[chunk][0][row]),
                            _mm512_load_ps(sums[chunk][1][row]));
    }
  }
}

// Output columns [128 s0, 128 s1) of every row: each strip packed once, then multiplied by the
// rows 32 at a time, a 32-column group after another.
void kn_tiles(const Operands<uint16_t>& o, int64_t s0, int64_t s1) {
  configure_tiles();
  const int64_t steps = o.k_tiles / kTileDepth;
  const int64_t group_size = steps * 2 * kTileRows * 32;
  constexpr int kGroups = kTileStrip / 32;
  thread_local std::vector<uint16_t, AlignedAllocator<uint16_t>> pack;
  if (int64_t(pack.size()) < kGroups * group_size) pack.resize(kGroups * group_size);
  for (int64_t strip = s0; strip < s1; ++strip) {
    const int64_t c0 = strip * kTileStrip;
    const int groups = int(std::min<int64_t>(kGroups, (o.N - c0 + 31) / 32));
    pack_pairs(o.w, o.K, o.N, c0, groups, steps, pack.data());
    for (int g = 0; g < groups; ++g) {
      const uint16_t* group = pack.data() + g * group_size;
      group_rows<Order::kUnpacked>(o, c0 + 32 * g, group, group + kTileRows * 32,
                                   2 * kTileRows * 32, steps);
    }
  }
  _tile_release();
}

// A weight stored in the tiles' layout at load ("kn" packed, `infer.model.llama.tile_weights`):
// [N / 16][K / 2][16][2], w_packed[t][q][j][h] = w[2q + h][16t + j]: per 16 output columns, every
// pair of weight rows in order, each step's tile 1 KB of contiguous memory. The tiles read it
// as stored, so no packing per call: a product streams the weight at the read rate whatever
// the rows, 1-16 rows alike (single-thread scratch, 576 x 1536: 24-28 GB/s at 1-16 rows, where
// kn_tiles packs at 11 GB/s and the VDPBF16PS rows at 28 GB/s for 1 row, 18 for 4, 9 for 8).
// Each sum takes the pairs in the order kn_tiles does, so the bits are kn_tiles' at every row
// count. Needs K and N multiples of 32. Units are 32-column groups. (Prefetching the weight's
// tiles two steps ahead into L1 was 10-20% faster on one thread, scratch, but 0-6% slower at
// 1-8 rows and no faster at 16-64 in the two-thread `experiments.dense_cpu` run: dropped. So
// was loading a 16-row chunk's odd steps into other tiles, so that their loads need not wait
// for the even steps' multiplies: 10-25% faster on one thread at 1-16 rows, 0-10% slower in
// the two-thread run.)
void kn_packed(const Operands<uint16_t>& o, int64_t g0, int64_t g1) {
  configure_tiles();
  const int64_t column_tile = o.K * kTileRows;  // values per 16 columns
  for (int64_t g = g0; g < g1; ++g) {
    const uint16_t* first = o.w + 2 * g * column_tile;
    group_rows<Order::kColumns>(o, 32 * g, first, first + column_tile, kTileRows * 32,
                                o.K / kTileDepth);
  }
  _tile_release();
}

// "nk" (the vocabulary projection, [N, K]) on AMX tiles: the weight's rows are a tile's rows as
// stored (16 weight rows x 32 values of K), so no packing; x goes in pair layout instead
// (`rows_as_pairs`). Each unit is 32 weight rows, multiplied by every row of x 32 at a time;
// sums come out [weight row][x row] and are stored transposed. Each sum takes its terms in
// order of k, 32 at a time, over all of K; the last unit's rows past N are zeros (a copy).
constexpr int64_t kNkTileUnit = 32;

// x [M, K] as B tiles: per 16 rows of x and 32 values of K, 16 rows of pairs, each row
// (x[m][2p], x[m][2p + 1]) for the 16 m: [M to 16 / 16][K / 32][16 pairs][16 m][2].
std::vector<uint16_t, AlignedAllocator<uint16_t>> rows_as_pairs(const uint16_t* x, int64_t M,
                                                                  int64_t K) {
  const int64_t chunks = (M + kTileRows - 1) / kTileRows, steps = K / kTileDepth;
  std::vector<uint16_t, AlignedAllocator<uint16_t>> pairs(chunks * steps * kTileRows * 32, 0);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) {
      const int64_t c = m / kTileRows, s = k / kTileDepth, p = (k % kTileDepth) / 2;
      pairs[((c * steps + s) * kTileRows + p) * 32 + (m % kTileRows) * 2 + (k & 1)] =
          x[m * K + k];
    }
  return pairs;
}

// 32 weight rows from `rows` against x rows [m, m + 16 * kChunks): sums [2 * kChunks][16][16],
// per (weight-row half, x chunk) a tile [weight row][x row].
template <int kChunks>
void nk_tile_sums(const Operands<uint16_t>& o, const uint16_t* rows, int64_t m, float* sums) {
  const int64_t steps = o.K / kTileDepth, stride = o.K * int64_t(sizeof(uint16_t));
  const uint16_t* b0 = o.x_tiles + (m / kTileRows) * steps * kTileRows * 32;
  const uint16_t* b1 = b0 + steps * kTileRows * 32;
  zero_sums<kChunks>();
  for (int64_t s = 0; s < steps; ++s) {
    _tile_loadd(4, rows + s * kTileDepth, stride);
    _tile_loadd(5, rows + kTileRows * o.K + s * kTileDepth, stride);
    _tile_loadd(6, b0 + s * kTileRows * 32, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 5, 6);
    if constexpr (kChunks == 2) {
      _tile_loadd(7, b1 + s * kTileRows * 32, 64);
      _tile_dpbf16ps(2, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  store_sums_tiles<kChunks>(sums);
}

// Units [u0, u1) of 32 weight rows, every x row.
void nk_tiles(const Operands<uint16_t>& o, int64_t u0, int64_t u1) {
  configure_tiles();
  alignas(64) float sums[4][kTileRows][kTileRows];
  const __m512i column = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10,
                                                              11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(kTileRows));
  thread_local std::vector<uint16_t, AlignedAllocator<uint16_t>> last;  // the last unit, padded
  for (int64_t u = u0; u < u1; ++u) {
    const int64_t n = u * kNkTileUnit, count = std::min(kNkTileUnit, o.N - n);
    const uint16_t* rows = o.w + n * o.K;
    if (count < kNkTileUnit) {
      last.assign(kNkTileUnit * o.K, 0);
      std::memcpy(last.data(), rows, count * o.K * sizeof(uint16_t));
      rows = last.data();
    }
    for (int64_t m = 0; m < o.M; m += 2 * kTileRows) {
      if (m + kTileRows < o.M)
        nk_tile_sums<2>(o, rows, m, &sums[0][0][0]);
      else
        nk_tile_sums<1>(o, rows, m, &sums[0][0][0]);
      for (int64_t r = 0; r < std::min<int64_t>(2 * kTileRows, o.M - m); ++r) {
        const int chunk = int(r / kTileRows), row = int(r % kTileRows);
        for (int half = 0; half < 2 && half * kTileRows < count; ++half) {
          // Tile (half, chunk): sums[weight row][x row]; x row `row` is its column.
          const float* tile = &sums[chunk * 2 + half][0][0];
          _mm512_mask_storeu_ps(o.out + (m + r) * o.N + n + half * kTileRows,
                                tail_mask(count - half * kTileRows),
                                _mm512_i32gather_ps(_mm512_add_epi32(column,
                                                                     _mm512_set1_epi32(row)),
                                                    tile, 4));
        }
      }
    }
  }
  _tile_release();
}

// x as whole tiles: [M, K] bfloat16 into [M to 16, K to 32], zeros around.
std::vector<uint16_t, AlignedAllocator<uint16_t>> rows_as_tiles(const uint16_t* x, int64_t M,
                                                                 int64_t K, int64_t k_tiles) {
  const int64_t m_tiles = (M + kTileRows - 1) / kTileRows * kTileRows;
  std::vector<uint16_t, AlignedAllocator<uint16_t>> tiles(m_tiles * k_tiles, 0);
  for (int64_t m = 0; m < M; ++m) std::memcpy(&tiles[m * k_tiles], x + m * K, K * 2);
  return tiles;
}
#endif

// Weights smaller than this are multiplied on the calling thread: handing half of a few hundred
// kilobytes to another thread costs about what it saves.
constexpr int64_t kParallelBytes = 512 * 1024;

// How a product's work is split into units: kNkUnit weight rows of an [N, K] weight; a block of
// kKnBlockRows weight rows of a [K, N] one (few rows, the partial sums added afterwards); or, with
// kTiledRows rows or more, and at any row count for float32 strips, a 32-column strip of its
// output.
enum class Split { kNkRows, kKnBlocks, kKnStrips, kKnStripsPacked, kKnTiles, kNkTiles, kKnPacked };

template <typename T>
void run_units(const Operands<T>& o, float* partials, Split split, int64_t first, int64_t last) {
  if (split == Split::kKnStrips) {
    kn_strips(o, first, last);
    return;
  }
  if constexpr (std::is_same_v<T, float>) {
    if (split == Split::kKnStripsPacked) {
      kn_strips_packed(o, first, last);
      return;
    }
  }
#if defined(INFER_DENSE_AMX)
  if constexpr (std::is_same_v<T, uint16_t>) {
    if (split == Split::kKnTiles) {
      kn_tiles(o, first, last);
      return;
    }
    if (split == Split::kNkTiles) {
      nk_tiles(o, first, last);
      return;
    }
    if (split == Split::kKnPacked) {
      kn_packed(o, first, last);
      return;
    }
  }
#endif
  for (int64_t u = first; u < last; ++u) {
    if (split == Split::kNkRows) {
      all_rows(o, true, u * kNkUnit, std::min(kNkUnit, o.N - u * kNkUnit));
    } else {
      Operands<T> block = o;
      block.out = partials + u * o.M * o.ldp;
      all_rows(block, false, u * kKnBlockRows, std::min(kKnBlockRows, o.K - u * kKnBlockRows));
    }
  }
}

// The units of one product of a group, numbered from `first` among the group's units.
template <typename T>
struct Product {
  Operands<T> o;
  int64_t units = 0;
  int64_t first = 0;
  float* partials = nullptr;  // kKnBlocks: the blocks' partial sums, [units, M, ldp]
};

// Products of the same rows with several weights of one layout (a layer's query, key and value
// projections; its gate and up projections), split between threads as one piece of work: one
// hand-off to the pool instead of one per weight, and weights too small to be worth splitting
// on their own (a key projection: 221 KB in bfloat16) share the threads with the rest. Each
// product's units and sums are those of the product alone, so its bits are too. `packed`: every
// weight is "kn" and stored at load, bfloat16 in the tiles' layout (kn_packed; the caller
// checked tiles_permitted()), float32 as strips (kn_strips_packed).
template <typename T>
void multiply(ffi::ThreadPool& pool, const std::vector<Operands<T>>& ops, bool nk,
              int64_t tiles_from, bool packed = false) {
  const int64_t M = ops.front().M;
  Split split = nk ? Split::kNkRows : (M >= kTiledRows ? Split::kKnStrips : Split::kKnBlocks);
  if constexpr (std::is_same_v<T, float>) {
    if (packed) split = Split::kKnStripsPacked;
  }
#if defined(INFER_DENSE_AMX)
  std::vector<uint16_t, AlignedAllocator<uint16_t>> x_tiles;
  int64_t k_tiles = 0;
  if constexpr (std::is_same_v<T, uint16_t>) {
    const int64_t K = ops.front().K;
    const bool tiles = tiles_from > 0 && M >= tiles_from && tiles_permitted();
    if (packed) {
      split = Split::kKnPacked;
      k_tiles = K;
      x_tiles = rows_as_tiles(ops.front().x16, M, K, k_tiles);
    } else if (tiles && !nk) {
      split = Split::kKnTiles;
      k_tiles = (K + kTileDepth - 1) / kTileDepth * kTileDepth;
      x_tiles = rows_as_tiles(ops.front().x16, M, K, k_tiles);
    } else if (tiles && K % kTileDepth == 0) {
      // Tiles read the weight's rows as stored, 32 values of K a step: K must be whole steps.
      split = Split::kNkTiles;
      k_tiles = K;
      x_tiles = rows_as_pairs(ops.front().x16, M, K);
    }
  }
#else
  (void)tiles_from;
  (void)packed;
#endif
  std::vector<Product<T>> products(ops.size());
  int64_t units = 0, scratch_floats = 0, weight_bytes = 0;
  for (size_t i = 0; i < ops.size(); ++i) {
    Product<T>& p = products[i];
    p.o = ops[i];
#if defined(INFER_DENSE_AMX)
    p.o.x_tiles = x_tiles.data();
    p.o.k_tiles = k_tiles;
#endif
    const Operands<T>& o = ops[i];
    p.units = split == Split::kNkRows    ? (o.N + kNkUnit - 1) / kNkUnit
              : split == Split::kKnStrips ? (o.N + 2 * kLanes - 1) / (2 * kLanes)
              : split == Split::kKnStripsPacked ? o.N / (2 * kLanes)
#if defined(INFER_DENSE_AMX)
              : split == Split::kKnTiles ? (o.N + kTileStrip - 1) / kTileStrip
              : split == Split::kNkTiles ? (o.N + kNkTileUnit - 1) / kNkTileUnit
              : split == Split::kKnPacked ? o.N / 32
#endif
                                          : (o.K + kKnBlockRows - 1) / kKnBlockRows;
    p.first = units;
    units += p.units;
    if (split == Split::kKnBlocks) {
      p.o.ldp = (o.N + 2 * kLanes - 1) / (2 * kLanes) * (2 * kLanes);
      scratch_floats += p.units * M * p.o.ldp;
    }
    weight_bytes += o.K * o.N * int64_t(sizeof(T));
  }
  // The calling thread's scratch for "kn" partial sums, kept between calls (pool threads write
  // into it only while this call waits for them).
  thread_local std::vector<float> scratch;
  if (int64_t(scratch.size()) < scratch_floats) scratch.resize(scratch_floats);
  if (split == Split::kKnBlocks) {
    float* partials = scratch.data();
    for (Product<T>& p : products) {
      p.partials = partials;
      partials += p.units * M * p.o.ldp;
    }
  }
  // Rows of "nk" and strips: four chunks a thread even out threads that start late. "kn"
  // blocks are chunks. Small weights stay on the calling thread.
  const int64_t threads = pool.num_threads();
  const int64_t chunks = weight_bytes < kParallelBytes ? 1
                         : split == Split::kKnBlocks ? units : 4 * threads;
  infer_cpu::run_in_chunks(pool, units, chunks, [&](int64_t first, int64_t last) {
    for (const Product<T>& p : products) {
      const int64_t lo = std::max(first, p.first), hi = std::min(last, p.first + p.units);
      if (lo < hi) run_units(p.o, p.partials, split, lo - p.first, hi - p.first);
    }
  });
  if (split == Split::kKnBlocks)
    for (const Product<T>& p : products)
      add_blocks<T>(p.partials, p.units, M, p.o.N, p.o.ldp, p.o.out);
}

// out_i = x times w_i for each weight w_i (all of one dtype and layout), in one call.
ffi::Error dense_impl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::RemainingArgs weights,
                      ffi::RemainingRets outs, bool nk, int64_t tiles_from) {
  const auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("dense_cpu: x must be [M, K]");
  if (weights.size() == 0 || weights.size() != outs.size())
    return ffi::Error::InvalidArgument("dense_cpu: one output per weight, at least one");
  const int64_t M = xd[0], K = xd[1];
  std::vector<ffi::AnyBuffer> ws;
  std::vector<float*> os;
  std::vector<int64_t> ns;
  // Weights stored at load, all or none of them: rank 4, bfloat16 "kn" weights in the tiles'
  // layout (kn_packed); rank 3, float32 "kn" weights as strips (kn_strips_packed).
  const auto first = weights.get<ffi::AnyBuffer>(0);
  const size_t first_rank = first.has_value() ? first->dimensions().size() : 0;
  const bool strips = first_rank == 3;
  const bool packed = first_rank == 4 || strips;
  if (strips && (nk || x.element_type() != ffi::DataType::F32))
    return ffi::Error::InvalidArgument(
        "dense_cpu: weights stored as strips are float32 \"kn\" weights");
  if (packed && !strips) {
#if defined(INFER_DENSE_AMX)
    if (nk || x.element_type() != ffi::DataType::BF16 || !tiles_permitted() || K % 32 != 0)
      return ffi::Error::InvalidArgument(
          "dense_cpu: a packed weight needs bfloat16 \"kn\" rows with K a multiple of 32 and "
          "AMX tiles permitted");
#else
    return ffi::Error::InvalidArgument("dense_cpu: packed weights need a build with AMX tiles");
#endif
  }
  for (size_t i = 0; i < weights.size(); ++i) {
    auto w = weights.get<ffi::AnyBuffer>(i);
    auto out = outs.get<ffi::Buffer<ffi::F32>>(i);
    if (!w.has_value() || !out.has_value())
      return ffi::Error::InvalidArgument("dense_cpu: weights must be arrays, outputs float32");
    const auto wd = w->dimensions();
    if (strips ? wd.size() != 3 || wd[2] != 2 * kLanes
               : packed ? wd.size() != 4 || wd[2] != 16 || wd[3] != 2 || wd[0] % 2 != 0
                        : wd.size() != 2)
      return ffi::Error::InvalidArgument(
          "dense_cpu: w must be 2-D, or all weights packed: [N / 16 (even), K / 2, 16, 2] "
          "(bfloat16) or [N / 32, K, 32] (float32)");
    if (w->element_type() != x.element_type())
      return ffi::Error::InvalidArgument("dense_cpu: x and w must share a dtype");
    if ((strips ? wd[1] : packed ? 2 * wd[1] : nk ? wd[1] : wd[0]) != K)
      return ffi::Error::InvalidArgument("dense_cpu: x and w disagree on K");
    const int64_t N = strips ? 2 * kLanes * wd[0] : packed ? 16 * wd[0] : nk ? wd[0] : wd[1];
    // The kernel writes M x N floats: an output of another shape would be written past its end.
    const auto od = (*out)->dimensions();
    if (od.size() != 2 || od[0] != M || od[1] != N)
      return ffi::Error::InvalidArgument("dense_cpu: each output must be [M, N] float32");
    float* o = (*out)->typed_data();
    if (M == 0 || N == 0) continue;
    if (K == 0) {
      std::fill(o, o + M * N, 0.0f);
      continue;
    }
    ws.push_back(*w);
    os.push_back(o);
    ns.push_back(N);
  }
  if (ws.empty()) return ffi::Error::Success();
  switch (x.element_type()) {
    case ffi::DataType::F32: {
      std::vector<Operands<float>> ops;
      for (size_t i = 0; i < ws.size(); ++i)
        ops.push_back({static_cast<const float*>(x.untyped_data()), nullptr,
                       static_cast<const float*>(ws[i].untyped_data()), os[i], M, K, ns[i]});
      multiply(pool, ops, nk, tiles_from, packed);
      return ffi::Error::Success();
    }
    case ffi::DataType::BF16: {
      // Where the CPU multiplies bfloat16 pairs, both layouts read the rows as they came;
      // elsewhere they are widened once here. The weight, which is the traffic, stays 16-bit.
      const uint16_t* xb = static_cast<const uint16_t*>(x.untyped_data());
      std::vector<float> xf;
#if !defined(__AVX512BF16__)
      xf.resize(M * K);
      for (int64_t i = 0; i < M * K; ++i) {
        const uint32_t bits = uint32_t(xb[i]) << 16;
        std::memcpy(&xf[i], &bits, sizeof(float));
      }
#endif
      std::vector<Operands<uint16_t>> ops;
      for (size_t i = 0; i < ws.size(); ++i)
        ops.push_back({xf.empty() ? nullptr : xf.data(), xb,
                       static_cast<const uint16_t*>(ws[i].untyped_data()), os[i], M, K, ns[i]});
      multiply(pool, ops, nk, tiles_from, packed);
      return ffi::Error::Success();
    }
    default:
      return ffi::Error::InvalidArgument("dense_cpu: weights must be float32 or bfloat16");
  }
}

}  // namespace

// Whether this build multiplies on AMX tiles and Linux lets this process use them: Python packs
// weights into the tiles' layout only then (`kernels_cpu.dense.packs`).
extern "C" int InferDenseTilesPermitted() {
#if defined(INFER_DENSE_AMX)
  return tiles_permitted() ? 1 : 0;
#else
  return 0;
#endif
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(InferDenseCpu, dense_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<bool>("nk")
                                  .Attr<int64_t>("tiles_from"));
