// y = x @ w.T (+ bias) for skinny bf16 GEMMs (decoding: 1 to a few dozen rows), fp32 accumulation.
//
// Row-invariant by construction: every output element y[m, n] is computed by the same
// instruction sequence whatever M is and whichever tile it falls in: 16 fp32 lanes of
// vdpbf16ps over K in 32-wide chunks from k = 0 (a masked last chunk), the 16 lanes added in
// one fixed halving tree (reduce16), then the bias in fp32 and one round to bf16 (nearest
// even). So a token's row comes out bit-identical alone (a plain step) or inside a tree.
// Built by core/native.py with gcc; threads come from the OpenMP runtime torch already loaded.
#include "common.h"

// MB rows of x times NB rows of w (MB * NB <= 16; unused accumulators stay 0) -> out[i * ldo + j]
#define TILE(MB, NB)                                                                          \
static inline void tile_##MB##x##NB(const uint16_t *x, int64_t ldx, const uint16_t *w,        \
                                    int64_t ldw, int K, __mmask32 tail, float *out, int ldo) { \
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
    __m512 sums = in_order16(reduce16(acc)); /* lane i * NB + j: row i, column j */          \
    for (int i = 0; i < MB; i++)                                                              \
        _mm512_mask_storeu_ps(out + i * ldo - i * NB, (__mmask16)(((1u << NB) - 1u) << (i * NB)), sums); \
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
// Software prefetch of the weights, two blocks ahead into L2, spread over the block's row
// groups. Without it a core either streams weights or computes: at 11 rows the LM head took
// 4.4-5.3 ms, with it 2.6-2.9 (2 threads, 49152 x 576). One row is a pure stream that the
// hardware prefetchers already keep at the memory bandwidth, so it is left alone.
#define PF_MIN_ROWS 2
#define PF_BLOCKS 2

int amx_serves(int N, int K);
void gemm_amx(const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t ldw, const uint16_t *bias,
              uint16_t *y, int64_t ldy, int M, int N, int K, int nthreads);

void gemm_bf16(const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t ldw, const uint16_t *bias,
               uint16_t *y, int64_t ldy, int M, int N, int K, int nthreads) {
    if (amx_serves(N, K)) {  // AMX tiles where this machine has them (gemm_amx.c): chosen by shape, never by M
        gemm_amx(x, ldx, w, ldw, bias, y, ldy, M, N, K, nthreads);
        return;
    }
    __mmask32 tail = (K % 32) ? (__mmask32)((1u << (K % 32)) - 1u) : 0;
    int nblocks = (N + NBLK - 1) / NBLK;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int nb = 0; nb < nblocks; nb++) {
        int n0 = nb * NBLK, nn = N - n0 < NBLK ? N - n0 : NBLK;
        const uint16_t *wn = w + n0 * ldw;
        float out[4 * NBLK];
        int m0 = 0;
        if (nn == NBLK) {
            int groups = (M + 3) / 4;
            for (; m0 < M; m0 += 4) {  // 4 rows at a time; 3, 2 or 1 leftover rows: their own tile
                int rows = M - m0 < 4 ? M - m0 : 4;
                if (M >= PF_MIN_ROWS && nb + PF_BLOCKS < nblocks) {  // this group's share of the rows
                    int g = m0 / 4, r0 = g * NBLK / groups, r1 = (g + 1) * NBLK / groups;
                    for (int r = r0; r < r1; r++) {
                        const char *row = (const char *)(w + (int64_t)(n0 + PF_BLOCKS * NBLK + r) * ldw);
                        for (int b = 0; b < K * 2; b += 64) _mm_prefetch(row + b, _MM_HINT_T1);
                    }
                }
                const uint16_t *xm = x + m0 * ldx;
                if (rows == 4) for (int c = 0; c < NBLK; c += 4) tile_4x4(xm, ldx, wn + c * ldw, ldw, K, tail, out + c, NBLK);
                else if (rows == 3) for (int c = 0; c < NBLK; c += 4) tile_3x4(xm, ldx, wn + c * ldw, ldw, K, tail, out + c, NBLK);
                else if (rows == 2) for (int c = 0; c < NBLK; c += 8) tile_2x8(xm, ldx, wn + c * ldw, ldw, K, tail, out + c, NBLK);
                else tile_1x16(xm, ldx, wn, ldw, K, tail, out, NBLK);
                __m512 b = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                                      _mm256_loadu_si256((const __m256i *)(bias + n0))), 16)) : _mm512_setzero_ps();
                for (int i = 0; i < rows; i++)
                    _mm256_storeu_si256((__m256i *)(y + (m0 + i) * ldy + n0),
                                        to_bf16x16(_mm512_add_ps(_mm512_loadu_ps(out + i * NBLK), b)));
            }
        } else {
            for (; m0 < M; m0++) for (int j = 0; j < nn; j++) {
                tile_1x1(x + m0 * ldx, ldx, wn + j * ldw, ldw, K, tail, out, 1);
                y[m0 * ldy + n0 + j] = to_bf16(out[0] + (bias ? from_bf16(bias[n0 + j]) : 0.0f));
            }
        }
    }
}
