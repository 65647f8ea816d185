// Skinny matrix multiply for decoding on CPU: y[s, n] = sum_k x[s, k] * w[n, k], for few rows s.
//
// Decoding multiplies a few token rows by weight matrices that are read from memory once per step.
// BLAS picks a packing GEMM as soon as there is more than one row, which on small CPUs costs twice
// a GEMV; here each weight row is read once and applied to every token row while it sits in L1,
// so verifying k+1 tokens costs about what decoding one does.
//
// Weights are fp32, bf16 (row-major, or tiled: WT_BF16T), int8 (per output row scale) or int4 (bf16 scale per group
// of input columns, two nibbles per byte; row-major or tiled: WT_I4T). Tiles only change where a row's bytes are. Each output element is computed by one fixed instruction sequence whatever the
// number of rows in the call, the tile it falls in or the thread count, so speculative verification,
// trees, batches and prefill see bit-identical logits to plain decoding.
//
// fp32 and int8 weights: decoded to fp32 in registers; 16 fp32 lanes accumulate k = l, l + 16, ...
// (lane l) by fused multiply-add, the lanes are summed by a fixed tree, the K % 16 tail is added by
// scalar fmaf, and an int8 row is scaled last.
//
// bf16 and int4 weights (bf16 dot products): each row of x is rounded to bf16 once per call (round to
// nearest even, denormals to signed zero, NaN quieted: what vcvtneps2bf16 does) and zero-padded to a
// multiple of 32 columns. Lane j (0..15) of a 32-column block accumulates, in this order,
//     acc = RN(acc + w[2j + 1] x[2j + 1]);  acc = RN(acc + w[2j] x[2j])
// with exact products, denormal inputs read as zero and denormal results flushed to signed zero: that is
// vdpbf16ps (AVX512_BF16), measured bitwise on this CPU (AMD Zen 4) against a float128 model and against
// the two-FMA emulation below on 16M random and adversarial lanes (cancellation, exponent spread,
// denormals, overflow; only NaN payloads differ). int4 nibbles are looked up into bf16(u - 8), exactly.
// The lanes are summed by the same fixed tree; int4 lanes sum a group, then add scale * partial sum.
// These two weight types run with MXCSR FTZ|DAZ in both builds (set and restored per call and thread).
//
// W4A8 (int4 weights in blocks of 16 rows, activations quantized to int8 per group): integer dot products, one
// output row per lane; see tile_a8.
//
// This file is compiled twice: with AVX-512 (+ AVX512_BF16: one zmm per 16 lanes, vdpbf16ps; + AVX512_VNNI:
// vpdpbusd) and with AVX2 (two ymm; the dot product as two FMAs under FTZ|DAZ, vpdpbusd as vpmaddubsw + vpmaddwd);
// both implement the same sequence, so the two builds agree bit for bit as well. Both are compiled with
// -ffp-contract=off (kernels.py): only the fused multiply-adds written here (fmaf, FMA intrinsics) fuse, so plain C
// arithmetic rounds as written in either build.
#define _GNU_SOURCE  // sched_getaffinity, CPU_COUNT (the pool's core count)
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <immintrin.h>
#include <stdlib.h>
#include <stdatomic.h>
#include <stdio.h>
#include <pthread.h>

enum { WT_F32 = 0, WT_BF16 = 1, WT_I8 = 2, WT_I4 = 3, WT_BF16T = 4, WT_I4T = 5, WT_I8T = 6, WT_I4A8 = 7,
       WT_GGUF = 8 /* GGUF Q4_K / Q6_K panels: gguf_kernels.c */ };

// The weight-type codes by name: kernels.py reads this table when it loads the library (skinny_weight_types), so the
// codes are written here and nowhere else. A new weight type gets an enum value, a line here and a case in
// weights_ok.
static const struct { const char *name; int code; } WEIGHT_TYPES[] = {
    {"f32", WT_F32}, {"bf16", WT_BF16}, {"i8", WT_I8}, {"i4", WT_I4}, {"bf16t", WT_BF16T}, {"i4t", WT_I4T},
    {"i8t", WT_I8T}, {"i4a8", WT_I4A8}, {"gguf", WT_GGUF}};
// "name=code name=code ...", built once.
const char *skinny_weight_types(void) {
    static char text[512];
    if (!text[0]) {
        size_t at = 0;
        for (size_t i = 0; i < sizeof WEIGHT_TYPES / sizeof WEIGHT_TYPES[0] && at < sizeof text; i++)
            at += (size_t)snprintf(text + at, sizeof text - at, "%s%s=%d", i ? " " : "", WEIGHT_TYPES[i].name,
                                   WEIGHT_TYPES[i].code);
    }
    return text;
}

// What the entry points that can fail return (kernels.py raises on anything but SK_OK): a shape or weight type the
// kernel cannot read (kernels.py checks these first, with the argument's name; this is the C side's own guard), or
// a scratch buffer that could not be allocated.
enum { SK_OK = 0, SK_EARG = 1, SK_ENOMEM = 2 };

// Scratch buffers: one set per calling thread, kept between calls (a decode step makes hundreds of these calls) and
// freed when the thread ends. A slot grows to the largest request up to SCRATCH_KEEP bytes; a larger one (a long
// prefill) is allocated for that call alone, so a thread keeps at most SC_N * SCRATCH_KEEP bytes.
enum { SC_XQ, SC_Q8, SC_S8, SC_C8, SC_SHARE, SC_PRE, SC_ACC, SC_QKV, SC_Q, SC_O, SC_H, SC_ATT, SC_GGQ, SC_GGDX, SC_GGXS,
       SC_GGO, SC_GGQI, SC_N };
#define SCRATCH_KEEP ((size_t)8 << 20)
typedef struct { void *p; size_t n; } slot_t;
_Atomic long long skinny_scratch_allocs;  // scratch allocations made, for the test that hot calls make none
static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;
static void scratch_free(void *v) {
    slot_t *s = (slot_t *)v;
    for (int i = 0; i < SC_N; i++) free(s[i].p);
    free(s);
}
static void scratch_init(void) { pthread_key_create(&scratch_key, scratch_free); }
// A 64-byte aligned buffer of `bytes` for `slot`, or NULL when out of memory. *owned: the caller frees it
// (scratch_done) because it is larger than a slot keeps.
// Inside decoder_layers (scratch_hold) a larger request stays in its slot until the call ends (scratch_trim): a
// 2,048-token prefill chunk of the 1.5B takes about 300 MB of such buffers a layer (the gate/up output alone 147 MB),
// and allocating them layer by layer had the kernel map and zero those pages 28 times a chunk (perf: 12.8% of a cold
// prefill in the kernel, clear_page and page faults).
static _Thread_local int scratch_hold;
static void *scratch(int slot, size_t bytes, int *owned) {
    const size_t n = bytes ? (bytes + 63) & ~(size_t)63 : 64;
    *owned = n > SCRATCH_KEEP && !scratch_hold;
    if (*owned) {
        atomic_fetch_add_explicit(&skinny_scratch_allocs, 1, memory_order_relaxed);
        return aligned_alloc(64, n);
    }
    pthread_once(&scratch_once, scratch_init);
    slot_t *s = (slot_t *)pthread_getspecific(scratch_key);
    if (!s) {
        if (!(s = (slot_t *)calloc(SC_N, sizeof(slot_t))) || pthread_setspecific(scratch_key, s)) {
            free(s);
            return NULL;
        }
    }
    if (s[slot].n < n) {
        atomic_fetch_add_explicit(&skinny_scratch_allocs, 1, memory_order_relaxed);
        free(s[slot].p);
        s[slot].p = aligned_alloc(64, n);
        s[slot].n = s[slot].p ? n : 0;
    }
    return s[slot].p;
}
static inline void scratch_done(void *p, int owned) {
    if (owned) free(p);
}
// The end of a hold: slots grown past SCRATCH_KEEP are freed, so a thread keeps at most SC_N * SCRATCH_KEEP bytes
// between calls.
static void scratch_trim(void) {
    pthread_once(&scratch_once, scratch_init);
    slot_t *s = scratch_hold ? NULL : (slot_t *)pthread_getspecific(scratch_key);
    for (int i = 0; s && i < SC_N; i++)
        if (s[i].n > SCRATCH_KEEP) free(s[i].p), s[i].p = NULL, s[i].n = 0;
}

static inline float hsum256(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    __m128 sh = _mm_movehdup_ps(lo);
    __m128 s = _mm_add_ps(lo, sh);
    sh = _mm_movehl_ps(sh, s);
    s = _mm_add_ss(s, sh);
    return _mm_cvtss_f32(s);
}

// fp32 -> bf16 as vcvtneps2bf16: round to nearest even, NaN -> quiet NaN, denormal -> signed zero; returned
// as the fp32 value (bf16 << 16) in each 32-bit lane.
static inline __m256i bf16_round8(__m256 f) {
    const __m256i u = _mm256_castps_si256(f);
    const __m256i absu = _mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF));
    const __m256i top = _mm256_srli_epi32(u, 16);
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)),
                                                   _mm256_and_si256(top, _mm256_set1_epi32(1))), 16);
    const __m256i nan = _mm256_cmpgt_epi32(absu, _mm256_set1_epi32(0x7F800000));
    const __m256i den = _mm256_cmpeq_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7F800000)), _mm256_setzero_si256());
    r = _mm256_blendv_epi8(r, _mm256_or_si256(top, _mm256_set1_epi32(0x40)), nan);
    r = _mm256_blendv_epi8(r, _mm256_and_si256(top, _mm256_set1_epi32(0x8000)), den);
    return _mm256_slli_epi32(r, 16);
}

// n fp32 -> bf16 as bf16_round8 rounds (vcvtneps2bf16's rounding), in both builds: the caches' K and V, a unit's q.
static void bf16_row(const float *x, uint16_t *out, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256i r = _mm256_srli_epi32(bf16_round8(_mm256_loadu_ps(x + i)), 16);
        _mm_storeu_si128((__m128i *)(out + i), _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
    }
    if (i < n) {
        float t[8] __attribute__((aligned(32))) = {0};
        uint32_t r[8] __attribute__((aligned(32)));
        memcpy(t, x + i, sizeof(float) * (size_t)(n - i));
        _mm256_store_si256((__m256i *)r, bf16_round8(_mm256_load_ps(t)));
        for (int k = 0; k < n - i; k++) out[i + k] = (uint16_t)(r[k] >> 16);
    }
}

#if defined(__AVX512F__)
#define ISA_NAME "avx512"
typedef __m512 v16;
static inline v16 v_zero(void) { return _mm512_setzero_ps(); }
static inline v16 v_set1(float f) { return _mm512_set1_ps(f); }
// A bf16 value from memory in every fp32 lane: vpbroadcastw + vpslld, two instructions where the scalar route took
// four. An int4 row takes one per group, and the 0.5B draft's int4 layers are compute-bound once L3 holds them:
// one layer hot on one thread, g64 357 -> 324 us, g128 309 -> 291 us.
static inline v16 v_bf16_set1(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_set1_epi16((short)*p), 16));
}
static inline v16 v_fma(v16 a, v16 b, v16 c) { return _mm512_fmadd_ps(a, b, c); }
static inline v16 v_loadf(const float *p) { return _mm512_loadu_ps(p); }
static inline v16 v_i8(const int8_t *p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p))); }
static inline float v_hsum(v16 a) {
    __m256 lo = _mm512_castps512_ps256(a);
    __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
    return hsum256(_mm256_add_ps(lo, hi));
}
// Weight rows per tile for a token group of g rows, fp32 / int8 weights (32 zmm registers: accumulators
// R*g, decoded weights).
static const int R_FOR_G[7] = {0, 8, 6, 4, 4, 3, 3};
// Every (R, g) that rows() asks for: R_FOR_G[g] (RB_, RQ_ below) with groups of g and g - 1 rows, and R = 1.
#define TILE_CASES_F(T) T(8, 1) T(6, 2) T(6, 1) T(4, 3) T(4, 2) T(4, 4) T(3, 5) T(3, 4) T(3, 6) \
                        T(1, 1) T(1, 2) T(1, 3) T(1, 4) T(1, 5) T(1, 6)
#define TILE_CASES_B(T) T(8, 1) T(6, 2) T(6, 1) T(4, 3) T(4, 2) T(4, 4) T(4, 5) T(4, 6) \
                        T(1, 1) T(1, 2) T(1, 3) T(1, 4) T(1, 5) T(1, 6)
#define TILE_CASES_T(T) T(4, 1) T(4, 2) T(4, 3) T(4, 4) T(4, 5) T(4, 6) \
                        T(1, 1) T(1, 2) T(1, 3) T(1, 4) T(1, 5) T(1, 6)
#define TILE_CASES_Q(T) T(8, 1) T(5, 2) T(5, 1) T(3, 3) T(3, 2) T(3, 4) T(2, 5) T(2, 4) T(2, 6) \
                        T(1, 1) T(1, 2) T(1, 3) T(1, 4) T(1, 5) T(1, 6)
// bf16 dot products. wv32 / xv32: 32 bf16 weights / activations (column 2j in the low half of lane j).
#if !defined(__AVX512BF16__)
#error "the AVX-512 build needs AVX512_BF16 (-mavx512bf16)"
#endif
typedef __m512i wv32;
typedef __m512i xv32;
typedef uint16_t xq_t;  // rounded activations as stored: bf16
static inline wv32 w_bf16(const uint16_t *p) { return _mm512_loadu_si512((const void *)p); }
static inline wv32 w_bf16_tail(const uint16_t *p, int n) {
    return _mm512_maskz_loadu_epi16((__mmask32)((1ull << n) - 1), (const void *)p);
}
static inline xv32 x_load(const xq_t *p) { return _mm512_loadu_si512((const void *)p); }
static inline v16 v_dp(v16 acc, wv32 w, xv32 x) { return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)x); }
// bf16(u - 8) for u = 0..15, twice: vpermw reads the low 5 bits of each index, bit 4 is a neighbour's bit.
static const uint16_t U4_BF16[32] __attribute__((aligned(64))) = {
    0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80,
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
    0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80,
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0};
static const uint16_t U4_SHIFT[32] __attribute__((aligned(64))) = {
    0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4, 8, 8, 8, 8, 8, 8, 8, 8, 12, 12, 12, 12, 12, 12, 12, 12};
// One 32-column int4 block (16 bytes = 8 words; word i holds column 8m + i in nibble m) -> 32 bf16 in
// column order: the block is broadcast to the four 128-bit lanes, lane m shifts its words right by 4m
// (vpsrlvw) and vpermw looks the low nibble up in U4_BF16. No cross-lane shuffle besides the lookup.
static inline wv32 w_u4(const uint8_t *p) {
    const __m512i b = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)p));
    const __m512i sh = _mm512_load_si512((const void *)U4_SHIFT), tab = _mm512_load_si512((const void *)U4_BF16);
    return _mm512_permutexvar_epi16(_mm512_srlv_epi16(b, sh), tab);
}
// Chunk m (columns 32m..32m + 31) of a 128-column int4 superblock (64 bytes = 32 words; word i holds column
// 32m + i in nibble m): one plain load, a shift and the lookup, no broadcast (a broadcast load costs a
// shuffle on this CPU: the per-32-column blocks above made one-token int4 matmuls ~9% slower).
static inline wv32 w_u4s(const uint8_t *p, const int m) {
    const __m512i tab = _mm512_load_si512((const void *)U4_BF16);
    return _mm512_permutexvar_epi16(_mm512_srli_epi16(_mm512_loadu_si512((const void *)p), 4 * m), tab);
}
// x row -> bf16, padded with zeros to Kp (a multiple of 32) columns: vcvtneps2bf16.
static void x_round(const float *x, xq_t *out, int K, int Kp) {
    int k = 0;
    for (; k + 16 <= K; k += 16)
        _mm256_storeu_si256((__m256i *)(out + k), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + k)));
    if (k < K) {
        __m512 t = _mm512_maskz_loadu_ps((__mmask16)((1u << (K - k)) - 1), x + k);
        _mm256_storeu_si256((__m256i *)(out + k), (__m256i)_mm512_cvtneps_pbh(t));
        k += 16;
    }
    for (; k < Kp; k++) out[k] = 0;
}
// Weight rows per tile for a token group of g rows, bf16 dot products (accumulators R*g, R weight
// vectors, one x vector) and int4 (R*g more for a group's partial sums, the lookup table and shifts).
// (Measured, one thread, a Qwen2.5-1.5B layer: 6 rows x 3 tokens streamed 15% slower than 4 x 3.)
static const int RB_FOR_G[7] = {0, 8, 6, 4, 4, 4, 4};
// Tiled bf16: the rows of one 4-row tile.
static const int RT_FOR_G[7] = {0, 4, 4, 4, 4, 4, 4};
static const int RQ_FOR_G[7] = {0, 8, 5, 3, 3, 2, 2};

