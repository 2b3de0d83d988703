// A weight matrix as the GEMMs read it: bf16 rows, or GGUF blocks (Q4_0, Q4_1, Q8_0) that are
// dequantized, one panel of output rows at a time, to exactly the bf16 values the converter
// (gguf's dequantize, then torch's fp32 -> bf16) gives. The GEMM then runs the same instruction
// sequence on the same bf16 values as it does on a bf16 copy of the weight, so a quantized
// weight computes bit for bit what its bf16 copy computes (and stays row-invariant).
#pragma once
#include <stdint.h>

enum { WT_BF16 = 30, WT_Q4_0 = 2, WT_Q4_1 = 3, WT_Q8_0 = 8 };  // ggml's type ids (GGML_TYPE_BF16 = 30)
// Our own layouts for 8-bit activations (csrc/gemm_x8.c, core.quant.pack_x8): Q4_0 / Q4_1 and
// Q8_0 blocks regrouped per 16 output rows for VNNI.
// WT_Q8_SPLIT: Q8_X8 with each code's two nibbles in two arrays (the screened LM head, csrc/gemm_x8.c).
// WT_Q5_X8: 5-bit codes (GGUF's Q5_0 / Q5_1 / Q5_K as Q5_1 blocks, w = d u + m, u in 0..31) in Q4_X8's nibble
// order plus a plane of fifth bits (csrc/gemm_x8.c).
// WT_Q6_X8: GGUF's Q6_K (w = d s (u - 32), u in 0..63, a scale s per 16 values) in Q4_X8's nibble order plus
// two planes of high bits (csrc/gemm_x8.c).
// WT_Q4K_X8: GGUF's Q4_K (256-value super-blocks: fp16 d, dmin, a 6-bit scale and minimum per 32 values,
// w = d sc u - dmin mn) with its own scales, in Q4_X8's nibble order (csrc/gemm_x8.c).
// WT_Q40_X8: GGUF's Q4_0 (w = d (u - 8)) in Q4_X8's nibble order, d alone (csrc/gemm_x8.c).
// WT_Q5K_X8: GGUF's Q5_K as WT_Q4K_X8 with Q5_X8's plane of fifth bits (csrc/gemm_x8.c).
enum { WT_Q4_X8 = 100, WT_Q8_X8 = 101, WT_Q8_SPLIT = 102, WT_Q5_X8 = 103, WT_Q6_X8 = 104, WT_Q4K_X8 = 105,
       WT_Q40_X8 = 107, WT_Q5K_X8 = 108 };
// The 4-bit layouts: codes in Q4_X8's nibble order, w = D u + M per block column (csrc/gemm_x8.c nibble_scales)
static inline int is_nibbles(int type) { return type == WT_Q4_X8 || type == WT_Q40_X8 || type == WT_Q4K_X8; }

typedef struct {
    int32_t type;      // WT_*
    int32_t N, K;      // output rows, inner size (a multiple of 32 for block types)
    int32_t tiled;     // blocks only: 0, N rows of K / 32 blocks (the file's order); 1, per 16 rows
                       // and block column kb, the 16 rows' blocks side by side (N % 16 == 0), so
                       // a GEMM reads the weight front to back (core.quant.tile_blocks)
    const void *data;
    int64_t ld;        // bf16: elements between rows; blocks, untiled: bytes between rows
} wmat;

// Rows [n0, n0 + rows) of w as bf16, `*ldw` elements apart: w's own rows (bf16), or `scratch`
// (rows * K elements) filled with their dequantized values.
const uint16_t *weight_panel(const wmat *w, int n0, int rows, uint16_t *scratch, int64_t *ldw);
// Block column kb (K positions 32 kb .. 32 kb + 31) of rows [n0, n0 + rows) of a block weight,
// as bf16 rows 32 apart in `out`: one AMX tile's A operand per 16 rows.
void weight_tiles(const wmat *w, int n0, int rows, int kb, uint16_t *out);
// Prefetch (into L1) what weight_tiles will read for block column kb.
void weight_prefetch(const wmat *w, int n0, int rows, int kb);
// Row n of w (K bf16 values) into out: an embedding lookup.
void weight_row(const wmat *w, int64_t n, uint16_t *out);

