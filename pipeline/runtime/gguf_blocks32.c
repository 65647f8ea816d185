// Blocks of 32 (#included by gguf_kernels.c before gg_panels): the GGUF types whose blocks are 32 weights with one fp16
// scale d (and, for the _1 types, an fp16 min m): Q4_0, Q4_1, Q5_0, Q5_1, Q8_0. As for the k-quants, each tensor is
// repacked at build time (pipeline/runtime/gguf_weights.py, pack32), never requantized, into panels of 16 output rows,
// one record per block of 32 columns, each record:
//   q: Q4_0 / Q4_1 / Q5_0 / Q5_1: 4 lines of 64 bytes of nibbles, byte 4 l + j of line c holding row l's column
//        8c + j (low nibble) and 8c + 4 + j (high), as the k-quants' lines; Q5_0 / Q5_1 then one line of their fifth
//        bits, bit 2c / 2c + 1 of byte 4 l + j being those two columns'; Q8_0: 8 lines of 64 bytes, byte 4 l + j of
//        line c row l's column 4c + j as q + 128 (uint8);
//   D[16] fp32: d widened (exact); Q4_1 / Q5_1 then M[16] fp32: m widened.
// The weight is D (q - z) (z = 8 Q4_0, 16 Q5_0, 0 Q8_0: always exact in fp32, the GGUF's value) or D q + M for the _1
// types (gguf.quants rounds RN(D q + M); the kernel multiplies by the exact D q and M separately).
//
// Activations: each token row is quantized per 32 columns (llama.cpp's Q8_0 grain; these types' widths, 576 or 896 on
// the shipped models, are not multiples of 256): x8 = rint(x * RN(127 / max|x|)), dx_j = RN(max|x| / 127) (max below
// 1e-30: zeros, dx_j = 0; a NaN or infinity in the block: zeros, dx_j = NaN), xs_j = float(sum x8).
// Arithmetic per output element, in this order, IEEE fp32 with denormals (the contract both builds keep and the tests
// pin; gguf_weights.reference_matmul is it in torch), for each block j in column order, from y = 0:
//   i_j = sum (q - z) x8 (exact integer: |i_j| <= 32 * 128 * 127 < 2^24),
//   y = fma(float(i_j), RN(D_j dx_j), y),
//   Q4_1 / Q5_1: y = fma(RN(M_j dx_j), xs_j, y).
// The integer sums are exact and the float steps are single fp32 operations in a fixed order (-ffp-contract=off), so
// the builds agree bit for bit, whatever the grouping of token rows. No AMX path: these types take this code in every
// mode. The AVX2 build runs full panels through gg32_both (both 8-row halves in one pass, every line of a record
// prefetched): on a 2-core Zen 3, SmolLM2-135M's one-token step took 5.0 ms where the half-by-half passes, one line
// of six prefetched a record and the scalar activation quantizer had taken 6.9 (experiments/kernel_log.md,
// 2026-12-07 18:10).

static inline int gg_rec32(int type) {
    switch (type) {
    case GG_Q4_0: return 256 + 64;
    case GG_Q4_1: return 256 + 128;
    case GG_Q5_0: return 256 + 64 + 64;
    case GG_Q5_1: return 256 + 64 + 128;
    default: return 512 + 64;  // Q8_0
    }
}
static inline int gg_zero32(int type) { return type == GG_Q4_0 ? 8 : type == GG_Q5_0 ? 16 : 0; }
static inline int gg_min32(int type) { return type == GG_Q4_1 || type == GG_Q5_1; }
static inline int64_t gg_panel_bytes(int type, int K) {
    return gg_is32(type) ? (int64_t)(K / 32) * gg_rec32(type) : (int64_t)(K / 256) * gg_record(type);
}
// Where D (and M) start in a record.
static inline int gg_doff32(int type) {
    return type == GG_Q8_0 ? 512 : type == GG_Q5_0 || type == GG_Q5_1 ? 320 : 256;
}