// W4A8 (WT_I4A8): int32 lanes, one output row each. vpdpbusd multiplies 4 unsigned weight bytes by 4 signed
// activation bytes and adds the four products to the lane, exactly.
#if !defined(__AVX512VNNI__)
#error "the AVX-512 build needs AVX512_VNNI (-mavx512vnni)"
#endif
#define A8_LANES 16
typedef __m512i vi_t;   // A8_LANES int32 lanes
typedef __m512 vf_t;    // A8_LANES fp32 lanes
static inline vi_t vi_set1(int32_t v) { return _mm512_set1_epi32(v); }
static inline vi_t vi_add(vi_t a, vi_t b) { return _mm512_add_epi32(a, b); }
// 4 A8_LANES bytes of a chunk: weight nibbles of the lanes' rows, low nibbles (columns 8c..8c + 3) and high (8c + 4..)
static inline void a8_nibbles(const uint8_t *p, vi_t *lo, vi_t *hi) {
    const __m512i w = _mm512_loadu_si512((const void *)p), m = _mm512_set1_epi8(15);
    *lo = _mm512_and_si512(w, m);
    *hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), m);
}
// x4: 4 int8 activations, broadcast to every lane straight from memory. Through a general register, as a 16-byte
// memcpy had it, the draft's gate/up matmul (9728 x 896, hot, 2 threads, best of 300, three alternations) took 52-59
// against 39-40 us for one token row, 138-161 against 91-99 us for four.
static inline vi_t vi_dp(vi_t acc, vi_t u, const int8_t *x4) {
    return _mm512_dpbusd_epi32(acc, u, _mm512_broadcastd_epi32(_mm_loadu_si32((const void *)x4)));
}
static inline vf_t vf_cvt(vi_t a) { return _mm512_cvtepi32_ps(a); }
static inline vf_t vf_bf16(const uint16_t *p) {  // A8_LANES bf16 -> fp32
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline vf_t vf_zero(void) { return _mm512_setzero_ps(); }
static inline vf_t vf_scale(vf_t s, float x) { return _mm512_mul_ps(s, _mm512_set1_ps(x)); }
static inline vf_t vf_fma(vf_t a, vf_t b, vf_t c) { return _mm512_fmadd_ps(a, b, c); }
static inline void vf_store(float *y, vf_t v, int n) {
    if (n >= A8_LANES) _mm512_storeu_ps(y, v);
    else _mm512_mask_storeu_ps(y, (__mmask16)((1u << n) - 1), v);
}

#else
#define ISA_NAME "avx2"
typedef struct { __m256 a, b; } v16;
static inline v16 v_zero(void) { v16 r = {_mm256_setzero_ps(), _mm256_setzero_ps()}; return r; }
static inline v16 v_set1(float f) { v16 r = {_mm256_set1_ps(f), _mm256_set1_ps(f)}; return r; }
static inline float bf16_f32(uint16_t h);
static inline v16 v_bf16_set1(const uint16_t *p) { return v_set1(bf16_f32(*p)); }
static inline v16 v_fma(v16 a, v16 b, v16 c) {
    v16 r = {_mm256_fmadd_ps(a.a, b.a, c.a), _mm256_fmadd_ps(a.b, b.b, c.b)};
    return r;
}
static inline v16 v_loadf(const float *p) { v16 r = {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; return r; }
static inline __m256 i8x8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline v16 v_i8(const int8_t *p) { v16 r = {i8x8(p), i8x8(p + 8)}; return r; }
static inline float v_hsum(v16 a) { return hsum256(_mm256_add_ps(a.a, a.b)); }
// 16 ymm registers, two per 16-lane accumulator.
static const int R_FOR_G[7] = {0, 3, 2, 1, 1, 1, 1};
#define TILE_CASES_F(T) T(3, 1) T(2, 2) T(2, 1) T(1, 1) T(1, 2) T(1, 3) T(1, 4) T(1, 5) T(1, 6)
#define TILE_CASES_B(T) T(2, 1) T(1, 1) T(1, 2) T(1, 3) T(1, 4) T(1, 5) T(1, 6)
#define TILE_CASES_Q(T) T(8, 1) T(4, 2) T(4, 1) T(3, 3) T(3, 2) T(2, 4) T(2, 3) T(2, 5) \
                        T(1, 1) T(1, 2) T(1, 3) T(1, 4) T(1, 5) T(1, 6)
#define TILE_CASES_T TILE_CASES_B
// bf16 dot products emulated: per lane, two FMAs (odd column first) on the bf16 values widened to fp32,
// under MXCSR FTZ|DAZ, which is vdpbf16ps bit for bit (see the header). o*: odd columns 2j + 1, e*: even
// columns 2j, a: lanes 0..7, b: lanes 8..15.
typedef struct { __m256 oa, ob, ea, eb; } wv32;
typedef wv32 xv32;
typedef float xq_t;  // rounded activations as stored: fp32, each 32-column block as oa ob ea eb
static inline wv32 w_split(__m256i a, __m256i b) {
    const __m256i hi = _mm256_set1_epi32((int)0xFFFF0000);
    wv32 r = {_mm256_castsi256_ps(_mm256_and_si256(a, hi)), _mm256_castsi256_ps(_mm256_and_si256(b, hi)),
              _mm256_castsi256_ps(_mm256_slli_epi32(a, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(b, 16))};
    return r;
}
static inline wv32 w_bf16(const uint16_t *p) {
    return w_split(_mm256_loadu_si256((const __m256i *)p), _mm256_loadu_si256((const __m256i *)(p + 16)));
}
static inline wv32 w_bf16_tail(const uint16_t *p, int n) {
    uint16_t t[32] = {0};
    memcpy(t, p, 2 * (size_t)n);
    return w_bf16(t);
}
static inline xv32 x_load(const xq_t *p) {
    xv32 r = {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8), _mm256_loadu_ps(p + 16), _mm256_loadu_ps(p + 24)};
    return r;
}
static inline v16 v_dp(v16 acc, wv32 w, xv32 x) {
    acc.a = _mm256_fmadd_ps(w.oa, x.oa, acc.a);
    acc.a = _mm256_fmadd_ps(w.ea, x.ea, acc.a);
    acc.b = _mm256_fmadd_ps(w.ob, x.ob, acc.b);
    acc.b = _mm256_fmadd_ps(w.eb, x.eb, acc.b);
    return acc;
}
// As the AVX-512 w_u4: lane j needs columns 2j, 2j + 1 = words 2 (j % 4), 2 (j % 4) + 1, i.e. dword j % 4,
// nibble j / 4 of each half: broadcast the block to both 128-bit halves, shift dwords right by 4 (j / 4).
static inline __m256 u4f(__m256i v) {  // low 4 bits u -> u - 8 in fp32, exact
    const __m256i m15 = _mm256_set1_epi32(15), magic = _mm256_set1_epi32(0x4B000000);
    return _mm256_sub_ps(_mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(v, m15), magic)),
                         _mm256_set1_ps(8388616.0f));
}
static inline wv32 w_u4(const uint8_t *p) {
    const __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p));
    __m256i la = _mm256_srlv_epi32(b, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4));
    __m256i lb = _mm256_srlv_epi32(b, _mm256_setr_epi32(8, 8, 8, 8, 12, 12, 12, 12));
    wv32 r = {u4f(_mm256_srli_epi32(la, 16)), u4f(_mm256_srli_epi32(lb, 16)), u4f(la), u4f(lb)};
    return r;
}
// As the AVX-512 w_u4s: lane j needs columns 32m + 2j, 32m + 2j + 1 = nibble m of words 2j, 2j + 1, i.e. of
// dword j, bits 4m and 16 + 4m.
static inline wv32 w_u4s(const uint8_t *p, const int m) {
    __m256i la = _mm256_srli_epi32(_mm256_loadu_si256((const __m256i *)p), 4 * m);
    __m256i lb = _mm256_srli_epi32(_mm256_loadu_si256((const __m256i *)(p + 32)), 4 * m);
    wv32 r = {u4f(_mm256_srli_epi32(la, 16)), u4f(_mm256_srli_epi32(lb, 16)), u4f(la), u4f(lb)};
    return r;
}
static void x_round(const float *x, xq_t *out, int K, int Kp) {
    float t[32];
    for (int k0 = 0; k0 < Kp; k0 += 32) {
        const float *src = x + k0;
        if (k0 + 32 > K) {
            for (int k = 0; k < 32; k++) t[k] = k0 + k < K ? x[k0 + k] : 0.f;
            src = t;
        }
        // pairs (2j, 2j + 1) of columns: odd to lane j of oa/ob, even to ea/eb
        const __m256i perm = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
        for (int h = 0; h < 2; h++) {
            __m256i p0 = _mm256_permutevar8x32_epi32(bf16_round8(_mm256_loadu_ps(src + 16 * h)), perm);
            __m256i p1 = _mm256_permutevar8x32_epi32(bf16_round8(_mm256_loadu_ps(src + 16 * h + 8)), perm);
            // p0 = [e0..e3 | o0..o3] of lanes 8h..8h+3, p1 the same for lanes 8h+4..8h+7
            __m256i ev = _mm256_permute2x128_si256(p0, p1, 0x20), od = _mm256_permute2x128_si256(p0, p1, 0x31);
            _mm256_storeu_si256((__m256i *)(out + k0 + 8 * h), od);
            _mm256_storeu_si256((__m256i *)(out + k0 + 16 + 8 * h), ev);
        }
    }
}
static const int RB_FOR_G[7] = {0, 2, 1, 1, 1, 1, 1};
static const int RT_FOR_G[7] = {0, 2, 1, 1, 1, 1, 1};
// int4 runs half a block at a time (tile_i4_avx2): a row's partial sums take one ymm per token row.
static const int RQ_FOR_G[7] = {0, 8, 4, 3, 2, 2, 1};

// W4A8 as in the AVX-512 build, 8 rows per pass: vpdpbusd is vpmaddubsw (u8 x s8 pairs to int16: |sum| <= 2 * 15 *
// 128, so it never saturates) then vpmaddwd by ones (pairs to int32), exact, so the lanes hold the same integers.
#define A8_LANES 8
typedef __m256i vi_t;
typedef __m256 vf_t;
static inline vi_t vi_set1(int32_t v) { return _mm256_set1_epi32(v); }
static inline vi_t vi_add(vi_t a, vi_t b) { return _mm256_add_epi32(a, b); }
static inline void a8_nibbles(const uint8_t *p, vi_t *lo, vi_t *hi) {
    const __m256i w = _mm256_loadu_si256((const __m256i *)p), m = _mm256_set1_epi8(15);
    *lo = _mm256_and_si256(w, m);
    *hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), m);
}
static inline vi_t vi_dp(vi_t acc, vi_t u, const int8_t *x4) {
    const __m256i p = _mm256_maddubs_epi16(u, _mm256_broadcastd_epi32(_mm_loadu_si32((const void *)x4)));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}
// vi_dp over 16 columns in one: four vpmaddubsw pair sums of 4-bit weights (|each| <= 2 * 15 * 127) add exactly in
// int16 (|sum| <= 15240) and widen once, where four vi_dp paid four vpmaddwd and four adds.
static inline vi_t vi_dp16(vi_t acc, vi_t l0, vi_t h0, vi_t l1, vi_t h1, const int8_t *x16) {
    const __m256i a = _mm256_add_epi16(
        _mm256_maddubs_epi16(l0, _mm256_broadcastd_epi32(_mm_loadu_si32((const void *)x16))),
        _mm256_maddubs_epi16(h0, _mm256_broadcastd_epi32(_mm_loadu_si32((const void *)(x16 + 4)))));
    const __m256i b = _mm256_add_epi16(
        _mm256_maddubs_epi16(l1, _mm256_broadcastd_epi32(_mm_loadu_si32((const void *)(x16 + 8)))),
        _mm256_maddubs_epi16(h1, _mm256_broadcastd_epi32(_mm_loadu_si32((const void *)(x16 + 12)))));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_add_epi16(a, b), _mm256_set1_epi16(1)));
}
static inline vf_t vf_cvt(vi_t a) { return _mm256_cvtepi32_ps(a); }
static inline vf_t vf_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline vf_t vf_zero(void) { return _mm256_setzero_ps(); }
static inline vf_t vf_scale(vf_t s, float x) { return _mm256_mul_ps(s, _mm256_set1_ps(x)); }
static inline vf_t vf_fma(vf_t a, vf_t b, vf_t c) { return _mm256_fmadd_ps(a, b, c); }
static inline void vf_store(float *y, vf_t v, int n) {
    if (n >= A8_LANES) {
        _mm256_storeu_ps(y, v);
    } else {
        float t[8];
        _mm256_storeu_ps(t, v);
        for (int i = 0; i < n; i++) y[i] = t[i];
    }
}

#endif

const char *skinny_isa(void) { return ISA_NAME; }

// The next tile is prefetched into L2, not L1: with T0 the 8 rows in flight plus x overflowed the 32 KB
// L1 and a one-token bf16 / int8 step ran at 13 / 10 GB/s on one core instead of 20 / 19 (measured).
#define PF_HINT _MM_HINT_T1
// The window it prefetches starts at least PF_BYTES past the tile being read: a tile of 8 rows of a 0.5B draft's
// int4 weights is 3.5 KB, which the cores read in about the time one DRAM access takes, so prefetching only the
// next tile came too late (measured, int4 draft-shaped layers from DRAM: 8 KB ahead streamed 6-8% faster;
// bf16 tiles and the 1.5B's int4 tiles, 6 KB and more, did not change).
#define PF_BYTES 8192
// Tiled bf16 weights (WT_BF16T) are one sequential stream of 4-row tiles; how far ahead to prefetch depends on the
// number of token rows G, measured on the 1.5B's matmuls, paired against row-major tiles (the prefetch of the next
// tile that row-major reading needs was 1.09x slower than this at G = 1):
//   G = 1: 4 KB ahead: 1.13x as fast as row-major when memory was fast (25 paired rounds at 51 GB/s read), 1.02x when
//          slow (114 at 31 GB/s); 8-row tiles, 1.08x. 4-row tiles keep every G a sequential read: 8-row tiles read
//          as 4-row halves ran verification (G = 4 + 3) at 0.67x;
//   G = 2: 2 KB: 1.00x (16 KB: 0.84x);
//   G > 2: one tile ahead (its 4 rows): 1.04x at 7 rows (4 KB: 0.67x), 0.93-0.97x at 4 rows; 48-row prefill 1.01x.
#define TROWS 4
#define PF_TILED1 4096
#define PF_TILED2 2048
// Tiled int4 (8-row tiles of 64-byte superblocks): the 0.5B draft's 97 one-token matmuls, paired against row-major,
// 300 rounds: 8 KB ahead 1.057x / 1.065x / 1.060x at 30 / 44 / 48 GB/s read; 16 KB 1.04-1.07x; 4 KB 0.97-0.99x.
#define PF_I4T 8192
// Tiled int8 (8 rows of 16 columns side by side) prefetches one tile (8 rows) ahead: the 1.5B's one-token int8 matmuls,
// paired against row-major, 100 rounds: 1.047x / 1.081x / 1.118x at 28 / 43 / 47 GB/s read (16 KB ahead: 1.04-1.11x;
// 4 KB: 0.93x).
static inline int64_t pf_shift(int64_t tile) { return tile >= PF_BYTES ? 0 : (PF_BYTES - tile + 63) & ~63; }
// Prefetch byte `off` of a buffer of `size` bytes, clamped to its last byte: on the last tiles the window runs past the
// end of the weights (or scales), and forming a pointer past a buffer's end is undefined behaviour in C. Offsets are
// computed as integers, and only the clamped one becomes a pointer.
static inline void pf(const void *base, int64_t off, int64_t size) {
    _mm_prefetch((const char *)base + (off < size ? off : size - 1), PF_HINT);
}
#define MAXR 8
#define MAXG 6

static inline float bf16_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline int64_t row_bytes(int K, int wt) {
    return wt == WT_F32 ? 4 * (int64_t)K : wt == WT_BF16 || wt == WT_BF16T ? 2 * (int64_t)K
         : wt == WT_I8 || wt == WT_I8T ? (int64_t)K : (int64_t)K / 2;  // int4
}

// Row n of a tiled int4 matrix (quant.tile): its superblock sb at tile(n / 8) + 512 sb + 64 (n % 8); K % 128 == 0.
static inline const uint8_t *i4t_row(const char *wb, int64_t n, int64_t rb) {
    return (const uint8_t *)(wb + n / 8 * 8 * rb + n % 8 * 64);
}

// One weight element, for the K % 16 tail of fp32 / int8 rows.
static inline float w1(const void *w, int64_t row, int64_t k, int K, int wt) {
    if (wt == WT_F32) return ((const float *)w)[row * K + k];
    return (float)((const int8_t *)w)[row * K + k];
}

