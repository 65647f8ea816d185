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
//
// One translation unit, in this order: this file's layouts, tiles and helpers; pool.c (the thread pool);
// gguf_kernels.c (the GGUF's k-quants, which #includes gguf_blocks32.c); skinny_matmul and the layers' element-wise
// kernels; logits.c (argmax, the head screen, sampling, softmax); attention.c; decoder_layer. kernels.py compiles this
// file alone and digests every file it includes (`kernels.source_files`).
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

#include "pool.c"

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

#include "logits.c"

#include "attention.c"


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
