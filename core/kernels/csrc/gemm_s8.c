// Drafting GEMM on int8 weights: y = x @ w.T (+ bias) for a few bf16 rows x and a weight
// stored as int8 with one fp32 scale per output row (per-channel, symmetric). The draft head
// and its LM head stream their weights from memory every round (the target's 270 MB evict
// them between steps), so halving the bytes is what makes a round cheaper; VNNI's vpdpbusd
// also does twice the multiply-adds of vdpbf16ps per instruction.
//
// Each x row is quantized on the fly (symmetric, scale max|x| / 127) and offset to unsigned
// (u = q + 128, as vpdpbusd multiplies unsigned by signed bytes); the offset is taken back out
// with the weight row's sum: sum_k q_k w_k = sum_k u_k w_k - 128 * sum_k w_k. Integer sums are
// exact, so a row's result does not depend on the other rows in the call.
// Approximate by design (about 1% relative error on a logit): drafts only, never the target.
#include <stdlib.h>
#include "common.h"

// 16 int32 accumulators -> their 16 lane sums, reduce16's shuffle tree on integers.
static inline __m512i reduce16_epi32(const __m512i *a) {
    __m512 t[8], v[4], x[2];
#define P(z) _mm512_castsi512_ps(z)
#define I(z) _mm512_castps_si512(z)
#define ADD(p, q) P(_mm512_add_epi32(I(p), I(q)))
    for (int p = 0; p < 8; p++)
        t[p] = ADD(_mm512_shuffle_f32x4(P(a[2 * p]), P(a[2 * p + 1]), 0x44),
                   _mm512_shuffle_f32x4(P(a[2 * p]), P(a[2 * p + 1]), 0xEE));
    for (int r = 0; r < 4; r++)
        v[r] = ADD(_mm512_shuffle_f32x4(t[2 * r], t[2 * r + 1], 0x88),
                   _mm512_shuffle_f32x4(t[2 * r], t[2 * r + 1], 0xDD));
    for (int s = 0; s < 2; s++)
        x[s] = ADD(_mm512_shuffle_ps(v[2 * s], v[2 * s + 1], 0x44), _mm512_shuffle_ps(v[2 * s], v[2 * s + 1], 0xEE));
    return I(ADD(_mm512_shuffle_ps(x[0], x[1], 0x88), _mm512_shuffle_ps(x[0], x[1], 0xDD)));
#undef ADD
#undef I
#undef P
}

// MB rows of u times NB rows of w (MB * NB <= 16) -> integer dot products, out[i * ldo + j]
#define TILE8(MB, NB)                                                                          \
static inline void tile8_##MB##x##NB(const uint8_t *u, int64_t ldu, const int8_t *w, int64_t ldw, \
                                      int K, __mmask64 tail, int32_t *out, int ldo) {             \
    __m512i acc[16];                                                                           \
    for (int a = 0; a < 16; a++) acc[a] = _mm512_setzero_si512();                              \
    int k = 0;                                                                                 \
    for (; k + 64 <= K; k += 64) {                                                             \
        __m512i wv[NB];                                                                        \
        for (int j = 0; j < NB; j++) wv[j] = _mm512_loadu_si512(w + j * ldw + k);             \
        for (int i = 0; i < MB; i++) {                                                         \
            __m512i xv = _mm512_loadu_si512(u + i * ldu + k);                                  \
            for (int j = 0; j < NB; j++) acc[i * NB + j] = _mm512_dpbusd_epi32(acc[i * NB + j], xv, wv[j]); \
        }                                                                                      \
    }                                                                                          \
    if (k < K) {                                                                               \
        __m512i wv[NB];                                                                        \
        for (int j = 0; j < NB; j++) wv[j] = _mm512_maskz_loadu_epi8(tail, w + j * ldw + k);  \
        for (int i = 0; i < MB; i++) {                                                         \
            __m512i xv = _mm512_maskz_loadu_epi8(tail, u + i * ldu + k);                       \
            for (int j = 0; j < NB; j++) acc[i * NB + j] = _mm512_dpbusd_epi32(acc[i * NB + j], xv, wv[j]); \
        }                                                                                      \
    }                                                                                          \
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15); \
    __m512i sums = _mm512_permutexvar_epi32(order, reduce16_epi32(acc)); /* lane i*NB+j */    \
    for (int i = 0; i < MB; i++)                                                               \
        _mm512_mask_storeu_epi32(out + i * ldo - i * NB, (__mmask16)(((1u << NB) - 1u) << (i * NB)), sums); \
}

TILE8(4, 4)
TILE8(2, 8)
TILE8(1, 16)

#define NBLK8 16
#define PF8_BLOCKS 4  // weight blocks prefetched ahead: the draft LM head's cold call 0.58 -> 0.33 ms

