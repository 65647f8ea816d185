// Attention over the bf16 K/V cache for few-token steps and prefill chunks (#included by skinny.c, one
// translation unit with it, before decoder_layer, which calls it).

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
