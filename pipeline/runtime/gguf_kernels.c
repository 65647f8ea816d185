// GGUF k-quant weights (Q4_K, Q6_K) in the skinny kernel, never rounded twice (#included by skinny.c before
// skinny_matmul, so it sees A8_LANES, vi_t / vf_t, a8_nibbles, vi_dp, claim / share_t, pool_run and the ISA switch).
//
// Weights. A GGUF tensor keeps its own integers and scales; at build time (pipeline/runtime/gguf_weights.py) each
// part of a layer is repacked into panels of 16 output rows (one int32 lane per row, as W4A8's tile_a8), super-block
// (256 columns) after super-block, each super-block one contiguous record:
//   Q4_K (2368 bytes): 32 lines of 64 bytes of nibbles q (line c: byte 4 l + j holds row l's column 8c + j in the low
//        nibble, 8c + 4 + j in the high one), d[16] fp16, dmin[16] fp16 (the GGUF's own, widened exactly by
//        vcvtph2ps as they are read: fp32 copies had cost 64 bytes a record, 2.6% of every Q4_K read), sc[8][16] and
//        m[8][16] uint8 (sub-block j of 32 columns, row l): w = d sc_j q - dmin m_j.
//   Q6_K (3392 bytes): the low 4 bits of q (0..63) as the Q4_K nibbles, then 16 lines of 64 bytes of its high 2 bits
//        (line j covers nibble lines 2j, 2j + 1: bits 0-1 / 2-3 / 4-5 / 6-7 of byte 4 l + jj belong to columns
//        16j + jj, 16j + 4 + jj, 16j + 8 + jj, 16j + 12 + jj), d[16] fp32, sc[16][16] int8 (sub-block j of 16
//        columns): w = d sc_j (q - 32), always exact in fp32.
// A layer is up to four parts (the fused q/k/v and gate/up of a GGUF mix Q4_K and Q6_K tensors): gg_desc_t.
//
// Activations: each token row is quantized per super-block of 256 columns to int8 (llama.cpp's Q8_K grain),
// x8 = rint(x * RN(127 / max|x|)), with dx = RN(max|x| / 127) (max below 1e-30: all zero, dx = 0; a NaN or infinity
// in the super-block: x8 = 0, dx = NaN), and per 32 columns xs = float(sum x8) (Q4_K's min term, an exact integer)
// and per 16 columns o = -32 * sum x8 (Q6_K's offset).
//
// Arithmetic per output element, in this order (the contract both builds keep and the tests pin, IEEE fp32 with
// denormals, MXCSR FTZ / DAZ cleared for the call), for each super-block s in column order, from a = 0:
//   Q4_K: for each sub-block j (32 columns) in column order: i_j = sum q x8 (exact integer),
//         a = fma(float(i_j), D_j, a),  a = fma(-M_j, xs_j, a),  D_j = d sc_j, M_j = dmin m_j (both exact);
//   Q6_K: for each sub-block j (16 columns) in column order: i_j = o_j + sum q x8 = sum (q - 32) x8 (exact),
//         a = fma(float(i_j), D_j, a), D_j = d sc_j (exact);
//   then y = fma(a, dx_s, y) (y from 0).
// So each weight enters as its exact value d sc q - dmin m. Q6_K's is always the GGUF's fp32 value; Q4_K's is too
// whenever it is representable in fp32 (gguf_weights.q4k_exact checks every sub-block at build time; the GGUF
// reference rounds it otherwise). Integer sums are exact: vpdpbusd in the AVX-512 build; vpmaddubsw in the AVX2 build,
// whose pair sums (|q x8 + q' x8'| <= 2 * 63 * 127) never saturate and add in int16 only as far as they stay exact
// (8 for Q4_K, 2 for Q6_K) before vpmaddwd widens them. The fp32 steps are the same instructions in both builds, so
// the builds agree bit for bit, whatever the number of token rows, the thread count or which thread ran a panel.
// One activation scale per super-block, not per 32 columns (as until 2026-12-03), takes the scale product
// RN(D_j dx_j) out of every token row's sub-block (at 8 token rows, 8 multiplies beside the sub-block's 64 vpdpbusd
// on the pipes they share): a 6-token forward of the 1.5B target took 39.2-41.2 against 44.8-47.3 ms
// (docs/gguf_weights.md, with the greedy agreement and log-likelihood it keeps).
//
// AMX (below, "AMX"): where the CPU and the OS allow it, the AVX-512 build takes the integers i_j from TDPBSSD tiles
// instead of vpdpbusd, with the same float steps in the same order, so the bits do not change. No machine here has
// AMX: the tests run that code on a software model of the tiles (written from the instruction reference, pinned to it
// by its own test) and require the AVX-512 tiles' bits; experiments/gguf_tile.c checks the real tiles against the
// AVX-512 ones before it times them.

#define GG_Q4K 12  // ggml type ids
#define GG_Q6K 14
#define GG_Q4_0 2  // the 32-weight block types ("Blocks of 32" below)
#define GG_Q4_1 3
#define GG_Q5_0 6
#define GG_Q5_1 7
#define GG_Q8_0 8
#define GG_SB_Q4K 2368
#define GG_SB_Q6K 3392
#define GG_MAXPARTS 4
// Every line of a record is prefetched (into L2, as the other weight types) this far ahead of the one being read: the
// panels are one sequential stream per thread. AVX-512: 5 KB, about two Q4_K records. The 1.5B's one-token matmuls
// (all layers and the head, paired calls alternating with an 8 KB build, the bandwidth probe read between them, 2-core
// Zen 4, 2026-12-05) took 0.90-0.92x the time with memory at 33-37 GB/s and 0.89-0.92x at 57-67 GB/s; 4 and 8 token
// rows unchanged (0.98-1.03x); 4 and 6 KB 0.91-0.99x, 3 KB 0.97x, 16 and 32 KB 1.04-1.10x, none 1.06-1.09x, into L1
// 1.6x; SmolLM2's Q4_1 layers (gguf_blocks32.c) 1.00x. The AVX2 build keeps 8 KB: run on the same Zen 4, 5 KB was
// 0.95x its 8 KB with memory slow and 1.09x with it fast (experiments/kernel_log.md, 2026-12-05 10:00).
// Which lines are prefetched never changes a bit.
#if defined(__AVX512F__)
#define GG_PF 5120
#else
#define GG_PF 8192
#endif
// Token rows per pass over a panel, in both builds: verifying up to 8 tokens decodes each panel once (at 4, 5-8 rows
// decoded it twice: 2.5x a one-token step at 5 rows on the 1.5B). In the AVX-512 build 32 zmm hold 8 rows'
// super-block sums (a) and dot products beside the decoded weights; the AVX2 tiles keep each row's int16 sums in
// registers and let the float accumulators spill (a load and a store a sub-block against 8 to 16 multiplies). Each
// row's arithmetic is the same whatever the group, so the bits do not change.
#define GG_MAXG 8
// AVX2: token rows up to which a pass covers both 8-row halves of a panel (measured on Zen 3, see gg_pass_q4k).
#define GG_BOTH 3
#define GG_BOTH6 1
#if defined(__AVX512F__)
static inline vf_t gg_loadf(const float *p) { return _mm512_loadu_ps(p); }
static inline vf_t gg_loadh(const uint8_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline vf_t gg_u8(const uint8_t *p) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p))); }
static inline vf_t gg_i8(const uint8_t *p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p))); }
static inline vf_t gg_mul(vf_t a, vf_t b) { return _mm512_mul_ps(a, b); }
static inline vf_t gg_set1(float f) { return _mm512_set1_ps(f); }
static inline vf_t gg_fnma(vf_t a, vf_t b, vf_t c) { return _mm512_fnmadd_ps(a, b, c); }  // RN(c - a b)
static inline vf_t gg_fma(vf_t a, vf_t b, vf_t c) { return _mm512_fmadd_ps(a, b, c); }  // RN(a b + c)
static inline unsigned gg_nlt(vf_t a, vf_t b) { return _mm512_cmp_ps_mask(a, b, _CMP_NLT_UQ); }  // a >= b or NaN
static inline vi_t gg_load(const uint8_t *p) { return _mm512_loadu_si512((const void *)p); }
static inline vi_t gg_or(vi_t a, vi_t b) { return _mm512_or_si512(a, b); }
static inline vi_t gg_and30(vi_t a) { return _mm512_and_si512(a, _mm512_set1_epi8(0x30)); }
static inline vi_t gg_sl(vi_t a, int n) { return _mm512_slli_epi16(a, n); }
static inline vi_t gg_sr(vi_t a, int n) { return _mm512_srli_epi16(a, n); }
// vi_dp with the 4 activation bytes as vpdpbusd's own embedded broadcast ({1to16}), which GCC 12 does not fold from
// the intrinsics (it emits a vpbroadcastd before each vpdpbusd: 64 more instructions a sub-block at 8 token rows); a
// chain's first product from the intrinsic onto zero (gg_dp0), so that no zeroed register is copied into the asm's.
static inline vi_t gg_dp(vi_t acc, vi_t u, const int8_t *x4) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*(const int32_t *)x4));
    return acc;
}
static inline vi_t gg_dp0(vi_t u, const int8_t *x4) { return vi_dp(_mm512_setzero_si512(), u, x4); }
#else
static inline vf_t gg_loadf(const float *p) { return _mm256_loadu_ps(p); }
static inline vf_t gg_loadh(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline vf_t gg_u8(const uint8_t *p) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p))); }
static inline vf_t gg_i8(const uint8_t *p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p))); }
static inline vf_t gg_mul(vf_t a, vf_t b) { return _mm256_mul_ps(a, b); }
static inline vf_t gg_set1(float f) { return _mm256_set1_ps(f); }
static inline vf_t gg_fnma(vf_t a, vf_t b, vf_t c) { return _mm256_fnmadd_ps(a, b, c); }
static inline vf_t gg_fma(vf_t a, vf_t b, vf_t c) { return _mm256_fmadd_ps(a, b, c); }
static inline unsigned gg_nlt(vf_t a, vf_t b) { return (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_NLT_UQ)); }
static inline vi_t gg_load(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline vi_t gg_or(vi_t a, vi_t b) { return _mm256_or_si256(a, b); }
static inline vi_t gg_and30(vi_t a) { return _mm256_and_si256(a, _mm256_set1_epi8(0x30)); }
static inline vi_t gg_sl(vi_t a, int n) { return _mm256_slli_epi16(a, n); }
static inline vi_t gg_sr(vi_t a, int n) { return _mm256_srli_epi16(a, n); }
#endif

typedef struct {
    int type, N, n0, pad;  // ggml type, rows, first output column of the part
    const uint8_t *w;      // ceil(N / 16) panels of K / 256 records
} gg_part_t;
typedef struct {
    int nparts, K;
    gg_part_t part[GG_MAXPARTS];
} gg_desc_t;

// Quantized activations of a chunk of token rows.
typedef struct {
    const int8_t *q;    // [S, K]
    const int8_t *qi;   // AVX2 build: q again, each group of G rows from s0 (gg_panels' grouping) at qi + s0 K with
                        // its rows' 4-column pieces side by side ([K / 4][G][4]), so one pointer reaches every row
    const float *dx;    // [S, K / 256]
    const float *xs;    // [S, K / 32]
    const int32_t *o;   // [S, K / 16]
    const int8_t *q32;  // the 32-weight block types' activations (gg_quant32): [S, K]
    const float *dx32;  // [S, K / 32]
    const float *xs32;  // [S, K / 32]
} gx_t;

static inline int gg_is32(int type) {
    return type == GG_Q4_0 || type == GG_Q4_1 || type == GG_Q5_0 || type == GG_Q5_1 || type == GG_Q8_0;
}
static inline int gg_record(int type) { return type == GG_Q4K ? GG_SB_Q4K : GG_SB_Q6K; }
// Bytes of one panel (16 rows, all K columns) of a part of this type.
static inline int64_t gg_panel_bytes(int type, int K);

// 8 values x times inv, rounded to nearest even, stored as int8 at q (the activation rule's one step); returns them
// as int32 for the caller's sums. Both quantizers (gg_quant_row, gguf_blocks32.c's gg_quant32_row) take it.
static inline __m256i gg_q8x8(const float *x, __m256 inv, int8_t *q) {
    const __m256i qi = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x), inv));  // MXCSR round to nearest even
    const __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(qi), _mm256_extracti128_si256(qi, 1));
    _mm_storel_epi64((__m128i *)q, _mm_packs_epi16(w16, w16));
    return qi;
}

