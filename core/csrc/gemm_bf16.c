// y = x @ w.T (+ bias) for skinny bf16 GEMMs (decoding: 1 to a few dozen rows), fp32 accumulation.
//
// Row-invariant by construction: every output element y[m, n] is computed by the same
// instruction sequence whatever M is and whichever tile it falls in: 16 fp32 lanes of
// vdpbf16ps over K in 32-wide chunks from k = 0 (a masked last chunk), the 16 lanes added in
// one fixed halving tree (reduce16), then the bias in fp32 and one round to bf16 (nearest
// even). So a token's row comes out bit-identical alone (a plain step) or inside a tree.
// Built by core/native.py with gcc; threads come from the OpenMP runtime torch already loaded.
#include "common.h"

// MB rows of x times NB rows of w (MB * NB <= 16; unused accumulators stay 0); out[i * NB + j]
#define TILE(MB, NB)                                                                          \
static inline void tile_##MB##x##NB(const uint16_t *x, int64_t ldx, const uint16_t *w,        \
                                    int64_t ldw, int K, __mmask32 tail, float *out) {          \
    __m512 acc[16];                                                                           \
    for (int a = 0; a < 16; a++) acc[a] = _mm512_setzero_ps();                                \
    int k = 0;                                                                                \
    for (; k + 32 <= K; k += 32) {                                                            \
        __m512bh wv[NB];                                                                      \
        for (int j = 0; j < NB; j++) wv[j] = (__m512bh)_mm512_loadu_si512(w + j * ldw + k);   \
        for (int i = 0; i < MB; i++) {                                                        \
            __m512bh xv = (__m512bh)_mm512_loadu_si512(x + i * ldx + k);                      \
            for (int j = 0; j < NB; j++) acc[i * NB + j] = _mm512_dpbf16_ps(acc[i * NB + j], xv, wv[j]); \
        }                                                                                     \
    }                                                                                         \
    if (k < K) {                                                                              \
        __m512bh wv[NB];                                                                      \
        for (int j = 0; j < NB; j++) wv[j] = (__m512bh)_mm512_maskz_loadu_epi16(tail, w + j * ldw + k); \
        for (int i = 0; i < MB; i++) {                                                        \
            __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(tail, x + i * ldx + k);          \
            for (int j = 0; j < NB; j++) acc[i * NB + j] = _mm512_dpbf16_ps(acc[i * NB + j], xv, wv[j]); \
        }                                                                                     \
    }                                                                                         \
    float sums[16];                                                                           \
    store16(reduce16(acc), sums);                                                             \
    for (int a = 0; a < MB * NB; a++) out[a] = sums[a];                                       \
}

TILE(4, 4)
TILE(3, 4)
TILE(2, 8)
TILE(1, 16)
TILE(1, 1)

// Output columns per task: 4x4 tiles cover 16 columns of 4 rows; 3, 2 or 1 leftover rows take
// the 3x4, 2x8 or 1x16 tile; a last partial block (N % 16) the 1x1 tile. The same per-element
// sequence in all of them.
#define NBLK 16

void gemm_bf16(const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t ldw, const uint16_t *bias,
               uint16_t *y, int64_t ldy, int M, int N, int K, int nthreads) {
    __mmask32 tail = (K % 32) ? (__mmask32)((1u << (K % 32)) - 1u) : 0;
    int nblocks = (N + NBLK - 1) / NBLK;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int nb = 0; nb < nblocks; nb++) {
        int n0 = nb * NBLK, nn = N - n0 < NBLK ? N - n0 : NBLK;
        const uint16_t *wn = w + n0 * ldw;
        float out[4 * NBLK], t[16];
        int m0 = 0;
        if (nn == NBLK) {
            for (; m0 + 4 <= M; m0 += 4) {
                for (int c = 0; c < NBLK; c += 4) {
                    tile_4x4(x + m0 * ldx, ldx, wn + c * ldw, ldw, K, tail, t);
                    for (int i = 0; i < 4; i++) for (int j = 0; j < 4; j++) out[i * NBLK + c + j] = t[i * 4 + j];
                }
                for (int i = 0; i < 4; i++) for (int j = 0; j < NBLK; j++) {
                    float v = out[i * NBLK + j] + (bias ? from_bf16(bias[n0 + j]) : 0.0f);
                    y[(m0 + i) * ldy + n0 + j] = to_bf16(v);
                }
            }
            int rest = M - m0;  // 0-3 leftover rows: one tile shape each, 16 columns
            if (rest == 3)
                for (int c = 0; c < NBLK; c += 4) {
                    tile_3x4(x + m0 * ldx, ldx, wn + c * ldw, ldw, K, tail, t);
                    for (int i = 0; i < 3; i++) for (int j = 0; j < 4; j++) out[i * NBLK + c + j] = t[i * 4 + j];
                }
            else if (rest == 2)
                for (int c = 0; c < NBLK; c += 8) {
                    tile_2x8(x + m0 * ldx, ldx, wn + c * ldw, ldw, K, tail, t);
                    for (int i = 0; i < 2; i++) for (int j = 0; j < 8; j++) out[i * NBLK + c + j] = t[i * 8 + j];
                }
            else if (rest == 1)
                tile_1x16(x + m0 * ldx, ldx, wn, ldw, K, tail, out);
            for (int i = 0; i < rest; i++) for (int j = 0; j < NBLK; j++)
                y[(m0 + i) * ldy + n0 + j] = to_bf16(out[i * NBLK + j] + (bias ? from_bf16(bias[n0 + j]) : 0.0f));
        } else {
            for (; m0 < M; m0++) for (int j = 0; j < nn; j++) {
                tile_1x1(x + m0 * ldx, ldx, wn + j * ldw, ldw, K, tail, t);
                y[m0 * ldy + n0 + j] = to_bf16(t[0] + (bias ? from_bf16(bias[n0 + j]) : 0.0f));
            }
        }
    }
}