// fp32 / int8: R weight rows times G token rows, all in registers; R, G and wt are constants after
// inlining. While it runs, the next R rows are prefetched (into L2): without that, the hardware prefetcher
// leaves DRAM idle during the FMAs, and verifying 4 tokens cost 1.6x decoding one instead of ~1.0x.
static inline __attribute__((always_inline)) void tile(const void *xv, const void *w, const float *sc, float *y,
                                                       int K, int N, int gs, int n, int s0, const int R, const int G,
                                                       const int wt) {
    (void)gs;
    const float *x = (const float *)xv;
    v16 acc[MAXR][MAXG];
    const int64_t rb = row_bytes(K, wt);
    const char *wb = (const char *)w;
    const int64_t next = (int64_t)(n + R) * rb + pf_shift(R * rb), wsize = (int64_t)N * rb;
    for (int r = 0; r < R; r++)
        for (int i = 0; i < G; i++) acc[r][i] = v_zero();
    const int esize = wt == WT_F32 ? 4 : 1;
    const int64_t row0 = (int64_t)(n / 8) * 8 * rb + (n % 8) * 16;  // rowt[0]'s offset (WT_I8T)
    int K16 = K & ~15;
    // Tiled int8 (quant.tile): the 16 columns k.. of row n at tile(n / 8) + 8 k + 16 (n % 8); K % 16 == 0.
    const char *rowt[MAXR];
    if (wt == WT_I8T)
        for (int r = 0; r < R; r++) rowt[r] = wb + (int64_t)((n + r) / 8) * 8 * rb + ((n + r) % 8) * 16;
    for (int k = 0; k < K16; k += 16) {
        if (wt == WT_I8T)
            for (int off = 0; off < R * 16; off += 64) pf(wb, row0 + (int64_t)k * 8 + 8 * rb + off, wsize);
        else
            for (int off = 0; off < R * 16 * esize; off += 64) pf(wb, next + (int64_t)k * R * esize + off, wsize);
        v16 wv[MAXR];
        for (int r = 0; r < R; r++) {
            const char *p = wt == WT_I8T ? rowt[r] + (int64_t)k * 8 : wb + (int64_t)(n + r) * rb + (int64_t)k * esize;
            wv[r] = wt == WT_F32 ? v_loadf((const float *)p) : v_i8((const int8_t *)p);
        }
        for (int i = 0; i < G; i++) {
            v16 xr = v_loadf(x + (int64_t)(s0 + i) * K + k);
            for (int r = 0; r < R; r++) acc[r][i] = v_fma(wv[r], xr, acc[r][i]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int i = 0; i < G; i++) {
            float v = v_hsum(acc[r][i]);
            for (int k = K & ~15; k < K; k++) v = fmaf(w1(w, n + r, k, K, wt), x[(int64_t)(s0 + i) * K + k], v);
            if (wt == WT_I8 || wt == WT_I8T) v *= sc[n + r];
            y[(int64_t)(s0 + i) * N + n + r] = v;
        }
}

#if !defined(__AVX512F__)
// AVX2 int4, half a 32-column block at a time: lanes 0..7 (bytes 0..31 of a row's superblock), then lanes 8..15
// (bytes 32..63). Each lane runs the FMAs tile_dp runs, in the same order, so the bits do not change. Decoding
// whole blocks held four ymm per weight row and left room for one row, so each lane's FMA waited on the one
// before it: one-token int4 matmuls ran at 7.7 GB/s on Zen 3, half of bf16's rate. A half-block takes one ymm per
// row and token row, so R rows' chains run side by side: a 17920 x 1536 matmul, paired against whole blocks (15
// rounds), 1.05x / 1.01x / 1.07x / 1.06x at 1 / 2 / 4 / 7 token rows. K % 128 columns (32-column blocks) take both
// halves. (The same split for bf16 rows measured 0.94-0.99x, so bf16 keeps whole blocks.)
static inline __attribute__((always_inline)) void tile_i4_avx2(const float *xq, const char *wb, const float *sc,
                                                               float *y, int K, int N, int gs, int n, int s0,
                                                               const int R, const int G, const int wt) {
    const int64_t Kp = (K + 31) & ~31, rb = K / 2;
    const int ng = K / gs, K128 = K & ~127;
    const uint16_t *s16 = (const uint16_t *)sc;
    __m256 acc[2][MAXR][MAXG];
    for (int h = 0; h < 2; h++)
        for (int r = 0; r < R; r++)
            for (int i = 0; i < G; i++) acc[h][r][i] = _mm256_setzero_ps();
    const int64_t snext = 2 * (int64_t)(n + 4 * R) * ng, ssize = 2 * (int64_t)N * ng;
    for (int off = 0; off < R * ng * 2; off += 64) pf(s16, snext + off, ssize);
    // Superblock sb of row n: row-major at n * rb + 64 sb; tiled at i4t_row(n) + 512 sb.
    const uint8_t *row[MAXR];
    for (int r = 0; r < R; r++)
        row[r] = wt == WT_I4T ? i4t_row(wb, n + r, rb) : (const uint8_t *)(wb + (int64_t)(n + r) * rb);
    const int64_t sbs = wt == WT_I4T ? 512 : 64;
    const int64_t next = (int64_t)(n + R) * rb + pf_shift(R * rb), wsize = (int64_t)N * rb;
    const int64_t row0 = (int64_t)((const char *)row[0] - wb);
    for (int k = 0; k < K128; k += 128) {
        const int64_t at = (int64_t)k / 128 * sbs;
        for (int off = 0; off < R * 64; off += 64)
            pf(wb, wt == WT_I4T ? row0 + at + PF_I4T + off : next + (int64_t)k / 2 * R + off, wsize);
        for (int h = 0; h < 2; h++) {
            __m256 part[MAXR][MAXG];
            for (int r = 0; r < R; r++)
                for (int i = 0; i < G; i++) part[r][i] = _mm256_setzero_ps();
#pragma GCC unroll 4
            for (int m = 0; m < 4; m++) {
                for (int r = 0; r < R; r++) {
                    const __m256i l = _mm256_loadu_si256((const __m256i *)(row[r] + at + 32 * h));
                    const __m256 wo = u4f(_mm256_srli_epi32(l, 16 + 4 * m)), we = u4f(_mm256_srli_epi32(l, 4 * m));
                    for (int i = 0; i < G; i++) {
                        const float *xb = xq + (int64_t)(s0 + i) * Kp + k + 32 * m + 8 * h;
                        part[r][i] = _mm256_fmadd_ps(wo, _mm256_loadu_ps(xb), part[r][i]);
                        part[r][i] = _mm256_fmadd_ps(we, _mm256_loadu_ps(xb + 16), part[r][i]);
                    }
                }
                if ((k + 32 * m + 32) % gs == 0)
                    for (int r = 0; r < R; r++) {
                        const __m256 vs = _mm256_set1_ps(bf16_f32(s16[(int64_t)(n + r) * ng + (k + 32 * m) / gs]));
                        for (int i = 0; i < G; i++)
                            acc[h][r][i] = _mm256_fmadd_ps(vs, part[r][i], acc[h][r][i]), part[r][i] = _mm256_setzero_ps();
                    }
            }
        }
    }
    if (K128 < K) {
        __m256 part[2][MAXR][MAXG];
        for (int h = 0; h < 2; h++)
            for (int r = 0; r < R; r++)
                for (int i = 0; i < G; i++) part[h][r][i] = _mm256_setzero_ps();
        for (int k = K128; k < K; k += 32) {
            for (int off = 0; off < R * 16; off += 64) pf(wb, next + (int64_t)k / 2 * R + off, wsize);
            for (int r = 0; r < R; r++) {
                const wv32 wq = w_u4((const uint8_t *)(wb + (int64_t)(n + r) * rb + k / 2));
                for (int i = 0; i < G; i++) {
                    const xv32 xr = x_load(xq + (int64_t)(s0 + i) * Kp + k);
                    part[0][r][i] = _mm256_fmadd_ps(wq.ea, xr.ea, _mm256_fmadd_ps(wq.oa, xr.oa, part[0][r][i]));
                    part[1][r][i] = _mm256_fmadd_ps(wq.eb, xr.eb, _mm256_fmadd_ps(wq.ob, xr.ob, part[1][r][i]));
                }
            }
            if ((k + 32) % gs == 0)
                for (int r = 0; r < R; r++) {
                    const __m256 vs = _mm256_set1_ps(bf16_f32(s16[(int64_t)(n + r) * ng + k / gs]));
                    for (int h = 0; h < 2; h++)
                        for (int i = 0; i < G; i++)
                            acc[h][r][i] = _mm256_fmadd_ps(vs, part[h][r][i], acc[h][r][i]),
                            part[h][r][i] = _mm256_setzero_ps();
                }
        }
    }
    for (int r = 0; r < R; r++)
        for (int i = 0; i < G; i++) y[(int64_t)(s0 + i) * N + n + r] = hsum256(_mm256_add_ps(acc[0][r][i], acc[1][r][i]));
}

#endif

// bf16 / int4: the same tile with bf16 dot products on x rounded to bf16 (xq: rows of Kp = K rounded up
// to 32, zero-padded; see x_round). A bf16 row's K % 32 tail is one more block, the weights zero-filled.
// int4: y = sum over groups of s_g * (sum over the group of (u - 8) x): the group's partial sums stay in
// registers and are scaled once per group, not once per weight.
static inline __attribute__((always_inline)) void tile_dp(const void *xv, const void *w, const float *sc, float *y,
                                                          int K, int N, int gs, int n, int s0, const int R,
                                                          const int G, const int wt) {
#if !defined(__AVX512F__)
    if (wt == WT_I4 || wt == WT_I4T) {
        tile_i4_avx2((const float *)xv, (const char *)w, sc, y, K, N, gs, n, s0, R, G, wt);
        return;
    }
#endif
    const xq_t *xq = (const xq_t *)xv;
    const int64_t Kp = (K + 31) & ~31;
    v16 acc[MAXR][MAXG];
    const int64_t rb = row_bytes(K, wt);
    const char *wb = (const char *)w;
    const int64_t next = (int64_t)(n + R) * rb + pf_shift(R * rb), wsize = (int64_t)N * rb;
    for (int r = 0; r < R; r++)
        for (int i = 0; i < G; i++) acc[r][i] = v_zero();
    if (wt == WT_I4 || wt == WT_I4T) {
        // Columns below K & ~127 come in 128-column superblocks, the rest in 32-column blocks (see
        // skinny_matmul); either way lane sums go chunk by chunk into a group's partial sums.
        const int ng = K / gs, K128 = K & ~127;
        const uint16_t *s16 = (const uint16_t *)sc;
        // The scales of the tile 4 tiles on (a few cache lines), a second stream: without this prefetch the
        // 0.5B draft's int4 layers streamed 7-8% slower from DRAM (40 paired rounds, twice), the 1.5B's 1.6%.
        const int64_t snext = 2 * (int64_t)(n + 4 * R) * ng, ssize = 2 * (int64_t)N * ng;
        for (int off = 0; off < R * ng * 2; off += 64) pf(s16, snext + off, ssize);
        v16 part[MAXR][MAXG];
        for (int r = 0; r < R; r++)
            for (int i = 0; i < G; i++) part[r][i] = v_zero();
#define I4_CHUNK(DECODE, KC)                                                                                   \
    {                                                                                                          \
        wv32 wq[MAXR];                                                                                         \
        for (int r = 0; r < R; r++) wq[r] = DECODE;                                                            \
        for (int i = 0; i < G; i++) {                                                                          \
            xv32 xr = x_load(xq + (int64_t)(s0 + i) * Kp + (KC));                                              \
            for (int r = 0; r < R; r++) part[r][i] = v_dp(part[r][i], wq[r], xr);                              \
        }                                                                                                      \
        if (((KC) + 32) % gs == 0) {                                                                           \
            for (int r = 0; r < R; r++) {                                                                      \
                v16 vs = v_bf16_set1(s16 + (int64_t)(n + r) * ng + (KC) / gs);                                 \
                for (int i = 0; i < G; i++) acc[r][i] = v_fma(vs, part[r][i], acc[r][i]), part[r][i] = v_zero(); \
            }                                                                                                  \
        }                                                                                                      \
    }
        if (wt == WT_I4T) {
            const uint8_t *rowt[MAXR];
            for (int r = 0; r < R; r++) rowt[r] = i4t_row(wb, n + r, rb);
            for (int k = 0; k < K128; k += 128) {
                const int64_t at = (int64_t)k / 128 * 512;
                for (int off = 0; off < R * 64; off += 64) pf(wb, (const char *)rowt[0] - wb + at + PF_I4T + off, wsize);
                I4_CHUNK(w_u4s(rowt[r] + at, 0), k)
                I4_CHUNK(w_u4s(rowt[r] + at, 1), k + 32)
                I4_CHUNK(w_u4s(rowt[r] + at, 2), k + 64)
                I4_CHUNK(w_u4s(rowt[r] + at, 3), k + 96)
            }
        } else {
            for (int k = 0; k < K128; k += 128) {
                for (int off = 0; off < R * 64; off += 64) pf(wb, next + (int64_t)k / 2 * R + off, wsize);
                const uint8_t *rowp = (const uint8_t *)(wb + (int64_t)n * rb + k / 2);
                I4_CHUNK(w_u4s(rowp + r * rb, 0), k)
                I4_CHUNK(w_u4s(rowp + r * rb, 1), k + 32)
                I4_CHUNK(w_u4s(rowp + r * rb, 2), k + 64)
                I4_CHUNK(w_u4s(rowp + r * rb, 3), k + 96)
            }
        }
        for (int k = K128; k < K; k += 32) {
            for (int off = 0; off < R * 16; off += 64) pf(wb, next + (int64_t)k / 2 * R + off, wsize);
            I4_CHUNK(w_u4((const uint8_t *)(wb + (int64_t)(n + r) * rb + k / 2)), k)
        }
#undef I4_CHUNK
    } else if (wt == WT_BF16T) {
        // Rows n.. of one 4-row tile (n % 4 + R <= 4): block kb of lane l at tile + 256 kb + 64 l, so the tile
        // streams by in address order. K is a multiple of 32 here (quant.tile).
        const int64_t baseo = (int64_t)(n / TROWS) * TROWS * rb + (n % TROWS) * 64;
        const char *base = wb + baseo;
        const int64_t pfd = G == 1 ? PF_TILED1 : G == 2 ? PF_TILED2 : TROWS * rb;
        for (int kb = 0; kb < K / 32; kb++) {
            const char *blk = base + (int64_t)kb * 64 * TROWS;
            for (int off = 0; off < R * 64; off += 64) pf(wb, baseo + (int64_t)kb * 64 * TROWS + pfd + off, wsize);
            wv32 wq[MAXR];
            for (int r = 0; r < R; r++) wq[r] = w_bf16((const uint16_t *)(blk + 64 * r));
            for (int i = 0; i < G; i++) {
                xv32 xr = x_load(xq + (int64_t)(s0 + i) * Kp + 32 * kb);
                for (int r = 0; r < R; r++) acc[r][i] = v_dp(acc[r][i], wq[r], xr);
            }
        }
    } else {
        const int K32 = K & ~31;
        for (int k = 0; k < K32; k += 32) {
            for (int off = 0; off < R * 64; off += 64) pf(wb, next + (int64_t)k * 2 * R + off, wsize);
            wv32 wq[MAXR];
            for (int r = 0; r < R; r++) wq[r] = w_bf16((const uint16_t *)(wb + (int64_t)(n + r) * rb) + k);
            for (int i = 0; i < G; i++) {
                xv32 xr = x_load(xq + (int64_t)(s0 + i) * Kp + k);
                for (int r = 0; r < R; r++) acc[r][i] = v_dp(acc[r][i], wq[r], xr);
            }
        }
        if (K32 < K) {
            wv32 wq[MAXR];
            for (int r = 0; r < R; r++) wq[r] = w_bf16_tail((const uint16_t *)(wb + (int64_t)(n + r) * rb) + K32, K - K32);
            for (int i = 0; i < G; i++) {
                xv32 xr = x_load(xq + (int64_t)(s0 + i) * Kp + K32);
                for (int r = 0; r < R; r++) acc[r][i] = v_dp(acc[r][i], wq[r], xr);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int i = 0; i < G; i++) y[(int64_t)(s0 + i) * N + n + r] = v_hsum(acc[r][i]);
}

// W4A8 (WT_I4A8): int4 weights, int8 activations, integer dot products. The 0.5B draft's int4 layers are
// compute-bound under W4A16 once memory is fast (a shift, a lookup and a bf16 dot product per 32 weights, plus a
// scale per row and group); here a row is one int32 lane, so the group scale is one vector op per 16 rows and a
// 64-byte load feeds 128 multiply-adds. Hot, the draft's gate/up matmul (9728 x 896, 2 threads, best of 300, three
// alternations, skinny_matmul called from C) took 44-47 us against tiled W4A16's 98-118 at one token row, 90-103
// against 272-314 at four, 159-169 against 471-491 at seven.
//
// Activations: each row of x is quantized per group of gs columns (x_a8): m = max |x| over the group, q = RN(x *
// RN(127 / m)) in [-127, 127], s_x = RN(m / 127), and c = -8 * sum q. Weights (quant.tile_a8): blocks of 16 rows,
// each K / 8 chunks of 64 bytes; byte 4 l + j of chunk c holds u = q_w + 8 of row l's column 8c + j in its low
// nibble and of column 8c + 4 + j in its high one; bf16 scales [N / 16, K / gs, 16]. Lane l holds, exactly in int32,
// c + sum over the group of u * q = sum of q_w * q, and then, group after group,
//     acc = RN(float(lane) * RN(s_w * s_x) + acc)     (one fused multiply-add)
// so each output element is one fixed sequence whatever the number of rows, the thread count or the build.
typedef struct {
    const int8_t *q;   // [S, K]
    const float *s;    // [S, K / gs]
    const int32_t *c;  // [S, K / gs]
} xa8_t;

// AVX2: token rows up to which a W4A8 pass covers both halves of a 16-row block (measured on Zen 3: one token row
// 0.78x the time of two passes, two rows 0.82x; three rows no faster).
#define A8_BOTH 2
// AVX2: each chunk pair's two lines are prefetched (into L2) this far ahead as the pass reads them, as the GGUF
// passes do (GG_PF, GG_SPREAD): on Zen 3 (2 cores) the hardware prefetcher alone held the draft's W4A8 step at 0.73 of
// the bandwidth probes; with them a step took 0.923x the time, 0.85 of the probes (q/k/v 0.90x, o 0.91x, gate/up
// 0.92x, down 0.94x; step_stages.py --model draft --against, 8 paired rounds, experiments/kernel_log.md 2026-12-07
// 21:28). The AVX-512 passes issue none: on Zen 4 they read at 0.95 of the probes without. Bits unchanged.
#define A8_PF 8192

// Below this max |x| a group counts as zero: 127 / m would overflow near the smallest normal floats.
#define A8_TINY 1e-30f

// One row x [K] -> q, s, c as above, in AVX2 (both builds run this same code, so they agree bit for bit). A group
// holding a NaN or an infinity gets s = NaN, so the outputs it feeds are NaN, as a float matmul's would be.
static void x_a8(const float *x, int K, int gs, int8_t *q, float *s, int32_t *c) {
    const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    for (int g = 0; g < K / gs; g++) {
        const float *xg = x + (int64_t)g * gs;
        int8_t *qg = q + (int64_t)g * gs;
        __m256 m = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
        for (int k = 0; k < gs; k += 8) {
            const __m256 v = _mm256_loadu_ps(xg + k);
            m = _mm256_max_ps(m, _mm256_and_ps(v, absm));
            bad = _mm256_or_ps(bad, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        }
        float t[8], mx = 0.f;
        _mm256_storeu_ps(t, m);
        for (int i = 0; i < 8; i++) mx = t[i] > mx ? t[i] : mx;
        if (_mm256_movemask_ps(bad) || mx > 3.4028235e38f || mx < A8_TINY) {
            memset(qg, 0, (size_t)gs);
            s[g] = mx < A8_TINY && !_mm256_movemask_ps(bad) ? 0.f : NAN;
            c[g] = 0;
            continue;
        }
        const __m256 inv = _mm256_set1_ps(127.0f / mx);
        __m256i sum = _mm256_setzero_si256();
        for (int k = 0; k < gs; k += 8) {
            const __m256i qi = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xg + k), inv));
            sum = _mm256_add_epi32(sum, qi);
            const __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(qi), _mm256_extracti128_si256(qi, 1));
            _mm_storel_epi64((__m128i *)(qg + k), _mm_packs_epi16(w16, w16));
        }
        int32_t lanes[8], tot = 0;
        _mm256_storeu_si256((__m256i *)lanes, sum);
        for (int i = 0; i < 8; i++) tot += lanes[i];
        s[g] = mx / 127.0f;
        c[g] = -8 * tot;
    }
}

// One pass over a block of 16 rows (n % 16 == 0) for G token rows: H halves of A8_LANES rows from h0 (AVX-512: the
// one half; AVX2: both at once for up to A8_BOTH token rows, so the pass's loops and each row's activation bytes serve
// 16 rows, else one half a pass). A token row's lanes sum in two or four chains (the integer sums are exact, so the
// split never changes a bit): one chain per lane would wait on the latency of each vpdpbusd.
static inline __attribute__((always_inline)) void pass_a8(const xa8_t *X, const uint8_t *blk, const uint16_t *sb,
                                                          float *y, int K, int N, int gs, int n, int s0, const int G,
                                                          int h0, const int H) {
    const int ng = K / gs, cpg = gs / 8, NCH = H == 2 ? 2 : G <= 2 ? 4 : 2, c1 = NCH == 4 ? 2 : 0;
    vf_t acc[2][MAXG];
    for (int hh = 0; hh < H; hh++)
        for (int i = 0; i < G; i++) acc[hh][i] = vf_zero();
    for (int g = 0; g < ng; g++) {
        vi_t p[2][4][MAXG];
        for (int hh = 0; hh < H; hh++)
            for (int i = 0; i < G; i++) {
                p[hh][0][i] = vi_set1(X->c[(int64_t)(s0 + i) * ng + g]);
                for (int j = 1; j < NCH; j++) p[hh][j][i] = vi_set1(0);
            }
        const uint8_t *cp = blk + (int64_t)g * cpg * 64;
        for (int cc = 0; cc < cpg; cc += 2) {
#if !defined(__AVX512F__)
            if (h0 == 0) {
                _mm_prefetch((const char *)cp + 64 * cc + A8_PF, _MM_HINT_T1);
                _mm_prefetch((const char *)cp + 64 * cc + 64 + A8_PF, _MM_HINT_T1);
            }
#endif
            for (int hh = 0; hh < H; hh++) {
                vi_t l0, h0v, l1, h1;
                a8_nibbles(cp + 64 * cc + 4 * A8_LANES * (h0 + hh), &l0, &h0v);
                a8_nibbles(cp + 64 * (cc + 1) + 4 * A8_LANES * (h0 + hh), &l1, &h1);
                for (int i = 0; i < G; i++) {
                    const int8_t *xr = X->q + (int64_t)(s0 + i) * K + (int64_t)g * gs + 8 * cc;
#if defined(__AVX512F__)
                    p[hh][0][i] = vi_dp(p[hh][0][i], l0, xr);
                    p[hh][1][i] = vi_dp(p[hh][1][i], h0v, xr + 4);
                    p[hh][c1][i] = vi_dp(p[hh][c1][i], l1, xr + 8);
                    p[hh][c1 + 1][i] = vi_dp(p[hh][c1 + 1][i], h1, xr + 12);
#else
                    // the four pair sums (|each| <= 3810) add in int16 before one vpmaddwd: the same integers
                    (void)c1;
                    p[hh][(cc >> 1) & (NCH - 1)][i] = vi_dp16(p[hh][(cc >> 1) & (NCH - 1)][i], l0, h0v, l1, h1, xr);
#endif
                }
            }
        }
        for (int hh = 0; hh < H; hh++) {
            const vf_t sw = vf_bf16(sb + (int64_t)g * 16 + A8_LANES * (h0 + hh));
            for (int i = 0; i < G; i++) {
                vi_t t = vi_add(p[hh][0][i], p[hh][1][i]);
                if (NCH == 4) t = vi_add(t, vi_add(p[hh][2][i], p[hh][3][i]));
                acc[hh][i] = vf_fma(vf_cvt(t), vf_scale(sw, X->s[(int64_t)(s0 + i) * ng + g]), acc[hh][i]);
            }
        }
    }
    for (int hh = 0; hh < H; hh++)
        for (int i = 0; i < G; i++)
            vf_store(y + (int64_t)(s0 + i) * N + n + A8_LANES * (h0 + hh), acc[hh][i], N - n - A8_LANES * (h0 + hh));
}

// One block of 16 rows (n % 16 == 0) times G token rows.
static inline __attribute__((always_inline)) void tile_a8(const void *xv, const void *w, const float *sc, float *y,
                                                          int K, int N, int gs, int n, int s0, const int R,
                                                          const int G, const int wt) {
    (void)R;
    (void)wt;
    const xa8_t *X = (const xa8_t *)xv;
    const uint8_t *blk = (const uint8_t *)w + (int64_t)(n / 16) * (K / 8) * 64;
    const uint16_t *sb = (const uint16_t *)sc + (int64_t)(n / 16) * (K / gs) * 16;
    if (A8_LANES == 8 && G <= A8_BOTH && N - n > 8) {
        pass_a8(X, blk, sb, y, K, N, gs, n, s0, G, 0, 2);
        return;
    }
    for (int h = 0; h < 16 / A8_LANES; h++)
        if (N - n - A8_LANES * h > 0) pass_a8(X, blk, sb, y, K, N, gs, n, s0, G, h, 1);
}

#define TILE_FN(NAME, KERNEL, CASES, WT)                                                                         \
    static void NAME(const void *x, const void *w, const float *sc, float *y, int K, int N, int gs, int n,        \
                     int s0, int R, int G) {                                                                     \
        switch (R * 16 + G) {                                                                                    \
            CASES(T_##WT)                                                                                        \
            default: /* not reached: every CASES lists T(1, 1..MAXG); one row at a time is the same arithmetic */ \
                for (int r = 0; R > 1 && r < R; r++) NAME(x, w, sc, y, K, N, gs, n + r, s0, 1, G);               \
        }                                                                                                        \
    }
#define T_F32(R, G) case (R) * 16 + (G): tile(x, w, sc, y, K, N, gs, n, s0, R, G, WT_F32); break;
#define T_I8(R, G) case (R) * 16 + (G): tile(x, w, sc, y, K, N, gs, n, s0, R, G, WT_I8); break;
#define T_I8T(R, G) case (R) * 16 + (G): tile(x, w, sc, y, K, N, gs, n, s0, R, G, WT_I8T); break;
#define T_BF16(R, G) case (R) * 16 + (G): tile_dp(x, w, sc, y, K, N, gs, n, s0, R, G, WT_BF16); break;
#define T_I4(R, G) case (R) * 16 + (G): tile_dp(x, w, sc, y, K, N, gs, n, s0, R, G, WT_I4); break;
#define T_BF16T(R, G) case (R) * 16 + (G): tile_dp(x, w, sc, y, K, N, gs, n, s0, R, G, WT_BF16T); break;
#define T_I4T(R, G) case (R) * 16 + (G): tile_dp(x, w, sc, y, K, N, gs, n, s0, R, G, WT_I4T); break;
#define T_I4A8(R, G) case (R) * 16 + (G): tile_a8(x, w, sc, y, K, N, gs, n, s0, 16, G, WT_I4A8); break;
// W4A8 reads whole 16-row blocks (tile_a8 stops at N), so any R is the block's 16: one row at a time would be another
// layout, not the same arithmetic, and would recurse on itself (rows() always asks for R = 16 here).
#define TILE_CASES_A8(T) T(16, 1) T(16, 2) T(16, 3) T(16, 4) T(16, 5) T(16, 6)
#define TILE_CASES_A8_ANY(T) TILE_CASES_A8(T) T(1, 1) T(1, 2) T(1, 3) T(1, 4) T(1, 5) T(1, 6)
TILE_FN(tile_f32, tile, TILE_CASES_F, F32)
TILE_FN(tile_i8, tile, TILE_CASES_F, I8)
TILE_FN(tile_bf16, tile_dp, TILE_CASES_B, BF16)
TILE_FN(tile_i4, tile_dp, TILE_CASES_Q, I4)
TILE_FN(tile_bf16t, tile_dp, TILE_CASES_T, BF16T)
TILE_FN(tile_i4t, tile_dp, TILE_CASES_Q, I4T)
TILE_FN(tile_i8t, tile, TILE_CASES_F, I8T)
TILE_FN(tile_i4a8, tile_a8, TILE_CASES_A8_ANY, I4A8)

typedef void (*tile_fn)(const void *, const void *, const float *, float *, int, int, int, int, int, int, int);

// The shapes each weight type's tiles can read (kernels.py checks the same, naming the argument): int4 reads whole
// 32-column blocks and groups, tiled layouts whole tiles (quant.tile, quant.tile_a8), W4A8 pairs of 8-column chunks
// per group. An unknown type is refused.
static int weights_ok(int K, int N, int wt, int gs) {
    if (K < 1 || N < 1) return 0;
    switch (wt) {
        case WT_F32: case WT_BF16: case WT_I8: return 1;
        case WT_I4: return gs > 0 && gs % 32 == 0 && K % gs == 0;
        case WT_I4T: return gs > 0 && gs % 32 == 0 && K % gs == 0 && K % 128 == 0 && N % 8 == 0;
        case WT_BF16T: return K % 32 == 0 && N % TROWS == 0;
        case WT_I8T: return K % 16 == 0 && N % 8 == 0;
        case WT_I4A8: return gs > 0 && gs % 16 == 0 && K % gs == 0;
        case WT_GGUF: return K % 32 == 0;  // whole GGUF blocks (gguf_weights checks 256 for k-quant parts)
        default: return 0;
    }
}

// Weight rows per tile for S token rows (split into groups of at most MAXG).
static int tile_rows(int S, int wt) {
    if (wt == WT_I4A8) return 16;
    int groups = (S + MAXG - 1) / MAXG, base = S / groups, extra = S % groups;
    return (wt == WT_I4 || wt == WT_I4T ? RQ_FOR_G : wt == WT_BF16 ? RB_FOR_G : wt == WT_BF16T ? RT_FOR_G : R_FOR_G)
        [base + (extra > 0)];
}

static void rows(const void *x, const void *w, const float *sc, float *y, int S, int K, int N, int gs, int n0,
                 int n1, int wt) {
    tile_fn f = wt == WT_F32 ? tile_f32 : wt == WT_BF16 ? tile_bf16 : wt == WT_I8 ? tile_i8 : wt == WT_I4 ? tile_i4
              : wt == WT_BF16T ? tile_bf16t : wt == WT_I4T ? tile_i4t : wt == WT_I4A8 ? tile_i4a8 : tile_i8t;
    int groups = (S + MAXG - 1) / MAXG, base = S / groups, extra = S % groups;
    int R = tile_rows(S, wt);
    // bf16 dot products flush denormals (vdpbf16ps does, whatever MXCSR says): the AVX2 FMAs must as well,
    // and the rest of both builds' arithmetic (lane sums, int4 group scales, W4A8's scale products) runs under the
    // same mode.
    const int dp = wt == WT_BF16 || wt == WT_I4 || wt == WT_BF16T || wt == WT_I4T || wt == WT_I4A8;
    const unsigned int csr = _mm_getcsr();
    if (dp) _mm_setcsr(csr | 0x8040);  // FTZ | DAZ
    for (int n = n0; n < n1;) {
        int r = n1 - n >= R || wt == WT_I4A8 ? R : 1;
        for (int i = 0, s0 = 0; i < groups; i++) {
            int g = base + (i < extra);
            f(x, w, sc, y, K, N, gs, n, s0, r, g);
            s0 += g;
        }
        n += r;
    }
    if (dp) _mm_setcsr(csr);
}

// Token rows per pass over the weights: a pass keeps its rows of x in L2 while every weight row streams
// by once, so a 512-token prefill reads the weights 512 / ROW_CHUNK times (it is compute-bound anyway).
#define ROW_CHUNK 48

// Work sharing. Each thread owns a contiguous share of the weight rows and takes it front to back, CLAIM_BYTES
// of weights at a time; a thread done with its share takes claims from the back of the others'. A static split
// made every call wait for the slower core, and on this machine one core streams up to 10% slower than the
// other (per-thread times of the 0.5B draft's matmuls). The draft's 97 int4 matmuls of a step, 2 threads, 100
// rounds paired against the static split, three runs: 1.043x, 1.036x, 1.009x (8 KB claims: 1.011x, 1.031x,
// 1.007x). Which thread computes a row never changes its bits.
#define CLAIM_BYTES 32768
_Atomic long long skinny_stolen_rows;  // rows computed outside their owner's share, for tests and profiling
typedef struct { _Atomic uint64_t v; char pad[56]; } share_t;  // rows [lo, hi) left: lo in bits 0-31, hi above
static inline int take(share_t *s, int blk, int back, int *n0, int *n1) {
    uint64_t v = atomic_load_explicit(&s->v, memory_order_relaxed);
    for (;;) {
        const uint32_t lo = (uint32_t)v, hi = (uint32_t)(v >> 32);
        if (lo >= hi) return 0;
        const uint32_t n = hi - lo > (uint32_t)blk ? (uint32_t)blk : hi - lo;
        const uint64_t nv = back ? (uint64_t)(hi - n) << 32 | lo : (uint64_t)hi << 32 | (lo + n);
        if (atomic_compare_exchange_weak_explicit(&s->v, &v, nv, memory_order_relaxed, memory_order_relaxed)) {
            *n0 = back ? (int)(hi - n) : (int)lo;
            *n1 = back ? (int)hi : (int)(lo + n);
            return 1;
        }
    }
}
// Thread t's next claim of `threads` shares: from its own share's front while it lasts, then from the back of the
// others' (1: own rows, 2: taken from another's share, 0: nothing left anywhere).
static inline int claim(share_t *share, int threads, int t, int blk, int *n0, int *n1) {
    if (take(&share[t], blk, 0, n0, n1)) return 1;
    for (int o = 1; o < threads; o++)
        if (take(&share[(t + o) % threads], blk, 1, n0, n1)) return 2;
    return 0;
}

// The kernels' thread pool, in place of OpenMP's parallel-for. Its wait decides two things libgomp's one spin count
// cannot have at once (docs/peers.md "A busy machine"): between a decode step's C calls the caller runs Python for
// 50-500 us, and a worker that went to sleep there cost a draft_target request ~10% (GOMP_SPINCOUNT=1000 against
// libgomp's default 300000, in process, 4 alternating runs each, Zen 4); but beside another CPU-bound process, long
// spins took the core from the thread holding the work (draft_target 39x slower at the default, 2.0-2.2x at 1000). So a
// waiting thread spins long while the machine has no runnable thread besides ours (/proc/loadavg's running count,
// read at most every POOL_PROBE_NS), and briefly otherwise, then sleeps on a futex. pool_run gives share t of n to
// fn(ctx, t): share 0 on the caller, the others on the workers. Shares never change an output's bits (each output
// element is computed by one fixed sequence, whoever runs it), so a nested call, or a second caller while the pool
// is busy, simply runs every share itself.
#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#define POOL_MAX 63
#define POOL_PROBE_NS 20000000LL
typedef void (*pool_fn)(void *ctx, int t);
static struct {
    pthread_mutex_t lock;                // one caller's job at a time
    _Atomic uint32_t gen, done;          // job count (workers sleep on it); jobs finished (the caller sleeps on it)
    _Atomic int left, sleepers, caller_sleeps;
    pool_fn fn;
    void *ctx;
    int n, workers;
    pid_t pid;                           // a forked child starts its own workers
} pool = {.lock = PTHREAD_MUTEX_INITIALIZER};
static _Thread_local int pool_inside;    // this thread is running a share: a call from it runs alone
// Spin budgets, ns: long while the machine is otherwise idle, short when something else wants a core (the tests set
// both through ctypes; 0 sleeps at once). pool_busy_seen counts probes that found another runnable thread and
// pool_sleeps the futex waits, for the tests.
long long pool_spin_quiet_ns = 3000000, pool_spin_busy_ns = 20000;
_Atomic long long pool_busy_seen, pool_sleeps;
static _Atomic long long probe_at;
static _Atomic int probe_busy;

static inline long long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

// Runnable threads on the machine besides ours: /proc/loadavg's fourth field is running/total; `ours` of them are
// this pool's (the caller and every worker not asleep).
static int others_running(int ours) {
    char buf[128];
    FILE *f = fopen("/proc/loadavg", "r");
    if (!f) return 0;
    const size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    int running = 0;
    if (sscanf(buf, "%*s %*s %*s %d/", &running) != 1) return 0;
    return running > ours ? running - ours : 0;
}

static int pool_cpus = 1 << 30;  // the CPUs this process may run on (pool_grow)

static long long spin_budget(void) {
    const long long t = now_ns();
    if (t - atomic_load_explicit(&probe_at, memory_order_relaxed) > POOL_PROBE_NS) {
        atomic_store_explicit(&probe_at, t, memory_order_relaxed);
        const int busy = others_running(1 + pool.workers - atomic_load(&pool.sleepers)) > 0;
        atomic_store_explicit(&probe_busy, busy, memory_order_relaxed);
        if (busy) atomic_fetch_add_explicit(&pool_busy_seen, 1, memory_order_relaxed);
    }
    // more threads than cores: a spinner always holds a core another of ours needs
    const int busy = atomic_load_explicit(&probe_busy, memory_order_relaxed) || pool.workers + 1 > pool_cpus;
    return busy ? pool_spin_busy_ns : pool_spin_quiet_ns;
}

// Spin until *w != v or the budget is spent; 1 when it changed.
static int spin_until(_Atomic uint32_t *w, uint32_t v, long long budget) {
    if (budget <= 0) return atomic_load(w) != v;
    const long long end = now_ns() + budget;
    for (;;) {
        for (int i = 0; i < 32; i++) {
            if (atomic_load_explicit(w, memory_order_acquire) != v) return 1;
            _mm_pause();
        }
        if (now_ns() > end) return 0;
    }
}

static void futex_wait(_Atomic uint32_t *w, uint32_t v) {
    atomic_fetch_add_explicit(&pool_sleeps, 1, memory_order_relaxed);
    syscall(SYS_futex, (uint32_t *)w, FUTEX_WAIT_PRIVATE, v, NULL, NULL, 0);
}
static void futex_wake(_Atomic uint32_t *w) {
    syscall(SYS_futex, (uint32_t *)w, FUTEX_WAKE_PRIVATE, INT32_MAX, NULL, NULL, 0);
}

static uint32_t pool_born[POOL_MAX];  // the job count when worker i was started: its first job is the next one

static void *pool_worker(void *arg) {
    const int me = (int)(intptr_t)arg;  // runs share me + 1
    uint32_t seen = pool_born[me];
    pool_inside = 1;
    for (;;) {
        if (!spin_until(&pool.gen, seen, spin_budget())) {
            atomic_fetch_add(&pool.sleepers, 1);
            while (atomic_load(&pool.gen) == seen) futex_wait(&pool.gen, seen);
            atomic_fetch_sub(&pool.sleepers, 1);
        }
        seen = atomic_load_explicit(&pool.gen, memory_order_acquire);
        if (me + 1 < pool.n) pool.fn(pool.ctx, me + 1);
        if (atomic_fetch_sub(&pool.left, 1) == 1) {
            atomic_fetch_add(&pool.done, 1);
            if (atomic_load(&pool.caller_sleeps)) futex_wake(&pool.done);
        }
    }
    return NULL;
}

// Workers for shares 1..n-1 (started on first need, kept for the process); the number running.
static int pool_grow(int n) {
    if (pool.pid != getpid()) {  // first use, or a forked child: the parent's workers are not here
        pool.workers = 0, pool.pid = getpid();
        cpu_set_t set;
        pool_cpus = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : (int)sysconf(_SC_NPROCESSORS_ONLN);
        if (pool_cpus < 1) pool_cpus = 1;
    }
    while (pool.workers < n - 1 && pool.workers < POOL_MAX) {
        pthread_t th;
        pthread_attr_t at;
        pthread_attr_init(&at);
        pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
        pool_born[pool.workers] = atomic_load(&pool.gen);
        const int rc = pthread_create(&th, &at, pool_worker, (void *)(intptr_t)pool.workers);
        pthread_attr_destroy(&at);
        if (rc) break;
        pool.workers++;
    }
    return pool.workers;
}

static void pool_run(pool_fn fn, void *ctx, int n) {
    if (n > 1 && !pool_inside && pthread_mutex_trylock(&pool.lock) == 0) {
        if (pool_grow(n) >= n - 1) {
            pool.fn = fn, pool.ctx = ctx, pool.n = n;
            atomic_store(&pool.left, pool.workers);
            const uint32_t d = atomic_load(&pool.done);
            atomic_fetch_add_explicit(&pool.gen, 1, memory_order_seq_cst);
            if (atomic_load(&pool.sleepers)) futex_wake(&pool.gen);
            pool_inside = 1;
            fn(ctx, 0);
            pool_inside = 0;
            if (!spin_until(&pool.done, d, spin_budget())) {
                atomic_store(&pool.caller_sleeps, 1);
                while (atomic_load(&pool.done) == d) futex_wait(&pool.done, d);
                atomic_store(&pool.caller_sleeps, 0);
            }
            pthread_mutex_unlock(&pool.lock);
            return;
        }
        pthread_mutex_unlock(&pool.lock);
    }
    for (int t = 0; t < n; t++) fn(ctx, t);
}

#include "gguf_kernels.c"

// One thread's part of a skinny_matmul chunk: its own share front to back, then the others' from the back.
typedef struct {
    const void *x, *w;
    const float *sc;
    float *y;
    share_t *share;
    int S, K, N, gs, wt, blk, threads;
} rows_job_t;
static void rows_share(void *ctx, int t) {
    const rows_job_t *j = (const rows_job_t *)ctx;
    int a, b;
    for (int k; (k = claim(j->share, j->threads, t, j->blk, &a, &b));) {
        rows(j->x, j->w, j->sc, j->y, j->S, j->K, j->N, j->gs, a, b, j->wt);
        if (k == 2) atomic_fetch_add_explicit(&skinny_stolen_rows, b - a, memory_order_relaxed);
    }
}

// x: [S, K] fp32; w: [N, K] as wt (int4: [N, K / 2] bytes of u = q + 8: columns below K & ~127 in 128-column
// superblocks of 64 bytes read as 32 little-endian 16-bit words, word i holding column 32m + i in nibble m
// (bits 4m..4m+3), the remaining K % 128 columns in 32-column blocks of 16 bytes = 8 words, word i holding
// column 8m + i in nibble m);
// sc: int8 [N] fp32 or int4 [N, K / gs] bf16 scales (NULL otherwise); y: [S, N] fp32. Any S.
// Returns SK_OK, SK_EARG when weights_ok refuses the shapes, or SK_ENOMEM (y is then not written).
int skinny_matmul(const float *x, const void *w, const float *sc, float *y, int S, int K, int N, int threads,
                  int wt, int gs) {
    if (wt == WT_GGUF) {  // w is a gg_desc_t
        if (S < 0 || !weights_ok(K, N, wt, gs)) return SK_EARG;
        return S == 0 ? SK_OK : gguf_matmul(x, (const gg_desc_t *)w, y, S, K, N, threads);
    }
    if (threads < 1) threads = 1;
    if (S < 0 || !weights_ok(K, N, wt, gs)) return SK_EARG;
    if (S == 0) return SK_OK;
    const int a8 = wt == WT_I4A8;
    // W4A8 weights come in blocks of 16 rows (the last one padded), and a thread's share starts on a block.
    const int Nr = a8 ? (N + 15) & ~15 : N, align = a8 ? 16 : 24;
    int chunk = (Nr + threads - 1) / threads;
    chunk = (chunk + align - 1) / align * align;
    const int dp = wt == WT_BF16 || wt == WT_I4 || wt == WT_BF16T || wt == WT_I4T;
    const int Kp = (K + 31) & ~31, rows_max = S < ROW_CHUNK ? S : ROW_CHUNK;
    int o_xq = 0, o_q8 = 0, o_s8 = 0, o_c8 = 0, o_sh = 0;
    xq_t *xq = dp ? (xq_t *)scratch(SC_XQ, sizeof(xq_t) * (size_t)rows_max * Kp, &o_xq) : NULL;
    int8_t *q8 = a8 ? (int8_t *)scratch(SC_Q8, (size_t)rows_max * K, &o_q8) : NULL;
    float *s8 = a8 ? (float *)scratch(SC_S8, sizeof(float) * (size_t)rows_max * (K / gs), &o_s8) : NULL;
    int32_t *c8 = a8 ? (int32_t *)scratch(SC_C8, sizeof(int32_t) * (size_t)rows_max * (K / gs), &o_c8) : NULL;
    const xa8_t xa = {q8, s8, c8};
    share_t *share = threads > 1 ? (share_t *)scratch(SC_SHARE, sizeof(share_t) * (size_t)threads, &o_sh) : NULL;
    int rc = SK_OK;
    if ((dp && !xq) || (a8 && (!q8 || !s8 || !c8)) || (threads > 1 && !share)) {
        rc = SK_ENOMEM;
        goto done;
    }
    for (int c0 = 0; c0 < S; c0 += ROW_CHUNK) {
        int cs = S - c0 < ROW_CHUNK ? S - c0 : ROW_CHUNK;
        const void *xc = x + (int64_t)c0 * K;
        float *yc = y + (int64_t)c0 * N;
        if (dp) {
            for (int s = 0; s < cs; s++) x_round(x + (int64_t)(c0 + s) * K, xq + (int64_t)s * Kp, K, Kp);
            xc = xq;
        }
        if (a8) {
            const unsigned int csr = _mm_getcsr();
            _mm_setcsr(csr | 0x8040);  // FTZ | DAZ, as the tiles run: a denormal activation reads as zero in both
            for (int s = 0; s < cs; s++)
                x_a8(x + (int64_t)(c0 + s) * K, K, gs, q8 + (int64_t)s * K, s8 + (int64_t)s * (K / gs),
                     c8 + (int64_t)s * (K / gs));
            _mm_setcsr(csr);
            xc = &xa;
        }
        if (!share) {
            rows(xc, w, sc, yc, cs, K, N, gs, 0, Nr, wt);
            continue;
        }
        const int R = tile_rows(cs, wt);
        const int64_t per = CLAIM_BYTES / row_bytes(K, wt);
        const int blk = per <= R ? R : (int)((per + R - 1) / R * R);
        for (int t = 0; t < threads; t++) {
            const uint32_t n0 = (uint32_t)(t * chunk < Nr ? t * chunk : Nr);
            const uint32_t n1 = n0 + chunk < (uint32_t)Nr ? n0 + chunk : (uint32_t)Nr;
            atomic_init(&share[t].v, (uint64_t)n1 << 32 | n0);
        }
        const rows_job_t job = {xc, w, sc, yc, share, cs, K, N, gs, wt, blk, threads};
        pool_run(rows_share, (void *)&job, threads);
    }
done:
    scratch_done(share, o_sh);
    scratch_done(xq, o_xq);
    scratch_done(q8, o_q8);
    scratch_done(s8, o_s8);
    scratch_done(c8, o_c8);
    return rc;
}

// The bandwidth probe: a pure streaming read of n bytes (a multiple of 64) split over the threads, returning an xor
// of the words so that nothing is optimised away. It reads 4-8% faster than torch's sum (paired, 8 rounds, twice);
// software prefetching 8-32 KB ahead made it 1-28% slower.
typedef struct {
    const char *p;
    int64_t blocks, per;
    uint64_t *part;
} stream_job_t;
static void stream_share(void *ctx, int t) {
    const stream_job_t *j = (const stream_job_t *)ctx;
    __m256i a = _mm256_setzero_si256(), b = a;
    const int64_t e = (t + 1) * j->per < j->blocks ? (t + 1) * j->per : j->blocks;
    for (int64_t i = t * j->per; i < e; i++) {
        a = _mm256_xor_si256(a, _mm256_loadu_si256((const __m256i *)(j->p + 64 * i)));
        b = _mm256_xor_si256(b, _mm256_loadu_si256((const __m256i *)(j->p + 64 * i + 32)));
    }
    a = _mm256_xor_si256(a, b);
    j->part[t] = (uint64_t)_mm256_extract_epi64(a, 0) ^ (uint64_t)_mm256_extract_epi64(a, 1) ^
                 (uint64_t)_mm256_extract_epi64(a, 2) ^ (uint64_t)_mm256_extract_epi64(a, 3);
}
uint64_t stream_read(const void *p, int64_t n, int threads) {
    threads = threads < 1 ? 1 : threads > 256 ? 256 : threads;
    const int64_t blocks = n / 64, per = (blocks + threads - 1) / threads;
    uint64_t part[256] = {0};
    const stream_job_t job = {(const char *)p, blocks, per, part};
    pool_run(stream_share, (void *)&job, threads);
    uint64_t x = 0;
    for (int t = 0; t < threads; t++) x ^= part[t];
    return x;
}

// The multiply-add probe: each thread runs `iters` rounds of 12 independent int8 dot-product accumulations, the
// instruction this build's int8 tiles are made of (AVX-512: vpdpbusd zmm, 64 multiply-adds; AVX2: vpmaddubsw ymm and
// its int16 add, 32), and the call returns their count, so that multiply-adds / seconds is the rate no kernel of this
// build can beat: the floor bench.json puts under a many-token verification (`verify_floor`). The empty asm keeps
// the operands opaque, so the compiler can neither hoist the products nor fold the loop.
typedef struct {
    int64_t iters;
    int64_t *sink;
} peak_job_t;
#define PEAK_ACC(M) M(0) M(1) M(2) M(3) M(4) M(5) M(6) M(7) M(8) M(9) M(10) M(11)
static void peak_share(void *ctx, int t) {
    const peak_job_t *j = (const peak_job_t *)ctx;
#if defined(__AVX512F__)
    __m512i w = _mm512_set1_epi8(3), x = _mm512_set1_epi8((char)(t + 5));
#define PEAK_DECL(i) __m512i a##i = _mm512_set1_epi32(i);
#define PEAK_STEP(i) a##i = _mm512_dpbusd_epi32(a##i, w, x);
#define PEAK_SUM(i) s += _mm512_reduce_add_epi32(a##i);
#define PEAK_OPAQUE() __asm__ volatile("" : "+v"(w), "+v"(x))
#else
    __m256i x = _mm256_set1_epi8((char)(t + 5));
#define PEAK_DECL(i) __m256i a##i = _mm256_set1_epi16(i);
#define PEAK_STEP(i) a##i = _mm256_add_epi16(a##i, _mm256_maddubs_epi16(a##i, x));  // a's own bytes: no CSE
#define PEAK_SUM(i) s += _mm256_extract_epi16(a##i, 0);
#define PEAK_OPAQUE() __asm__ volatile("" : "+v"(x))
#endif
    PEAK_ACC(PEAK_DECL)
    for (int64_t k = 0; k < j->iters; k++) {
        PEAK_OPAQUE();
        PEAK_ACC(PEAK_STEP)
        __asm__ volatile("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5));
        __asm__ volatile("" : "+v"(a6), "+v"(a7), "+v"(a8), "+v"(a9), "+v"(a10), "+v"(a11));
    }
    int64_t s = 0;
    PEAK_ACC(PEAK_SUM)
    j->sink[t] = s;
#undef PEAK_DECL
#undef PEAK_STEP
#undef PEAK_SUM
#undef PEAK_OPAQUE
}
// Multiply-adds done by `threads` threads running `iters` rounds each (the caller times the call).
int64_t int8_peak(int64_t iters, int threads) {
    threads = threads < 1 ? 1 : threads > 256 ? 256 : threads;
    int64_t sink[256] = {0};
    const peak_job_t job = {iters < 0 ? 0 : iters, sink};
    pool_run(peak_share, (void *)&job, threads);
    return (iters < 0 ? 0 : iters) * threads * 12 * (int64_t)(A8_LANES * 4);
}

// The rest of a decoder layer for few-token steps, so a layer is five C calls instead of ~40 torch ops.

// out[s] = x[s] / sqrt(mean(x[s]^2) + eps) * g, row by row. The sum of squares in 32 lanes (lane j of accumulator a
// takes columns 32 i + 8 a + j by FMA), added (a0 + a1) + (a2 + a3), then hsum256, then the K % 32 tail in order by
// fmaf; each output (x * inv) * g. AVX2 in both builds, so they agree bit for bit. The single fmaf chain it replaced
// waited on FMA latency at every column while the other threads waited on it: 7 rows of 1536 took 12 us (24 us of
// each layer of a 7-token verification of the 1.5B), 7 rows of 8960 74 us (Zen 4, in cache).
void rmsnorm(const float *x, const float *g, float eps, float *out, int S, int K) {
    for (int s = 0; s < S; s++) {
        float *o = out + (int64_t)s * K;
        const float *r = x + (int64_t)s * K;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        int k = 0;
        for (; k + 32 <= K; k += 32) {
            const __m256 v0 = _mm256_loadu_ps(r + k), v1 = _mm256_loadu_ps(r + k + 8);
            const __m256 v2 = _mm256_loadu_ps(r + k + 16), v3 = _mm256_loadu_ps(r + k + 24);
            a0 = _mm256_fmadd_ps(v0, v0, a0), a1 = _mm256_fmadd_ps(v1, v1, a1);
            a2 = _mm256_fmadd_ps(v2, v2, a2), a3 = _mm256_fmadd_ps(v3, v3, a3);
        }
        float ss = hsum256(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
        for (; k < K; k++) ss = fmaf(r[k], r[k], ss);
        const float inv = 1.0f / sqrtf(ss / K + eps);
        const __m256 vinv = _mm256_set1_ps(inv);
        for (k = 0; k + 8 <= K; k += 8)
            _mm256_storeu_ps(o + k, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(r + k), vinv), _mm256_loadu_ps(g + k)));
        for (; k < K; k++) o[k] = (r[k] * inv) * g[k];
    }
}

// exp(x) = 2^n exp(r), x = n ln2 + r with |r| <= ln2 / 2, exp(r) by its Taylor polynomial to r^7 / 7! (largest
// relative error against exp in double, 70M points on [-87, 0]: 7.9e-8). Returns exp(r); n in *n.
static inline __m256 exp_reduced8(__m256 x, __m256 *n) {
    *n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(*n, _mm256_set1_ps(0.693145752f), x);
    r = _mm256_fnmadd_ps(*n, _mm256_set1_ps(1.42860677e-6f), r);
    __m256 p = _mm256_set1_ps(1.0f / 5040);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    return _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
}

// exp(x) for x <= 0 (x = -inf gives 0), 2^n built in the exponent bits. glibc's scalar expf, one call per score, had
// been most of a decode step's attention: 63 us a layer at kv_len 300 on the 0.5B draft's shapes, 1.5 ms of its step
// (now 21 us).
static inline __m256 exp_neg8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f);
    const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    __m256 n;
    const __m256 p = exp_reduced8(x, &n);
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

// SwiGLU of 8 columns, a / (1 + exp(-a)) * b, exp(-a) by exp_reduced8 for any a: below exp(-87) it is 0 (1 + e is 1
// either way), above 88.72283 (ln FLT_MAX) infinity (a / inf = -0, as expf gives), a NaN stays NaN; 2^n is built as
// 2^(n - 1) times 2, so n = 128 (exp up to FLT_MAX) does not overflow the exponent bits. glibc's scalar expf was 4.1 ns
// an element here (Zen 4): 4 ms of an 8-token verification of the 1.5B (8 x 8960 elements, 28 layers, 2 threads),
// 0.5 ms of a step.
static inline __m256 silu_mul8(__m256 a, __m256 b) {
    const __m256 t = _mm256_sub_ps(_mm256_setzero_ps(), a);
    const __m256 under = _mm256_cmp_ps(t, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
    const __m256 over = _mm256_cmp_ps(t, _mm256_set1_ps(88.72283f), _CMP_GT_OQ);
    __m256 n;
    const __m256 clamped = _mm256_min_ps(_mm256_max_ps(t, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.72283f));
    const __m256 p = exp_reduced8(clamped, &n);
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(126)), 23);
    __m256 ex = _mm256_mul_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), _mm256_set1_ps(2.0f));
    ex = _mm256_blendv_ps(_mm256_andnot_ps(under, ex), _mm256_set1_ps(INFINITY), over);
    return _mm256_mul_ps(_mm256_div_ps(a, _mm256_add_ps(_mm256_set1_ps(1.0f), ex)), b);
}

