// Skinny matrix multiply for decoding on CPU: y[s, n] = sum_k x[s, k] * w[n, k], for few rows s.
//
// Decoding multiplies a few token rows by weight matrices that are read from memory once per step.
// BLAS picks a packing GEMM as soon as there is more than one row, which on small CPUs costs twice
// a GEMV; here each weight row is read once and applied to every token row while it sits in L1,
// so verifying k+1 tokens costs about what decoding one does.
//
// Weights are fp32, bf16, int8 (per output row scale) or int4 (scale per group of input columns, two
// nibbles per byte), decoded to fp32 in registers. Each output element is computed by one fixed
// instruction sequence whatever the number of rows in the call, the tile it falls in or the thread
// count: 16 fp32 lanes accumulate k = l, l + 16, ... (lane l) by fused multiply-add, the lanes are
// summed by a fixed tree, the K % 16 tail is added by scalar fmaf, and an int8 row is scaled last
// (int4: each lane sums (u - 8) x over a group, then adds scale * that partial sum).
// So speculative verification, trees, batches and prefill see bit-identical logits to plain decoding.
// This file is compiled twice: with AVX-512 (one zmm per 16 lanes) and with AVX2 (two ymm); both
// implement the same sequence, so the two builds agree bit for bit as well.
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <immintrin.h>

enum { WT_F32 = 0, WT_BF16 = 1, WT_I8 = 2, WT_I4 = 3 };

static inline float hsum256(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    __m128 sh = _mm_movehdup_ps(lo);
    __m128 s = _mm_add_ps(lo, sh);
    sh = _mm_movehl_ps(sh, s);
    s = _mm_add_ss(s, sh);
    return _mm_cvtss_f32(s);
}

#if defined(__AVX512F__)
#define ISA_NAME "avx512"
typedef __m512 v16;
static inline v16 v_zero(void) { return _mm512_setzero_ps(); }
static inline v16 v_set1(float f) { return _mm512_set1_ps(f); }
static inline v16 v_fma(v16 a, v16 b, v16 c) { return _mm512_fmadd_ps(a, b, c); }
static inline v16 v_loadf(const float *p) { return _mm512_loadu_ps(p); }
static inline v16 v_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline v16 v_i8(const int8_t *p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p))); }
// One 32-column int4 block (16 bytes, layout in skinny_matmul's comment) -> u - 8 for columns k..k+15
// (lo) and k+16..k+31 (hi), exact small integers in fp32. The block is broadcast to the four 128-bit
// lanes, each lane shifts its own nibbles down (vpsrlvd, no cross-lane shuffle) and vpermps looks the
// low 4 bits up in the table u - 8: this keeps the conversion off the FP pipes, which the FMAs fill
// (converting with cvtdq2ps or a 2^23 bias made one-token int4 steps no faster than int8 on this CPU).
static inline void v_u4(const uint8_t *p, v16 *lo, v16 *hi) {
    const __m512i b = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)p));
    const __m512i sh = _mm512_setr_epi32(0, 0, 0, 0, 8, 8, 8, 8, 16, 16, 16, 16, 24, 24, 24, 24);
    const __m512 tab = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    __m512i l = _mm512_srlv_epi32(b, sh);
    *lo = _mm512_permutexvar_ps(l, tab);  // only the low 4 bits of each index are used
    *hi = _mm512_permutexvar_ps(_mm512_srli_epi32(l, 4), tab);
}
static inline float v_hsum(v16 a) {
    __m256 lo = _mm512_castps512_ps256(a);
    __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
    return hsum256(_mm256_add_ps(lo, hi));
}
// Weight rows per tile for a token group of g rows (32 zmm registers: accumulators R*g, decoded weights;
// int4 also holds a group's partial sums, R*g more).
static const int R_FOR_G[7] = {0, 8, 6, 4, 4, 3, 3};
static const int R4_FOR_G[7] = {0, 6, 4, 3, 2, 2, 2};
// Every (R, g) that rows() asks for: R_FOR_G[g] or R4_FOR_G[g] with groups of g and g - 1 rows, and R = 1.
#define TILE_CASES(T) T(8, 1) T(6, 2) T(6, 1) T(4, 3) T(4, 2) T(4, 4) T(3, 5) T(3, 4) T(3, 6) \
                      T(4, 1) T(3, 3) T(3, 2) T(2, 4) T(2, 3) T(2, 5) T(2, 6) \
                      T(1, 1) T(1, 2) T(1, 3) T(1, 4) T(1, 5) T(1, 6)
