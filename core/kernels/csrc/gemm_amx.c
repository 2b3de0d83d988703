// y = x @ w.T (+ bias) on AMX tiles (Intel Sapphire Rapids and later), for K % 32 == 0 and N % 16 == 0.
//
// Why: core/csrc/gemm_bf16.c computes each extra row with vdpbf16ps at about 1.5 ms per row
// of a 135M model on two cores, so a 10-token verification step costs 1.5 plain steps. One
// TDPBF16PS multiplies a 16 x 32 weight block by 32 x 16 of x (8,192 products) in about 16
// cycles: up to 16 rows of x cost what one does, and the weights' stream is the whole cost.
//
// Row-invariant by construction: the weight is the tile's A operand (16 output columns n,
// 32 of K each) and x the B operand (x packed in pairs of K, one tile column per row m, 16
// at most; unused columns are zero). Element (n, m) is one TDPBF16PS accumulation chain over
// K in 32-wide steps from k = 0; it reads only weight row n and x row m, whatever M is and
// whichever tile column the row lands in, and whether its 16-row block of x is multiplied
// alone or paired with the next one (17 rows and more: each weight tile is loaded once for
// two blocks of x, the same instruction per element). Then the bias in fp32 and one round to bf16
// (nearest even), as in gemm_bf16.c. So a token's row is bit-identical alone (a plain step)
// or inside a tree. The sums differ from gemm_bf16.c's (another reduction order), so a
// machine uses one of the two for every call of a given shape: the choice depends on the
// shape and the machine only (`gemm_bf16` dispatches here).
#include "common.h"
#include "weights.h"
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef __AMX_TILE__  // a compiler without -mamx-tile (gcc < 11): stubs, the AVX-512 GEMM serves every shape
int amx_enable(int want) { (void)want; return 0; }
int amx_serves(int N, int K) { (void)N; (void)K; return 0; }
void amx_begin(void) {}
void amx_end(void) {}
void amx_pack_team(const uint16_t *x, int64_t ldx, int M, int K, uint16_t *pack) {
    (void)x; (void)ldx; (void)M; (void)K; (void)pack;
}
void gemm_amx_team(const uint16_t *pack, int M, int K, const gemm_job *jobs, int count, uint16_t *scratch) {
    (void)pack; (void)M; (void)K; (void)jobs; (void)count; (void)scratch;
}
#else

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static int amx_on = 0;
#ifdef EAGLE_AMX_EMULATE
__thread amx_tiles amx_emulated;
#define TILES_GRANTED 1  // emulated tiles need no state from Linux
#else
#define TILES_GRANTED (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0)
#endif

// Ask Linux for the AMX tile state (once per process); 1 if AMX now runs, 0 if off or refused.
// ctypes: amx_enable(i32 want) -> i32
int amx_enable(int want) {
    amx_on = want && TILES_GRANTED;
    return amx_on;
}

int amx_serves(int N, int K) { return amx_on && N % 16 == 0 && K % 32 == 0; }

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tile_config;

// Tiles 0-7 shaped rows[t] x colsb[t] bytes (palette 1); also csrc/attention_amx.c's shapes.
void amx_config(const int rows[8], const int colsb[8]) {
    tile_config c __attribute__((aligned(64)));
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) { c.rows[t] = (uint8_t)rows[t]; c.colsb[t] = (uint16_t)colsb[t]; }
    // gcc's _tile_loadconfig tells the compiler it reads 8 bytes of c: without this barrier the
    // stores to rows and colsb can be dropped as dead (seen with gcc 12)
    __asm__ __volatile__("" : : "r"(&c) : "memory");
    _tile_loadconfig(&c);
}

// Every tile is 16 rows of 64 bytes. One 16-row block of x: tiles 0-3 C (four 16 x 16 fp32
// blocks of y.T), 4 B (x packed), 5-6 A (weight blocks). Two blocks of x (17-32 rows, each
// weight block loaded once for both): 0-3 C (2 weight blocks x 2 x blocks), 4-5 B, 6-7 A.
void amx_begin(void) {
    if (!amx_on) return;
    const int rows[8] = {16, 16, 16, 16, 16, 16, 16, 16}, colsb[8] = {64, 64, 64, 64, 64, 64, 64, 64};
    amx_config(rows, colsb);
}