// SwiGLU of x [S, 2K] into out [S, K], 8 columns an item, items split evenly over `threads` shares (share t of
// them runs items [t n / threads, (t + 1) n / threads)); a row's last K % 8 go through the same vector code, padded,
// so every element is computed alike wherever it falls.
typedef struct {
    const float *x;
    float *out;
    int K;
    int64_t n;
    int threads;
} swiglu_job_t;
static void swiglu_share(void *ctx, int t) {
    const swiglu_job_t *j = (const swiglu_job_t *)ctx;
    const int K = j->K, per = (K + 7) / 8;
    for (int64_t it = j->n * t / j->threads; it < j->n * (t + 1) / j->threads; it++) {
        const int64_t s = it / per;
        const int k = (int)(it % per) * 8;
        const float *a = j->x + s * 2 * K + k, *b = a + K;
        float *out = j->out + s * K + k;
        if (k + 8 <= K) {
            _mm256_storeu_ps(out, silu_mul8(_mm256_loadu_ps(a), _mm256_loadu_ps(b)));
        } else {
            float ta[8] = {0}, tb[8] = {0}, to[8];
            memcpy(ta, a, sizeof(float) * (K - k));
            memcpy(tb, b, sizeof(float) * (K - k));
            _mm256_storeu_ps(to, silu_mul8(_mm256_loadu_ps(ta), _mm256_loadu_ps(tb)));
            memcpy(out, to, sizeof(float) * (K - k));
        }
    }
}

