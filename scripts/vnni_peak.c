// The machine's ceiling for the w4a8 GEMMs' core instruction: vpdpbusd on 512-bit registers
// (64 int8 multiply-adds each), per core, with fp32 FMA beside it for scale. docs/native-step.md
// compares a verified row's measured cost with it.
//   gcc -O2 -march=x86-64-v4 -mavx512vnni scripts/vnni_peak.c -o /tmp/vnni_peak && /tmp/vnni_peak
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(void) {
    const long n = 200000000;
    __m512i acc[12], a = _mm512_set1_epi32(0x01020304), b = _mm512_set1_epi32(0x05060708);
    for (int i = 0; i < 12; i++) acc[i] = _mm512_set1_epi32(i);
    double t0 = now();
    for (long r = 0; r < n; r++) {
#pragma GCC unroll 12
        for (int i = 0; i < 12; i++) acc[i] = _mm512_dpbusd_epi32(acc[i], a, b);  // 12 independent chains
        __asm__ volatile("" : "+v"(acc[0]), "+v"(acc[1]), "+v"(acc[2]), "+v"(acc[3]));
    }
    double t = now() - t0;
    int sink = 0;
    for (int i = 0; i < 12; i++) sink += _mm512_reduce_add_epi32(acc[i]);
    printf("vpdpbusd zmm, independent: %.2f G/s per core (%.1f G int8 MAC/s)\n", n * 12 / t / 1e9, n * 12 * 64 / t / 1e9);
    __m512 f[12], x = _mm512_set1_ps(0.999f);
    for (int i = 0; i < 12; i++) f[i] = _mm512_set1_ps((float)i);
    t0 = now();
    for (long r = 0; r < n; r++) {
#pragma GCC unroll 12
        for (int i = 0; i < 12; i++) f[i] = _mm512_fmadd_ps(f[i], x, x);
        __asm__ volatile("" : "+v"(f[0]), "+v"(f[1]));
    }
    t = now() - t0;
    float fs = 0;
    for (int i = 0; i < 12; i++) fs += _mm512_reduce_add_ps(f[i]);
    printf("vfmadd231ps zmm, independent: %.2f G/s per core (%d %g)\n", n * 12 / t / 1e9, sink, fs);
    return 0;
}