// One GEMM of a batch that shares its input x: y = x @ w.T (+ bias). A decoding step runs q, k
// and v (or gate and up) as one batch, so one team of threads splits all their column blocks.
typedef struct {
    const wmat *w;
    const uint16_t *bias;  // (N,) or NULL
    uint16_t *y;
    int64_t ldy;
} gemm_job;

// Work memory for gemm_team: x packed for AMX (pack_elems(M, K)), and per thread a 64 x K panel.
static inline int64_t pack_elems(int M, int K) { return (int64_t)((M + 15) / 16) * K * 16; }
static inline int64_t scratch_elems(int K) { return (int64_t)64 * K; }

// The batch's GEMMs split over the threads of the enclosing OpenMP team (call it from every
// thread of a parallel region; outside one, a team of one). Every job's w has inner size K. On
// AMX the caller's threads must have configured their tiles (amx_begin). 0, or -1 if any job's
// weight has a type the kernels do not read.
int gemm_team(const uint16_t *x, int64_t ldx, const gemm_job *jobs, int count, int M, int K, uint16_t *pack,
              uint16_t *scratch);
// The batch's GEMMs on 8-bit activations (every job's w an X8 type): x quantized per row into
// `shared` (x8_work_bytes(M, K) <= pack_elems(M, K) * 2 bytes), or by every thread into its own
// `mine` (mine_bytes) for up to 16 rows, then the 16-row groups split over the team. 0, or -1 for
// a weight that is not X8 or does not fit K.
int gemm_x8_team(const uint16_t *x, int64_t ldx, const gemm_job *jobs, int count, int M, int K, void *shared,
                 void *mine, int64_t mine_bytes);
int is_x8(int type);
int64_t x8_work_bytes(int M, int K);
void x8_row(const wmat *w, int64_t n, uint16_t *out);
void x8_rows_bf16(const wmat *w, int64_t g, int j0, int rows, uint16_t *out, int64_t ldo);
int x8_group_bytes(int type);
const uint8_t *x8_block_at(const wmat *w, int64_t g, int kb);  // block column kb's codes in group g
void q4x8_block(const wmat *w, int64_t g, int kb, int j0, int rows, uint16_t *out, int64_t ldo);
int amx_serves(int N, int K);  // 1 where AMX tiles were granted and the shape suits them (csrc/gemm_amx.c)
void amx_begin(void);  // per thread, once per parallel region that runs AMX GEMMs (no-op without AMX)
void amx_end(void);

// A screen for an LM head stored as WT_Q8_SPLIT (csrc/gemm_x8.c, lm_screen_team; built by
// core.kernels.screen): with A the weight its h nibbles give (u ~ 16 h + 7.5) and D = W - A, a logit
// is A x + C z + D_res, where z = U x (U: rank orthonormal rows, the directions the final hidden
// states take), C = D U^T, and |D_res| <= e1 ||x - U^T z|| + e2 ||z|| + e3 ||U (x - U^T z)|| + fp slack.
typedef struct {
    int32_t rank;           // r (rows of U), <= 64
    int32_t pad;
    const float *basis;     // (r, K) fp32: U
    const uint16_t *proj;   // (N / 16, r, 16) bf16: C per group of 16 vocabulary rows
    const float *coef;      // (N / 16, 4, 16) fp32 per vocabulary row: e1, e2, e3, s (the fp32 slack's weight)
} lm_screen;

// y = x @ w.T where only each row's maximum matters (greedy decoding): exact bf16 logits, Q8_X8's
// bits, for every 16-row group that may hold a row's maximum (the first maximum included), -inf
// elsewhere, so an argmax over y is the argmax over the full product. w: WT_Q8_SPLIT; M <= 16.
// Call from every thread of a team (as gemm_team). shared: screen_work_floats(M, N, threads).
// 0, or -1 where w, M or the work memory do not suit (the caller then runs gemm_team).
int lm_screen_team(const uint16_t *x, int64_t ldx, const wmat *w, const lm_screen *sc, uint16_t *y, int64_t ldy,
                   int M, void *mine, int64_t mine_bytes, float *shared);
int64_t screen_work_floats(int M, int N, int nthreads);
int screen_fits(const wmat *w, const lm_screen *sc, int M, int64_t mine_bytes);