// y[S, N] (+)= pre(x)[S, K] @ w[N, K].T, where pre is identity (mode 0), RMSNorm with weight g (mode 1,
// x is [S, K]) or SwiGLU silu(x[:, :K]) * x[:, K:] (mode 2, x is [S, 2K]).
// Returns skinny_matmul's status (SK_EARG also for a mode other than 0, 1, 2).
int fused_linear(const float *x, const float *g, float eps, const void *w, const float *sc, float *y, int S, int K,
                 int N, int threads, int wt, int gs, int mode, int accumulate) {
    if (S < 0 || mode < 0 || mode > 2 || !weights_ok(K, N, wt, gs)) return SK_EARG;
    const float *in = x;
    float *buf = NULL;
    int o_buf = 0, o_tmp = 0, rc;
    if (mode != 0) {
        buf = (float *)scratch(SC_PRE, sizeof(float) * (size_t)S * K, &o_buf);
        if (!buf) return SK_ENOMEM;
        if (mode == 1) {
            rmsnorm(x, g, eps, buf, S, K);
        } else {
            // Split over the threads (a single thread's SwiGLU made the other wait) from 2048 elements.
            const int parts = (int64_t)S * K >= 2048 ? threads : 1;
            const swiglu_job_t job = {x, buf, K, (int64_t)S * ((K + 7) / 8), parts};
            pool_run(swiglu_share, (void *)&job, parts);
        }
        in = buf;
    }
    if (!accumulate) {
        rc = skinny_matmul(in, w, sc, y, S, K, N, threads, wt, gs);
    } else {
        float *tmp = (float *)scratch(SC_ACC, sizeof(float) * (size_t)S * N, &o_tmp);
        rc = tmp ? skinny_matmul(in, w, sc, tmp, S, K, N, threads, wt, gs) : SK_ENOMEM;
        if (rc == SK_OK)
            for (int64_t i = 0; i < (int64_t)S * N; i++) y[i] += tmp[i];
        scratch_done(tmp, o_tmp);
    }
    scratch_done(buf, o_buf);
    return rc;
}

// qkv [B, S, Hq + 2 Hkv, D]: add the q/k/v bias [(Hq + 2 Hkv) D] when given (Qwen2), rotate q and k
// (half-rotation RoPE, cos/sin tables [*, D] indexed by pos), write q to q_out [B, S, Hq, D] and k, v to
// the caches [B, Hkv, L, D] at each token's slot, rounded to bf16 (bf16_row).
void rope_write(const float *qkv, const float *bias, const int64_t *pos, const int64_t *slots, const float *cos_t,
                const float *sin_t, float *q_out, uint16_t *kc, uint16_t *vc, int B, int S, int Hq, int Hkv, int D,
                int L) {
    int H = Hq + 2 * Hkv, half = D / 2;
    float tmp[D];  // a rotated k row or a biased v row before its rounding
    for (int b = 0; b < B; b++)
        for (int s = 0; s < S; s++) {
            int64_t t = (int64_t)b * S + s;
            const float *c = cos_t + pos[t] * D, *sn = sin_t + pos[t] * D;
            const float *row = qkv + t * H * D;
            for (int h = 0; h < Hq + Hkv; h++) {
                const float *x = row + (int64_t)h * D;
                const float *bh = bias ? bias + (int64_t)h * D : NULL;
                float *o = h < Hq ? q_out + (t * Hq + h) * D : tmp;
                for (int i = 0; i < half; i++) {
                    float x1 = x[i], x2 = x[i + half];
                    if (bh) { x1 += bh[i]; x2 += bh[i + half]; }
                    o[i] = x1 * c[i] - x2 * sn[i];
                    o[i + half] = x2 * c[i + half] + x1 * sn[i + half];
                }
                if (h >= Hq) bf16_row(tmp, kc + (((int64_t)b * Hkv + (h - Hq)) * L + slots[t]) * D, D);
            }
            for (int h = 0; h < Hkv; h++) {
                const float *x = row + (int64_t)(Hq + Hkv + h) * D;
                uint16_t *o = vc + (((int64_t)b * Hkv + h) * L + slots[t]) * D;
                if (!bias) { bf16_row(x, o, D); continue; }
                const float *bh = bias + (int64_t)(Hq + Hkv + h) * D;
                for (int i = 0; i < D; i++) tmp[i] = x[i] + bh[i];
                bf16_row(tmp, o, D);
            }
        }
}