// One row x [K] -> q [K], dx [K / 32], xs [K / 32] (the activation rule above), in AVX2 in both builds (the product
// x * RN(127 / max) and its conversion, round to nearest even, are single IEEE steps in any width, as gg_quant_row's).
static void gg_quant32_row(const float *x, int K, int8_t *q, float *dx, float *xs) {
    const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF)), fmax = _mm256_set1_ps(3.4028235e38f);
    for (int j = 0; j < K / 32; j++) {
        const float *xb = x + 32 * j;
        __m256 m = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
        for (int u = 0; u < 4; u++) {
            const __m256 a = _mm256_and_ps(_mm256_loadu_ps(xb + 8 * u), absm);
            m = _mm256_max_ps(m, a);
            bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, fmax, _CMP_NLE_UQ));  // NaN or infinity
        }
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
        const float mx = _mm_cvtss_f32(h);
        const int isbad = _mm256_movemask_ps(bad) != 0;
        if (isbad || mx < 1e-30f) {
            memset(q + 32 * j, 0, 32);
            dx[j] = isbad ? NAN : 0.f;
            xs[j] = 0.f;
            continue;
        }
        const __m256 inv = _mm256_set1_ps(127.0f / mx);
        __m256i sum = _mm256_setzero_si256();
        for (int u = 0; u < 4; u++) sum = _mm256_add_epi32(sum, gg_q8x8(xb + 8 * u, inv, q + 32 * j + 8 * u));
        __m128i t = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
        xs[j] = (float)_mm_cvtsi128_si32(t);  // |sum| <= 32 * 127: exact
        dx[j] = mx / 127.0f;
    }
}

// Row l's column k's integer q (as the GGUF holds it, Q8_0's as q + 128) in a record.
static inline int gg32_q(int type, const uint8_t *r, int l, int k) {
    if (type == GG_Q8_0) return r[64 * (k / 4) + 4 * l + k % 4];
    const int c = k / 8, hi = (k % 8) / 4, j = k % 4;
    int q = (r[64 * c + 4 * l + j] >> (4 * hi)) & 15;
    if (type == GG_Q5_0 || type == GG_Q5_1) q |= ((r[256 + 4 * l + j] >> (2 * c + hi)) & 1) << 4;
    return q;
}

#if defined(__AVX512F__)
static inline vi_t gg32_and10(vi_t a) { return _mm512_and_si512(a, _mm512_set1_epi8(0x10)); }
static inline vi_t gg32_sub(vi_t a, int z) { return _mm512_sub_epi32(a, _mm512_set1_epi32(z)); }
// Q8_0: u = q + 128 (0..255) by x8: vpdpbusd sums in int32 without saturating; the offset comes off after (Z8).
static inline vi_t gg32_dp8(vi_t acc, vi_t u, const int8_t *x4) { return vi_dp(acc, u, x4); }
#define GG32_Z8 128
#else
static inline vi_t gg32_and10(vi_t a) { return _mm256_and_si256(a, _mm256_set1_epi8(0x10)); }
static inline vi_t gg32_sub(vi_t a, int z) { return _mm256_sub_epi32(a, _mm256_set1_epi32(z)); }
// Q8_0 in AVX2: vpmaddubsw would saturate 255 * 127 * 2, so the signed q's magnitude times x8 with q's sign
// (|q| <= 128: pair sums <= 2 * 128 * 127 < 2^15, exact), no offset to take off.
static inline vi_t gg32_dp8(vi_t acc, vi_t u, const int8_t *x4) {
    const __m256i w = _mm256_xor_si256(u, _mm256_set1_epi8((char)0x80));
    const __m256i x = _mm256_broadcastd_epi32(_mm_loadu_si32((const void *)x4));
    const __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}
#define GG32_Z8 0
#endif

