// The GGUF tiles alone: gguf_matmul (pipeline/runtime/gguf_kernels.c, through skinny.c as the library builds it) on
// random Q4_K or Q6_K panels, S = 1..8 token rows (or the comma-separated list given as the 8th argument, up to 1024), timed in C with no Python between calls, against the build's own
// int8 peak (int8_peak: vpdpbusd in 12 independent chains). `copies` > 1 cycles through that many copies of the
// weights, so with a total above the L3 they stream from memory as in a decode step; 1 keeps them in cache, which
// leaves only the tile's own instruction cost.
//   gcc -O3 -ffp-contract=off -pthread -mavx2 -mfma -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512bf16 -mavx512vnni -mf16c experiments/gguf_tile.c -o /tmp/gguf_tile -lm
//   /tmp/gguf_tile q4k 1024 1536 1 1      # type, rows N, columns K, threads, copies [, seconds per S]
//   /tmp/gguf_tile q4k 17920 1536 2 12    # gate/up of the 1.5B target, streamed (12 x 16.3 MB)
//   /tmp/gguf_tile q4k 1024 1536 1 1 1 amx   # the AMX tiles (Sapphire Rapids and later), checked bit for bit against
//                                            # the AVX-512 tiles at every S first; `amx-model` runs the same code on
//                                            # the software model of the tiles (its timings mean nothing)
//   /tmp/gguf_tile q4k 1536 1536 1 1 1 avx512 1,4,8,16,32,64,128,256,512   # rows per step up to a prefill chunk
// Drop the AVX-512 flags (keep -mavx2 -mfma -mf16c) for the AVX2 build. docs/gguf_weights.md has what it printed on Zen 4.
#include "../pipeline/runtime/skinny.c"

#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static uint64_t rng = 88172645463325252ull;
static uint32_t rnd(void) {
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (uint32_t)rng;
}

