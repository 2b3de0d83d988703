// The machine's ceiling for a decoding step's weight stream: OpenMP threads each summing their half of a 4 GiB buffer
// with 512-bit loads, in 2 MB pages (MADV_HUGEPAGE, as core/kernels/hugepages.py places the packed weights) or, with
// `4k`, in 4 KB pages. A one-token forward of a model larger than the caches cannot read its weights faster than this.
//   gcc -O2 -mavx512f -fopenmp scripts/read_bandwidth.c -o /tmp/read_bandwidth
//   OMP_NUM_THREADS=2 /tmp/read_bandwidth        # 2 MB pages;  /tmp/read_bandwidth 4k: 4 KB pages
// AMD EPYC Zen 4 VM, 2 threads, 2026-12-07: 31.8-32.6 GB/s in 2 MB pages, 28.7-31.3 in 4 KB pages, 22.8-26.3 on one
// thread (docs/native-step.md).
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>

int main(int argc, char **argv) {
    size_t n = (size_t)4 << 30, huge = (size_t)2 << 20;
    int small = argc > 1 && strcmp(argv[1], "4k") == 0;
    char *raw = mmap(0, n + huge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) return perror("mmap"), 1;
    char *p = (char *)(((size_t)raw + huge - 1) & ~(huge - 1));
    madvise(p, n, small ? MADV_NOHUGEPAGE : MADV_HUGEPAGE);
    memset(p, 1, n);
    for (int rep = 0; rep < 5; rep++) {
        double t = omp_get_wtime();
        long long total = 0;
#pragma omp parallel reduction(+ : total)
        {
            size_t per = n / omp_get_num_threads();
            const char *q = p + per * omp_get_thread_num();
            __m512i acc = _mm512_setzero_si512();
            for (size_t i = 0; i < per; i += 256) {
                acc = _mm512_add_epi32(acc, _mm512_load_si512(q + i));
                acc = _mm512_add_epi32(acc, _mm512_load_si512(q + i + 64));
                acc = _mm512_add_epi32(acc, _mm512_load_si512(q + i + 128));
                acc = _mm512_add_epi32(acc, _mm512_load_si512(q + i + 192));
            }
            total += _mm512_reduce_add_epi32(acc);
        }
        double dt = omp_get_wtime() - t;
        printf("%s pages, %d threads: %.1f GB/s (checksum %lld)\n", small ? "4 KB" : "2 MB", omp_get_max_threads(),
               n / dt / 1e9, total);
    }
    return 0;
}