void amx_end(void) {
    if (amx_on) _tile_release();
}

// x rows [m0, m0 + 16) -> pack[kb][p][m][2] = x[m0 + m][32 kb + 2p + {0, 1}] (zero past M): per block
// of 32 values, the 16 rows' pairs (32-bit each) transposed in registers
static void pack_x(const uint16_t *x, int64_t ldx, int m0, int M, int K, uint16_t *pack) {
    int rows = M - m0 < 16 ? M - m0 : 16;
    for (int kb = 0; kb < K / 32; kb++) {
        __m512i r[16];
        for (int m = 0; m < 16; m++)  // unaligned loads: a row of x may start at any element
            r[m] = m < rows ? _mm512_loadu_si512(x + (int64_t)(m0 + m) * ldx + 32 * kb) : _mm512_setzero_si512();
        transpose16x16_epi32(r);  // r[p]: the pair (2p, 2p + 1) of rows 0 .. 15
        for (int p = 0; p < 16; p++) _mm512_storeu_si512(pack + 512 * kb + 32 * p, r[p]);
    }
}

// y[m0 + m, n0 + i] = bf16(c[i][m] + bias[n0 + i]) for the rows present (c transposed in registers)
static void store_block(const float *c, const uint16_t *bias, int n0, int m0, int M, uint16_t *y, int64_t ldy) {
    __m512 b = bias ? bf16x16_to_ps(bias + n0) : _mm512_setzero_ps();
    int rows = M - m0 < 16 ? M - m0 : 16;
    __m512i r[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512(c + 16 * i);
    transpose16x16_epi32(r);  // r[m]: row m of y's block
    for (int m = 0; m < rows; m++)
        _mm256_storeu_si256((__m256i *)(y + (int64_t)(m0 + m) * ldy + n0),
                            to_bf16x16(_mm512_add_ps(_mm512_castsi512_ps(r[m]), b)));
}

// x's row blocks packed for the tiles, split over the team (pack_elems(M, K) elements).
void amx_pack_team(const uint16_t *x, int64_t ldx, int M, int K, uint16_t *pack) {
    int mblocks = (M + 15) / 16;
#pragma omp for schedule(static)
    for (int mb = 0; mb < mblocks; mb++) pack_x(x, ldx, 16 * mb, M, K, pack + (size_t)mb * K * 16);
}

// Pairs of x blocks (17 rows and more): 32 weight columns g of one job, its panel dequantized once
// (block weights) for every pair.
static void pairs_task(const uint16_t *pack, int M, int K, const gemm_job *job, int g, uint16_t *scratch) {
    const wmat *w = job->w;
    int nblocks = w->N / 16, kblocks = K / 32, pairs = (M + 15) / 16 / 2;
    int n0 = 32 * g, two = nblocks - 2 * g > 1;
    float c[4][256] __attribute__((aligned(64)));
    // A operands: the weight's bf16 rows (lda apart, step 32 per kb), or block weights dequantized
    // once into tile order, scratch[kb][32 rows][32] (step 1,024 per kb), for every pair
    const uint16_t *wp = (const uint16_t *)w->data + (int64_t)n0 * w->ld;
    int64_t lda = w->ld, step = 32;
    if (w->type != WT_BF16) {
        for (int kb = 0; kb < kblocks; kb++) weight_tiles(w, n0, 16 * (1 + two), kb, scratch + 1024 * kb);
        wp = scratch;
        lda = 32;
        step = 1024;
    }
    for (int pr = 0; pr < pairs; pr++) {
        const uint16_t *p0 = pack + (size_t)(2 * pr) * K * 16, *p1 = p0 + (size_t)K * 16;
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int kb = 0; kb < kblocks; kb++) {
            _tile_loadd(4, p0 + 512 * kb, 64);
            _tile_loadd(5, p1 + 512 * kb, 64);
            _tile_loadd(6, wp + step * kb, lda * 2);
            _tile_dpbf16ps(0, 6, 4);
            _tile_dpbf16ps(1, 6, 5);
            if (two) {
                _tile_loadd(7, wp + 16 * lda + step * kb, lda * 2);
                _tile_dpbf16ps(2, 7, 4);
                _tile_dpbf16ps(3, 7, 5);
            }
        }
        _tile_stored(0, c[0], 64);
        _tile_stored(1, c[1], 64);
        if (two) { _tile_stored(2, c[2], 64); _tile_stored(3, c[3], 64); }
        for (int j = 0; j <= two; j++)
            for (int h = 0; h < 2; h++)
                store_block(c[2 * j + h], job->bias, n0 + 16 * j, 16 * (2 * pr + h), M, job->y, job->ldy);
    }
}