// One row x [K] -> q, dx, xs, o (the header's activation rule), in AVX2 in both builds, so they round alike (the
// product x * RN(127 / max) and its round-to-nearest-even conversion are single IEEE steps in any width). Vector, not
// scalar: quantizing a row ran alone while the other threads waited, 3.4 ns a column (30 us of a 16-row K = 8960 call).
static void gg_quant_row(const float *x, int K, int8_t *q, float *dx, float *xs, int32_t *o) {
    const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF)), fmax = _mm256_set1_ps(3.4028235e38f);
    for (int s = 0; s < K / 256; s++) {
        const float *xb = x + 256 * s;
        __m256 m = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
        for (int u = 0; u < 32; u++) {
            const __m256 a = _mm256_and_ps(_mm256_loadu_ps(xb + 8 * u), absm);
            m = _mm256_max_ps(m, a);
            bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, fmax, _CMP_NLE_UQ));  // NaN or infinity
        }
        float t[8], mx = 0.f;
        _mm256_storeu_ps(t, m);
        for (int i = 0; i < 8; i++) mx = t[i] > mx ? t[i] : mx;
        int8_t *qb = q + 256 * s;
        const int isbad = _mm256_movemask_ps(bad) != 0;
        if (isbad || mx < 1e-30f) {
            memset(qb, 0, 256);
            dx[s] = isbad ? NAN : 0.f;
            for (int b = 0; b < 8; b++) xs[8 * s + b] = 0.f, o[16 * s + 2 * b] = o[16 * s + 2 * b + 1] = 0;
            continue;
        }
        const __m256 inv = _mm256_set1_ps(127.0f / mx);
        for (int b = 0; b < 8; b++) {
            __m256i sum[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
            for (int u = 0; u < 4; u++)
                sum[u / 2] = _mm256_add_epi32(sum[u / 2], gg_q8x8(xb + 32 * b + 8 * u, inv, qb + 32 * b + 8 * u));
            int32_t lanes[2][8], tot[2] = {0, 0};
            _mm256_storeu_si256((__m256i *)lanes[0], sum[0]);
            _mm256_storeu_si256((__m256i *)lanes[1], sum[1]);
            for (int i = 0; i < 8; i++) tot[0] += lanes[0][i], tot[1] += lanes[1][i];
            xs[8 * s + b] = (float)(tot[0] + tot[1]);  // |sum| <= 32 * 127: exact
            o[16 * s + 2 * b] = -32 * tot[0];
            o[16 * s + 2 * b + 1] = -32 * tot[1];
        }
        dx[s] = mx / 127.0f;
    }
}

#if defined(__AVX512F__)
// One panel (16 rows from n, `left` of them real) times G token rows from s0.
static inline __attribute__((always_inline)) void gg_tile_q4k(const gx_t *X, const uint8_t *panel, float *y, int ys,
                                                              int K, int left0, int s0, const int G) {
    const int nsb = K / 256, nb = K / 32, NCH = G == 1 ? 4 : G == 2 ? 2 : 1;
    for (int h = 0; h < 16 / A8_LANES; h++) {
        const int left = left0 - A8_LANES * h;
        if (left <= 0) break;
        // y's partial sums wait in memory between super-blocks (touched once a super-block), so the 32 registers
        // hold a super-block's a, the integer sums and the decoded weights of 8 token rows without spilling
        float acc[GG_MAXG][A8_LANES] __attribute__((aligned(64)));
        vf_t a[GG_MAXG];
        for (int i = 0; i < G; i++) _mm512_store_ps(acc[i], gg_set1(0.f));
        for (int s = 0; s < nsb; s++) {
            const uint8_t *rec = panel + (int64_t)s * GG_SB_Q4K, *sc = rec + 2048;
            if (h == 0)
                for (int off = 0; off < GG_SB_Q4K; off += 64) _mm_prefetch((const char *)rec + GG_PF + off, PF_HINT);
            const vf_t d = gg_loadh(sc + 2 * A8_LANES * h), dmin = gg_loadh(sc + 32 + 2 * A8_LANES * h);
            for (int i = 0; i < G; i++) a[i] = gg_set1(0.f);
            for (int j = 0; j < 8; j++) {
                const vf_t D = gg_mul(d, gg_u8(sc + 64 + 16 * j + A8_LANES * h));
                const vf_t M = gg_mul(dmin, gg_u8(sc + 192 + 16 * j + A8_LANES * h));
                vi_t p[4][GG_MAXG];
                for (int c = 0; c < 4; c++) {
                    vi_t lo, hi;
                    a8_nibbles(rec + 64 * (4 * j + c) + 4 * A8_LANES * h, &lo, &hi);
                    const int c0 = NCH == 4 ? 2 * (c & 1) : 0, c1 = NCH == 1 ? 0 : c0 + 1;
                    const int first = NCH == 4 ? c < 2 : c == 0;  // the line that starts chains c0 and c1
                    for (int i = 0; i < G; i++) {
                        const int8_t *xr = X->q + (int64_t)(s0 + i) * K + 256 * s + 32 * j + 8 * c;
                        p[c0][i] = first ? gg_dp0(lo, xr) : gg_dp(p[c0][i], lo, xr);
                        p[c1][i] = first && NCH != 1 ? gg_dp0(hi, xr + 4) : gg_dp(p[c1][i], hi, xr + 4);
                    }
                }
                const int b = 8 * s + j;
                for (int i = 0; i < G; i++) {  // one chain per token row from 3 rows: enough in flight
                    vi_t t = NCH == 1 ? p[0][i] : vi_add(p[0][i], p[1][i]);
                    if (NCH == 4) t = vi_add(t, vi_add(p[2][i], p[3][i]));
                    a[i] = vf_fma(vf_cvt(t), D, a[i]);
                    a[i] = gg_fnma(M, gg_set1(X->xs[(int64_t)(s0 + i) * nb + b]), a[i]);
                }
            }
            for (int i = 0; i < G; i++)
                _mm512_store_ps(acc[i], vf_fma(a[i], gg_set1(X->dx[(int64_t)(s0 + i) * nsb + s]), _mm512_load_ps(acc[i])));
        }
        for (int i = 0; i < G; i++) vf_store(y + (int64_t)(s0 + i) * ys + A8_LANES * h, _mm512_load_ps(acc[i]), left);
    }
}