// One bf16 row -> int8 values round(x / s) + offset (clamped to +-127 before the offset) with
// s = max|x| / 127; returns s, and the values' sum (before the offset) in *total. Weights take
// offset 0 (int8), inputs offset 128 (unsigned bytes for vpdpbusd).
static float quantize_row(const uint16_t *x, int K, int offset, uint8_t *out, int32_t *total) {
    float m = 0.0f;
    for (int k = 0; k < K; k++) { float f = fabsf(from_bf16(x[k])); m = f > m ? f : m; }
    float s = m > 0.0f ? m / 127.0f : 1.0f;
    int32_t sum = 0;
    for (int k = 0; k < K; k++) {
        int v = (int)lrintf(from_bf16(x[k]) / s);
        v = v > 127 ? 127 : (v < -127 ? -127 : v);
        out[k] = (uint8_t)(v + offset);
        sum += v;
    }
    *total = sum;
    return s;
}

// Per-row quantization of a weight (N, K) bf16 -> int8 (N, K), scale (N,), row sums (N,).
// ctypes: quantize_weight_s8(ptr w, i64 ldw, ptr q, ptr scale, ptr sums, i32 N, i32 K, i32 nthreads) -> void
void quantize_weight_s8(const uint16_t *w, int64_t ldw, int8_t *q, float *scale, int32_t *sums, int N, int K,
                        int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int n = 0; n < N; n++) scale[n] = quantize_row(w + n * ldw, K, 0, (uint8_t *)(q + (int64_t)n * K), sums + n);
}

// 0, or -1 where the quantized rows' memory could not be had.
// ctypes: gemm_s8(ptr x, i64 ldx, ptr w, ptr wscale, ptr wsum, ptr bias, ptr y, i64 ldy, i32 M, i32 N,
//                 i32 K, i32 nthreads) -> i32
int gemm_s8(const uint16_t *x, int64_t ldx, const int8_t *w, const float *wscale, const int32_t *wsum,
            const uint16_t *bias, uint16_t *y, int64_t ldy, int M, int N, int K, int nthreads) {
    int64_t ldu = (K + 63) / 64 * 64;
    uint8_t *u = aligned_alloc(64, (size_t)(M * ldu));
    float *xs = (float *)malloc((size_t)M * sizeof(float));  // on the heap: M is the caller's
    if (!u || !xs) {
        free(u);
        free(xs);
        return -1;
    }
    for (int m = 0; m < M; m++) {  // each row: u = round(x / s) + 128, s = max|x| / 127
        int32_t unused;
        xs[m] = quantize_row(x + m * ldx, K, 128, u + m * ldu, &unused);
        for (int k = K; k < ldu; k++) u[m * ldu + k] = 0;
    }
    __mmask64 tail = (K % 64) ? (((__mmask64)1 << (K % 64)) - 1) : 0;
    int nblocks = (N + NBLK8 - 1) / NBLK8;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int nb = 0; nb < nblocks; nb++) {
        int n0 = nb * NBLK8, nn = N - n0 < NBLK8 ? N - n0 : NBLK8;
        int32_t dots[4 * NBLK8];
        if (nb + PF8_BLOCKS < nblocks) {  // the weights PF8_BLOCKS blocks ahead, into L2
            const char *ahead = (const char *)(w + (int64_t)(n0 + PF8_BLOCKS * NBLK8) * K);
            for (int64_t b = 0; b < (int64_t)NBLK8 * K; b += 64) _mm_prefetch(ahead + b, _MM_HINT_T1);
        }
        for (int m0 = 0; m0 < M; m0 += 4) {
            int rows = M - m0 < 4 ? M - m0 : 4;
            const uint8_t *um = u + m0 * ldu;
            if (nn == NBLK8 && rows == 4) {
                for (int c = 0; c < NBLK8; c += 4) tile8_4x4(um, ldu, w + (int64_t)(n0 + c) * K, K, K, tail, dots + c, NBLK8);
            } else if (nn == NBLK8) {  // 3, 2 or 1 rows: pairs on a 2x8 tile, a last row on 1x16
                int i = 0;
                if (rows >= 2) {
                    for (int c = 0; c < NBLK8; c += 8) tile8_2x8(um, ldu, w + (int64_t)(n0 + c) * K, K, K, tail, dots + c, NBLK8);
                    i = 2;
                }
                if (rows > i) tile8_1x16(um + i * ldu, ldu, w + (int64_t)n0 * K, K, K, tail, dots + i * NBLK8, NBLK8);
            } else {  // a last partial block of columns
                for (int i = 0; i < rows; i++) for (int j = 0; j < nn; j++) {
                    int32_t t = 0;
                    for (int k = 0; k < K; k++) t += (int32_t)um[i * ldu + k] * (int32_t)w[(int64_t)(n0 + j) * K + k];
                    dots[i * NBLK8 + j] = t;
                }
            }
            for (int i = 0; i < rows; i++) for (int j = 0; j < nn; j++) {
                int n = n0 + j;
                float v = xs[m0 + i] * wscale[n] * (float)(dots[i * NBLK8 + j] - 128 * wsum[n]);
                if (bias) v += from_bf16(bias[n]);
                y[(m0 + i) * ldy + n] = to_bf16(v);
            }
        }
    }
    free(u);
    free(xs);
    return 0;
}
