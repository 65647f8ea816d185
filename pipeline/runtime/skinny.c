// Skinny matrix multiply for decoding on CPU: y[s, n] = sum_k x[s, k] * w[n, k], for few rows s.
//
// Decoding multiplies 1..32 token rows by weight matrices that are read from memory once per step.
// BLAS picks a packing GEMM as soon as there is more than one row, which on small CPUs costs twice
// a GEMV; here each weight row is read once and applied to every token row while it sits in L1,
// so verifying k+1 tokens costs about what decoding one does. Each output element is computed by
// the same instruction sequence whatever the number of rows, so results do not depend on how many
// tokens share a call (speculative verification sees bit-identical logits to plain decoding).
#include <stdint.h>
#include <string.h>
#include <immintrin.h>

static inline float hsum256(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    __m128 sh = _mm_movehdup_ps(lo);
    __m128 s = _mm_add_ps(lo, sh);
    sh = _mm_movehl_ps(sh, s);
    s = _mm_add_ss(s, sh);
    return _mm_cvtss_f32(s);
}

static inline __m256 load_w(const void *w, int64_t idx, int bf16) {
    if (!bf16) return _mm256_loadu_ps((const float *)w + idx);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + idx));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline float load_w1(const void *w, int64_t idx, int bf16) {
    if (!bf16) return ((const float *)w)[idx];
    uint32_t u = ((uint32_t)((const uint16_t *)w)[idx]) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

#define MAXR 8
#define MAXG 3

// R weight rows times G token rows, all in registers; R, G and bf16 are constants after inlining.
static inline __attribute__((always_inline)) void tile(const float *x, const void *w, float *y, int K, int N,
                                                       int n, int s0, const int R, const int G, const int bf16) {
    __m256 acc[MAXR][MAXG];
    for (int r = 0; r < R; r++)
        for (int i = 0; i < G; i++) acc[r][i] = _mm256_setzero_ps();
    int K8 = K & ~7;
    for (int k = 0; k < K8; k += 8) {
        __m256 wv[MAXR];
        for (int r = 0; r < R; r++) wv[r] = load_w(w, (int64_t)(n + r) * K + k, bf16);
        for (int i = 0; i < G; i++) {
            __m256 xv = _mm256_loadu_ps(x + (int64_t)(s0 + i) * K + k);
            for (int r = 0; r < R; r++) acc[r][i] = _mm256_fmadd_ps(wv[r], xv, acc[r][i]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int i = 0; i < G; i++) {
            float v = hsum256(acc[r][i]);
            for (int k = K8; k < K; k++) v += load_w1(w, (int64_t)(n + r) * K + k, bf16) * x[(int64_t)(s0 + i) * K + k];
            y[(int64_t)(s0 + i) * N + n + r] = v;
        }
}

#define TILE_G(R, BF)                                                         \
    switch (g) {                                                              \
    case 1: tile(x, w, y, K, N, n, s0, R, 1, BF); break;                      \
    case 2: tile(x, w, y, K, N, n, s0, R, 2, BF); break;                      \
    default: tile(x, w, y, K, N, n, s0, R, 3, BF); break;                     \
    }

static void rows(const float *x, const void *w, float *y, int S, int K, int N, int n0, int n1, int bf16) {
    for (int n = n0; n < n1;) {
        int R = n1 - n >= 4 ? (S == 1 && n1 - n >= 8 ? 8 : 4) : 1;
        for (int s0 = 0; s0 < S; s0 += MAXG) {
            int g = S - s0 < MAXG ? S - s0 : MAXG;
            if (R == 8) {
                if (bf16) { tile(x, w, y, K, N, n, s0, 8, 1, 1); } else { tile(x, w, y, K, N, n, s0, 8, 1, 0); }
            } else if (R == 4) {
                if (bf16) { TILE_G(4, 1) } else { TILE_G(4, 0) }
            } else {
                if (bf16) { TILE_G(1, 1) } else { TILE_G(1, 0) }
            }
        }
        n += R;
    }
}

// x: [S, K] fp32, w: [N, K] fp32 (bf16 = 0) or bf16 bits (bf16 = 1), y: [S, N] fp32.
void skinny_matmul(const float *x, const void *w, float *y, int S, int K, int N, int threads, int bf16) {
    if (threads < 1) threads = 1;
    int chunk = (N + threads - 1) / threads;
    chunk = (chunk + 7) & ~7;
#pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int t = 0; t < threads; t++) {
        int n0 = t * chunk, n1 = n0 + chunk < N ? n0 + chunk : N;
        if (n0 < n1) rows(x, w, y, S, K, N, n0, n1, bf16);
    }
}
