// What does vdpbf16ps compute on this CPU? Compares it bitwise, lane by lane, with scalar models (float128
// arithmetic) that differ in order, rounding and denormal handling, on random and adversarial inputs.
// Flags bit: 1 DAZ bf16 inputs, 2 DAZ acc, 4 FTZ intermediate, 8 FTZ output, 16 even element first,
// 32 single rounding, 64 products rounded to fp32. On AMD Zen 4 only flags 15 matches (0 mismatches on 16M lanes):
// acc = RN(acc + a[2j+1] b[2j+1]); acc = RN(acc + a[2j] b[2j]), exact products, DAZ inputs, FTZ results.
//   gcc -O2 -mavx512f -mavx512bf16 -mavx512bw experiments/dpbf16_model.c -o /tmp/m -lm -lquadmath
//   /tmp/m 200000        # every model, the ones with < 20000 mismatches
//   /tmp/m 1000000 15    # one model, with examples of mismatches
#include <stdio.h>
#include <stdint.h>
#include <string.h>
#include <stdlib.h>
#include <math.h>
#include <quadmath.h>
#include <immintrin.h>
typedef __float128 Q;
static uint64_t s = 88172645463325252ull;
static inline uint64_t rnd(void) { s ^= s << 13; s ^= s >> 7; s ^= s << 17; return s; }
static inline float f_(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t u_(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float bf(uint16_t b) { return f_((uint32_t)b << 16); }
static inline float daz(float f) { return fpclassify(f) == FP_SUBNORMAL ? copysignf(0.f, f) : f; }
// flags: 1 DAZ bf16 inputs, 2 DAZ acc, 4 FTZ intermediate, 8 FTZ output, 16 even-first, 32 single rounding,
//        64 products rounded to fp32 (not wide)
static float cand(float acc, uint16_t a0, uint16_t a1, uint16_t b0, uint16_t b1, int fl) {
    float x0 = bf(a0), x1 = bf(a1), y0 = bf(b0), y1 = bf(b1);
    if (fl & 1) { x0 = daz(x0); x1 = daz(x1); y0 = daz(y0); y1 = daz(y1); }
    if (fl & 2) acc = daz(acc);
    Q p0 = (Q)x0 * y0, p1 = (Q)x1 * y1;
    if (fl & 64) { p0 = (float)p0; p1 = (float)p1; }
    if (fl & 16) { Q t = p0; p0 = p1; p1 = t; }
    if (fl & 32) { float r = (float)((Q)acc + p1 + p0); return (fl & 8) ? daz(r) : r; }
    float t = (float)((Q)acc + p1);
    if (fl & 4) t = daz(t);
    float r = (float)((Q)t + p0);
    return (fl & 8) ? daz(r) : r;
}
static uint16_t gen_bf(int mode) {
    uint16_t r = rnd();
    switch (mode) {
    case 0: return r;
    case 1: { float f = (float)((int)(rnd() % 2001) - 1000) / 97.f; return u_(f) >> 16; }
    case 2: return (r & 0x807F) | ((uint16_t)(rnd() % 8) << 7);
    case 3: return (r & 0x807F) | ((uint16_t)(60 + rnd() % 10) << 7);
    case 4: return (r & 0x807F) | ((uint16_t)(120 + rnd() % 16) << 7);
    default: return (r & 0x807F) | ((uint16_t)(190 + rnd() % 65) << 7);
    }
}
int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 200000;
    static long bad[128][6]; long cnt[6] = {0};
    int shown[128] = {0};
    int only = argc > 2 ? atoi(argv[2]) : -1;
    for (long it = 0; it < n; it++) {
        uint16_t a[32], b[32]; float acc[16];
        int mode = it % 6;
        for (int i = 0; i < 32; i++) { a[i] = gen_bf(mode); b[i] = gen_bf(mode == 0 ? 0 : (rnd() % 6)); }
        for (int j = 0; j < 16; j++) {
            uint32_t kind = rnd() % 5;
            if (kind == 0) acc[j] = f_((uint32_t)rnd());
            else if (kind == 1) acc[j] = -bf(a[2*j+1]) * bf(b[2*j+1]) * (1.0f + (float)(rnd()%16)/ (1<<20));
            else if (kind == 2) acc[j] = -bf(a[2*j]) * bf(b[2*j]) - bf(a[2*j+1]) * bf(b[2*j+1]);
            else if (kind == 3) acc[j] = -bf(a[2*j]) * bf(b[2*j]) * (1.0f + (float)(rnd()%16)/ (1<<20));
            else acc[j] = f_((uint32_t)(rnd() & 0x807FFFFF) | ((uint32_t)(rnd() % 8) << 23));
        }
        __m512 va = _mm512_loadu_ps(acc);
        __m512bh wa, wb; memcpy(&wa, a, 64); memcpy(&wb, b, 64);
        float out[16]; _mm512_storeu_ps(out, _mm512_dpbf16_ps(va, wa, wb));
        for (int j = 0; j < 16; j++) {
            uint32_t h = u_(out[j]); cnt[mode]++;
            for (int q = 0; q < 128; q++) {
                if (only >= 0 && q != only) continue;
                float c = cand(acc[j], a[2*j], a[2*j+1], b[2*j], b[2*j+1], q);
                if (!(u_(c) == h || (isnan(c) && isnan(out[j])))) {
                    bad[q][mode]++;
                    if (only >= 0 && shown[q]++ < 12)
                        printf("mode %d: acc %08x a %04x %04x b %04x %04x hw %08x cand %08x\n", mode, u_(acc[j]), a[2*j], a[2*j+1], b[2*j], b[2*j+1], h, u_(c));
                }
            }
        }
    }
    for (int q = 0; q < 128; q++) {
        if (only >= 0 && q != only) continue;
        long t = 0; for (int m = 0; m < 6; m++) t += bad[q][m];
        if (only < 0 && t > 20000) continue;
        printf("flags %3d:", q);
        for (int m = 0; m < 6; m++) printf(" m%d:%ld/%ld", m, bad[q][m], cnt[m]);
        printf("\n");
    }
}