static inline __attribute__((always_inline)) void gg_tile_q6k(const gx_t *X, const uint8_t *panel, float *y, int ys,
                                                              int K, int left0, int s0, const int G) {
    const int nsb = K / 256, n16 = K / 16, NCH = G <= 2 ? 2 : 1;
    for (int h = 0; h < 16 / A8_LANES; h++) {
        const int left = left0 - A8_LANES * h;
        if (left <= 0) break;
        float acc[GG_MAXG][A8_LANES] __attribute__((aligned(64)));  // as gg_tile_q4k
        vf_t a[GG_MAXG];
        for (int i = 0; i < G; i++) _mm512_store_ps(acc[i], gg_set1(0.f));
        for (int s = 0; s < nsb; s++) {
            const uint8_t *rec = panel + (int64_t)s * GG_SB_Q6K, *hb = rec + 2048, *sc = rec + 3072;
            if (h == 0)
                for (int off = 0; off < GG_SB_Q6K; off += 64) _mm_prefetch((const char *)rec + GG_PF + off, PF_HINT);
            const vf_t d = gg_loadf((const float *)sc + A8_LANES * h);
            for (int i = 0; i < G; i++) a[i] = gg_set1(0.f);
            for (int j = 0; j < 16; j++) {
                const vf_t D = gg_mul(d, gg_i8(sc + 64 + 16 * j + A8_LANES * h));
                vi_t l0, h0, l1, h1;
                a8_nibbles(rec + 64 * (2 * j) + 4 * A8_LANES * h, &l0, &h0);
                a8_nibbles(rec + 64 * (2 * j + 1) + 4 * A8_LANES * h, &l1, &h1);
                const vi_t hi = gg_load(hb + 64 * j + 4 * A8_LANES * h);
                l0 = gg_or(l0, gg_and30(gg_sl(hi, 4)));
                h0 = gg_or(h0, gg_and30(gg_sl(hi, 2)));
                l1 = gg_or(l1, gg_and30(hi));
                h1 = gg_or(h1, gg_and30(gg_sr(hi, 2)));
                vi_t p[2][GG_MAXG];
                for (int i = 0; i < G; i++) {
                    const int8_t *xr = X->q + (int64_t)(s0 + i) * K + 256 * s + 16 * j;
                    p[0][i] = vi_set1(X->o[(int64_t)(s0 + i) * n16 + 16 * s + j]);
                    if (NCH == 2) {
                        p[0][i] = gg_dp(p[0][i], l0, xr);
                        p[1][i] = gg_dp0(h0, xr + 4);
                        p[0][i] = gg_dp(p[0][i], l1, xr + 8);
                        p[1][i] = gg_dp(p[1][i], h1, xr + 12);
                        p[0][i] = vi_add(p[0][i], p[1][i]);
                    } else {
                        p[0][i] = gg_dp(p[0][i], l0, xr);
                        p[0][i] = gg_dp(p[0][i], h0, xr + 4);
                        p[0][i] = gg_dp(p[0][i], l1, xr + 8);
                        p[0][i] = gg_dp(p[0][i], h1, xr + 12);
                    }
                }
                for (int i = 0; i < G; i++) a[i] = vf_fma(vf_cvt(p[0][i]), D, a[i]);
            }
            for (int i = 0; i < G; i++)
                _mm512_store_ps(acc[i], vf_fma(a[i], gg_set1(X->dx[(int64_t)(s0 + i) * nsb + s]), _mm512_load_ps(acc[i])));
        }
        for (int i = 0; i < G; i++) vf_store(y + (int64_t)(s0 + i) * ys + A8_LANES * h, _mm512_load_ps(acc[i]), left);
    }
}

#else
// AVX2. vpmaddubsw gives int16 pair sums q x8 (|q| <= 15: |pair| <= 3810); a Q4_K sub-block's 8 of them per row add
// up in int16 (|sum| <= 8 * 3810 = 30480 < 32767, so exact) before one vpmaddwd widens them, where the per-4-column
// vi_dp paid a vpmaddwd and an add each. Same integers, same float steps: the bits of the AVX-512 build. On Zen 3
// (L2-resident, one thread) 8 token rows of a Q4_K panel took 0.85x the time of the vi_dp tile, Q6_K 0.85x.
// GG_SPREAD: each record's lines are prefetched a few at a time as its sub-blocks are read, not all at its start. On
// Zen 3 (2 cores, AVX2 only) the burst of 37 (Q4_K) or 53 (Q6_K) prefetches at a record's start held the one-token
// step at 0.75-0.84 of the bandwidth probes; spread, the 1.5B's step took 0.86x the time (0.887 spread by sub-block,
// then 0.966 of that by line; step_stages.py --against, 10 paired rounds each), 0.92-0.98 of the probes
// (experiments/kernel_log.md, 2026-12-07 14:05). The AVX-512 passes keep the burst: measured on Zen 4, they already
// read at 0.90-0.98 of the probes.
#define GG_LINES4 (GG_SB_Q4K / 64)
#define GG_LINES6 (GG_SB_Q6K / 64)
static inline __m256i gg_mb(__m256i w, const int8_t *x4) {
    return _mm256_maddubs_epi16(w, _mm256_broadcastd_epi32(_mm_loadu_si32((const void *)x4)));
}

// One pass over a panel for H of its two 8-row halves from h0 (H = 2: both halves at once, for up to GG_BOTH token
// rows, so each broadcast activation feeds 2 H vpmaddubsw and the pass's loop and prefetch run once; H = 1 for more
// rows, whose int16 sums need the registers). A token row's arithmetic is the same either way.
static inline __attribute__((always_inline)) void gg_pass_q4k(const gx_t *X, const uint8_t *panel, float *y, int ys,
                                                              int K, int left0, int s0, const int G, int h0,
                                                              const int H) {
    const int nsb = K / 256, nb = K / 32;
    const __m256i ones = _mm256_set1_epi16(1);
    vf_t acc[2][GG_MAXG], a[2][GG_MAXG];
    for (int hh = 0; hh < H; hh++)
        for (int i = 0; i < G; i++) acc[hh][i] = gg_set1(0.f);
    for (int s = 0; s < nsb; s++) {
        const uint8_t *rec = panel + (int64_t)s * GG_SB_Q4K, *sc = rec + 2048;
        for (int hh = 0; hh < H; hh++)
            for (int i = 0; i < G; i++) a[hh][i] = gg_set1(0.f);
        for (int j = 0; j < 8; j++) {
            // line by line, each row's pair sums adding up in an int16 register: H G of them, the line's decoded
            // vectors and temporaries fit the 16 ymm with 8 rows at H = 1 (the float accumulators spill instead,
            // touched once a sub-block)
            __m256i t[2][GG_MAXG];
            for (int c = 0; c < 4; c++) {
                if (h0 == 0)  // the record's 37 lines, spread over its 32 (j, c) steps (GG_SPREAD)
                    for (int l = GG_LINES4 * (4 * j + c) / 32; l < GG_LINES4 * (4 * j + c + 1) / 32; l++)
                        _mm_prefetch((const char *)rec + GG_PF + 64 * l, PF_HINT);
                vi_t lo[2], hi[2];  // line c: low nibbles pair with columns 8c..8c+3, high ones with 8c+4..8c+7
                for (int hh = 0; hh < H; hh++) a8_nibbles(rec + 64 * (4 * j + c) + 32 * (h0 + hh), &lo[hh], &hi[hh]);
                const int8_t *xg = X->qi + (int64_t)s0 * K + (int64_t)(64 * s + 8 * j + 2 * c) * 4 * G;
                for (int i = 0; i < G; i++) {
                    const __m256i a = _mm256_broadcastd_epi32(_mm_loadu_si32((const void *)(xg + 4 * i)));
                    const __m256i b = _mm256_broadcastd_epi32(_mm_loadu_si32((const void *)(xg + 4 * G + 4 * i)));
                    for (int hh = 0; hh < H; hh++) {
                        const __m256i u = _mm256_add_epi16(_mm256_maddubs_epi16(lo[hh], a),
                                                           _mm256_maddubs_epi16(hi[hh], b));
                        t[hh][i] = c ? _mm256_add_epi16(t[hh][i], u) : u;
                        // GCC would otherwise reassociate the integer adds and compute all 8 products of every row
                        // first, spilling them (23 stack accesses a row and sub-block at 8 rows, 2.5x the time)
                        __asm__("" : "+x"(t[hh][i]));
                    }
                }
            }
            // the scales only now, from memory (L1), so they hold no register while the sums above need them all
            const int b = 8 * s + j;
            for (int hh = 0; hh < H; hh++) {
                const int h = h0 + hh;
                const vf_t D = gg_mul(gg_loadh(sc + 16 * h), gg_u8(sc + 64 + 16 * j + 8 * h));
                const vf_t M = gg_mul(gg_loadh(sc + 32 + 16 * h), gg_u8(sc + 192 + 16 * j + 8 * h));
                for (int i = 0; i < G; i++) {
                    a[hh][i] = vf_fma(vf_cvt(_mm256_madd_epi16(t[hh][i], ones)), D, a[hh][i]);
                    a[hh][i] = gg_fnma(M, gg_set1(X->xs[(int64_t)(s0 + i) * nb + b]), a[hh][i]);
                }
            }
        }
        for (int hh = 0; hh < H; hh++)
            for (int i = 0; i < G; i++)
                acc[hh][i] = vf_fma(a[hh][i], gg_set1(X->dx[(int64_t)(s0 + i) * nsb + s]), acc[hh][i]);
    }
    for (int hh = 0; hh < H; hh++)
        for (int i = 0; i < G; i++)
            vf_store(y + (int64_t)(s0 + i) * ys + 8 * (h0 + hh), acc[hh][i], left0 - 8 * (h0 + hh));
}

