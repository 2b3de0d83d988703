// RMSNorm for bf16 rows, as transformers' LlamaRMSNorm computes it, one fixed sequence per row:
//   r = 1 / sqrt(sum(x^2) / H + eps)   fp32; squares summed on 16 lanes in order, then reduce16's tree
//   y = bf16(w * bf16(x * r))          the two roundings of `weight * hidden.to(bf16)`
// A row's result does not depend on the other rows or the thread count.
#include "common.h"

static void rmsnorm_row(const uint16_t *xr, const uint16_t *w, uint16_t *yr, int H, float eps) {
    {
        __m512 acc = _mm512_setzero_ps();
        int h = 0;
        for (; h + 16 <= H; h += 16) {
            __m512 v = bf16x16_to_ps(xr + h);
            acc = _mm512_fmadd_ps(v, v, acc);
        }
        if (h < H) {
            __m512 v = bf16x16_to_ps_masked(xr + h, (__mmask16)((1u << (H - h)) - 1u));
            acc = _mm512_fmadd_ps(v, v, acc);
        }
        float r = 1.0f / sqrtf(hsum16(acc) / (float)H + eps);
        __m512 rv = _mm512_set1_ps(r);
        for (h = 0; h < H; h += 16) {  // to_bf16x16: to_bf16's bits on 16 lanes
            __mmask16 m = H - h >= 16 ? 0xFFFF : (__mmask16)((1u << (H - h)) - 1u);
            __m256i t = to_bf16x16(_mm512_mul_ps(bf16x16_to_ps_masked(xr + h, m), rv));
            __m512 tv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(t), 16));
            _mm256_mask_storeu_epi16(yr + h, m, to_bf16x16(_mm512_mul_ps(bf16x16_to_ps_masked(w + h, m), tv)));
        }
    }
}

// The rows split over the enclosing team (call from every thread of a parallel region, or alone).
void rmsnorm_team(const uint16_t *x, int64_t ldx, const uint16_t *w, uint16_t *y, int64_t ldy, int M, int H, float eps) {
#pragma omp for schedule(static)
    for (int m = 0; m < M; m++) rmsnorm_row(x + m * ldx, w, y + m * ldy, H, eps);
}

// ctypes: rmsnorm_bf16(ptr x, i64 ldx, ptr w, ptr y, i64 ldy, i32 M, i32 H, f32 eps, i32 nthreads) -> void
void rmsnorm_bf16(const uint16_t *x, int64_t ldx, const uint16_t *w, uint16_t *y, int64_t ldy,
                  int M, int H, float eps, int nthreads) {
#pragma omp parallel num_threads(nthreads) if (M > 1)
    rmsnorm_team(x, ldx, w, y, ldy, M, H, eps);
}
