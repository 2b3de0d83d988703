// y = x @ w.T (+ bias) for skinny bf16 GEMMs (decoding: 1 to a few dozen rows), fp32 accumulation.
//
// Row-invariant by construction: every output element y[m, n] is computed by the same
// instruction sequence whatever M is and whichever tile it falls in: 16 fp32 lanes of
// vdpbf16ps over K in 32-wide chunks from k = 0 (a masked last chunk), the 16 lanes added in
// one fixed halving tree (reduce16), then the bias in fp32 and one round to bf16 (nearest
// even). So a token's row comes out bit-identical alone (a plain step) or inside a tree.
// Built by core/native.py with gcc; threads come from the OpenMP runtime torch already loaded.
#include "common.h"
#include "weights.h"
#include <omp.h>
#include <stdlib.h>

// MB rows of x times NB rows of w (MB * NB <= 16; unused accumulators stay 0) -> out[i * ldo + j]
#define TILE(MB, NB)                                                                          \
static inline void tile_##MB##x##NB(const uint16_t *x, int64_t ldx, const uint16_t *w,        \
                                    int64_t ldw, int K, __mmask32 tail, float *out, int ldo) { \
    __m512 acc[16];                                                                           \
    for (int a = 0; a < 16; a++) acc[a] = _mm512_setzero_ps();                                \
    int k = 0;                                                                                \
    for (; k + 32 <= K; k += 32) {                                                            \
        __m512bh wv[NB];                                                                      \
        for (int j = 0; j < NB; j++) wv[j] = AS_BH(_mm512_loadu_si512(w + j * ldw + k));   \
        for (int i = 0; i < MB; i++) {                                                        \
            __m512bh xv = AS_BH(_mm512_loadu_si512(x + i * ldx + k));                      \
            for (int j = 0; j < NB; j++) acc[i * NB + j] = _mm512_dpbf16_ps(acc[i * NB + j], xv, wv[j]); \
        }                                                                                     \
    }                                                                                         \
    if (k < K) {                                                                              \
        __m512bh wv[NB];                                                                      \
        for (int j = 0; j < NB; j++) wv[j] = AS_BH(_mm512_maskz_loadu_epi16(tail, w + j * ldw + k)); \
        for (int i = 0; i < MB; i++) {                                                        \
            __m512bh xv = AS_BH(_mm512_maskz_loadu_epi16(tail, x + i * ldx + k));          \
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

void gemm_amx_team(const uint16_t *pack, int M, int K, const gemm_job *jobs, int count, uint16_t *scratch);
void amx_pack_team(const uint16_t *x, int64_t ldx, int M, int K, uint16_t *pack);

// Bytes of one weight row and between rows (bf16 or blocks), for the prefetch.
static inline int64_t row_bytes(const wmat *w) {
    return w->type == WT_BF16 ? (int64_t)w->K * 2 : (int64_t)(w->K / 32) * (w->type == WT_Q4_1 ? 20 : w->type == WT_Q4_0 ? 18 : 34);
}
static inline int64_t row_stride(const wmat *w) { return w->type == WT_BF16 ? w->ld * 2 : w->ld; }

// Column block nb (NBLK output columns) of one job, every row of x.
static void avx512_block(const uint16_t *x, int64_t ldx, const gemm_job *job, int nb, int M, uint16_t *scratch) {
    const wmat *w = job->w;
    int N = w->N, K = w->K, nblocks = (N + NBLK - 1) / NBLK;
    __mmask32 tail = (K % 32) ? (__mmask32)((1u << (K % 32)) - 1u) : 0;
    const uint16_t *bias = job->bias;
    uint16_t *y = job->y;
    int64_t ldy = job->ldy, rbytes = row_bytes(w), rstride = row_stride(w), ldw;
    int n0 = nb * NBLK, nn = N - n0 < NBLK ? N - n0 : NBLK;
    const uint16_t *wn = weight_panel(w, n0, nn, scratch, &ldw);
    float out[4 * NBLK];
    int m0 = 0;
    if (nn == NBLK) {
        int groups = (M + 3) / 4;
        for (; m0 < M; m0 += 4) {  // 4 rows at a time; 3, 2 or 1 leftover rows: their own tile
            int rows = M - m0 < 4 ? M - m0 : 4;
            if (M >= PF_MIN_ROWS && nb + PF_BLOCKS < nblocks) {  // this group's share of the rows
                int g = m0 / 4, r0 = g * NBLK / groups, r1 = (g + 1) * NBLK / groups;
                for (int r = r0; r < r1; r++) {  // (tiled blocks: the same bytes, in another order)
                    const char *row = (const char *)w->data + (int64_t)(n0 + PF_BLOCKS * NBLK + r) * rstride;
                    for (int64_t b = 0; b < rbytes; b += 64) _mm_prefetch(row + b, _MM_HINT_T1);
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

// x packed for the tiles, then every job's columns on them (the team's tiles configured: amx_begin)
static void tiles_team(const uint16_t *x, int64_t ldx, const gemm_job *jobs, int count, int M, int K, uint16_t *pack,
                       uint16_t *scratch) {
    amx_pack_team(x, ldx, M, K, pack);
    gemm_amx_team(pack, M, K, jobs, count, scratch);
}

static int known_type(int t) { return t == WT_BF16 || t == WT_Q4_0 || t == WT_Q4_1 || t == WT_Q8_0; }

int gemm_team(const uint16_t *x, int64_t ldx, const gemm_job *jobs, int count, int M, int K, uint16_t *pack,
              uint16_t *scratch) {
    int amx = 1, total = 0;
    if (count > 0 && is_x8(jobs[0].w->type))
        return gemm_x8_team(x, ldx, jobs, count, M, K, pack, scratch, scratch_elems(K) * 2);
    for (int j = 0; j < count; j++) {
        if (!known_type(jobs[j].w->type) || jobs[j].w->K != K) return -1;
        amx &= amx_serves(jobs[j].w->N, K);  // AMX tiles where this machine has them: by shape, never by M
    }
    if (amx) {
        tiles_team(x, ldx, jobs, count, M, K, pack, scratch);
        return 0;
    }
    int first[8];  // job j's blocks are [first[j], first[j + 1]) of the batch's
    for (int j = 0; j < count && j < 7; j++) { first[j] = total; total += (jobs[j].w->N + NBLK - 1) / NBLK; }
    first[count] = total;
#pragma omp for schedule(static)
    for (int t = 0; t < total; t++) {
        int j = 0;
        while (t >= first[j + 1]) j++;
        avx512_block(x, ldx, &jobs[j], t - first[j], M, scratch);
    }
    return 0;
}

// y = x @ w.T (+ bias) on a team of its own: gemm_team, or with `tiles` the AMX path for any kind it reads
static int gemm_run(const uint16_t *x, int64_t ldx, const wmat *w, const uint16_t *bias, uint16_t *y, int64_t ldy,
                    int M, int nthreads, int tiles) {
    gemm_job job = {w, bias, y, ldy};
    uint16_t *pack = (uint16_t *)aligned_alloc(64, (size_t)pack_elems(M, w->K) * 2);
    uint16_t *scratch = (uint16_t *)malloc((size_t)nthreads * scratch_elems(w->K) * 2);
    int status = pack && scratch ? 0 : -1;
    if (!status) {
#pragma omp parallel num_threads(nthreads)
        {
            uint16_t *mine = scratch + omp_get_thread_num() * scratch_elems(w->K);
            int s = 0;
            amx_begin();
            if (tiles)
                tiles_team(x, ldx, &job, 1, M, w->K, pack, mine);
            else
                s = gemm_team(x, ldx, &job, 1, M, w->K, pack, mine);
            amx_end();
            if (s) {
#pragma omp atomic write
                status = s;
            }
        }
    }
    free(pack);
    free(scratch);
    return status;
}

// y = x @ w.T (+ bias) for any weight kind, on its own team of threads; 0, or -1 where memory
// could not be had or the weight's type is unknown.
// ctypes: gemm_w(ptr x, i64 ldx, ptr w, ptr bias, ptr y, i64 ldy, i32 M, i32 nthreads) -> i32
int gemm_w(const uint16_t *x, int64_t ldx, const wmat *w, const uint16_t *bias, uint16_t *y, int64_t ldy,
           int M, int nthreads) {
    return gemm_run(x, ldx, w, bias, y, ldy, M, nthreads, 0);
}

// A prompt's y = x @ w.T (+ bias) on AMX tiles whatever the weight's kind: bf16 rows, or GGUF / 4-bit X8 blocks
// dequantized per 16 x 32 tile into the thread's scratch (dequantize_bf16's values), so the bits gemm_w gives
// on those values' bf16 copy, without the copy. 0; -1 out of memory; -2 where the tiles do not serve (no
// AMX, the shape, or a kind the tiles do not read: Q8_X8, the screened LM head).
// ctypes: gemm_tiles(ptr x, i64 ldx, ptr w, ptr bias, ptr y, i64 ldy, i32 M, i32 nthreads) -> i32
int gemm_tiles(const uint16_t *x, int64_t ldx, const wmat *w, const uint16_t *bias, uint16_t *y, int64_t ldy,
               int M, int nthreads) {
    if (!(known_type(w->type) || is_nibbles(w->type)) || !amx_serves(w->N, w->K))
        return -2;
    return gemm_run(x, ldx, w, bias, y, ldy, M, nthreads, 1);
}

// gemm_w over a bf16 weight (N, K) with row stride ldw: 0, or -1 out of memory.
// ctypes: gemm_bf16(ptr x, i64 ldx, ptr w, i64 ldw, ptr bias, ptr y, i64 ldy, i32 M, i32 N, i32 K,
//                   i32 nthreads) -> i32
int gemm_bf16(const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t ldw, const uint16_t *bias,
              uint16_t *y, int64_t ldy, int M, int N, int K, int nthreads) {
    wmat m = {WT_BF16, N, K, 0, w, ldw};
    return gemm_w(x, ldx, &m, bias, y, ldy, M, nthreads);
}