static inline __attribute__((always_inline)) void gg_tile_q4k(const gx_t *X, const uint8_t *panel, float *y, int ys,
                                                              int K, int left0, int s0, const int G) {
    if (G <= GG_BOTH && left0 > 8) {
        gg_pass_q4k(X, panel, y, ys, K, left0, s0, G, 0, 2);
    } else {
        gg_pass_q4k(X, panel, y, ys, K, left0, s0, G, 0, 1);
        if (left0 > 8) gg_pass_q4k(X, panel, y, ys, K, left0, s0, G, 1, 1);
    }
}

// Q6_K: |q| <= 63, so |pair| <= 16002 and only two pair sums share an int16 (32004) before widening. H halves a pass
// as gg_pass_q4k (one token row: both halves, each decoded and used in turn, which saves the second pass's loop).
static inline __attribute__((always_inline)) void gg_pass_q6k(const gx_t *X, const uint8_t *panel, float *y, int ys,
                                                              int K, int left0, int s0, const int G, int h0,
                                                              const int H) {
    const int nsb = K / 256, n16 = K / 16;
    const __m256i ones = _mm256_set1_epi16(1);
    vf_t acc[2][GG_MAXG], a[2][GG_MAXG];
    for (int hh = 0; hh < H; hh++)
        for (int i = 0; i < G; i++) acc[hh][i] = gg_set1(0.f);
    for (int s = 0; s < nsb; s++) {
        const uint8_t *rec = panel + (int64_t)s * GG_SB_Q6K, *hb = rec + 2048, *sc = rec + 3072;
        for (int hh = 0; hh < H; hh++)
            for (int i = 0; i < G; i++) a[hh][i] = gg_set1(0.f);
        for (int j = 0; j < 16; j++) {
            if (h0 == 0)  // the record's 53 lines, spread over its 16 sub-blocks (GG_SPREAD)
                for (int l = GG_LINES6 * j / 16; l < GG_LINES6 * (j + 1) / 16; l++)
                    _mm_prefetch((const char *)rec + GG_PF + 64 * l, PF_HINT);
            const int b = 16 * s + j;
            const int8_t *xg = X->qi + (int64_t)s0 * K + (int64_t)(64 * s + 4 * j) * 4 * G;
            for (int hh = 0; hh < H; hh++) {
                const int h = h0 + hh;
                const vf_t D = gg_mul(gg_loadf((const float *)sc + 8 * h), gg_i8(sc + 64 + 16 * j + 8 * h));
                vi_t l0, h0v, l1, h1;
                a8_nibbles(rec + 64 * (2 * j) + 32 * h, &l0, &h0v);
                a8_nibbles(rec + 64 * (2 * j + 1) + 32 * h, &l1, &h1);
                const vi_t hi = gg_load(hb + 64 * j + 32 * h);
                l0 = gg_or(l0, gg_and30(gg_sl(hi, 4)));
                h0v = gg_or(h0v, gg_and30(gg_sl(hi, 2)));
                l1 = gg_or(l1, gg_and30(hi));
                h1 = gg_or(h1, gg_and30(gg_sr(hi, 2)));
                for (int i = 0; i < G; i++) {
                    const int8_t *xr = xg + 4 * i;  // columns 16j + 4m of row i at xr + 4 G m
                    const __m256i ta = _mm256_add_epi16(gg_mb(l0, xr), gg_mb(h0v, xr + 4 * G));
                    const __m256i tb = _mm256_add_epi16(gg_mb(l1, xr + 8 * G), gg_mb(h1, xr + 12 * G));
                    const vi_t t = vi_add(vi_set1(X->o[(int64_t)(s0 + i) * n16 + b]),
                                          vi_add(_mm256_madd_epi16(ta, ones), _mm256_madd_epi16(tb, ones)));
                    a[hh][i] = vf_fma(vf_cvt(t), D, a[hh][i]);
                }
            }
        }
        for (int hh = 0; hh < H; hh++)
            for (int i = 0; i < G; i++)
                acc[hh][i] = vf_fma(a[hh][i], gg_set1(X->dx[(int64_t)(s0 + i) * nsb + s]), acc[hh][i]);
    }
    for (int hh = 0; hh < H; hh++)
        for (int i = 0; i < G; i++) vf_store(y + (int64_t)(s0 + i) * ys + 8 * (h0 + hh), acc[hh][i], left0 - 8 * (h0 + hh));
}

static inline __attribute__((always_inline)) void gg_tile_q6k(const gx_t *X, const uint8_t *panel, float *y, int ys,
                                                              int K, int left0, int s0, const int G) {
    if (G <= GG_BOTH6 && left0 > 8) {
        gg_pass_q6k(X, panel, y, ys, K, left0, s0, G, 0, 2);
    } else {
        gg_pass_q6k(X, panel, y, ys, K, left0, s0, G, 0, 1);
        if (left0 > 8) gg_pass_q6k(X, panel, y, ys, K, left0, s0, G, 1, 1);
    }
}
#endif

// A chunk's S token rows in groups of at most maxg (GG_MAXG; the AMX tiles' GG_AMXG), as even as can be: group g has G
// rows from s0.
static inline int gg_group(int S, int g, int maxg, int *s0) {
    const int groups = (S + maxg - 1) / maxg, base = S / groups, extra = S % groups;
    *s0 = g * base + (g < extra ? g : extra);
    return base + (g < extra);
}

#if defined(__AVX512F__)
// AMX (Sapphire Rapids and later): the same integers i_j from tiles. TDPBSSD multiplies a tile of G token rows' int8
// activations (A: G rows of one sub-block's 32 / 16 columns, read straight from q with stride K) by the panel's decoded
// weights (B: 8 / 4 rows of 64 bytes, row k holding 4 consecutive columns of each of the 16 panel rows, which is what
// a8_nibbles makes of a record's line: its low nibbles are columns 8c..8c+3, its high ones 8c+4..8c+7) into C, G rows
// of 16 int32 sums, one per panel row; q is 0..15 (Q4_K) or 0..63 (Q6_K), so signed x signed (TDPBSSD) is exact.
// The float steps are then the AVX-512 tile's, in its order, so the bits are the AVX-512 build's: one pass covers up to
// 16 token rows, each panel decoded once for them. At 8 rows the AVX-512 tile spends 64 vpdpbusd a sub-block on
// what is one TDPBSSD here; the float steps (3 a row) remain.
//
// gg_amx_mode: 0 the AVX-512 tiles; 1 the AMX instructions (gguf_amx(1) turns it on only where CPUID reports AMX-TILE
// and AMX-INT8, the OS enables their state in XCR0 and Linux grants this process XTILEDATA); 2 the same code on a
// software model of the tiles, written from the instruction set reference's pseudocode (the tests run it: this CPU has
// no AMX). The model counts in gg_amx_faults every operation the hardware would refuse (#UD: no configuration loaded,
// shapes that do not chain), which the tests require to stay 0.
int gg_amx_mode;
_Atomic long long gg_amx_faults;
int gg_amx_model_flip;  // tests: the model adds this to its first sum, so gguf_amx_selftest's failure path is exercised
// The fewest token rows a chunk needs for the tiles to take it: below, the AVX-512 tiles run it (same bits). The tiles
// decode every weight into B rows whatever the rows, which the AVX-512 tile's vpdpbusd skip at a few rows. On a 2-core
// Xeon with AMX (2026-12-06), the flagship target's whole forward on the tiles took 1.35x as long as on the AVX-512
// tiles at 1 row, 1.13x at 8, 1.00x at 10, 0.98x at 11 and 0.90x at 16 (docs/gguf_weights.md, "AMX tiles").
// gguf_amx_min_rows sets it (the self-test and the tests set 1: the AMX code at every row count).
int gg_amx_min_rows = 11;
#define GG_AMXG 16  // token rows per tile pass (a tile's 16 rows)

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} gg_tilecfg_t;
_Static_assert(sizeof(gg_tilecfg_t) == 64, "LDTILECFG reads 64 bytes");