#if !defined(__AVX512F__)
// AVX2, a group of up to GG32_BOTH token rows from s0: one pass covers both 8-row halves of a full panel, so each
// record is read once, each broadcast activation feeds both halves, and the pair sums of 4- and 5-bit weights add in
// int16 as far as they stay exact (Q4: 8 of |pair| <= 2 * 15 * 127; Q5: 4 of 2 * 31 * 127; Q8_0: 1) before one
// vpmaddwd widens them. The integers are the same and so are the float steps, in the same order: the bits do not
// change. The first group's pass prefetches every line of a record (the half passes had prefetched one line of six
// and left the rest to the hardware, which on Zen 3 does not keep two cores fed: the k-quants' GG_SPREAD). 40 random
// Q4_1 layers of 3072 x 576 (53 MB), 2 threads, Zen 3, best of 7, three alternations: 1 token row 2.5-3.0 ms against
// 3.6-4.2 before; 3 rows 2.3-3.0 against 4.7-5.6; 8 rows (two groups of 4) 5.0-6.6 against 7.7-10.0.
#define GG32_BOTH 4
static inline __attribute__((always_inline)) void gg32_both(const gx_t *X, const uint8_t *panel, float *yp, int N,
                                                            int K, int left, int s0, const int G, const int type) {
    const int nb = K / 32, rec = gg_rec32(type), doff = gg_doff32(type), hasm = gg_min32(type);
    const int five = type == GG_Q5_0 || type == GG_Q5_1;
    const int z = type == GG_Q8_0 ? GG32_Z8 : gg_zero32(type);
    const __m256i ones = _mm256_set1_epi16(1);
    vf_t acc[2][GG32_BOTH];
    for (int h = 0; h < 2; h++)
        for (int i = 0; i < G; i++) acc[h][i] = vf_zero();
    for (int j = 0; j < nb; j++) {
        const uint8_t *r = panel + (int64_t)j * rec;
        if (s0 == 0)  // the first group's pass prefetches the record's lines
            for (int l = 0; l < rec; l += 64) _mm_prefetch((const char *)r + GG_PF + l, PF_HINT);
        __m256i is[2][GG32_BOTH];
        for (int h = 0; h < 2; h++)
            for (int i = 0; i < G; i++) is[h][i] = _mm256_setzero_si256();
        if (type == GG_Q8_0) {
            for (int c = 0; c < 8; c++)
                for (int h = 0; h < 2; h++) {
                    const vi_t u = gg_load(r + 64 * c + 32 * h);
                    for (int i = 0; i < G; i++)
                        is[h][i] = gg32_dp8(is[h][i], u, X->q32 + (int64_t)(s0 + i) * K + 32 * j + 4 * c);
                }
        } else {
            __m256i t[2][GG32_BOTH];
            const vi_t H0 = five ? gg_load(r + 256) : _mm256_setzero_si256();
            const vi_t H1 = five ? gg_load(r + 256 + 32) : _mm256_setzero_si256();
            for (int c = 0; c < 4; c++) {
                vi_t lo[2], hi[2];
                for (int h = 0; h < 2; h++) {
                    a8_nibbles(r + 64 * c + 32 * h, &lo[h], &hi[h]);
                    if (five) {  // fifth bits of columns 8c + j (bit 2c) and 8c + 4 + j (bit 2c + 1), as gg32_panels
                        const vi_t H = h ? H1 : H0;
                        const int sl = 4 - 2 * c;
                        lo[h] = gg_or(lo[h], gg32_and10(sl >= 0 ? gg_sl(H, sl) : gg_sr(H, -sl)));
                        hi[h] = gg_or(hi[h], gg32_and10(sl - 1 >= 0 ? gg_sl(H, sl - 1) : gg_sr(H, 1 - sl)));
                    }
                }
                for (int i = 0; i < G; i++) {
                    const int8_t *x8 = X->q32 + (int64_t)(s0 + i) * K + 32 * j + 8 * c;
                    const __m256i a = _mm256_broadcastd_epi32(_mm_loadu_si32((const void *)x8));
                    const __m256i b = _mm256_broadcastd_epi32(_mm_loadu_si32((const void *)(x8 + 4)));
                    for (int h = 0; h < 2; h++) {
                        const __m256i u = _mm256_add_epi16(_mm256_maddubs_epi16(lo[h], a),
                                                           _mm256_maddubs_epi16(hi[h], b));
                        t[h][i] = (five ? c % 2 : c) ? _mm256_add_epi16(t[h][i], u) : u;
                        __asm__("" : "+x"(t[h][i]));  // keep the int16 sums in order (see gg_pass_q4k)
                        if (c == 3 || (five && c == 1))
                            is[h][i] = _mm256_add_epi32(is[h][i], _mm256_madd_epi16(t[h][i], ones));
                    }
                }
            }
        }
        for (int h = 0; h < 2; h++) {
            const vf_t D = gg_loadf((const float *)(r + doff) + A8_LANES * h);
            const vf_t M = hasm ? gg_loadf((const float *)(r + doff + 64) + A8_LANES * h) : D;
            for (int i = 0; i < G; i++) {
                const int64_t row = (int64_t)(s0 + i);
                const float dx = X->dx32[row * nb + j], xs = X->xs32[row * nb + j];
                vi_t v = is[h][i];
                if (z) v = gg32_sub(v, z * (int)xs);
                acc[h][i] = vf_fma(vf_cvt(v), gg_mul(D, gg_set1(dx)), acc[h][i]);
                if (hasm) acc[h][i] = vf_fma(gg_mul(M, gg_set1(dx)), gg_set1(xs), acc[h][i]);
            }
        }
    }
    for (int h = 0; h < 2; h++)
        for (int i = 0; i < G; i++) vf_store(yp + (int64_t)(s0 + i) * N + A8_LANES * h, acc[h][i], left - A8_LANES * h);
}
#endif

