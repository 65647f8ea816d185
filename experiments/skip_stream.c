// Does a matmul that skips the weights of zeroed activations read fewer bytes' worth of time? (activation sparsity,
// TEAL / CATS / Deja Vu: the columns a token row zeroes need not be read, if each column's weights are contiguous.)
// Streams a buffer of MB megabytes in granules of G bytes, a random fraction F of the granules skipped (one fixed
// mask), on T threads (each its own half), with or without a software prefetch of the kept granule PF bytes ahead;
// prints the best of REPS passes and the rate over the whole buffer and over the bytes read. G stands for one
// column's weights in a column-major int4 layout: 448 B for the 0.5B draft's down projection (896 rows), 4864 B for
// its gate/up (9728 rows), 576 B for q/k/v; 64 B for skipping single cache lines of the row-major W4A8 blocks.
//   gcc -O2 -mavx512f -mavx512bw -pthread experiments/skip_stream.c -o /tmp/skip_stream
//   /tmp/skip_stream 512 64 0 0 2 5          # the whole buffer: the reference
//   /tmp/skip_stream 512 4864 0.6 5120 2 5   # 40% of gate/up-sized columns kept, prefetched 5 KB ahead
// experiments/kernel_log.md (2026-12-06, activation sparsity) has what it printed on Zen 4.
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

typedef struct {
    const uint8_t *p;
    size_t n;
    int G;
    const uint8_t *keep;
    int pf;
    __m512i acc;
} job_t;

static void *run(void *a) {
    job_t *j = a;
    __m512i acc = _mm512_setzero_si512();
    const size_t ng = j->n / j->G;
    for (size_t g = 0; g < ng; g++) {
        if (!j->keep[g]) continue;
        const uint8_t *q = j->p + g * (size_t)j->G;
        if (j->pf) {
            const size_t ga = (g * (size_t)j->G + j->pf) / j->G;
            if (ga < ng && j->keep[ga])
                for (int o = 0; o < j->G; o += 64) _mm_prefetch((const char *)(j->p + ga * (size_t)j->G + o), _MM_HINT_T1);
        }
        for (int o = 0; o < j->G; o += 64) acc = _mm512_add_epi32(acc, _mm512_loadu_si512((const void *)(q + o)));
    }
    j->acc = acc;
    return 0;
}

int main(int argc, char **argv) {
    if (argc != 7) {
        fprintf(stderr, "usage: %s MB G F PF T REPS (e.g. 512 4864 0.6 5120 2 5)\n", argv[0]);
        return 2;
    }
    const size_t B = (size_t)atol(argv[1]) << 20;
    const int G = atoi(argv[2]), pf = atoi(argv[4]), T = atoi(argv[5]), reps = atoi(argv[6]);
    const double F = atof(argv[3]);
    if (G < 64 || G % 64 || T < 1 || T > 8) {
        fprintf(stderr, "G must be a multiple of 64 bytes, T 1..8\n");
        return 2;
    }
    uint8_t *buf = aligned_alloc(4096, B);
    memset(buf, 1, B);
    const size_t ng = B / G;
    uint8_t *keep = malloc(ng);
    srand(7);
    size_t kept = 0;
    for (size_t g = 0; g < ng; g++) kept += keep[g] = rand() / (double)RAND_MAX >= F;
    double best = 1e9;
    for (int r = 0; r < reps; r++) {
        job_t J[8];
        pthread_t th[8];
        const double t0 = now();
        for (int t = 0; t < T; t++) {
            const size_t per = ng / T;
            J[t] = (job_t){buf + t * per * G, per * G, G, keep + t * per, pf, _mm512_setzero_si512()};
            pthread_create(&th[t], 0, run, &J[t]);
        }
        for (int t = 0; t < T; t++) pthread_join(th[t], 0);
        const double dt = now() - t0;
        best = dt < best ? dt : best;
    }
    printf("G=%d F=%.2f pf=%d: %.2f ms, %.1f GB/s of the whole buffer, %.1f GB/s of the bytes read (kept %.2f)\n", G, F,
           pf, best * 1e3, B / best / 1e9, kept * (double)G / best / 1e9, kept / (double)ng);
    return 0;
}