static _Thread_local struct {
    int on;
    uint8_t rows[8];
    uint16_t colsb[8];
    uint8_t t[8][16][64];
} amx_emu;
static void emu_fault(void) { atomic_fetch_add(&gg_amx_faults, 1); }
static void emu_cfg(const gg_tilecfg_t *c) {
    memset(&amx_emu, 0, sizeof amx_emu);
    if (c->palette != 1) {
        emu_fault();
        return;
    }
    for (int i = 0; i < 8; i++) {
        if (c->rows[i] > 16 || c->colsb[i] > 64) {
            emu_fault();
            return;
        }
        amx_emu.rows[i] = c->rows[i], amx_emu.colsb[i] = c->colsb[i];
    }
    amx_emu.on = 1;
}
static int emu_ok(int t) {
    if (!amx_emu.on || !amx_emu.rows[t] || !amx_emu.colsb[t]) return emu_fault(), 0;
    return 1;
}
static void emu_load(int t, const void *base, long stride) {  // TILELOADD: the rest of each row, and rows past, zero
    if (!emu_ok(t)) return;
    memset(amx_emu.t[t], 0, sizeof amx_emu.t[t]);
    for (int r = 0; r < amx_emu.rows[t]; r++) memcpy(amx_emu.t[t][r], (const char *)base + r * stride, amx_emu.colsb[t]);
}
static void emu_store(int t, void *base, long stride) {
    if (!emu_ok(t)) return;
    for (int r = 0; r < amx_emu.rows[t]; r++) memcpy((char *)base + r * stride, amx_emu.t[t][r], amx_emu.colsb[t]);
}
static void emu_zero(int t) {
    if (emu_ok(t)) memset(amx_emu.t[t], 0, sizeof amx_emu.t[t]);
}
// TDPBSSD c, a, b: c.dword[m][n] += sum over k < a.colsb / 4, i < 4 of a.byte[m][4k + i] * b.byte[k][4n + i], signed
// bytes, wrapping int32; #UD unless c.rows == a.rows, c.colsb == b.colsb, b.rows == a.colsb / 4 (all multiples of 4).
static void emu_dpbssd(int c, int a, int b) {
    if (!emu_ok(c) || !emu_ok(a) || !emu_ok(b)) return;
    if (amx_emu.rows[c] != amx_emu.rows[a] || amx_emu.colsb[c] != amx_emu.colsb[b] || amx_emu.colsb[a] % 4 ||
        amx_emu.colsb[c] % 4 || amx_emu.rows[b] != amx_emu.colsb[a] / 4) {
        emu_fault();
        return;
    }
    for (int m = 0; m < amx_emu.rows[c]; m++)
        for (int n = 0; n < amx_emu.colsb[c] / 4; n++) {
            int32_t acc;
            memcpy(&acc, amx_emu.t[c][m] + 4 * n, 4);
            uint32_t u = (uint32_t)acc;
            for (int k = 0; k < amx_emu.colsb[a] / 4; k++)
                for (int i = 0; i < 4; i++)
                    u += (uint32_t)((int32_t)(int8_t)amx_emu.t[a][m][4 * k + i] * (int8_t)amx_emu.t[b][k][4 * n + i]);
            acc = (int32_t)(u + (m == 0 && n == 0 ? (uint32_t)gg_amx_model_flip : 0));
            memcpy(amx_emu.t[c][m] + 4 * n, &acc, 4);
        }
}

