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
#define MAXG 6

// R weight rows times G token rows, all in registers; R, G and bf16 are constants after inlining. While
// it runs, the next R rows are prefetched: without that, the hardware prefetcher leaves DRAM idle
// during the FMAs, and verifying 4 tokens cost 1.6x decoding one instead of ~1.0x.
static inline __attribute__((always_inline)) void tile(const float *x, const void *w, float *y, int K, int N,
                                                       int n, int s0, const int R, const int G, const int bf16) {
    __m256 acc[MAXR][MAXG];
    const int esize = bf16 ? 2 : 4;
    const char *next = (const char *)w + (int64_t)(n + R) * K * esize;
    for (int r = 0; r < R; r++)
        for (int i = 0; i < G; i++) acc[r][i] = _mm256_setzero_ps();
    int K8 = K & ~7;
    for (int k = 0; k < K8; k += 8) {
        __m256 wv[MAXR];
        for (int off = 0; off < R * 8 * esize; off += 64) _mm_prefetch(next + (int64_t)k * R * esize + off, _MM_HINT_T0);
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

#define T(R, G) case (R) * 16 + (G): if (bf16) tile(x, w, y, K, N, n, s0, R, G, 1); else tile(x, w, y, K, N, n, s0, R, G, 0); break;
#define TG(R) T(R, 1) T(R, 2) T(R, 3) T(R, 4) T(R, 5) T(R, 6)

static void tile_any(const float *x, const void *w, float *y, int K, int N, int n, int s0, int R, int G, int bf16) {
    switch (R * 16 + G) {
        TG(1) TG(2) TG(3) TG(4) T(8, 1)
    }
}

// Weight rows per tile for a token group of size g: as many as fit in 16 ymm registers with the
// accumulators (measured on a 2-core EPYC: 8x1, 4x2, 3x3, 3x4, 2x5, 2x6).
static const int R_FOR_G[MAXG + 1] = {0, 8, 4, 3, 3, 2, 2};

static void rows(const float *x, const void *w, float *y, int S, int K, int N, int n0, int n1, int bf16) {
    int groups = (S + MAXG - 1) / MAXG, base = S / groups, extra = S % groups;
    int R = R_FOR_G[base + (extra > 0)];
    for (int n = n0; n < n1;) {
        int r = n1 - n >= R ? R : 1;
        for (int i = 0, s0 = 0; i < groups; i++) {
            int g = base + (i < extra);
            tile_any(x, w, y, K, N, n, s0, r, g, bf16);
            s0 += g;
        }
        n += r;
    }
}

// x: [S, K] fp32, w: [N, K] fp32 (bf16 = 0) or bf16 bits (bf16 = 1), y: [S, N] fp32.
void skinny_matmul(const float *x, const void *w, float *y, int S, int K, int N, int threads, int bf16) {
    if (threads < 1) threads = 1;
    int chunk = (N + threads - 1) / threads;
    chunk = (chunk + 23) / 24 * 24;
#pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int t = 0; t < threads; t++) {
        int n0 = t * chunk, n1 = n0 + chunk < N ? n0 + chunk : N;
        if (n0 < n1) rows(x, w, y, S, K, N, n0, n1, bf16);
    }
}

// The rest of a decoder layer for few-token steps, so a layer is five C calls instead of ~40 torch ops.

#include <math.h>
#include <stdlib.h>

// y[S, N] (+)= pre(x)[S, K] @ w[N, K].T, where pre is identity (mode 0), RMSNorm with weight g (mode 1,
// x is [S, K]) or SwiGLU silu(x[:, :K]) * x[:, K:] (mode 2, x is [S, 2K]).
void fused_linear(const float *x, const float *g, float eps, const void *w, float *y, int S, int K, int N,
                  int threads, int bf16, int mode, int accumulate) {
    const float *in = x;
    float *buf = NULL;
    if (mode != 0) {
        buf = (float *)malloc(sizeof(float) * (size_t)S * K);
        for (int s = 0; s < S; s++) {
            float *o = buf + (int64_t)s * K;
            if (mode == 1) {
                const float *r = x + (int64_t)s * K;
                float ss = 0.f;
                for (int k = 0; k < K; k++) ss += r[k] * r[k];
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
        skinny_matmul(in, w, y, S, K, N, threads, bf16);
    } else {
        float *tmp = (float *)malloc(sizeof(float) * (size_t)S * N);
        skinny_matmul(in, w, tmp, S, K, N, threads, bf16);
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