// The largest of l[0..N) (NaN aside: *nan says whether the row holds one), 8 lanes then the tail.
static inline float row_max(const float *l, int N, int *nan) {
    __m256 m8 = _mm256_set1_ps(-INFINITY), nan8 = _mm256_setzero_ps();
    int k = 0;
    for (; k + 8 <= N; k += 8) {
        const __m256 v = _mm256_loadu_ps(l + k);
        m8 = _mm256_max_ps(m8, v);
        nan8 = _mm256_or_ps(nan8, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    float t[8], mx = -INFINITY;
    *nan = _mm256_movemask_ps(nan8) != 0;
    _mm256_storeu_ps(t, m8);
    for (int i = 0; i < 8; i++) mx = t[i] > mx ? t[i] : mx;
    for (; k < N; k++) {
        mx = l[k] > mx ? l[k] : mx;
        *nan |= l[k] != l[k];
    }
    return mx;
}

// Per row of logits [B, N]: idx = the first index of the largest value (torch.argmax's choice) and prob = its softmax
// probability, 1 / sum exp(l - max), by exp_neg8, in one call: a draft step's argmax and confidence (torch's argmax,
// softmax and amax over 65536 logits) had taken 0.3 ms of a 7.7 ms step; this takes 35 us hot, most of it the exp
// pass, which prob = NULL skips (a draft without draft_confidence needs no probability). Rows whose max is not finite
// get prob NaN. A NaN is the largest value, as torch.argmax has it: a row holding one gets the first NaN's index and
// prob NaN (torch's softmax of that row is all NaN).
void argmax_prob(const float *logits, int B, int N, int64_t *idx, float *prob) {
    for (int b = 0; b < B; b++) {
        const float *l = logits + (int64_t)b * N;
        int nan;
        const float mx = row_max(l, N, &nan);
        float t[8];
        int k;
        int64_t at = 0;
        if (nan) {
            while (at < N - 1 && l[at] == l[at]) at++;
            idx[b] = at;
            if (prob) prob[b] = NAN;
            continue;
        }
        while (at < N - 1 && !(l[at] == mx)) at++;
        idx[b] = at;
        if (!prob) continue;
        if (!(mx > -INFINITY && mx < INFINITY)) {
            prob[b] = NAN;
            continue;
        }
        const __m256 vm = _mm256_set1_ps(mx);
        __m256 s8 = _mm256_setzero_ps();
        for (k = 0; k + 8 <= N; k += 8) s8 = _mm256_add_ps(s8, exp_neg8(_mm256_sub_ps(_mm256_loadu_ps(l + k), vm)));
        _mm256_storeu_ps(t, s8);
        float sum = 0.f;
        for (int i = 0; i < 8; i++) sum += t[i];
        for (; k < N; k++) sum += expf(l[k] - mx);
        prob[b] = 1.0f / sum;
    }
}

// One value of x as an int8 kernel uses it after quantizing its group (x_a8, gg_quant_row, gg_quant32_row all
// alike): q = RN(x RN(127 / m)) times RN(m / 127), m the group's max |x|; a group under 1e-30 is zero.
static inline double screen_q8(float x, float inv, float step) {
    return step == 0.f ? 0.0 : (double)rintf(x * inv) * (double)step;
}

// The exact greedy head's bounds (pipeline/runtime/head_screen.py): per row b of x [B, K] (finite), with a the row
// as the head's kernel quantizes it (groups of g1 columns) and a' as the screen's (groups of g2), the coefficients
// of |W_j| and |W_j - Q_j| in the bound on |r_j - s_j|: out[2 b] = |a - a'| + 2 tol m, out[2 b + 1] = |a'| + tol m,
// m = max(|a|, |a'|) (tol: both kernels' fp32 rounding, relative), in double, rounded up to fp32. Returns 1 (and
// writes nothing) if x holds a NaN or an infinity: no bound holds for such a row.
int screen_bounds(const float *x, int B, int K, int g1, int g2, double tol, float *out) {
    for (int64_t i = 0; i < (int64_t)B * K; i++)
        if (!(fabsf(x[i]) <= 3.4028235e38f)) return 1;
    for (int b = 0; b < B; b++) {
        const float *r = x + (int64_t)b * K;
        double d2 = 0.0, n2 = 0.0, r2 = 0.0;
        float inv1 = 0.f, st1 = 0.f, inv2 = 0.f, st2 = 0.f;
        for (int k = 0; k < K; k++) {
            for (int t = 0; t < 2; t++) {
                const int g = t ? g2 : g1;
                if (k % g) continue;
                float mx = 0.f;
                for (int i = k; i < k + g; i++) mx = fabsf(r[i]) > mx ? fabsf(r[i]) : mx;
                const float inv = mx < 1e-30f ? 0.f : 127.0f / mx, st = mx < 1e-30f ? 0.f : mx / 127.0f;
                if (t) inv2 = inv, st2 = st;
                else inv1 = inv, st1 = st;
            }
            const double a = screen_q8(r[k], inv1, st1), a2 = screen_q8(r[k], inv2, st2);
            d2 += (a - a2) * (a - a2);
            n2 += a2 * a2;
            r2 += a * a;
        }
        const double m = sqrt(r2 > n2 ? r2 : n2), up = 1.0 + 1e-9;
        out[2 * b] = nextafterf((float)((sqrt(d2) + 2 * tol * m) * up), INFINITY);
        out[2 * b + 1] = nextafterf((float)((sqrt(n2) + tol * m) * up), INFINITY);
    }
    return 0;
}

// The exact greedy head's logits (pipeline/runtime/head_screen.py's `logits`) in one call: token rows x [B, K], the
// screen's panels `sdesc` (its Q4_K rows), the head's panels w (one GGUF part of type `type`, N rows), wn / dn [N]
// the rows' bound coefficients of |W_j| and |W_j - Q_j| and pwn / pdn [ceil(N / 16)] each 16-row panel's largest,
// act_group the head kernel's activation group and tol the kernels' rounding (screen_bounds: a, c a token row's).
// Into s [B, N] the screen's scores, then: each panel's largest score (one pass); the panel of each row's best score
// computed with the head's own tiles (the union over the rows), a row's largest logit there its lower bound L; the
// panels where, for some row, largest score + pwn a + pdn c >= L (a NaN passes), and of those the ones where some
// row j passes s_j + wn_j a + dn_j c >= L itself (the panel test passes wherever a row's would: s_j, wn_j and dn_j
// are at most the panel's, and fp32 FMAs are monotone in each operand). Those are computed into s with the head's
// bits (the tiles' rows are independent), -inf everywhere else: no row left out can reach L. Returns the panels
// computed, or where s holds no logits (the caller reads the whole head): -1 more than max_panels would be computed,
// -2 out of memory, -3 shapes it does not take, -4 x holds a NaN or an infinity (no bound holds).
typedef struct {
    const gx_t *X;
    const gg_part_t *pt;
    float *s;
    const int32_t *list;
    int n, B, K, N, parts;
} sh_job_t;
static void sh_share(void *ctx, int t) {
    const sh_job_t *j = (const sh_job_t *)ctx;
    const unsigned int csr = _mm_getcsr();
    _mm_setcsr(csr & ~0x8040u);
    for (int i = j->n * t / j->parts; i < j->n * (t + 1) / j->parts; i++)
        gg_panels(j->X, j->pt, j->s, j->B, j->K, j->N, j->list[i], j->list[i] + 1);
    gg_amx_release();
    _mm_setcsr(csr);
}
#define SH_FIRST 8       // at most this many first panels (one per row: head_screen.py serves at most 6 rows)
#define SH_POOL_FROM 32  // marked panels from which the pool shares them
int64_t screen_head(const float *x, int B, int K, int act_group, double tol, const gg_desc_t *sdesc, int type,
                    const uint8_t *w, int N, float *s, const float *wn, const float *dn, const float *pwn,
                    const float *pdn, int max_panels, int threads) {
    if (B < 1 || B > SH_FIRST || K % 256 || N < 1 || sdesc->K != K || sdesc->nparts != 1 || sdesc->part[0].N != N)
        return -3;
    float ab[2 * SH_FIRST];
    if (screen_bounds(x, B, K, act_group, 256, tol, ab)) return -4;
    if (gguf_matmul(x, sdesc, s, B, K, N, threads) != SK_OK) return -2;
    const int P = (N + 15) / 16, is32 = gg_is32(type);
    int64_t done = -2;
    int oq, oqi = 0, odx, oxs, oo;
    int8_t *q = (int8_t *)scratch(SC_GGQ, (size_t)B * K, &oq);
#if defined(__AVX512F__)
    const int interleave = 0;
#else
    const int interleave = B > 1 && !is32;
#endif
    int8_t *qi = interleave ? (int8_t *)scratch(SC_GGQI, (size_t)B * K, &oqi) : q;
    float *dx = (float *)scratch(SC_GGDX, sizeof(float) * (size_t)B * (K / 256 + 1), &odx);
    float *xs = (float *)scratch(SC_GGXS, sizeof(float) * (size_t)B * (K / 32), &oxs);
    int32_t *o = (int32_t *)scratch(SC_GGO, sizeof(int32_t) * (size_t)B * (K / 16), &oo);
    int8_t *q32 = is32 ? (int8_t *)malloc((size_t)B * K + 2 * sizeof(float) * (size_t)B * (K / 32)) : NULL;
    float *dx32 = q32 ? (float *)(q32 + (size_t)B * K) : NULL, *xs32 = dx32 ? dx32 + (size_t)B * (K / 32) : NULL;
    float *ex = (float *)malloc(sizeof(float) * (size_t)B * 16 * SH_FIRST);
    float *pm = (float *)malloc(sizeof(float) * (size_t)B * P);
    int32_t *list = (int32_t *)malloc(sizeof(int32_t) * (size_t)P);
    const unsigned int csr = _mm_getcsr();
    if (!q || !qi || !dx || !xs || !o || (is32 && !q32) || !ex || !pm || !list) goto out;
    int first[SH_FIRST], nf = 0;
    for (int b = 0; b < B; b++) {  // each panel's largest score, and the panel of the row's largest
        const float *r = s + (int64_t)b * N;
        float *m = pm + (int64_t)b * P;
        int p = 0;
#ifdef __AVX512F__
        // 16 whole panels at a time: a transposing tree of maxima (half against half, lanes against lanes) leaves
        // their 16 maxima in one register, in the order `order` puts back; a block holding a NaN takes each panel alone
        const __m512i order = _mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15);
        for (; 16 * (p + 16) <= N; p += 16) {
            __m512 v[16];
            __mmask16 nan = 0;
            for (int i = 0; i < 16; i++) {
                v[i] = _mm512_loadu_ps(r + 16 * (p + i));
                nan |= _mm512_cmp_ps_mask(v[i], v[i], _CMP_UNORD_Q);
            }
            if (nan) {
                for (int i = 0; i < 16; i++) {
                    const __mmask16 u = _mm512_cmp_ps_mask(v[i], v[i], _CMP_UNORD_Q);
                    m[p + i] = u ? INFINITY : _mm512_reduce_max_ps(v[i]);
                }
                continue;
            }
            for (int i = 0; i < 8; i++)  // 128-bit lanes 0-1: panel i's halves' maxima, 2-3: panel i + 8's
                v[i] = _mm512_max_ps(_mm512_shuffle_f32x4(v[i], v[i + 8], 0x44),
                                     _mm512_shuffle_f32x4(v[i], v[i + 8], 0xEE));
            for (int i = 0; i < 4; i++)  // lanes: panels i, i + 8, i + 4, i + 12, four partial maxima each
                v[i] = _mm512_max_ps(_mm512_shuffle_f32x4(v[i], v[i + 4], 0x88),
                                     _mm512_shuffle_f32x4(v[i], v[i + 4], 0xDD));
            for (int i = 0; i < 2; i++)  // per lane two panels (of v[i] and v[i + 2]), two partial maxima each
                v[i] = _mm512_max_ps(_mm512_shuffle_ps(v[i], v[i + 2], 0x44), _mm512_shuffle_ps(v[i], v[i + 2], 0xEE));
            const __m512 t = _mm512_max_ps(_mm512_shuffle_ps(v[0], v[1], 0x88), _mm512_shuffle_ps(v[0], v[1], 0xDD));
            _mm512_storeu_ps(m + p, _mm512_permutexvar_ps(order, t));  // panels 0,2,1,3, 8,10,9,11, ... in order
        }
#endif
        for (; p < P; p++) {
            const int n = N - 16 * p < 16 ? N - 16 * p : 16;
            float v;
#ifdef __AVX512F__
            const __mmask16 k = (__mmask16)((1u << n) - 1);
            const __m512 t = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), k, r + 16 * p);
            v = _mm512_cmp_ps_mask(t, t, _CMP_UNORD_Q) ? INFINITY : _mm512_reduce_max_ps(t);
#else
            v = -INFINITY;
            if (n == 16) {
                const __m256 t0 = _mm256_loadu_ps(r + 16 * p), t1 = _mm256_loadu_ps(r + 16 * p + 8);
                if (_mm256_movemask_ps(_mm256_or_ps(_mm256_cmp_ps(t0, t0, _CMP_UNORD_Q),
                                                    _mm256_cmp_ps(t1, t1, _CMP_UNORD_Q)))) {
                    v = INFINITY;
                } else {
                    __m256 t = _mm256_max_ps(t0, t1);
                    __m128 h = _mm_max_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
                    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
                    h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
                    v = _mm_cvtss_f32(h);
                }
            } else {
                for (int i = 0; i < n; i++)
                    v = r[16 * p + i] != r[16 * p + i] ? INFINITY : r[16 * p + i] > v ? r[16 * p + i] : v;
            }
#endif
            m[p] = v;
        }
        int bp = 0;  // the first panel of the largest maximum (a NaN's INFINITY wins: any start is sound)
        for (int q = 1; q < P; q++) bp = m[q] > m[bp] ? q : bp;
        int seen = 0;
        for (int f = 0; f < nf; f++) seen |= first[f] == bp;
        if (!seen) first[nf++] = bp;
    }
    _mm_setcsr(csr & ~0x8040u);  // IEEE denormals: the tiles' contract, as gguf_matmul sets it
    for (int b = 0; b < B; b++) {
        if (is32) gg_quant32_row(x + (int64_t)b * K, K, q32 + (int64_t)b * K, dx32 + (int64_t)b * (K / 32),
                                 xs32 + (int64_t)b * (K / 32));
        else gg_quant_row(x + (int64_t)b * K, K, q + (int64_t)b * K, dx + (int64_t)b * (K / 256),
                          xs + (int64_t)b * (K / 32), o + (int64_t)b * (K / 16));
    }
    if (interleave) gg_interleave(q, qi, B, K);
    const gx_t X = {q, qi, dx, xs, o, q32, dx32, xs32};
    const int64_t pbytes = gg_panel_bytes(type, K);
    for (int f = 0; f < nf; f++) {  // the first panels into ex [B, 16 nf]
        const int left = N - 16 * first[f] < 16 ? N - 16 * first[f] : 16;
        const gg_part_t one = {type, left, 16 * f, 0, w + first[f] * pbytes};
        gg_panels(&X, &one, ex, B, K, 16 * nf, 0, 1);
    }
    gg_amx_release();
    _mm_setcsr(csr);
    float lo[SH_FIRST];  // each row's largest logit in the first panels (a NaN: every panel passes)
    for (int b = 0; b < B; b++) {
        lo[b] = -INFINITY;
        for (int f = 0; f < nf; f++) {
            const int left = N - 16 * first[f] < 16 ? N - 16 * first[f] : 16;
            for (int i = 0; i < left; i++) {
                const float v = ex[(int64_t)b * 16 * nf + 16 * f + i];
                lo[b] = v > lo[b] || v != v ? v : lo[b];
            }
        }
    }
    int n = 0, p = 0;
    for (; p + A8_LANES <= P; p += A8_LANES) {  // the same test as the loop below, a vector of panels at a time
        const vf_t wnv = gg_loadf(pwn + p), dnv = gg_loadf(pdn + p);
        unsigned keep = 0;
        for (int b = 0; b < B; b++) {
            const vf_t v = gg_fma(wnv, gg_set1(ab[2 * b]), gg_loadf(pm + (int64_t)b * P + p));
            keep |= gg_nlt(gg_fma(dnv, gg_set1(ab[2 * b + 1]), v), gg_set1(lo[b]));
        }
        for (; keep; keep &= keep - 1) list[n++] = p + __builtin_ctz(keep);
    }
    for (; p < P; p++) {
        int keep = 0;
        for (int b = 0; b < B && !keep; b++)
            keep = !(fmaf(pdn[p], ab[2 * b + 1], fmaf(pwn[p], ab[2 * b], pm[(int64_t)b * P + p])) < lo[b]);
        if (keep) list[n++] = p;
    }
    int kept = 0;  // each row of the panels that passed, tested alone; the first panels are computed already
    for (int i = 0; i < n; i++) {
        const int q = list[i], rows = N - 16 * q < 16 ? N - 16 * q : 16;
        int keep = 1;
        for (int f = 0; f < nf && keep; f++) keep = first[f] != q;
        int pass = 0;
        for (int b = 0; b < B && keep && !pass; b++)
            for (int j = 16 * q; j < 16 * q + rows && !pass; j++)
                pass = !(fmaf(dn[j], ab[2 * b + 1], fmaf(wn[j], ab[2 * b], s[(int64_t)b * N + j])) < lo[b]);
        if (keep && pass) list[kept++] = q;
    }
    n = kept;
    if (nf + n > max_panels) {
        done = -1;
        goto restore;
    }
    uint8_t *done_p = (uint8_t *)pm;  // pm is read no more: a byte a panel, 1 where it is computed
    memset(done_p, 0, (size_t)P);
    for (int f = 0; f < nf; f++) done_p[first[f]] = 1;
    for (int i = 0; i < n; i++) done_p[list[i]] = 1;
    for (int b = 0; b < B; b++) {  // -inf wherever no logit is computed
        float *r = s + (int64_t)b * N;
        for (int q = 0; q < P; q++) {
            if (done_p[q]) continue;
            const int rows = N - 16 * q < 16 ? N - 16 * q : 16;
            if (rows == 16) {
                _mm256_storeu_ps(r + 16 * q, _mm256_set1_ps(-INFINITY));
                _mm256_storeu_ps(r + 16 * q + 8, _mm256_set1_ps(-INFINITY));
            } else {
                for (int j = 0; j < rows; j++) r[16 * q + j] = -INFINITY;
            }
        }
        for (int f = 0; f < nf; f++) {
            const int left = N - 16 * first[f] < 16 ? N - 16 * first[f] : 16;
            memcpy(r + 16 * first[f], ex + (int64_t)b * 16 * nf + 16 * f, sizeof(float) * left);
        }
    }
    const gg_part_t all = {type, N, 0, 0, w};
    if (n < SH_POOL_FROM || threads < 2) {
        for (int i = 0; i < n; i++) gg_panels(&X, &all, s, B, K, N, list[i], list[i] + 1);
        gg_amx_release();
    } else {
        const sh_job_t job = {&X, &all, s, list, n, B, K, N, threads};
        pool_run(sh_share, (void *)&job, threads);
    }
    done = nf + n;
restore:
    _mm_setcsr(csr);
out:
    scratch_done(q, oq);
    if (interleave) scratch_done(qi, oqi);
    scratch_done(dx, odx);
    scratch_done(xs, oxs);
    scratch_done(o, oo);
    free(q32), free(ex), free(pm), free(list);
    return done;
}

// Per row of probs [B, N] (non-negative weights, any positive total): idx[b] = the first index whose running total
// exceeds u[b] x the row's total, so index i comes with odds p_i / total for u[b] uniform in [0, 1): inverse-CDF
// sampling from one uniform draw a row. torch.multinomial draws one exponential per entry instead (151,936 logs a
// token for Qwen: 3.1 ms, against a 22 ms target step and a 5 ms draft step, on the 2-core Zen 4); this reads the
// row once, then one 32-entry block again: 0.04 ms. Sums are double: 32-entry block sums, then their running total,
// then the running total inside the block that holds the target, one order throughout (a target the block's own scan
// misses by rounding takes that block's last positive entry). A zero entry is never chosen. Returns 0, or 1 + the
// first bad row (a negative, NaN or infinite entry, or a total of 0): torch.multinomial refuses those rows too.
#define SAMPLE_BLOCK 32
int sample_rows(const float *probs, int B, int N, const double *u, int64_t *idx) {
    const int nb = (N + SAMPLE_BLOCK - 1) / SAMPLE_BLOCK;
    double *bs = malloc(sizeof(double) * (size_t)(nb > 0 ? nb : 1));
    if (!bs) return -1;
    for (int b = 0; b < B; b++) {
        const float *p = probs + (int64_t)b * N;
        int bad = 0;
        double total = 0.0;
        for (int j = 0; j < nb; j++) {
            const int k0 = j * SAMPLE_BLOCK, k1 = k0 + SAMPLE_BLOCK < N ? k0 + SAMPLE_BLOCK : N;
            double s = 0.0;
            int k = k0;
            if (k1 - k0 == SAMPLE_BLOCK) {
                __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
                __m256 ok = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
                for (; k < k1; k += 8) {
                    const __m256 v = _mm256_loadu_ps(p + k);
                    // v >= 0 and v < inf (false for NaN): the entries multinomial accepts
                    ok = _mm256_and_ps(ok, _mm256_and_ps(_mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_GE_OQ),
                                                         _mm256_cmp_ps(v, _mm256_set1_ps(INFINITY), _CMP_LT_OQ)));
                    a0 = _mm256_add_pd(a0, _mm256_cvtps_pd(_mm256_castps256_ps128(v)));
                    a1 = _mm256_add_pd(a1, _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
                }
                bad |= _mm256_movemask_ps(ok) != 0xff;
                double t[4];
                _mm256_storeu_pd(t, _mm256_add_pd(a0, a1));
                s = (t[0] + t[1]) + (t[2] + t[3]);
            } else {
                for (; k < k1; k++) {
                    bad |= !(p[k] >= 0.f && p[k] < INFINITY);
                    s += p[k];
                }
            }
            bs[j] = s;
            total += s;
        }
        if (bad || !(total > 0.0)) {
            free(bs);
            return b + 1;
        }
        const double target = u[b] * total;
        double acc = 0.0;
        int j = 0;
        while (j < nb - 1 && !(acc + bs[j] > target)) acc += bs[j++];
        int last = 0;  // rounding walked past the last positive block: take its last positive entry
        while (j > 0 && bs[j] == 0.0) j--, last = 1;
        const int k0 = j * SAMPLE_BLOCK, k1 = k0 + SAMPLE_BLOCK < N ? k0 + SAMPLE_BLOCK : N;
        int64_t at = -1;
        for (int k = k0; k < k1; k++) {
            if (!(p[k] > 0.f)) continue;
            at = k;
            acc += p[k];
            if (!last && acc > target) break;
        }
        idx[b] = at;
    }
    free(bs);
    return 0;
}