// An assembler that predates AMX (binutils before 2.36) cannot build the instructions: kernels.py then compiles with
// SKINNY_NO_AMX, which keeps the tile model and leaves the hardware path out (gguf_amx_probe says -3).
#if defined(SKINNY_NO_AMX)
#define AMX_HW(...) __builtin_trap()
#else
#define AMX_HW(...) __VA_ARGS__
#endif
// The instructions, each with a "memory" clobber: GCC's own AMX intrinsics (inline asm too) tell the compiler
// nothing of the memory a tile load reads, so the stores of decoded weights just before it could be dropped.
#define AMX_CFG(emu, p) do { if (emu) emu_cfg(p); else AMX_HW(__asm__ volatile("ldtilecfg %0" :: "m"(*(p)) : "memory")); } while (0)
#define AMX_RELEASE(emu) do { if (emu) memset(&amx_emu, 0, sizeof amx_emu); else AMX_HW(__asm__ volatile("tilerelease" ::: "memory")); } while (0)
#define AMX_LOAD(emu, t, base, stride) do { if (emu) emu_load(t, base, stride); else \
    AMX_HW(__asm__ volatile("tileloadd (%0,%1,1), %%tmm" #t :: "r"((const void *)(base)), "r"((long)(stride)) : "memory")); } while (0)
#define AMX_STORE(emu, t, base, stride) do { if (emu) emu_store(t, base, stride); else \
    AMX_HW(__asm__ volatile("tilestored %%tmm" #t ", (%0,%1,1)" :: "r"((void *)(base)), "r"((long)(stride)) : "memory")); } while (0)
#define AMX_ZERO(emu, t) do { if (emu) emu_zero(t); else AMX_HW(__asm__ volatile("tilezero %%tmm" #t ::)); } while (0)
#define AMX_DP(emu, c, a, b) do { if (emu) emu_dpbssd(c, a, b); else AMX_HW(__asm__ volatile("tdpbssd %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::)); } while (0)

// The configuration this thread loaded (model or hardware << 16 | type << 8 | token rows; 0: none). Tiles 0 / 1: C (G rows of 16 int32);
// 2 / 3: A (G rows of a sub-block's 32 or 16 activation bytes); 4 / 5: B (its decoded weights, 8 or 4 rows of 64
// bytes). Two of each, so that one sub-block's tile product can run while the float steps of the other read theirs.
static _Thread_local int gg_amx_key;
static inline void gg_amx_config(const int emu, int type, int G) {
    const int key = (emu ? 2 : 1) << 16 | type << 8 | G;
    if (gg_amx_key == key) return;
    gg_tilecfg_t c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    const int kb = type == GG_Q4K ? 32 : 16;
    for (int i = 0; i < 2; i++) {
        c.rows[i] = (uint8_t)G, c.colsb[i] = 64;
        c.rows[2 + i] = (uint8_t)G, c.colsb[2 + i] = (uint16_t)kb;
        c.rows[4 + i] = (uint8_t)(kb / 4), c.colsb[4 + i] = 64;
    }
    AMX_CFG(emu, &c);
    gg_amx_key = key;
}
// Every call that configured tiles releases them before it returns (the next one, maybe on another thread's
// library, finds the state as it was).
static void gg_amx_release(void) {
    if (!gg_amx_key) return;
    if (gg_amx_key >> 16 == 2)
        AMX_RELEASE(1);
    else
        AMX_RELEASE(0);
    gg_amx_key = 0;
}

// One sub-block's tile product into ci (G rows of 16 int32), on tile set u (0 or 1).
#define GG_AMX_DP(emu, u, xa, stride, w, ci) do { \
    if (u) { AMX_ZERO(emu, 1); AMX_LOAD(emu, 3, xa, stride); AMX_LOAD(emu, 5, w, 64); AMX_DP(emu, 1, 3, 5); \
             AMX_STORE(emu, 1, ci, 64); } \
    else   { AMX_ZERO(emu, 0); AMX_LOAD(emu, 2, xa, stride); AMX_LOAD(emu, 4, w, 64); AMX_DP(emu, 0, 2, 4); \
             AMX_STORE(emu, 0, ci, 64); } } while (0)
// Sub-block j's product on tile set j & 1 into ci[j & 1], for j < n (the pipeline's next one, past the last: none).
#define GG_AMX_SUB(emu, j, n, xa, stride, w, ci) do { if ((j) < (n)) { \
    if ((j) & 1) GG_AMX_DP(emu, 1, xa, stride, w, ci[1]); else GG_AMX_DP(emu, 0, xa, stride, w, ci[0]); } } while (0)

static inline __attribute__((always_inline)) void gg_amx_q4k(const gx_t *X, const uint8_t *panel, float *y, int ys,
                                                             int K, int left, int s0, const int G, const int emu) {
    const int nsb = K / 256, nb = K / 32;
    uint8_t wq[8][8][64] __attribute__((aligned(64)));  // a super-block's weights: sub-block j, B row 2c / 2c + 1
    int32_t ci[2][GG_AMXG][16] __attribute__((aligned(64)));
    float acc[GG_AMXG][16] __attribute__((aligned(64)));
    vf_t a[GG_AMXG];
    gg_amx_config(emu, GG_Q4K, G);
    for (int i = 0; i < G; i++) _mm512_store_ps(acc[i], gg_set1(0.f));
    const int8_t *xq = X->q + (int64_t)s0 * K;
    for (int s = 0; s < nsb; s++) {
        const uint8_t *rec = panel + (int64_t)s * GG_SB_Q4K, *sc = rec + 2048;
        for (int off = 0; off < GG_SB_Q4K; off += 64) _mm_prefetch((const char *)rec + GG_PF + off, PF_HINT);
        for (int line = 0; line < 32; line++) {
            vi_t lo, hi;
            a8_nibbles(rec + 64 * line, &lo, &hi);
            _mm512_store_si512((void *)wq[line / 4][2 * (line % 4)], lo);
            _mm512_store_si512((void *)wq[line / 4][2 * (line % 4) + 1], hi);
        }
        const vf_t d = gg_loadh(sc), dmin = gg_loadh(sc + 32);
        for (int i = 0; i < G; i++) a[i] = gg_set1(0.f);
        const int8_t *xa = xq + 256 * s;
        GG_AMX_SUB(emu, 0, 8, xa, K, wq[0], ci);
        for (int j = 0; j < 8; j++) {
            GG_AMX_SUB(emu, j + 1, 8, xa + 32 * (j + 1), K, wq[j + 1], ci);  // the next one before these float steps
            const vf_t D = gg_mul(d, gg_u8(sc + 64 + 16 * j));
            const vf_t M = gg_mul(dmin, gg_u8(sc + 192 + 16 * j));
            const int b = 8 * s + j;
            for (int i = 0; i < G; i++) {
                a[i] = vf_fma(vf_cvt(_mm512_load_si512((const void *)ci[j & 1][i])), D, a[i]);
                a[i] = gg_fnma(M, gg_set1(X->xs[(int64_t)(s0 + i) * nb + b]), a[i]);
            }
        }
        for (int i = 0; i < G; i++)
            _mm512_store_ps(acc[i], vf_fma(a[i], gg_set1(X->dx[(int64_t)(s0 + i) * nsb + s]), _mm512_load_ps(acc[i])));
    }
    for (int i = 0; i < G; i++) vf_store(y + (int64_t)(s0 + i) * ys, _mm512_load_ps(acc[i]), left);
}

static inline __attribute__((always_inline)) void gg_amx_q6k(const gx_t *X, const uint8_t *panel, float *y, int ys,
                                                             int K, int left, int s0, const int G, const int emu) {
    const int nsb = K / 256, n16 = K / 16;
    uint8_t wq[16][4][64] __attribute__((aligned(64)));  // sub-block j's B rows: columns 0-3, 4-7, 8-11, 12-15
    int32_t ci[2][GG_AMXG][16] __attribute__((aligned(64)));
    float acc[GG_AMXG][16] __attribute__((aligned(64)));
    vf_t a[GG_AMXG];
    gg_amx_config(emu, GG_Q6K, G);
    for (int i = 0; i < G; i++) _mm512_store_ps(acc[i], gg_set1(0.f));
    const int8_t *xq = X->q + (int64_t)s0 * K;
    for (int s = 0; s < nsb; s++) {
        const uint8_t *rec = panel + (int64_t)s * GG_SB_Q6K, *hb = rec + 2048, *sc = rec + 3072;
        for (int off = 0; off < GG_SB_Q6K; off += 64) _mm_prefetch((const char *)rec + GG_PF + off, PF_HINT);
        for (int j = 0; j < 16; j++) {
            vi_t l0, h0, l1, h1;
            a8_nibbles(rec + 64 * (2 * j), &l0, &h0);
            a8_nibbles(rec + 64 * (2 * j + 1), &l1, &h1);
            const vi_t hi = gg_load(hb + 64 * j);
            _mm512_store_si512((void *)wq[j][0], gg_or(l0, gg_and30(gg_sl(hi, 4))));
            _mm512_store_si512((void *)wq[j][1], gg_or(h0, gg_and30(gg_sl(hi, 2))));
            _mm512_store_si512((void *)wq[j][2], gg_or(l1, gg_and30(hi)));
            _mm512_store_si512((void *)wq[j][3], gg_or(h1, gg_and30(gg_sr(hi, 2))));
        }
        const vf_t d = gg_loadf((const float *)sc);
        for (int i = 0; i < G; i++) a[i] = gg_set1(0.f);
        const int8_t *xa = xq + 256 * s;
        GG_AMX_SUB(emu, 0, 16, xa, K, wq[0], ci);
        for (int j = 0; j < 16; j++) {
            GG_AMX_SUB(emu, j + 1, 16, xa + 16 * (j + 1), K, wq[j + 1], ci);
            const vf_t D = gg_mul(d, gg_i8(sc + 64 + 16 * j));
            for (int i = 0; i < G; i++) {
                const vi_t t = vi_add(vi_set1(X->o[(int64_t)(s0 + i) * n16 + 16 * s + j]),
                                      _mm512_load_si512((const void *)ci[j & 1][i]));
                a[i] = vf_fma(vf_cvt(t), D, a[i]);
            }
        }
        for (int i = 0; i < G; i++)
            _mm512_store_ps(acc[i], vf_fma(a[i], gg_set1(X->dx[(int64_t)(s0 + i) * nsb + s]), _mm512_load_ps(acc[i])));
    }
    for (int i = 0; i < G; i++) vf_store(y + (int64_t)(s0 + i) * ys, _mm512_load_ps(acc[i]), left);
}

// Panels [p0, p1) of a part on the tiles (gg_amx_mode 1 or 2): token rows in passes of at most 16.
static void gg_amx_panels(const gx_t *X, const gg_part_t *pt, float *y, int S, int K, int N, int p0, int p1) {
    const int emu = gg_amx_mode == 2, passes = (S + GG_AMXG - 1) / GG_AMXG;
    const int64_t pbytes = (int64_t)(K / 256) * gg_record(pt->type);
    for (int p = p0; p < p1; p++) {
        const uint8_t *panel = pt->w + p * pbytes;
        float *yp = y + pt->n0 + 16 * p;
        const int left = pt->N - 16 * p;
        for (int g = 0, s0; g < passes; g++) {
            const int G = gg_group(S, g, GG_AMXG, &s0);
#define GG_AMX_CASE(n) case n: \
            if (pt->type == GG_Q4K) { if (emu) gg_amx_q4k(X, panel, yp, N, K, left, s0, n, 1); \
                                      else gg_amx_q4k(X, panel, yp, N, K, left, s0, n, 0); } \
            else { if (emu) gg_amx_q6k(X, panel, yp, N, K, left, s0, n, 1); \
                   else gg_amx_q6k(X, panel, yp, N, K, left, s0, n, 0); } break;
            switch (G) {
                GG_AMX_CASE(1) GG_AMX_CASE(2) GG_AMX_CASE(3) GG_AMX_CASE(4) GG_AMX_CASE(5) GG_AMX_CASE(6)
                GG_AMX_CASE(7) GG_AMX_CASE(8) GG_AMX_CASE(9) GG_AMX_CASE(10) GG_AMX_CASE(11) GG_AMX_CASE(12)
                GG_AMX_CASE(13) GG_AMX_CASE(14) GG_AMX_CASE(15) GG_AMX_CASE(16)
            }
#undef GG_AMX_CASE
        }
    }
}

// The model alone, for the tests that pin it to the instruction reference: one TDPBSSD of A [M, Kb] by B [b_rows,
// 4 N] (VNNI layout) into a zeroed C [M, N], configured as tiles 0 (C), 2 (A), 4 (B); and a load with no
// configuration, which the hardware refuses.
void gguf_amx_model_dp(const int8_t *a, const int8_t *b, int32_t *c, int M, int Kb, int N, int b_rows) {
    gg_tilecfg_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    cfg.rows[0] = (uint8_t)M, cfg.colsb[0] = (uint16_t)(4 * N);
    cfg.rows[2] = (uint8_t)M, cfg.colsb[2] = (uint16_t)Kb;
    cfg.rows[4] = (uint8_t)b_rows, cfg.colsb[4] = (uint16_t)(4 * N);
    emu_cfg(&cfg);
    emu_zero(0);
    emu_load(2, a, Kb);
    emu_load(4, b, 4 * N);
    emu_dpbssd(0, 2, 4);
    emu_store(0, c, 4 * N);
    memset(&amx_emu, 0, sizeof amx_emu);
}
void gguf_amx_model_unconfigured(void) {
    static const int8_t z[64];
    memset(&amx_emu, 0, sizeof amx_emu);
    emu_load(2, z, 64);
}

// Whether this process may use the AMX instructions: 1 yes; 0 the CPU lacks AMX-TILE or AMX-INT8 (CPUID.7.0:EDX bits
// 24, 25); -1 the OS has not enabled their state (XCR0 bits 17, 18); -2 Linux refused XTILEDATA
// (arch_prctl(ARCH_REQ_XCOMP_PERM), kernels before 5.16 lack it); -3 this library was built without the instructions.
#include <cpuid.h>
int gguf_amx_probe(void) {
#if defined(SKINNY_NO_AMX)
    return -3;
#else
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d >> 24 & 1) || !(d >> 25 & 1)) return 0;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c >> 27 & 1)) return -1;  // no OSXSAVE: xgetbv is not there
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo >> 17 & 3) != 3) return -1;
    if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) return -2;
    return 1;