int main(int argc, char **argv) {
    if (argc < 6) {
        fprintf(stderr, "usage: %s q4k|q6k N K threads copies [seconds per S [avx512|amx|amx-model [S,S,...]]]\n",
                argv[0]);
        return 2;
    }
    const int type = strcmp(argv[1], "q6k") == 0 ? GG_Q6K : GG_Q4K;
    const int N = atoi(argv[2]), K = atoi(argv[3]), threads = atoi(argv[4]), copies = atoi(argv[5]);
    const double secs = argc > 6 ? atof(argv[6]) : 1.0;
    if (N < 1 || K < 256 || K % 256 || threads < 1 || copies < 1) {
        fprintf(stderr, "N >= 1, K a multiple of 256, threads and copies >= 1\n");
        return 2;
    }
    const int rec = gg_record(type), P = (N + 15) / 16, nsb = K / 256;
    const size_t bytes = (size_t)P * nsb * rec, stride = (bytes + 4095) & ~(size_t)4095;
    uint8_t *w = aligned_alloc(4096, stride * copies);
    for (size_t i = 0; i < bytes; i++) w[i] = (uint8_t)rnd();
    for (size_t r = 0; r < (size_t)P * nsb; r++) {  // sane scales: fp32 d (and dmin), 6-bit Q4_K sub-block scales
        uint8_t *b = w + r * rec;
        if (type == GG_Q4K) {  // d and dmin fp16, then the 6-bit scales and mins
            for (int l = 0; l < 32; l++) {
                const uint16_t h = _cvtss_sh(1e-3f * (float)(1 + rnd() % 100), 0);
                memcpy(b + 2048 + 2 * l, &h, 2);
            }
            for (int i = 0; i < 256; i++) b[2048 + 64 + i] &= 63;
        } else {
            float *d = (float *)(b + 3072);
            for (int l = 0; l < 16; l++) d[l] = 1e-3f * (float)(1 + rnd() % 100);
        }
    }
    for (int c = 1; c < copies; c++) memcpy(w + stride * c, w, bytes);
    int list[64], ns = 0, smax = 8;
    if (argc > 8) {
        for (char *t = strtok(argv[8], ","); t && ns < 63; t = strtok(NULL, ","))
            if (atoi(t) >= 1 && atoi(t) <= 1024) list[ns++] = atoi(t);
    } else {
        for (int S = 1; S <= 8; S++) list[ns++] = S;
    }
    list[ns++] = list[0];  // the first S again: a late first-touch or huge-page effect shows as a change
    for (int i = 0; i < ns; i++) smax = list[i] > smax ? list[i] : smax;
    float *x = malloc(sizeof(float) * smax * K), *y = malloc(sizeof(float) * smax * N);
    for (int i = 0; i < smax * K; i++) x[i] = (float)((int)(rnd() % 2001) - 1000) * 1e-3f;
    gg_desc_t d = {1, K, {{type, N, 0, 0, w}}};
    const char *mode = argc > 7 ? argv[7] : "avx512";
    if (strcmp(mode, "avx512") != 0) {
#if !defined(__AVX512F__)
        fprintf(stderr, "mode %s: the AMX tiles need the AVX-512 build (this is the AVX2 one)\n", mode);
        return 2;
#else
        const int want = strcmp(mode, "amx") == 0 ? 1 : strcmp(mode, "amx-model") == 0 ? 2 : -1;
        if (want < 0 || (want == 1 && gguf_amx_probe() != 1)) {
            fprintf(stderr, want < 0 ? "mode: avx512, amx or amx-model\n" : "no AMX here (gguf_amx_probe %d)\n",
                    gguf_amx_probe());
            return 2;
        }
        float *ref = malloc(sizeof(float) * smax * N);
        for (int S = 1; S <= smax; S += S < 20 ? 1 : 37) {  // the tiles' bits against the AVX-512 tiles' before any timing
            gguf_amx(0);
            gguf_matmul(x, &d, ref, S, K, N, threads);
            gguf_amx(want);
            gguf_matmul(x, &d, y, S, K, N, threads);
            if (memcmp(ref, y, sizeof(float) * S * N) != 0 || gg_amx_faults) {
                printf("%s differs from the AVX-512 tiles at S = %d (model faults %lld)\n", mode, S,
                       (long long)gg_amx_faults);
                return 1;
            }
        }
        printf("%s: the same bits as the AVX-512 tiles at S = 1..20 and up to %d\n", mode, smax);
        free(ref);
#endif
    }

    double peak = 0;  // int8 multiply-adds per second, best of 3
    for (int r = 0; r < 3; r++) {
        const double t = now();
        const double rate = (double)int8_peak(1 << 20, threads) / (now() - t);
        peak = rate > peak ? rate : peak;
    }
    printf("%s N=%d K=%d, %d thread(s), %d cop%s of %.1f MB; int8 peak %.0f G multiply-adds/s\n", argv[1], N, K,
           threads, copies, copies == 1 ? "y" : "ies", bytes / 1e6, peak / 1e9);
    printf("  S   best us  median us   G MAC/s  of peak  weight GB/s\n");
    for (int r = 0; r < ns; r++) {
        const int S = list[r];
        gguf_matmul(x, &d, y, S, K, N, threads);
        double times[4096];
        int n = 0;
        const double t0 = now();
        while (now() - t0 < secs && n < 4096) {
            const double t = now();
            for (int c = 0; c < copies; c++) {
                d.part[0].w = w + stride * c;
                gguf_matmul(x, &d, y, S, K, N, threads);
            }
            times[n++] = (now() - t) / copies;
        }
        for (int i = 1; i < n; i++)  // insertion sort: n is small
            for (int j = i; j > 0 && times[j] < times[j - 1]; j--) {
                const double s = times[j];
                times[j] = times[j - 1], times[j - 1] = s;
            }
        const double best = times[0], med = times[n / 2], macs = (double)S * N * K;
        printf("%3d %9.1f %10.1f %9.1f %7.0f%% %12.1f\n", S, best * 1e6, med * 1e6, macs / best / 1e9,
               100 * macs / best / peak, bytes / best / 1e9);
    }
    return 0;
}