// out [B, N] = softmax(x / t) per row, on the calling thread: every sampled token's distribution (warp). torch's
// division and softmax over a vocabulary are OpenMP regions, and right after a kernel call the pool's workers hold
// the cores spinning (up to pool_spin_quiet_ns), so a region's worker waited for one: the flagship's draft warped its
// 65,536-entry row in 1.17 ms on average inside draft_target's rounds (0.085 alone) and the target its 7 x 151,936
// in 3.4 ms (2-core Zen 4, T = 1). exp by exp_neg8 (to float rounding above exp(-87), 0 below), the sum in double.
// x / t is a division, as torch's logits / temperature, so overflow and NaN go as they go there: a row holding NaN,
// or +inf after the division, or only -inf, and every row for a NaN t, come out all NaN, as torch's softmax makes
// them (sampling then refuses them).
void softmax_rows(const float *x, int B, int N, float t_, float *out) {
    for (int b = 0; b < B; b++) {
        const float *l = x + (int64_t)b * N;
        float *o = out + (int64_t)b * N;
        int nan, k;
        const float mx = row_max(l, N, &nan) / t_;  // the largest of x / t (t > 0: division keeps the order)
        if (nan || !(mx > -INFINITY && mx < INFINITY)) {
            for (k = 0; k < N; k++) o[k] = NAN;
            continue;
        }
        const __m256 vm = _mm256_set1_ps(mx), vt = _mm256_set1_ps(t_);
        __m256d s0 = _mm256_setzero_pd(), s1 = _mm256_setzero_pd();
        for (k = 0; k + 8 <= N; k += 8) {
            const __m256 e = exp_neg8(_mm256_sub_ps(_mm256_div_ps(_mm256_loadu_ps(l + k), vt), vm));
            _mm256_storeu_ps(o + k, e);
            s0 = _mm256_add_pd(s0, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
            s1 = _mm256_add_pd(s1, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
        }
        if (k < N) {  // the tail through the same vector code, padded with -inf (exp 0)
            float in[8], e[8];
            for (int i = 0; i < 8; i++) in[i] = k + i < N ? l[k + i] : -INFINITY;
            const __m256 v = exp_neg8(_mm256_sub_ps(_mm256_div_ps(_mm256_loadu_ps(in), vt), vm));
            _mm256_storeu_ps(e, v);
            s0 = _mm256_add_pd(s0, _mm256_cvtps_pd(_mm256_castps256_ps128(v)));
            s1 = _mm256_add_pd(s1, _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
            for (int i = 0; k + i < N; i++) o[k + i] = e[i];
        }
        double d[4];
        _mm256_storeu_pd(d, _mm256_add_pd(s0, s1));
        const float sum = (float)((d[0] + d[1]) + (d[2] + d[3]));
        const __m256 r = _mm256_set1_ps(1.0f / sum);
        for (k = 0; k + 8 <= N; k += 8) _mm256_storeu_ps(o + k, _mm256_mul_ps(_mm256_loadu_ps(o + k), r));
        for (; k < N; k++) o[k] *= 1.0f / sum;
    }
}

// out[b, s, h] = softmax(q . K[:kv_len] * scale, masked) @ V, grouped-query (head h reads kv head h / (Hq/Hkv)).
// mask [B, S, kv_len] (nonzero = attend), or NULL: a query attends to the slots up to its own (slots [B, S]).
// The caches hold K and V as bf16 (rope_write rounds them); q is rounded to bf16 as a unit starts, and the softmax
// weights as they are made: both products are bf16 dot products (vdpbf16ps, 16 multiply-adds where vfmadd231ps does
// 8, at the same rate on Zen 4; the AVX2 build emulates it as two FMAs, odd element first, which is the instruction
// bit for bit), so a long prefill's attention, bound by those multiply-adds, takes about half the time it took in
// fp32 and the cache half the memory. Attention runs under MXCSR FTZ|DAZ in both builds (as the bf16 matmul tiles).
// One query's result never depends on the other queries, on the thread
// that computes it, nor on masked slots past its own (kv_len padding): the exponentials are summed in 8 lanes by
// slot index (l % 8) and a masked slot adds an exact 0, and V rows of masked slots are never read.
// Nor, under a mask, on where its visible slots lie: there the k-th slot a pair sees goes to lane k % 8 (its rank,
// att_rank_sum), so a tree node at slot n + 2 that sees [0, n] and n + 2 (its sibling at n + 1 hidden) sums as the
// same token decoded in a chain at slot n + 1 does; by slot index its last exponential had landed in another lane, a
// different rounding (5e-6 on a float model) that the int8 activations of a GGUF Q4_1 target amplified to flipped
// tokens (issue 53: medusa 1/8 prompts like baseline). Without a mask and with masks contiguous from slot 0
// (padding) rank and slot index are the same, so those bits did not change; scores and values depend on a slot's
// K and V rows and the slot order only.
// Written with 8-lane (ymm) operations only, so both builds run the same sequence.
// The work comes in units of up to ATT_UNIT (query, head) pairs that read the same kv head, so each K and V row is
// loaded once for all of them: one pair at a time, every pair re-read its kv head's K and V from L2 (2 x 105 KB for
// the 1.5B at 206 slots) and its 4 dot products in flight waited on FMA latency; a 6-token verification of the 1.5B
// spent 3-5 ms of its 38 in attention. Each pair's arithmetic is what it was alone, in the same order (per slot: a
// bf16 dot product over the 16-column blocks of d from 0, the D % 16 tail read as zeros, then the fixed lane sum;
// per output column: bf16 dot products over the slot pairs (2m, 2m + 1) in order, skipping pairs whose two weights
// are 0), so grouping changes no bit.
// A unit computes nothing past the last slot any of its pairs sees (hi: its largest own slot + 1 without a mask, the
// last nonzero of its mask rows with one): a causal prefill chunk of 2,048 from slot 0 had scored every query
// against all 2,048 slots, half of them to write -inf, and the exponentials of those slots were exact zeros that
// the sums skip bit-for-bit. The unit's scores, exponentials and weights lie slot-major (a slot's 8 lanes are its
// pairs), so the max, the exponentials, the 8 partial sums by l % 8 and the weights are one vector op per slot for
// all pairs, each lane's arithmetic the scalar order it was pair by pair, and the 2 NI dot products of a slot pair
// are summed by one transposing hsum8x with hsum256's additions.
// Returns SK_OK, SK_EARG (shapes: Hq a multiple of Hkv, kv_len <= L), or SK_ENOMEM (some outputs not written).
// 8 pairs in the AVX-512 build (its 32 ymm hold 8 pairs' two-slot sums or value columns; the 1.5B's 6 heads of a
// query then read their kv head once, and a prefill chunk's units stream K and V half as often as at 4), 4 in AVX2.
#if defined(__AVX512F__)
#define ATT_UNIT 8
// acc + a . b over 8 lanes of two bf16 each (lane j: a[2j + 1] b[2j + 1], then a[2j] b[2j])
static inline __attribute__((always_inline)) __m256 att_dp(__m256 acc, __m256i a, __m256i b) {
    return _mm256_dpbf16_ps(acc, (__m256bh)a, (__m256bh)b);
}
// n (<= 16) bf16 from p, zeros after them (nothing past p + n is read)
static inline __attribute__((always_inline)) __m256i att_load16(const uint16_t *p, int n) {
    return n >= 16 ? _mm256_loadu_si256((const __m256i *)p) : _mm256_maskz_loadu_epi16((__mmask16)((1u << n) - 1), p);
}
#else
#define ATT_UNIT 4
static inline __attribute__((always_inline)) __m256 att_dp(__m256 acc, __m256i a, __m256i b) {
    const __m256i hi = _mm256_set1_epi32((int)0xFFFF0000);
    acc = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(a, hi)), _mm256_castsi256_ps(_mm256_and_si256(b, hi)),
                          acc);
    return _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(a, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(b, 16)),
                           acc);
}
static inline __attribute__((always_inline)) __m256i att_load16(const uint16_t *p, int n) {
    if (n >= 16) return _mm256_loadu_si256((const __m256i *)p);
    uint16_t t[16] __attribute__((aligned(32))) = {0};
    memcpy(t, p, 2 * (size_t)n);
    return _mm256_load_si256((const __m256i *)t);
}
#endif

typedef struct {
    const float *q;
    const uint16_t *kc, *vc;
    const uint8_t *mask;
    const int64_t *slots;
    float *out;
    int S, Hq, Hkv, group, D, L, kv_len, per_kv, unit, units, parts;
    float scale;
    _Atomic int failed;
} attn_job_t;

// Lane i of the result is hsum256(x[i]): the same additions in the same order (the halves lo + hi, then (t0 + t1) +
// (t2 + t3)), eight sums in 8 cross-lane permutes, 4 adds and 3 horizontal adds where eight hsum256 take 48
// instructions (two sums a slot for each pair).
static inline __attribute__((always_inline)) __m256 hsum8x(const __m256 *x) {
#define HALVES(u, v) _mm256_add_ps(_mm256_permute2f128_ps(u, v, 0x20), _mm256_permute2f128_ps(u, v, 0x31))
    // hadd interleaves its operands' 128-bit halves: taking x as 0 4, 1 5, 2 6, 3 7 puts the sums in lane order
    const __m256 p0 = HALVES(x[0], x[4]), p1 = HALVES(x[1], x[5]), p2 = HALVES(x[2], x[6]), p3 = HALVES(x[3], x[7]);
#undef HALVES
    return _mm256_hadd_ps(_mm256_hadd_ps(p0, p1), _mm256_hadd_ps(p2, p3));
}

// The K or V rows ATT_PF slots ahead, asked for whole: the first 16 columns' pass over V touches one 64-byte line of
// each row (256 bytes at D 128), a stride the hardware prefetchers follow poorly, so each of its lines waited on L3 or
// memory (a decode query at 16k slots reads 2 x 4 MB a kv head); the other passes then find the rows in L2.
#ifndef ATT_PF
#define ATT_PF 16
#endif
static inline __attribute__((always_inline)) void att_prefetch(const uint16_t *r, int n) {
    for (int c = 0; c < n; c += 32) _mm_prefetch((const char *)(r + c), _MM_HINT_T1);
}

// Scores of NI pairs at slots [l0, l1), slot-major: sc[8 l + i] = q_i . K[l] * scale, or -inf where pair i does not
// see slot l (masked: m[i][l] == 0; else l > own[i]; lanes NI..7 are -inf). q_i: bf16, zero-padded to a multiple of
// 16 columns. *mx: each lane's running max, as `e > mx ? e : mx` took it slot by slot (vmaxps: a NaN score is passed
// over). Two slots at a time: 2 NI independent dot products in flight, each K row loaded once (an odd last slot is
// paired with itself); rows up to lim prefetched.
static inline __attribute__((always_inline)) void att_scores(const uint16_t *const *qv, const uint16_t *K,
                                                             const uint8_t *const *m, int masked, __m256i own,
                                                             float *sc, __m256 *mx, int D, int l0, int l1, int lim,
                                                             float scale, const int NI) {
    const __m256 ninf = _mm256_set1_ps(-INFINITY), vs = _mm256_set1_ps(scale);
    __m256 top = *mx;
    for (int l = l0; l < l1; l += 2) {
        const int two = l + 2 <= l1;
        __m256 a[2][8];
        _Pragma("GCC unroll 8")
        for (int i = 0; i < 8; i++) a[0][i] = a[1][i] = _mm256_setzero_ps();
        const uint16_t *k0 = K + (int64_t)l * D, *k1 = two ? k0 + D : k0;
        if (ATT_PF && l + ATT_PF + 2 <= lim) att_prefetch(k0 + (int64_t)ATT_PF * D, 2 * D);
        for (int d = 0; d < D; d += 16) {
            const __m256i x0 = att_load16(k0 + d, D - d), x1 = att_load16(k1 + d, D - d);
            _Pragma("GCC unroll 8")
            for (int i = 0; i < NI; i++) {
                const __m256i qq = _mm256_loadu_si256((const __m256i *)(qv[i] + d));
                a[0][i] = att_dp(a[0][i], qq, x0);
                a[1][i] = att_dp(a[1][i], qq, x1);
            }
        }
        const __m256 v[2] = {hsum8x(a[0]), hsum8x(a[1])};
        for (int r = 0; r <= two; r++) {
            __m256i seen;
            if (masked) {
                int32_t s8[8] __attribute__((aligned(32))) = {0};
                for (int i = 0; i < NI; i++) s8[i] = m[i][l + r] ? -1 : 0;
                seen = _mm256_load_si256((const __m256i *)s8);
            } else {
                seen = _mm256_cmpgt_epi32(own, _mm256_set1_epi32(l + r - 1));  // l + r <= own
            }
            const __m256 x = _mm256_blendv_ps(ninf, _mm256_mul_ps(v[r], vs), _mm256_castsi256_ps(seen));
            _mm256_store_ps(sc + 8 * (int64_t)(l + r), x);
            top = _mm256_max_ps(x, top);
        }
    }
    *mx = top;
}

// o_i (+)= sum over slots l in [l0, l1) of p_i[l] V[l], for NI pairs, 16 columns of each in registers while the slots
// go by two at a time: rows 2m and 2m + 1 interleaved (vpunpck{l,h}wd: lane j holds a column of both) make one bf16
// dot product with pair i's two weights (pw: 16 bf16 a slot pair, pair i's at 2 i and 2 i + 1), so each V row is
// loaded once and a slot pair costs 2 NI dot products where fp32 took 4 NI FMAs. The interleave puts columns 0-3 and
// 8-11 in one register, 4-7 and 12-15 in the other; the sums are put back in column order as they are stored. A slot
// pair neither of whose weights is nonzero for any pair (nz) is skipped, and for one pair if its two are 0: that adds
// exact zeros. From 0 at l0 = 0, else from the sums the slots before left in o. l0 is even (0 or a multiple of
// ATT_VBLOCK); an odd l1's last slot is paired with zeros. The caller passes the slots in blocks of ATT_VBLOCK (64 KB
// of V rows at D 128), so the other units of a tile find them in L2.
#define ATT_VBLOCK 256
static inline __attribute__((always_inline)) void att_values(const uint16_t *pw, const uint8_t *nz, const uint16_t *V,
                                                             float *const *o, int D, int l0, int l1, int lim,
                                                             const int NI) {
    const int all = (1 << NI) - 1;
    for (int d0 = 0; d0 < D; d0 += 16) {
        const int dn = D - d0 < 16 ? D - d0 : 16;
        __m256 lo[ATT_UNIT], hi[ATT_UNIT];  // columns 0-3, 8-11 / 4-7, 12-15 of the block
        _Pragma("GCC unroll 8")
        for (int i = 0; i < NI; i++) {
            if (!l0) {
                lo[i] = hi[i] = _mm256_setzero_ps();
                continue;
            }
            float t[16] __attribute__((aligned(32))) = {0};
            memcpy(t, o[i] + d0, sizeof(float) * (size_t)dn);
            const __m256 a = _mm256_load_ps(t), b = _mm256_load_ps(t + 8);
            lo[i] = _mm256_permute2f128_ps(a, b, 0x20);
            hi[i] = _mm256_permute2f128_ps(a, b, 0x31);
        }
        for (int l = l0; l < l1; l += 2) {
            if (ATT_PF && d0 == 0 && l + ATT_PF + 2 <= lim) att_prefetch(V + (int64_t)(l + ATT_PF) * D, 2 * D);
            const int two = l + 1 < l1;
            const int z = nz[l] | (two ? nz[l + 1] : 0);
            if (!z) continue;  // no pair sees either slot: their V rows are not read
            const uint16_t *v = V + (int64_t)l * D + d0;
            const __m256i r0 = att_load16(v, dn), r1 = two ? att_load16(v + D, dn) : _mm256_setzero_si256();
            const __m256i vl = _mm256_unpacklo_epi16(r0, r1), vh = _mm256_unpackhi_epi16(r0, r1);
            const int32_t *pp = (const int32_t *)(pw + 8 * (int64_t)l);
            if (z == all) {  // every pair sees a slot of the two: no test per pair
                _Pragma("GCC unroll 8")
                for (int i = 0; i < NI; i++) {
                    const __m256i p = _mm256_set1_epi32(pp[i]);
                    lo[i] = att_dp(lo[i], p, vl);
                    hi[i] = att_dp(hi[i], p, vh);
                }
            } else {
                _Pragma("GCC unroll 8")
                for (int i = 0; i < NI; i++) {
                    if (z >> i & 1) {
                        const __m256i p = _mm256_set1_epi32(pp[i]);
                        lo[i] = att_dp(lo[i], p, vl);
                        hi[i] = att_dp(hi[i], p, vh);
                    }
                }
            }
        }
        _Pragma("GCC unroll 8")
        for (int i = 0; i < NI; i++) {
            const __m256 a = _mm256_permute2f128_ps(lo[i], hi[i], 0x20), b = _mm256_permute2f128_ps(lo[i], hi[i], 0x31);
            if (dn == 16) {
                _mm256_storeu_ps(o[i] + d0, a);
                _mm256_storeu_ps(o[i] + d0 + 8, b);
            } else {
                float t[16] __attribute__((aligned(32)));
                _mm256_store_ps(t, a);
                _mm256_store_ps(t + 8, b);
                memcpy(o[i] + d0, t, sizeof(float) * (size_t)dn);
            }
        }
    }
}

// Pair `lane`'s slots in [l0, hi) that its mask m shows, taken two at a time in order (a last odd one with zeros),
// added to o (which holds the sums of the slots before l0, all of which the pair sees, l0 even): the slots a pair
// sees are paired by their rank among them, which is what att_values's pairing by slot index is when the pair sees
// every slot from 0. So a tree node that sees the prefix and its ancestors (a sibling's slot between them hidden)
// sums its values as the same token decoded in a chain does, where those slots lie one after another.
static void att_values_ranked(const uint16_t *pw, int lane, const uint8_t *m, const uint16_t *V, float *o, int D,
                              int l0, int hi) {
#define PW(l) pw[8 * (int64_t)((l) & ~1) + 2 * lane + ((l) & 1)]  // the pair's weight at slot l, bf16
    for (int d0 = 0; d0 < D; d0 += 16) {
        const int dn = D - d0 < 16 ? D - d0 : 16;
        float t[16] __attribute__((aligned(32))) = {0};
        memcpy(t, o + d0, sizeof(float) * (size_t)dn);
        const __m256 a = _mm256_load_ps(t), b = _mm256_load_ps(t + 8);
        __m256 lo = _mm256_permute2f128_ps(a, b, 0x20), hi8 = _mm256_permute2f128_ps(a, b, 0x31);
        for (int l = l0, first = -1; l <= hi; l++) {
            if (l < hi && !m[l]) continue;
            if (l < hi && first < 0) {
                first = l;
                continue;
            }
            if (first < 0) break;  // the end, nothing left over
            const int two = l < hi;  // else the last slot alone, its partner zeros
            const __m256i r0 = att_load16(V + (int64_t)first * D + d0, dn);
            const __m256i r1 = two ? att_load16(V + (int64_t)l * D + d0, dn) : _mm256_setzero_si256();
            const __m256i p = _mm256_set1_epi32((int)((uint32_t)PW(first) | (two ? (uint32_t)PW(l) << 16 : 0u)));
            lo = att_dp(lo, p, _mm256_unpacklo_epi16(r0, r1));
            hi8 = att_dp(hi8, p, _mm256_unpackhi_epi16(r0, r1));
            first = -1;
        }
        _mm256_store_ps(t, _mm256_permute2f128_ps(lo, hi8, 0x20));
        _mm256_store_ps(t + 8, _mm256_permute2f128_ps(lo, hi8, 0x31));
        memcpy(o + d0, t, sizeof(float) * (size_t)dn);
    }
#undef PW
}