#define DP(C, A, J)                                                                        \
    do {                                                                                   \
        _tile_loadd(A, a + (int64_t)(16 * (J)) * lda, lda * 2);                              \
        _tile_dpbf16ps(C, A, 4);                                                           \
    } while (0)

#define PF_KB 2  // block columns ahead that block weights are prefetched (tiled: 16 rows' blocks are one run)

// The last (or only) x block alone: 64 weight columns g of one job. Block weights: each step's
// 16 x 32 tiles dequantized just before they are loaded (4 KB, in L1), as one x block reads
// each tile once.
static void single_task(const uint16_t *pack, int M, int K, const gemm_job *job, int g, uint16_t *scratch) {
    const wmat *w = job->w;
    int nblocks = w->N / 16, kblocks = K / 32, mb = (M + 15) / 16 - 1;
    int n0 = 64 * g, blocks = nblocks - 4 * g < 4 ? nblocks - 4 * g : 4;
    const uint16_t *p = pack + (size_t)mb * K * 16;
    const uint16_t *wp = (const uint16_t *)w->data + (int64_t)n0 * w->ld;
    float c[4][256] __attribute__((aligned(64)));
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int kb = 0; kb < kblocks; kb++) {
        const uint16_t *a = wp + 32 * kb;  // A operands: rows lda apart
        int64_t lda = w->ld;
        if (w->type != WT_BF16) {
            if (kb + PF_KB < kblocks) weight_prefetch(w, n0, 16 * blocks, kb + PF_KB);
            weight_tiles(w, n0, 16 * blocks, kb, scratch);
            a = scratch;
            lda = 32;
        }
        _tile_loadd(4, p + 512 * kb, 64);
        DP(0, 5, 0);
        if (blocks > 1) DP(1, 6, 1);
        if (blocks > 2) DP(2, 5, 2);
        if (blocks > 3) DP(3, 6, 3);
    }
    _tile_stored(0, c[0], 64);
    if (blocks > 1) _tile_stored(1, c[1], 64);
    if (blocks > 2) _tile_stored(2, c[2], 64);
    if (blocks > 3) _tile_stored(3, c[3], 64);
    for (int j = 0; j < blocks; j++) store_block(c[j], job->bias, n0 + 16 * j, 16 * mb, M, job->y, job->ldy);
}

// The batch's tasks (every job's column groups) split over the team; tiles configured (amx_begin).
void gemm_amx_team(const uint16_t *pack, int M, int K, const gemm_job *jobs, int count, uint16_t *scratch) {
    int mblocks = (M + 15) / 16, pfirst[8], sfirst[8];
    pfirst[0] = sfirst[0] = 0;
    for (int j = 0; j < count; j++) {
        int nblocks = jobs[j].w->N / 16;
        pfirst[j + 1] = pfirst[j] + (nblocks + 1) / 2;  // tasks of two 16-column blocks (a pair of x blocks)
        sfirst[j + 1] = sfirst[j] + (nblocks + 3) / 4;  // tasks of four (one x block)
    }
    if (mblocks / 2) {
#pragma omp for schedule(static)
        for (int t = 0; t < pfirst[count]; t++) {
            int j = 0;
            while (t >= pfirst[j + 1]) j++;
            pairs_task(pack, M, K, &jobs[j], t - pfirst[j], scratch);
        }
    }
    if (mblocks % 2) {
#pragma omp for schedule(static)
        for (int t = 0; t < sfirst[count]; t++) {
            int j = 0;
            while (t >= sfirst[j + 1]) j++;
            single_task(pack, M, K, &jobs[j], t - sfirst[j], scratch);
        }
    }
}
#endif  // __AMX_TILE__