// Panels [p0, p1) of a 32-block part, every token row of the chunk, up to GG_MAXG rows per pass over a panel, each
// half of A8_LANES rows (AVX2: two halves) on its own: a record's 8 vectors of weights (4 columns of each lane's row)
// are decoded once for the group, then each token row's integer sums i_j and float steps.
static void gg32_panels(const gx_t *X, const gg_part_t *pt, float *y, int S, int K, int N, int p0, int p1) {
    const int type = pt->type, nb = K / 32, rec = gg_rec32(type), doff = gg_doff32(type), hasm = gg_min32(type);
    const int five = type == GG_Q5_0 || type == GG_Q5_1;
    const int z = type == GG_Q8_0 ? GG32_Z8 : gg_zero32(type);
    const int64_t pbytes = gg_panel_bytes(type, K);
    for (int p = p0; p < p1; p++) {
        const uint8_t *panel = pt->w + p * pbytes;
        float *yp = y + pt->n0 + 16 * p;
#if !defined(__AVX512F__)
        if (pt->N - 16 * p > 8) {
            const int left = pt->N - 16 * p;
            for (int g = 0, s0; g < (S + GG32_BOTH - 1) / GG32_BOTH; g++) {
                const int G = gg_group(S, g, GG32_BOTH, &s0);
#define GG32_T(T) case T: switch (G) { \
        case 1: gg32_both(X, panel, yp, N, K, left, s0, 1, T); break; \
        case 2: gg32_both(X, panel, yp, N, K, left, s0, 2, T); break; \
        case 3: gg32_both(X, panel, yp, N, K, left, s0, 3, T); break; \
        default: gg32_both(X, panel, yp, N, K, left, s0, 4, T); break; } break;
                switch (type) { GG32_T(GG_Q4_0) GG32_T(GG_Q4_1) GG32_T(GG_Q5_0) GG32_T(GG_Q5_1) GG32_T(GG_Q8_0) }
#undef GG32_T
            }
            continue;
        }
#endif
        for (int h = 0; h < 16 / A8_LANES; h++) {
            const int left = pt->N - 16 * p - A8_LANES * h;
            if (left <= 0) break;
            const int hb = 4 * A8_LANES * h;  // this half's bytes in a 64-byte line
            for (int s0 = 0; s0 < S; s0 += GG_MAXG) {
                const int G = S - s0 < GG_MAXG ? S - s0 : GG_MAXG;
                vf_t acc[GG_MAXG];
                for (int i = 0; i < G; i++) acc[i] = vf_zero();
                for (int j = 0; j < nb; j++) {
                    const uint8_t *r = panel + (int64_t)j * rec;
#if defined(__AVX512F__)
                    __builtin_prefetch(r + GG_PF, 0, 2);  // one line a record (not measured otherwise on AVX-512)
#else
                    if (h == 0 && s0 == 0)  // every line of the record, as gg32_both
                        for (int l = 0; l < rec; l += 64) _mm_prefetch((const char *)r + GG_PF + l, PF_HINT);
#endif
                    vi_t u[8];
                    if (type == GG_Q8_0) {
                        for (int c = 0; c < 8; c++) u[c] = gg_load(r + 64 * c + hb);
                    } else {
                        for (int c = 0; c < 4; c++) a8_nibbles(r + 64 * c + hb, &u[2 * c], &u[2 * c + 1]);
                        if (five) {
                            const vi_t H = gg_load(r + 256 + hb);
                            u[0] = gg_or(u[0], gg32_and10(gg_sl(H, 4)));
                            u[1] = gg_or(u[1], gg32_and10(gg_sl(H, 3)));
                            u[2] = gg_or(u[2], gg32_and10(gg_sl(H, 2)));
                            u[3] = gg_or(u[3], gg32_and10(gg_sl(H, 1)));
                            u[4] = gg_or(u[4], gg32_and10(H));
                            u[5] = gg_or(u[5], gg32_and10(gg_sr(H, 1)));
                            u[6] = gg_or(u[6], gg32_and10(gg_sr(H, 2)));
                            u[7] = gg_or(u[7], gg32_and10(gg_sr(H, 3)));
                        }
                    }
                    const vf_t D = gg_loadf((const float *)(r + doff) + A8_LANES * h);
                    const vf_t M = hasm ? gg_loadf((const float *)(r + doff + 64) + A8_LANES * h) : D;
                    for (int i = 0; i < G; i++) {
                        const int64_t row = (int64_t)(s0 + i);
                        const int8_t *x8 = X->q32 + row * K + 32 * j;
                        const float dx = X->dx32[row * nb + j], xs = X->xs32[row * nb + j];
#if defined(__AVX512F__)
                        vi_t is = _mm512_setzero_si512();
#else
                        vi_t is = _mm256_setzero_si256();
#endif
                        if (type == GG_Q8_0)
                            for (int c = 0; c < 8; c++) is = gg32_dp8(is, u[c], x8 + 4 * c);
                        else
                            for (int c = 0; c < 8; c++) is = vi_dp(is, u[c], x8 + 4 * c);
                        if (z) is = gg32_sub(is, z * (int)xs);  // sum (q - z) x8, exact
                        const vf_t t = gg_mul(D, gg_set1(dx));  // RN(D_j dx_j)
                        acc[i] = vf_fma(vf_cvt(is), t, acc[i]);
                        if (hasm) acc[i] = vf_fma(gg_mul(M, gg_set1(dx)), gg_set1(xs), acc[i]);
                    }
                }
                for (int i = 0; i < G; i++) vf_store(yp + (int64_t)(s0 + i) * N + A8_LANES * h, acc[i], left);
            }
        }
    }
}

// A 32-block part's weights out [N, K] as gguf.quants computes them: RN(D (q - z)), or RN(D q + M).
static void gg32_dequant(const gg_part_t *pt, int K, float *out) {
    const int type = pt->type, nb = K / 32, rec = gg_rec32(type), doff = gg_doff32(type), hasm = gg_min32(type);
    const int z = type == GG_Q8_0 ? 128 : gg_zero32(type);
    for (int n = 0; n < pt->N; n++)
        for (int j = 0; j < nb; j++) {
            const uint8_t *r = pt->w + ((int64_t)(n / 16) * nb + j) * rec;
            const int l = n % 16;
            float D, M = 0.f;
            memcpy(&D, r + doff + 4 * l, 4);
            if (hasm) memcpy(&M, r + doff + 64 + 4 * l, 4);
            for (int k = 0; k < 32; k++) {
                const volatile float Dq = D * (float)(gg32_q(type, r, l, k) - z);
                out[(int64_t)n * K + 32 * j + k] = hasm ? Dq + M : Dq;
            }
        }
}