#else
#define ISA_NAME "avx2"
typedef struct { __m256 a, b; } v16;
static inline v16 v_zero(void) { v16 r = {_mm256_setzero_ps(), _mm256_setzero_ps()}; return r; }
static inline v16 v_set1(float f) { v16 r = {_mm256_set1_ps(f), _mm256_set1_ps(f)}; return r; }
static inline v16 v_fma(v16 a, v16 b, v16 c) {
    v16 r = {_mm256_fmadd_ps(a.a, b.a, c.a), _mm256_fmadd_ps(a.b, b.b, c.b)};
    return r;
}
static inline v16 v_loadf(const float *p) { v16 r = {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; return r; }
static inline __m256 bf8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline v16 v_bf16(const uint16_t *p) { v16 r = {bf8(p), bf8(p + 8)}; return r; }
static inline __m256 i8x8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline v16 v_i8(const int8_t *p) { v16 r = {i8x8(p), i8x8(p + 8)}; return r; }
// As the AVX-512 v_u4, with the block broadcast to both 128-bit halves of two ymm registers.
static inline __m256 u4_8(__m256i v, __m256i m15, __m256i magic, __m256 off) {
    return _mm256_sub_ps(_mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(v, m15), magic)), off);
}
static inline void v_u4(const uint8_t *p, v16 *lo, v16 *hi) {
    const __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p));
    const __m256i m15 = _mm256_set1_epi32(15), magic = _mm256_set1_epi32(0x4B000000);
    const __m256 off = _mm256_set1_ps(8388616.0f);
    __m256i la = _mm256_srlv_epi32(b, _mm256_setr_epi32(0, 0, 0, 0, 8, 8, 8, 8));
    __m256i lb = _mm256_srlv_epi32(b, _mm256_setr_epi32(16, 16, 16, 16, 24, 24, 24, 24));
    lo->a = u4_8(la, m15, magic, off), lo->b = u4_8(lb, m15, magic, off);
    hi->a = u4_8(_mm256_srli_epi32(la, 4), m15, magic, off), hi->b = u4_8(_mm256_srli_epi32(lb, 4), m15, magic, off);
}
static inline float v_hsum(v16 a) { return hsum256(_mm256_add_ps(a.a, a.b)); }
// 16 ymm registers, two per 16-lane accumulator.
static const int R_FOR_G[7] = {0, 3, 2, 1, 1, 1, 1};
static const int R4_FOR_G[7] = {0, 1, 1, 1, 1, 1, 1};
#define TILE_CASES(T) T(3, 1) T(2, 2) T(2, 1) T(1, 1) T(1, 2) T(1, 3) T(1, 4) T(1, 5) T(1, 6)
#endif

const char *skinny_isa(void) { return ISA_NAME; }

// The next tile is prefetched into L2, not L1: with T0 the 8 rows in flight plus x overflowed the 32 KB
// L1 and a one-token bf16 / int8 step ran at 13 / 10 GB/s on one core instead of 20 / 19 (measured).
#define PF_HINT _MM_HINT_T1
#define MAXR 8
#define MAXG 6

static inline int64_t row_bytes(int K, int wt) {
    return wt == WT_F32 ? 4 * (int64_t)K : wt == WT_BF16 ? 2 * (int64_t)K : wt == WT_I8 ? (int64_t)K : (int64_t)K / 2;
}

// One weight element, for the K % 16 tail (never reached for int4, whose K is a multiple of 32).
static inline float w1(const void *w, int64_t row, int64_t k, int K, int wt) {
    if (wt == WT_F32) return ((const float *)w)[row * K + k];
    if (wt == WT_BF16) {
        uint32_t u = ((uint32_t)((const uint16_t *)w)[row * K + k]) << 16;
        float f;
        memcpy(&f, &u, 4);
        return f;
    }
    return (float)((const int8_t *)w)[row * K + k];
}