#if ATT_UNIT > 4
#define ATT_CASES(CALL)                                                                                               \
    switch (NI) {                                                                                                      \
    case 1: CALL(1); break;                                                                                            \
    case 2: CALL(2); break;                                                                                            \
    case 3: CALL(3); break;                                                                                            \
    case 4: CALL(4); break;                                                                                            \
    case 5: CALL(5); break;                                                                                            \
    case 6: CALL(6); break;                                                                                            \
    case 7: CALL(7); break;                                                                                            \
    default: CALL(8); break;                                                                                           \
    }
#else
#define ATT_CASES(CALL)                                                                                               \
    switch (NI) {                                                                                                      \
    case 1: CALL(1); break;                                                                                            \
    case 2: CALL(2); break;                                                                                            \
    case 3: CALL(3); break;                                                                                            \
    default: CALL(4); break;                                                                                           \
    }
#endif

// Units taken together on one kv head (a tile) while its slots go by in blocks: each block of K rows (ATT_KBLOCK,
// 64 KB at D 128) and of V rows (ATT_VBLOCK) is read from L3 or memory once for the tile's units and from L2 for
// the others. A unit alone had streamed its kv head's K and V once for its 8 pairs: a 2,048-query chunk of the 1.5B
// (1,536 units a kv head) read 2 x 2 MB 1,536 times a layer at 4k slots, and at 16k slots (16 MB a kv head, past
// L3 for the two) from memory (at bf16, half those bytes). But a tile's buffers (52 bytes a slot a unit) leave L2 for L3: at 4k slots, where the
// two kv heads' K and V (8 MB) stay in L3, tiles of 4 were 0.98x as fast as units alone, at 16k 1.15x (S 2048, 2-core
// Zen 4 under other jobs, experiments/attention_long.py --define ATT_TILE=1), so units tile only past ATT_TILE_FROM
// slots.
#ifndef ATT_TILE
#define ATT_TILE 4
#endif
#ifndef ATT_TILE_FROM
#define ATT_TILE_FROM 8192
#endif
#define ATT_KBLOCK 128
// One pair's exponentials e[8 l] over slots [0, hi), in 8 partial sums by rank among the slots it sees (m[l] != 0:
// the k-th in sum k % 8), those added as hsum256 adds its lanes: the sum the unmasked path makes by slot index l % 8
// when the seen slots are [0, hi) (an unseen slot's exponential is an exact 0, so skipping it changes no sum).
static float att_rank_sum(const float *e, const uint8_t *m, int hi) {
    float p[8] = {0};
    for (int l = 0, k = 0; l < hi; l++)
        if (m[l]) p[k++ & 7] += e[8 * (int64_t)l];
    return ((p[0] + p[4]) + (p[1] + p[5])) + ((p[2] + p[6]) + (p[3] + p[7]));
}

typedef struct {
    const uint16_t *qv[ATT_UNIT];  // the pairs' queries in bf16 (qb)
    float *ov[ATT_UNIT];
    const uint8_t *m[ATT_UNIT];
    int32_t own[8];
    __m256 mx;
    float *sc;  // a slot's 8 lanes: the unit's scores, then exponentials
    uint8_t *nz;  // a byte a slot: which pairs' weights are not 0
    uint16_t *pw;  // the weights in bf16, by slot pair: pair i's two at 16 m + 2 i (slot 2 m), 16 m + 2 i + 1
    uint16_t *qb;  // the pairs' queries in bf16, Dp (D rounded up to 16) columns each, zero-padded
    int NI, hi;   // slots [0, hi) hold every slot a pair of the unit sees: past it nothing is computed or read
    int sh;       // values pair slots (2m, 2m + 1) for all pairs in [0, sh), each pair by its own rank past it
} att_unit_t;

static void attention_share(void *ctx, int share) {
    attn_job_t *j = (attn_job_t *)ctx;
    const int S = j->S, Hq = j->Hq, Hkv = j->Hkv, group = j->group, D = j->D, L = j->L, kv_len = j->kv_len;
    const int u0 = (int)((int64_t)j->units * share / j->parts), u1 = (int)((int64_t)j->units * (share + 1) / j->parts);
    const int per_unit = (j->per_kv + j->unit - 1) / j->unit;  // units of one (batch row, kv head)
    const int tile = kv_len > ATT_TILE_FROM ? ATT_TILE : 1, masked = j->mask != NULL;
    // Slots a unit's buffer holds: 13 floats a slot (scores 8, nz 1, pw 4) and 4 Dp for qb, each unit's part
    // 32-byte aligned.
    const int cap = kv_len <= 1024 ? 1024 : (kv_len + 7) & ~7, Dp = (D + 15) & ~15;
    const int64_t per = 13 * (int64_t)cap + 4 * (int64_t)Dp;
    float stack[13 * 1024 + 4 * 256] __attribute__((aligned(32)));
    int o_sc = 0;  // past 1,024 slots (or D past 256): the thread's own scratch, kept between calls
    float *buf = tile == 1 && cap == 1024 && Dp <= 256
                     ? stack
                     : (float *)scratch(SC_ATT, sizeof(float) * (size_t)per * tile, &o_sc);
    if (!buf) {
        if (u1 > u0) atomic_store(&j->failed, 1);
        return;
    }
    const unsigned int csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040);  // FTZ | DAZ: what vdpbf16ps does whatever MXCSR says, for every operation here
    const __m256 zero = _mm256_setzero_ps(), ninf = _mm256_set1_ps(-INFINITY);
    att_unit_t units[ATT_TILE];
    for (int u = u0; u < u1;) {
        const int bg = u / per_unit, b = bg / Hkv, g = bg % Hkv;
        int n = (bg + 1) * per_unit - u;  // the tile: units u .. u + n - 1, all on kv head g of row b
        n = n < u1 - u ? n : u1 - u;
        n = n < tile ? n : tile;
        const uint16_t *K = j->kc + ((int64_t)b * Hkv + g) * L * D, *V = j->vc + ((int64_t)b * Hkv + g) * L * D;
        int top = 0;
        for (int k = 0; k < n; k++) {
            att_unit_t *un = &units[k];
            const int first = (u + k) % per_unit * j->unit;
            const int NI = j->per_kv - first < j->unit ? j->per_kv - first : j->unit;
            un->NI = NI;
            un->hi = 0;
            un->mx = ninf;
            un->sc = buf + (int64_t)k * per;
            un->nz = (uint8_t *)(un->sc + 8 * (int64_t)cap);
            un->pw = (uint16_t *)(un->sc + 9 * (int64_t)cap);
            un->qb = (uint16_t *)(un->sc + 13 * (int64_t)cap);
            for (int i = 0; i < 8; i++) un->own[i] = -1;
            for (int i = 0; i < NI; i++) {  // pair first + i of this kv head: query s, head g * group + hh
                const int s = (first + i) / group, hh = (first + i) % group, t = b * S + s;
                const int64_t it = (int64_t)t * Hq + g * group + hh;
                uint16_t *qb = un->qb + (int64_t)i * Dp;
                bf16_row(j->q + it * D, qb, D);
                for (int c = D; c < Dp; c++) qb[c] = 0;
                un->qv[i] = qb;
                un->ov[i] = j->out + it * D;
                int h;
                if (masked) {
                    un->m[i] = j->mask + (int64_t)t * kv_len;
                    for (h = kv_len; h > 0 && !un->m[i][h - 1]; h--) {}
                } else {
                    const int64_t at = j->slots[t];
                    un->m[i] = NULL;
                    un->own[i] = at < 0 ? -1 : at < kv_len ? (int)at : kv_len;
                    h = at < 0 ? 0 : at < kv_len ? (int)at + 1 : kv_len;
                }
                un->hi = h > un->hi ? h : un->hi;
            }
            top = un->hi > top ? un->hi : top;
        }
        for (int l0 = 0; l0 < top; l0 += ATT_KBLOCK) {
            for (int k = 0; k < n; k++) {
                att_unit_t *un = &units[k];
                if (l0 >= un->hi) continue;
                const int l1 = un->hi - l0 < ATT_KBLOCK ? un->hi : l0 + ATT_KBLOCK, NI = un->NI;
                const __m256i own = _mm256_loadu_si256((const __m256i *)un->own);
#define SCORES(c) att_scores(un->qv, K, un->m, masked, own, un->sc, &un->mx, D, l0, l1, un->hi, j->scale, c)
                ATT_CASES(SCORES)
#undef SCORES
            }
        }
        for (int k = 0; k < n; k++) {
            // softmax weights of each lane: exponentials (0 where the lane saw nothing), summed in 8 partial sums by
            // slot index l % 8 and those added as hsum256 adds its lanes (under a mask by rank instead: the slot-index
            // sums are dropped for att_rank_sum's); the slots past hi would each have added an exact 0
            att_unit_t *un = &units[k];
            const int hi = un->hi;
            const __m256 mx = un->mx, none = _mm256_cmp_ps(mx, ninf, _CMP_EQ_OQ);
            __m256 part[8];
            _Pragma("GCC unroll 8")
            for (int r = 0; r < 8; r++) part[r] = zero;
            int l = 0;
            for (; l + 8 <= hi; l += 8) {
                _Pragma("GCC unroll 8")
                for (int r = 0; r < 8; r++) {
                    float *e = un->sc + 8 * (int64_t)(l + r);
                    const __m256 x = _mm256_andnot_ps(none, exp_neg8(_mm256_sub_ps(_mm256_load_ps(e), mx)));
                    _mm256_store_ps(e, x);
                    part[r] = _mm256_add_ps(part[r], x);
                }
            }
            _Pragma("GCC unroll 8")
            for (int r = 0; r < 8; r++) {
                if (l + r < hi) {
                    float *e = un->sc + 8 * (int64_t)(l + r);
                    const __m256 x = _mm256_andnot_ps(none, exp_neg8(_mm256_sub_ps(_mm256_load_ps(e), mx)));
                    _mm256_store_ps(e, x);
                    part[r] = _mm256_add_ps(part[r], x);
                }
            }
            const __m256 t0 = _mm256_add_ps(_mm256_add_ps(part[0], part[4]), _mm256_add_ps(part[1], part[5]));
            const __m256 t1 = _mm256_add_ps(_mm256_add_ps(part[2], part[6]), _mm256_add_ps(part[3], part[7]));
            __m256 sum = _mm256_add_ps(t0, t1);
            if (masked) {
                float r8[8] __attribute__((aligned(32))) = {0};  // lanes NI..7 saw nothing: 0, as by slot index
                for (int i = 0; i < un->NI; i++) r8[i] = att_rank_sum(un->sc + i, un->m[i], hi);
                sum = _mm256_load_ps(r8);
            }
            const __m256 inv = _mm256_and_ps(_mm256_cmp_ps(sum, zero, _CMP_GT_OQ),
                                             _mm256_div_ps(_mm256_set1_ps(1.0f), sum));
            const int all = (1 << un->NI) - 1;
            const __m256i top16 = _mm256_set1_epi32((int)0xFFFF0000);
            for (l = 0; l < hi; l += 2) {  // the weights in bf16 by slot pair (an odd hi's partner 0), which are not 0
                const __m256 w0 = _mm256_mul_ps(_mm256_load_ps(un->sc + 8 * (int64_t)l), inv);
                const __m256 w1 = l + 1 < hi ? _mm256_mul_ps(_mm256_load_ps(un->sc + 8 * (int64_t)l + 8), inv) : zero;
                const __m256i b0 = bf16_round8(w0), b1 = bf16_round8(w1);
                un->nz[l] = (uint8_t)(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(
                                          b0, _mm256_setzero_si256()))) ^ 0xFF) & all;
                if (l + 1 < hi)
                    un->nz[l + 1] = (uint8_t)(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(
                                                  b1, _mm256_setzero_si256()))) ^ 0xFF) & all;
                _mm256_storeu_si256((__m256i *)(un->pw + 8 * (int64_t)l),
                                    _mm256_or_si256(_mm256_srli_epi32(b0, 16), _mm256_and_si256(b1, top16)));
            }
        }
        for (int k = 0; k < n; k++) {
            // Values pair slots by rank among those a pair sees (see att_values_ranked): without a mask and where
            // every pair of the unit sees every slot that is slot index, shared; past that each pair alone.
            att_unit_t *un = &units[k];
            int c = un->hi;
            for (int i = 0; masked && i < un->NI; i++)
                for (int l = 0; l < c; l++)
                    if (!un->m[i][l]) c = l;
            un->sh = masked ? c & ~1 : un->hi;
        }
        for (int l0 = 0; l0 == 0 || l0 < top; l0 += ATT_VBLOCK) {
            for (int k = 0; k < n; k++) {
                att_unit_t *un = &units[k];
                if (l0 && l0 >= un->sh) continue;  // (the first block also writes the zeros of a unit that saw nothing)
                const int l1 = un->sh - l0 < ATT_VBLOCK ? un->sh : l0 + ATT_VBLOCK, NI = un->NI;
#define VALUES(c) att_values(un->pw, un->nz, V, un->ov, D, l0, l1, un->sh, c)
                ATT_CASES(VALUES)
#undef VALUES
            }
        }
        for (int k = 0; k < n; k++)
            for (int i = 0; units[k].sh < units[k].hi && i < units[k].NI; i++)
                att_values_ranked(units[k].pw, i, units[k].m[i], V, units[k].ov[i], D, units[k].sh, units[k].hi);
        u += n;
    }
    _mm_setcsr(csr);
    if (buf != stack) scratch_done(buf, o_sc);
}

int attention(const float *q, const uint16_t *kc, const uint16_t *vc, const uint8_t *mask, const int64_t *slots, float *out,
              int B, int S, int Hq, int Hkv, int D, int L, int kv_len, float scale, int threads) {
    if (B < 0 || S < 0 || Hq < 1 || Hkv < 1 || Hq % Hkv || D < 1 || kv_len < 0 || kv_len > L) return SK_EARG;
    const int items = B * S * Hq, per_kv = S * (Hq / Hkv);
    if (items == 0) return SK_OK;
    // Units of (query, head) pairs on one kv head, as even as ATT_UNIT allows (ATT_UNIT 4: 7 pairs 4 + 3, 6: 3 + 3).
    const int n_units = (per_kv + ATT_UNIT - 1) / ATT_UNIT, unit = (per_kv + n_units - 1) / n_units;
    const int units = B * Hkv * ((per_kv + unit - 1) / unit);
    const int parts = units > 1 && (int64_t)items * kv_len >= 512 ? (threads < units ? threads : units) : 1;
    attn_job_t job = {q, kc, vc, mask, slots, out, S, Hq, Hkv, Hq / Hkv, D, L, kv_len, per_kv, unit, units, parts,
                      scale, 0};
    pool_run(attention_share, (void *)&job, parts);
    return atomic_load(&job.failed) ? SK_ENOMEM : SK_OK;
}

// A whole decoder layer in one call (what Block.fast ran as five calls from Python): the per-call Python and
// ctypes work was ~14% of the int4 draft's step. The same C functions run in the same order on the same
// inputs, so results are bit-identical to the five calls. x [B, S, H] is updated in place.
typedef struct {
    const void *w;
    const float *sc;
    int wt, gs, N, K;
} lin_t;
typedef struct {
    lin_t qkv, o, up, down;  // up: fused gate/up [2F, H]; down: [H, F]
    const float *bias, *attn_norm, *ffn_norm;
    float eps, scale;
    int hq, hkv, d;
} layer_t;

// Returns SK_OK, or the first failing call's status (SK_EARG: a plan whose shapes do not chain; the layer then stops
// there, x and the caches partly updated).
int decoder_layer(const layer_t *L, float *x, int B, int S, const int64_t *pos, const int64_t *slots,
                  const float *cos_t, const float *sin_t, uint16_t *kc, uint16_t *vc, int cache_len, const uint8_t *mask,
                  int kv_len, int threads) {
    const int T = B * S, H = L->qkv.K, qd = L->hq * L->d;
    if (L->qkv.N != (L->hq + 2 * L->hkv) * L->d || L->o.K != qd || L->o.N != H || L->up.K != H ||
        L->down.K * 2 != L->up.N || L->down.N != H)
        return SK_EARG;
    int o1 = 0, o2 = 0, o3 = 0, o4 = 0, rc = SK_ENOMEM;
    float *qkv = (float *)scratch(SC_QKV, sizeof(float) * (size_t)T * L->qkv.N, &o1);
    float *q = (float *)scratch(SC_Q, sizeof(float) * (size_t)T * qd, &o2);
    float *o = (float *)scratch(SC_O, sizeof(float) * (size_t)T * qd, &o3);
    float *h = (float *)scratch(SC_H, sizeof(float) * (size_t)T * L->up.N, &o4);
    if (qkv && q && o && h &&
        !(rc = fused_linear(x, L->attn_norm, L->eps, L->qkv.w, L->qkv.sc, qkv, T, H, L->qkv.N, threads, L->qkv.wt,
                            L->qkv.gs, 1, 0))) {
        rope_write(qkv, L->bias, pos, slots, cos_t, sin_t, q, kc, vc, B, S, L->hq, L->hkv, L->d, cache_len);
        if (!(rc = attention(q, kc, vc, mask, slots, o, B, S, L->hq, L->hkv, L->d, cache_len, kv_len, L->scale,
                             threads)) &&
            !(rc = fused_linear(o, NULL, 0.f, L->o.w, L->o.sc, x, T, L->o.K, L->o.N, threads, L->o.wt, L->o.gs, 0, 1)) &&
            !(rc = fused_linear(x, L->ffn_norm, L->eps, L->up.w, L->up.sc, h, T, H, L->up.N, threads, L->up.wt,
                                L->up.gs, 1, 0)))
            rc = fused_linear(h, NULL, 0.f, L->down.w, L->down.sc, x, T, L->down.K, L->down.N, threads, L->down.wt,
                              L->down.gs, 2, 1);
    }
    scratch_done(qkv, o1);
    scratch_done(q, o2);
    scratch_done(o, o3);
    scratch_done(h, o4);
    return rc;
}

// Every decoder layer of a step in one call: layer i reads its plan plans[i] and its K/V at kc / vc + i * layer_stride.
// The Python loop around 24 decoder_layer calls had cost the 0.5B draft about 1 ms a step (45 us a layer) once the
// step's weights had streamed by and evicted the interpreter's data (stage timers compiled into the layer, 100 steps).
int decoder_layers(const layer_t *const *plans, int n, float *x, int B, int S, const int64_t *pos,
                   const int64_t *slots, const float *cos_t, const float *sin_t, uint16_t *kc, uint16_t *vc,
                   int64_t layer_stride, int cache_len, const uint8_t *mask, int kv_len, int threads) {
    int rc = SK_OK;
    scratch_hold++;  // the layers' large buffers are taken once for the call (scratch_hold above)
    for (int i = 0; i < n && !rc; i++)
        rc = decoder_layer(plans[i], x, B, S, pos, slots, cos_t, sin_t, kc + i * layer_stride, vc + i * layer_stride,
                           cache_len, mask, kv_len, threads);
    scratch_hold--;
    scratch_trim();
    return rc;
}

// a * b + c as written: kernels.py's test that the build does not contract it into a fused multiply-add (compiled
// with -ffp-contract=off, so only the explicit fmaf and FMA intrinsics fuse, the same ones in both builds).
float skinny_contract_probe(float a, float b, float c) { return a * b + c; }
