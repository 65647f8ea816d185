// Blocks of 32 (#included by gguf_kernels.c before gg_panels): the GGUF types whose blocks are 32 weights with one fp16
// scale d (and, for the _1 types, an fp16 min m): Q4_0, Q4_1, Q5_0, Q5_1, Q8_0. As for the k-quants, each tensor is
// repacked at build time (pipeline/runtime/gguf_weights.py, pack32), never requantized, into panels of 16 output rows,
// one record per block of 32 columns, each record:
//   q: Q4_0 / Q4_1 / Q5_0 / Q5_1: 256 bytes of nibbles, byte 16 k + l holding row l's column k (low nibble) and
//        k + 16 (high), k < 16, as ggml's own qs[k]; Q5_0 / Q5_1 then 64 bytes of their fifth bits, bit k % 8 of byte
//        16 (k / 8) + l being row l's column k's; Q8_0: 512 bytes, byte 16 k + l row l's column k (int8);
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
// The code is plain C that GCC vectorises over the 16 rows of a panel in each build; the integer sums are exact and
// the float steps are single fp32 operations in a fixed order (-ffp-contract=off), so the builds agree bit for bit.
// No AMX path: these types take this code in every mode.

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

// One row x [K] -> q [K], dx [K / 32], xs [K / 32] (the activation rule above), scalar fp32 steps.
static void gg_quant32_row(const float *x, int K, int8_t *q, float *dx, float *xs) {
    for (int j = 0; j < K / 32; j++) {
        const float *xb = x + 32 * j;
        float mx = 0.f;
        int bad = 0;
        for (int k = 0; k < 32; k++) {
            const float a = fabsf(xb[k]);
            bad |= !(a <= 3.4028235e38f);  // NaN or infinity
            mx = a > mx ? a : mx;
        }
        if (bad || mx < 1e-30f) {
            memset(q + 32 * j, 0, 32);
            dx[j] = bad ? NAN : 0.f;
            xs[j] = 0.f;
            continue;
        }
        const float inv = 127.0f / mx;
        int sum = 0;
        for (int k = 0; k < 32; k++) {
            const float v = xb[k] * inv;
            const int qi = (int)rintf(v);  // round to nearest even (MXCSR), as the k-quants' cvtps
            q[32 * j + k] = (int8_t)qi;
            sum += qi;
        }
        xs[j] = (float)sum;
        dx[j] = mx / 127.0f;
    }
}

// A record's integers q - z, w[k][l] (column k, panel row l).
static inline void gg32_decode(int type, const uint8_t *r, int8_t w[32][16]) {
    if (type == GG_Q8_0) {
        memcpy(w, r, 512);
        return;
    }
    const int z = gg_zero32(type);
    for (int k = 0; k < 16; k++)
        for (int l = 0; l < 16; l++) {
            w[k][l] = (int8_t)(r[16 * k + l] & 15);
            w[k + 16][l] = (int8_t)(r[16 * k + l] >> 4);
        }
    if (type == GG_Q5_0 || type == GG_Q5_1)
        for (int k = 0; k < 32; k++)
            for (int l = 0; l < 16; l++) w[k][l] = (int8_t)(w[k][l] | (((r[256 + 16 * (k / 8) + l] >> (k % 8)) & 1) << 4));
    if (z)
        for (int k = 0; k < 32; k++)
            for (int l = 0; l < 16; l++) w[k][l] = (int8_t)(w[k][l] - z);
}

// Panels [p0, p1) of a 32-block part, every token row of the chunk, up to GG_MAXG rows per pass over a panel.
static void gg32_panels(const gx_t *X, const gg_part_t *pt, float *y, int S, int K, int N, int p0, int p1) {
    const int nb = K / 32, rec = gg_rec32(pt->type), doff = gg_doff32(pt->type), hasm = gg_min32(pt->type);
    const int64_t pbytes = gg_panel_bytes(pt->type, K);
    int8_t w[32][16] __attribute__((aligned(64)));
    for (int p = p0; p < p1; p++) {
        const uint8_t *panel = pt->w + p * pbytes;
        float *yp = y + pt->n0 + 16 * p;
        const int left = pt->N - 16 * p < 16 ? pt->N - 16 * p : 16;
        for (int s0 = 0; s0 < S; s0 += GG_MAXG) {
            const int G = S - s0 < GG_MAXG ? S - s0 : GG_MAXG;
            float acc[GG_MAXG][16] __attribute__((aligned(64)));
            memset(acc, 0, sizeof(acc));
            for (int j = 0; j < nb; j++) {
                const uint8_t *r = panel + (int64_t)j * rec;
                __builtin_prefetch(r + GG_PF, 0, 2);
                gg32_decode(pt->type, r, w);
                float D[16], M[16];
                memcpy(D, r + doff, 64);
                if (hasm) memcpy(M, r + doff + 64, 64);
                for (int i = 0; i < G; i++) {
                    const int64_t row = (int64_t)(s0 + i);
                    const int8_t *x8 = X->q32 + row * K + 32 * j;
                    const float dx = X->dx32[row * nb + j], xs = X->xs32[row * nb + j];
                    int32_t is[16] = {0};
                    for (int k = 0; k < 32; k++)
                        for (int l = 0; l < 16; l++) is[l] += (int32_t)w[k][l] * (int32_t)x8[k];
                    for (int l = 0; l < 16; l++) {
                        const float t = D[l] * dx;
                        acc[i][l] = fmaf((float)is[l], t, acc[i][l]);
                    }
                    if (hasm)
                        for (int l = 0; l < 16; l++) {
                            const float u = M[l] * dx;
                            acc[i][l] = fmaf(u, xs, acc[i][l]);
                        }
                }
            }
            for (int i = 0; i < G; i++)
                for (int l = 0; l < left; l++) yp[(int64_t)(s0 + i) * N + l] = acc[i][l];
        }
    }
}

// A 32-block part's weights out [N, K] as gguf.quants computes them: RN(D (q - z)), or RN(D q + M).
static void gg32_dequant(const gg_part_t *pt, int K, float *out) {
    const int nb = K / 32, rec = gg_rec32(pt->type), doff = gg_doff32(pt->type), hasm = gg_min32(pt->type);
    int8_t w[32][16];
    for (int p = 0; p < (pt->N + 15) / 16; p++)
        for (int j = 0; j < nb; j++) {
            const uint8_t *r = pt->w + ((int64_t)p * nb + j) * rec;
            gg32_decode(pt->type, r, w);
            for (int l = 0; l < 16 && 16 * p + l < pt->N; l++) {
                float D, M = 0.f;
                memcpy(&D, r + doff + 4 * l, 4);
                if (hasm) memcpy(&M, r + doff + 64 + 4 * l, 4);
                for (int k = 0; k < 32; k++) {
                    const volatile float Dq = D * (float)w[k][l];
                    out[(int64_t)(16 * p + l) * K + 32 * j + k] = hasm ? Dq + M : Dq;
                }
            }
        }
}