#endif
}

// Set the GGUF tiles: 0 the AVX-512 ones, 1 AMX where gguf_amx_probe allows it (else 0), 2 the AMX code on the
// software model (tests); -1 only reads. Returns the mode now in force.
int gguf_amx(int want) {
    if (want == 0 || want == 2) gg_amx_mode = want;
    if (want == 1) gg_amx_mode = gguf_amx_probe() == 1;
    return gg_amx_mode;
}
// Set the fewest token rows the tiles take (1..1024; anything else only reads). Returns the value now in force.
int gguf_amx_min_rows(int rows) {
    if (rows >= 1 && rows <= 1024) gg_amx_min_rows = rows;
    return gg_amx_min_rows;
}
#else
static void gg_amx_release(void) {}
int gguf_amx_probe(void) { return 0; }
int gguf_amx(int want) { (void)want; return 0; }
int gguf_amx_min_rows(int rows) { (void)rows; return 0; }
#endif

// X->qi of the AVX2 tiles: each group's rows, 4 columns of each in turn.
static void gg_interleave(const int8_t *q, int8_t *qi, int S, int K) {
    for (int g = 0, s0; g < (S + GG_MAXG - 1) / GG_MAXG; g++) {
        const int G = gg_group(S, g, GG_MAXG, &s0);
        int8_t *out = qi + (int64_t)s0 * K;
        for (int k = 0; k < K; k += 4)
            for (int i = 0; i < G; i++) memcpy(out + ((int64_t)(k / 4) * G + i) * 4, q + (int64_t)(s0 + i) * K + k, 4);
    }
}

#include "gguf_blocks32.c"

// Panels [p0, p1) of a part, every token row of the chunk, in groups of at most GG_MAXG rows.
static void gg_panels(const gx_t *X, const gg_part_t *pt, float *y, int S, int K, int N, int p0, int p1) {
    if (gg_is32(pt->type)) {
        gg32_panels(X, pt, y, S, K, N, p0, p1);
        return;
    }
#if defined(__AVX512F__)
    if (gg_amx_mode && S >= gg_amx_min_rows) {
        gg_amx_panels(X, pt, y, S, K, N, p0, p1);
        return;
    }
#endif
    const int groups = (S + GG_MAXG - 1) / GG_MAXG;
    const int64_t pbytes = (int64_t)(K / 256) * gg_record(pt->type);
    for (int p = p0; p < p1; p++) {
        const uint8_t *panel = pt->w + p * pbytes;
        float *yp = y + pt->n0 + 16 * p;
        const int left = pt->N - 16 * p;
        for (int g = 0, s0; g < groups; g++) {
            const int G = gg_group(S, g, GG_MAXG, &s0);
#define GG_CASE(T, n) case n: gg_tile_##T(X, panel, yp, N, K, left, s0, n); break;
            if (pt->type == GG_Q4K) {
                switch (G) { GG_CASE(q4k, 1) GG_CASE(q4k, 2)
                             GG_CASE(q4k, 3) GG_CASE(q4k, 4) GG_CASE(q4k, 5) GG_CASE(q4k, 6) GG_CASE(q4k, 7)
                             GG_CASE(q4k, 8)
                }
            } else {
                switch (G) { GG_CASE(q6k, 1) GG_CASE(q6k, 2)
                             GG_CASE(q6k, 3) GG_CASE(q6k, 4) GG_CASE(q6k, 5) GG_CASE(q6k, 6) GG_CASE(q6k, 7)
                             GG_CASE(q6k, 8)
                }
            }
#undef GG_CASE
        }
    }
}

// One thread's panels of a part (its share, then the others' from the back), with IEEE denormals on that thread.
typedef struct {
    const gx_t *X;
    const gg_part_t *pt;
    float *y;
    share_t *share;
    int S, K, N, blk, threads;
} gg_job_t;
static void gg_share(void *ctx, int t) {
    const gg_job_t *j = (const gg_job_t *)ctx;
    const unsigned int csr = _mm_getcsr();
    _mm_setcsr(csr & ~0x8040u);
    int a, b;
    while (claim(j->share, j->threads, t, j->blk, &a, &b)) gg_panels(j->X, j->pt, j->y, j->S, j->K, j->N, a, b);
    gg_amx_release();
    _mm_setcsr(csr);
}

// The chunk's token rows quantized (gg_quant_row) on the pool, rows split evenly: alone on the calling thread, 7 rows
// of the 1.5B's down projection (K = 8960) took 19 us while the other threads waited (Zen 4, in cache).
#define GG_QUANT_POOL 16384  // columns in the chunk from which the rows are quantized on the pool
typedef struct {
    const float *x;
    int8_t *q;
    float *dx, *xs;
    int32_t *o;
    int K, rows, parts;
    int need256;                 // a k-quant part: gg_quant_row
    int8_t *q32;                 // a 32-block part (gguf_blocks32.c): gg_quant32_row, else NULL
    float *dx32, *xs32;
} gg_quant_job_t;
static void gg_quant_share(void *ctx, int t) {
    const gg_quant_job_t *j = (const gg_quant_job_t *)ctx;
    const int K = j->K;
    const unsigned int csr = _mm_getcsr();
    _mm_setcsr(csr & ~0x8040u);  // as on the calling thread: IEEE denormals, round to nearest
    for (int s = j->rows * t / j->parts; s < j->rows * (t + 1) / j->parts; s++) {
        if (j->need256)
            gg_quant_row(j->x + (int64_t)s * K, K, j->q + (int64_t)s * K, j->dx + (int64_t)s * (K / 256),
                         j->xs + (int64_t)s * (K / 32), j->o + (int64_t)s * (K / 16));
        if (j->q32)
            gg_quant32_row(j->x + (int64_t)s * K, K, j->q32 + (int64_t)s * K, j->dx32 + (int64_t)s * (K / 32),
                           j->xs32 + (int64_t)s * (K / 32));
    }
    _mm_setcsr(csr);
}

// y[S, N] = x[S, K] @ W.T for a GGUF layer (K % 256 == 0); threads share panels as skinny_matmul shares rows.
static int gguf_matmul(const float *x, const gg_desc_t *desc, float *y, int S, int K, int N, int threads) {
    if (threads < 1) threads = 1;
    const int rows_max = S < ROW_CHUNK ? S : ROW_CHUNK;
    // Scratch from the calling thread's slots (skinny.c): reused between calls, checked, never aborting.
    int oq, oqi = 0, odx, oxs, oo, osh, rc = SK_OK;
    int8_t *q = (int8_t *)scratch(SC_GGQ, (size_t)rows_max * K, &oq);
#if defined(__AVX512F__)
    const int interleave = 0;  // the AVX-512 tiles read q row by row
#else
    const int interleave = S > 1;  // one token's interleaved layout is q itself: a decode step copies nothing
#endif
    int need32 = 0, need256 = 0;
    for (int pi = 0; pi < desc->nparts; pi++) {
        if (gg_is32(desc->part[pi].type)) need32 = 1;
        else need256 = 1;
    }
    int8_t *qi = interleave && need256 ? (int8_t *)scratch(SC_GGQI, (size_t)rows_max * K, &oqi) : q;
    float *dx = (float *)scratch(SC_GGDX, sizeof(float) * (size_t)rows_max * (K / 256 + 1), &odx);
    float *xs = (float *)scratch(SC_GGXS, sizeof(float) * (size_t)rows_max * (K / 32), &oxs);
    int32_t *o = (int32_t *)scratch(SC_GGO, sizeof(int32_t) * (size_t)rows_max * (K / 16), &oo);
    share_t *share = (share_t *)scratch(SC_SHARE, sizeof(share_t) * (size_t)threads, &osh);
    // The 32-block types' activations (gguf_blocks32.c), from the heap: q [rows, K], then dx and xs [rows, K / 32].
    int8_t *q32 = need32 ? (int8_t *)malloc((size_t)rows_max * K + 2 * sizeof(float) * (size_t)rows_max * (K / 32))
                         : NULL;
    float *dx32 = q32 ? (float *)(q32 + (size_t)rows_max * K) : NULL;
    float *xs32 = q32 ? dx32 + (size_t)rows_max * (K / 32) : NULL;
    if (!q || !qi || !dx || !xs || !o || !share || (need32 && !q32)) {
        rc = SK_ENOMEM;
        goto done;
    }
    const gx_t X = {q, qi, dx, xs, o, q32, dx32, xs32};
    const unsigned int csr = _mm_getcsr();
    _mm_setcsr(csr & ~0x8040u);  // IEEE denormals: the contract above, whatever the caller's mode
    for (int c0 = 0; c0 < S; c0 += ROW_CHUNK) {
        const int cs = S - c0 < ROW_CHUNK ? S - c0 : ROW_CHUNK;
        const int qparts = (int64_t)cs * K >= GG_QUANT_POOL ? (threads < cs ? threads : cs) : 1;
        const gg_quant_job_t qjob = {x + (int64_t)c0 * K, q, dx, xs, o, K, cs, qparts, need256, q32, dx32, xs32};
        pool_run(gg_quant_share, (void *)&qjob, qparts);
        if (interleave && need256) gg_interleave(q, qi, cs, K);
        float *yc = y + (int64_t)c0 * N;
        for (int pi = 0; pi < desc->nparts; pi++) {
            const gg_part_t *pt = &desc->part[pi];
            const int P = (pt->N + 15) / 16;
            const int64_t pbytes = gg_panel_bytes(pt->type, K);
            const int blk = pbytes >= CLAIM_BYTES ? 1 : (int)(CLAIM_BYTES / pbytes);
            const int chunk = (P + threads - 1) / threads;
            if (threads == 1 || P < 2) {
                gg_panels(&X, pt, yc, cs, K, N, 0, P);
                gg_amx_release();
                continue;
            }
            for (int t = 0; t < threads; t++) {
                const uint32_t n0 = (uint32_t)(t * chunk < P ? t * chunk : P);
                const uint32_t n1 = n0 + chunk < (uint32_t)P ? n0 + chunk : (uint32_t)P;
                atomic_init(&share[t].v, (uint64_t)n1 << 32 | n0);
            }
            const gg_job_t job = {&X, pt, yc, share, cs, K, N, blk, threads};
            pool_run(gg_share, (void *)&job, threads);
        }
    }
    _mm_setcsr(csr);
done:
    scratch_done(share, osh);
    scratch_done(q, oq);
    if (interleave && need256) scratch_done(qi, oqi);
    scratch_done(dx, odx);
    scratch_done(xs, oxs);
    scratch_done(o, oo);
    free(q32);
    return rc;
}

