// What a step does with its logits, in C (#included by skinny.c, one translation unit with it, after the layers'
// kernels it calls): the greedy pick and its probability, the head screen's bounds and its one-call pass over
// the head (pipeline/runtime/head_screen.py), sampling by inverse CDF, and the softmax rows sampling reads.

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