// R weight rows times G token rows, all in registers; R, G and wt are constants after inlining. While
// it runs, the next R rows are prefetched (into L2): without that, the hardware prefetcher leaves DRAM idle
// during the FMAs, and verifying 4 tokens cost 1.6x decoding one instead of ~1.0x.
static inline __attribute__((always_inline)) void tile(const float *x, const void *w, const float *sc, float *y,
                                                       int K, int N, int gs, int n, int s0, const int R, const int G,
                                                       const int wt) {
    v16 acc[MAXR][MAXG];
    const int64_t rb = row_bytes(K, wt);
    const char *wb = (const char *)w;
    const char *next = wb + (int64_t)(n + R) * rb;
    for (int r = 0; r < R; r++)
        for (int i = 0; i < G; i++) acc[r][i] = v_zero();
    if (wt == WT_I4) {
        // y = sum over groups of s_g * (sum over the group of (u - 8) x): the group's partial sums stay in
        // registers and are scaled once per group, not once per weight.
        const int ng = K / gs;
        for (int g0 = 0; g0 < K; g0 += gs) {
            v16 part[MAXR][MAXG];
            for (int r = 0; r < R; r++)
                for (int i = 0; i < G; i++) part[r][i] = v_zero();
            for (int k = g0; k < g0 + gs; k += 32) {
                for (int off = 0; off < R * 16; off += 64) _mm_prefetch(next + (int64_t)k / 2 * R + off, PF_HINT);
                v16 lo[MAXR], hi[MAXR];
                for (int r = 0; r < R; r++) v_u4((const uint8_t *)(wb + (int64_t)(n + r) * rb + k / 2), &lo[r], &hi[r]);
                for (int i = 0; i < G; i++) {
                    const float *xr = x + (int64_t)(s0 + i) * K + k;
                    v16 x0 = v_loadf(xr), x1 = v_loadf(xr + 16);
                    for (int r = 0; r < R; r++) part[r][i] = v_fma(lo[r], x0, part[r][i]);
                    for (int r = 0; r < R; r++) part[r][i] = v_fma(hi[r], x1, part[r][i]);
                }
            }
            for (int r = 0; r < R; r++) {
                v16 vs = v_set1(sc[(int64_t)(n + r) * ng + g0 / gs]);
                for (int i = 0; i < G; i++) acc[r][i] = v_fma(vs, part[r][i], acc[r][i]);
            }
        }
    } else {
        const int esize = wt == WT_F32 ? 4 : wt == WT_BF16 ? 2 : 1;
        int K16 = K & ~15;
        for (int k = 0; k < K16; k += 16) {
            for (int off = 0; off < R * 16 * esize; off += 64)
                _mm_prefetch(next + (int64_t)k * R * esize + off, PF_HINT);
            v16 wv[MAXR];
            for (int r = 0; r < R; r++) {
                const char *p = wb + (int64_t)(n + r) * rb + (int64_t)k * esize;
                wv[r] = wt == WT_F32 ? v_loadf((const float *)p) : wt == WT_BF16 ? v_bf16((const uint16_t *)p)
                                                                                : v_i8((const int8_t *)p);
            }
            for (int i = 0; i < G; i++) {
                v16 xv = v_loadf(x + (int64_t)(s0 + i) * K + k);
                for (int r = 0; r < R; r++) acc[r][i] = v_fma(wv[r], xv, acc[r][i]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int i = 0; i < G; i++) {
            float v = v_hsum(acc[r][i]);
            if (wt != WT_I4)
                for (int k = K & ~15; k < K; k++) v = fmaf(w1(w, n + r, k, K, wt), x[(int64_t)(s0 + i) * K + k], v);
            if (wt == WT_I8) v *= sc[n + r];
            y[(int64_t)(s0 + i) * N + n + r] = v;
        }
}

#define T1(R, G, WT) case (R) * 16 + (G): tile(x, w, sc, y, K, N, gs, n, s0, R, G, WT); break;
#define TILE_FN(NAME, WT)                                                                                        \
    static void NAME(const float *x, const void *w, const float *sc, float *y, int K, int N, int gs, int n,       \
                     int s0, int R, int G) {                                                                     \
        switch (R * 16 + G) {                                                                                    \
            TILE_CASES(T_##WT)                                                                                   \
            default: /* not reached; one row at a time is the same arithmetic */                                 \
                for (int r = 0; r < R; r++) NAME(x, w, sc, y, K, N, gs, n + r, s0, 1, G);                        \
        }                                                                                                        \
    }
#define T_F32(R, G) T1(R, G, WT_F32)
#define T_BF16(R, G) T1(R, G, WT_BF16)
#define T_I8(R, G) T1(R, G, WT_I8)
#define T_I4(R, G) T1(R, G, WT_I4)
TILE_FN(tile_f32, F32)
TILE_FN(tile_bf16, BF16)
TILE_FN(tile_i8, I8)
TILE_FN(tile_i4, I4)

typedef void (*tile_fn)(const float *, const void *, const float *, float *, int, int, int, int, int, int, int);

static void rows(const float *x, const void *w, const float *sc, float *y, int S, int K, int N, int gs, int n0,
                 int n1, int wt) {
    tile_fn f = wt == WT_F32 ? tile_f32 : wt == WT_BF16 ? tile_bf16 : wt == WT_I8 ? tile_i8 : tile_i4;
    int groups = (S + MAXG - 1) / MAXG, base = S / groups, extra = S % groups;
    int R = (wt == WT_I4 ? R4_FOR_G : R_FOR_G)[base + (extra > 0)];
    for (int n = n0; n < n1;) {
        int r = n1 - n >= R ? R : 1;
        for (int i = 0, s0 = 0; i < groups; i++) {
            int g = base + (i < extra);
            f(x, w, sc, y, K, N, gs, n, s0, r, g);
            s0 += g;
        }
        n += r;
    }
}

// Token rows per pass over the weights: a pass keeps its rows of x in L2 while every weight row streams
// by once, so a 512-token prefill reads the weights 512 / ROW_CHUNK times (it is compute-bound anyway).
#define ROW_CHUNK 48

// x: [S, K] fp32; w: [N, K] as wt (int4: [N, K / 2] bytes of u = q + 8; in each 32-column block, byte
// 4p + m holds column 4m + p in its low nibble and column 16 + 4m + p in its high nibble); sc: int8 [N]
// or int4 [N, K / gs] fp32 scales (NULL otherwise); y: [S, N] fp32. Any S.
void skinny_matmul(const float *x, const void *w, const float *sc, float *y, int S, int K, int N, int threads,
                   int wt, int gs) {
    if (threads < 1) threads = 1;
    int chunk = (N + threads - 1) / threads;
    chunk = (chunk + 23) / 24 * 24;
    for (int c0 = 0; c0 < S; c0 += ROW_CHUNK) {
        int cs = S - c0 < ROW_CHUNK ? S - c0 : ROW_CHUNK;
        const float *xc = x + (int64_t)c0 * K;
        float *yc = y + (int64_t)c0 * N;
#pragma omp parallel for num_threads(threads) schedule(static, 1)
        for (int t = 0; t < threads; t++) {
            int n0 = t * chunk, n1 = n0 + chunk < N ? n0 + chunk : N;
            if (n0 < n1) rows(xc, w, sc, yc, cs, K, N, gs, n0, n1, wt);
        }
    }
}

// The rest of a decoder layer for few-token steps, so a layer is five C calls instead of ~40 torch ops.

#include <stdlib.h>

// y[S, N] (+)= pre(x)[S, K] @ w[N, K].T, where pre is identity (mode 0), RMSNorm with weight g (mode 1,
// x is [S, K]) or SwiGLU silu(x[:, :K]) * x[:, K:] (mode 2, x is [S, 2K]).
void fused_linear(const float *x, const float *g, float eps, const void *w, const float *sc, float *y, int S, int K,
                  int N, int threads, int wt, int gs, int mode, int accumulate) {
    const float *in = x;
    float *buf = NULL;
    if (mode != 0) {
        buf = (float *)malloc(sizeof(float) * (size_t)S * K);
        for (int s = 0; s < S; s++) {
            float *o = buf + (int64_t)s * K;
            if (mode == 1) {
                const float *r = x + (int64_t)s * K;
                float ss = 0.f;
                for (int k = 0; k < K; k++) ss = fmaf(r[k], r[k], ss);
                float inv = 1.0f / sqrtf(ss / K + eps);
                for (int k = 0; k < K; k++) o[k] = (r[k] * inv) * g[k];
            } else {
                const float *a = x + (int64_t)s * 2 * K, *b = a + K;
                for (int k = 0; k < K; k++) o[k] = a[k] / (1.0f + expf(-a[k])) * b[k];
            }
        }
        in = buf;
    }
    if (!accumulate) {
        skinny_matmul(in, w, sc, y, S, K, N, threads, wt, gs);
    } else {
        float *tmp = (float *)malloc(sizeof(float) * (size_t)S * N);
        skinny_matmul(in, w, sc, tmp, S, K, N, threads, wt, gs);
        for (int64_t i = 0; i < (int64_t)S * N; i++) y[i] += tmp[i];
        free(tmp);
    }
    free(buf);
}

// qkv [B, S, Hq + 2 Hkv, D]: add the q/k/v bias [(Hq + 2 Hkv) D] when given (Qwen2), rotate q and k
// (half-rotation RoPE, cos/sin tables [*, D] indexed by pos), write q to q_out [B, S, Hq, D] and k, v to
// the caches [B, Hkv, L, D] at each token's slot.
void rope_write(const float *qkv, const float *bias, const int64_t *pos, const int64_t *slots, const float *cos_t,
                const float *sin_t, float *q_out, float *kc, float *vc, int B, int S, int Hq, int Hkv, int D, int L) {
    int H = Hq + 2 * Hkv, half = D / 2;
    for (int b = 0; b < B; b++)
        for (int s = 0; s < S; s++) {
            int64_t t = (int64_t)b * S + s;
            const float *c = cos_t + pos[t] * D, *sn = sin_t + pos[t] * D;
            const float *row = qkv + t * H * D;
            for (int h = 0; h < Hq + Hkv; h++) {
                const float *x = row + (int64_t)h * D;
                const float *bh = bias ? bias + (int64_t)h * D : NULL;
                float *o = h < Hq ? q_out + (t * Hq + h) * D
                                  : kc + (((int64_t)b * Hkv + (h - Hq)) * L + slots[t]) * D;
                for (int i = 0; i < half; i++) {
                    float x1 = x[i], x2 = x[i + half];
                    if (bh) { x1 += bh[i]; x2 += bh[i + half]; }
                    o[i] = x1 * c[i] - x2 * sn[i];
                    o[i + half] = x2 * c[i + half] + x1 * sn[i + half];
                }
            }
            for (int h = 0; h < Hkv; h++) {
                const float *x = row + (int64_t)(Hq + Hkv + h) * D;
                float *o = vc + (((int64_t)b * Hkv + h) * L + slots[t]) * D;
                if (!bias) { memcpy(o, x, sizeof(float) * D); continue; }
                const float *bh = bias + (int64_t)(Hq + Hkv + h) * D;
                for (int i = 0; i < D; i++) o[i] = x[i] + bh[i];
            }
        }
}

// out[b, s, h] = softmax(q . K[:kv_len] * scale, masked) @ V, grouped-query (head h reads kv head h / (Hq/Hkv)).
// mask [B, S, kv_len] (nonzero = attend). One query's result never depends on the other queries.
void attention(const float *q, const float *kc, const float *vc, const uint8_t *mask, float *out, int B, int S,
               int Hq, int Hkv, int D, int L, int kv_len, float scale, int threads) {
    int group = Hq / Hkv;
    int items = B * S * Hq;
#pragma omp parallel for num_threads(threads) schedule(static) if (items * kv_len > 16384)
    for (int it = 0; it < items; it++) {
        int h = it % Hq, t = it / Hq, b = t / S;
        const float *qv = q + (int64_t)it * D;
        const float *K = kc + ((int64_t)b * Hkv + h / group) * L * D;
        const float *V = vc + ((int64_t)b * Hkv + h / group) * L * D;
        const uint8_t *m = mask + (int64_t)t * kv_len;
        float *o = out + (int64_t)it * D;
        float *sc = (float *)malloc(sizeof(float) * kv_len);
        float mx = -INFINITY;
        for (int l = 0; l < kv_len; l++) {
            if (!m[l]) { sc[l] = -INFINITY; continue; }
            const float *k = K + (int64_t)l * D;
            __m256 acc = _mm256_setzero_ps();
            int d = 0;
            for (; d + 8 <= D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qv + d), _mm256_loadu_ps(k + d), acc);
            float v = hsum256(acc);
            for (; d < D; d++) v += qv[d] * k[d];
            v *= scale;
            sc[l] = v;
            if (v > mx) mx = v;
        }
        float sum = 0.f;
        for (int l = 0; l < kv_len; l++) {
            float e = m[l] ? expf(sc[l] - mx) : 0.f;
            sc[l] = e;
            sum += e;
        }
        for (int d = 0; d < D; d++) o[d] = 0.f;
        float inv = sum > 0 ? 1.0f / sum : 0.f;
        for (int l = 0; l < kv_len; l++) {
            if (sc[l] == 0.f) continue;
            float p = sc[l] * inv;
            const float *v = V + (int64_t)l * D;
            int d = 0;
            __m256 pv = _mm256_set1_ps(p);
            for (; d + 8 <= D; d += 8)
                _mm256_storeu_ps(o + d, _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + d), _mm256_loadu_ps(o + d)));
            for (; d < D; d++) o[d] += p * v[d];
        }
        free(sc);
    }
}