// The AMX tiles against the AVX-512 tiles, bit for bit, before kernels.py lets a process use them: the AMX code has
// run only on the software model here, so on a machine with the instructions it first proves itself (in a child
// process, so that a tile fault cannot take the caller down). want: 1 the instructions, 2 the model (tests). Three
// parts as a fused layer has them (Q4_K with a partial panel, Q6_K, Q4_K; K = 512), S = 1..20 token rows (past one
// 16-row tile pass), one and two threads, weights with random bits and extreme fp16 scales (0, the smallest
// subnormal, 65504, negative), activation rows of every size: all zero, below the quantizer's 1e-30, one huge value.
// Returns 0 when every output's bits agree; 1000 S + 100 (threads - 1) + the first differing column (mod 100) when
// one does not; -1 where `want` cannot run (no AMX, or mode 1 refused by gguf_amx_probe); -2 out of memory.
#if defined(__AVX512F__)
int gguf_amx_selftest(int want) {
    if (want != 1 && want != 2) return -1;
    if (want == 1 && gguf_amx_probe() != 1) return -1;
    enum { K = 512, NSB = K / 256, SMAX = 20 };
    const int types[3] = {GG_Q4K, GG_Q6K, GG_Q4K}, rows[3] = {40, 24, 16};
    uint64_t r = 0x9E3779B97F4A7C15ull;
    gg_desc_t desc = {3, K, {{0}}};
    uint8_t *w[3] = {0};
    int N = 0, rc = 0;
    for (int i = 0; i < 3; i++) {
        const int rec = gg_record(types[i]), P = (rows[i] + 15) / 16;
        w[i] = aligned_alloc(64, (size_t)P * NSB * rec);
        if (!w[i]) { rc = -2; goto out; }
        for (size_t b = 0; b < (size_t)P * NSB * rec; b++) r ^= r << 13, r ^= r >> 7, r ^= r << 17, w[i][b] = (uint8_t)r;
        static const float fp16[] = {0.f, 5.9604645e-8f, 65504.f, -65504.f, -0.5f, 1e-3f, 3.0517578e-5f, 2.0f};
        for (int rb = 0; rb < P * NSB; rb++) {
            uint8_t *rec0 = w[i] + (size_t)rb * rec + 2048 + (types[i] == GG_Q6K ? 1024 : 0);
            for (int l = 0; l < (types[i] == GG_Q4K ? 32 : 16); l++) {  // d (and Q4_K's dmin): fp16 values
                r ^= r << 13, r ^= r >> 7, r ^= r << 17;
                const float v = rb == 0 ? fp16[l % 8] : ldexpf((float)(1024 + r % 1024), -24 - (int)(r >> 32) % 12);
                if (types[i] == GG_Q4K) {  // Q4_K keeps them as fp16 (rounded to it: both paths read the same bytes)
                    const uint16_t hv = _cvtss_sh(v, 0);
                    memcpy(rec0 + 2 * l, &hv, 2);
                } else {
                    memcpy(rec0 + 4 * l, &v, 4);
                }
            }
            if (types[i] == GG_Q4K)
                for (int b = 0; b < 256; b++) rec0[64 + b] &= 63;  // 6-bit sub-block scales and mins
        }
        desc.part[i] = (gg_part_t){types[i], rows[i], N, 0, w[i]};
        N += rows[i];
    }
    float *x = aligned_alloc(64, sizeof(float) * SMAX * K), *ref = aligned_alloc(64, sizeof(float) * SMAX * N),
          *y = aligned_alloc(64, sizeof(float) * SMAX * N);
    if (!x || !ref || !y) { rc = -2; goto done; }
    for (int s = 0; s < SMAX; s++)
        for (int k = 0; k < K; k++) {
            r ^= r << 13, r ^= r >> 7, r ^= r << 17;
            const float v = (float)((int)(r % 20001) - 10000) * 1e-4f;
            x[s * K + k] = s == 3 ? 0.f : s == 5 ? v * 1e-32f : s == 7 ? (k == 300 ? 1e30f : v) : ldexpf(v, s % 9 - 4);
        }
    const int saved = gg_amx_mode, saved_min = gg_amx_min_rows;
    gg_amx_min_rows = 1;  // the AMX code at every row count, whatever takes the tiles in use
    for (int threads = 1; threads <= 2 && !rc; threads++)
        for (int S = 1; S <= SMAX && !rc; S++) {
            gg_amx_mode = 0;
            int e = gguf_matmul(x, &desc, ref, S, K, N, threads);
            gg_amx_mode = want;
            e = e ? e : gguf_matmul(x, &desc, y, S, K, N, threads);
            gg_amx_release();
            if (e) { rc = -2; break; }
            for (int n = 0; n < S * N; n++)
                if (memcmp(ref + n, y + n, 4) != 0) { rc = 1000 * S + 100 * (threads - 1) + (n % N) % 100; break; }
        }
    gg_amx_mode = saved, gg_amx_min_rows = saved_min;
done:
    free(x), free(ref), free(y);
out:
    for (int i = 0; i < 3; i++) free(w[i]);
    return rc;
}
#else
int gguf_amx_selftest(int want) { (void)want; return -1; }
#endif

// The weights a part stands for, out [N, K] fp32, as gguf.quants computes them: Q4_K RN(RN(D q) - M) with D = d sc,
// M = dmin m; Q6_K RN(D (q - 32)). Read from the packed panels, for the tests that pin them to the GGUF reference.
void gguf_dequant(const gg_desc_t *desc, int part, float *out) {
    const gg_part_t *pt = &desc->part[part];
    const int K = desc->K, nsb = K / 256, rec = gg_record(pt->type);
    const unsigned int csr = _mm_getcsr();
    _mm_setcsr(csr & ~0x8040u);
    if (gg_is32(pt->type)) {
        gg32_dequant(pt, K, out);
        _mm_setcsr(csr);
        return;
    }
    for (int n = 0; n < pt->N; n++) {
        const int p = n / 16, l = n % 16;
        for (int s = 0; s < nsb; s++) {
            const uint8_t *r = pt->w + ((int64_t)p * nsb + s) * rec;
            for (int k = 0; k < 256; k++) {
                const int line = k / 8, byte = 64 * line + 4 * l + k % 4, nib = (k % 8) / 4;
                int qv = (r[byte] >> (4 * nib)) & 15;
                float v;
                if (pt->type == GG_Q4K) {
                    const uint8_t *sc = r + 2048;
                    uint16_t dh, mh;
                    memcpy(&dh, sc + 2 * l, 2);
                    memcpy(&mh, sc + 32 + 2 * l, 2);
                    const float d = _cvtsh_ss(dh), dmin = _cvtsh_ss(mh);
                    const volatile float D = d * (float)sc[64 + 16 * (k / 32) + l];
                    const volatile float M = dmin * (float)sc[192 + 16 * (k / 32) + l];
                    const volatile float Dq = D * (float)qv;
                    v = Dq - M;
                } else {
                    const int jj = k % 16, field = jj / 4;  // hi line k / 16: bits 2 field of byte 4 l + jj % 4
                    qv |= ((r[2048 + 64 * (k / 16) + 4 * l + jj % 4] >> (2 * field)) & 3) << 4;
                    const uint8_t *sc = r + 3072;
                    float d;
                    memcpy(&d, sc + 4 * l, 4);
                    const volatile float D = d * (float)(int8_t)sc[64 + 16 * (k / 16) + l];
                    v = D * (float)(qv - 32);
                }
                out[(int64_t)n * K + 256 * s + k] = v;
            }
        }
    }
    _mm_setcsr(csr);
}
