// GGUF blocks -> bf16, bit for bit what eagle-chat's bf16 copy of the embedded model holds: the
// gguf package dequantizes in fp32 (Q4_1: d * q, then + m, two roundings; Q4_0: d * (q - 8);
// Q8_0: d * q) and torch rounds fp32 to bf16 (nearest even). The explicit-rounding intrinsics
// keep the compiler from fusing d * q + m into one FMA (one rounding: other bits).
#include <omp.h>

#include "common.h"
#include "weights.h"

#define RN (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

static inline __m512 half_to_ps(const uint8_t *p) {  // one fp16 scale, broadcast (exact)
    uint16_t h; memcpy(&h, p, 2);
    return _mm512_cvtph_ps(_mm256_set1_epi16((short)h));  // vpbroadcastw + vcvtph2ps
}

// fp32 -> bf16, nearest even, in one instruction. It equals to_bf16x16 (torch's rounding) for
// every value a block can produce: finite, and zero or at least 2^-24 in magnitude (multiples
// of an fp16 scale), never an fp32 denormal, which this instruction would flush.
static inline __m256i cvt_bf16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }

// Q4 blocks: the 16 values d * q (+ m) for q = 0..15, computed once per block in fp32 with the
// converter's roundings, then each weight looked up by its nibble (vpermw): the same values as
// computing every weight, at a third of the instructions.
static inline __m512i q4_lookup(const uint8_t *nibbles, __m512 d, __m512 m, int has_min, int offset) {
    __m512 q = _mm512_sub_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                             _mm512_set1_ps((float)offset));  // exact small integers
    __m512 t = _mm512_mul_round_ps(d, q, RN);
    if (has_min) t = _mm512_add_round_ps(t, m, RN);
    __m512i table = _mm512_castsi256_si512(cvt_bf16(t));
    __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)nibbles));
    __m256i lo = _mm256_and_si256(w, _mm256_set1_epi16(15)), hi = _mm256_srli_epi16(w, 4);
    return _mm512_permutexvar_epi16(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1), table);
}

// one block of 32 weights -> 32 bf16 (elements 0-15: low nibbles / bytes 0-15, 16-31: the rest)
static inline void block_q4_1(const uint8_t *b, uint16_t *out) {  // {fp16 d, fp16 m, 16 bytes}: d * q + m
    _mm512_storeu_si512(out, q4_lookup(b + 4, half_to_ps(b), half_to_ps(b + 2), 1, 0));
}

static inline void block_q4_0(const uint8_t *b, uint16_t *out) {  // {fp16 d, 16 bytes}: d * (q - 8)
    _mm512_storeu_si512(out, q4_lookup(b + 2, half_to_ps(b), _mm512_setzero_ps(), 0, 8));
}

static inline void block_q8_0(const uint8_t *b, uint16_t *out) {  // {fp16 d, 32 int8}: q * d
    __m512 d = half_to_ps(b);
    __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 2))));
    __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 18))));
    _mm256_storeu_si256((__m256i *)out, cvt_bf16(_mm512_mul_round_ps(lo, d, RN)));
    _mm256_storeu_si256((__m256i *)(out + 16), cvt_bf16(_mm512_mul_round_ps(hi, d, RN)));
}

static inline int block_bytes(int type) { return type == WT_Q4_1 ? 20 : type == WT_Q4_0 ? 18 : 34; }

// where block column kb of row n starts
static inline const uint8_t *block_at(const wmat *w, int64_t n, int kb) {
    int64_t bs = block_bytes(w->type);
    if (w->tiled) return (const uint8_t *)w->data + (((n >> 4) * (w->K / 32) + kb) * 16 + (n & 15)) * bs;
    return (const uint8_t *)w->data + n * w->ld + kb * bs;
}

static inline void dequant_block(int type, const uint8_t *b, uint16_t *out) {
    switch (type) {
    case WT_Q4_1: block_q4_1(b, out); break;
    case WT_Q4_0: block_q4_0(b, out); break;
    case WT_Q8_0: block_q8_0(b, out); break;
    default: break;
    }
}

void weight_tiles(const wmat *w, int n0, int rows, int kb, uint16_t *out) {
    if (is_nibbles(w->type)) {  // n0 % 16 == 0: whole groups of 16 rows
        for (int r0 = 0; r0 < rows; r0 += 16)
            q4x8_block(w, (n0 + r0) / 16, kb, 0, rows - r0 < 16 ? rows - r0 : 16, out + 32 * r0, 32);
        return;
    }
    int bs = block_bytes(w->type);
    for (int r0 = 0; r0 < rows; r0 += 16) {  // tiled: one 16-row group's blocks are contiguous
        const uint8_t *b = block_at(w, n0 + r0, kb);
        int64_t step = w->tiled ? bs : w->ld;
        for (int r = 0; r < 16 && r0 + r < rows; r++) dequant_block(w->type, b + r * step, out + 32 * (r0 + r));
    }
}

void weight_prefetch(const wmat *w, int n0, int rows, int kb) {
    if (is_nibbles(w->type)) {  // a block column's codes and scales (Q4K: its super-block's header is in cache)
        int gb = x8_group_bytes(w->type);
        for (int r0 = 0; r0 < rows; r0 += 16) {
            const char *b = (const char *)x8_block_at(w, (n0 + r0) / 16, kb);
            for (int off = 0; off < gb; off += 64) _mm_prefetch(b + off, _MM_HINT_T0);
        }
        return;
    }
    int bs = block_bytes(w->type);
    for (int r0 = 0; r0 < rows; r0 += 16) {
        const char *b = (const char *)block_at(w, n0 + r0, kb);
        if (w->tiled)
            for (int off = 0; off < 16 * bs; off += 64) _mm_prefetch(b + off, _MM_HINT_T0);
        else
            for (int r = 0; r < 16 && r0 + r < rows; r++) _mm_prefetch(b + r * w->ld, _MM_HINT_T0);
    }
}

static void dequant_row(const wmat *w, int64_t n, uint16_t *out) {
    for (int kb = 0; kb < w->K / 32; kb++) dequant_block(w->type, block_at(w, n, kb), out + 32 * kb);
}

const uint16_t *weight_panel(const wmat *w, int n0, int rows, uint16_t *scratch, int64_t *ldw) {
    if (w->type == WT_BF16) {
        *ldw = w->ld;
        return (const uint16_t *)w->data + (int64_t)n0 * w->ld;
    }
    for (int r = 0; r < rows; r++) dequant_row(w, n0 + r, scratch + (int64_t)r * w->K);
    *ldw = w->K;
    return scratch;
}

void weight_row(const wmat *w, int64_t n, uint16_t *out) {
    if (is_x8(w->type)) x8_row(w, n, out);
    else if (w->type == WT_BF16) memcpy(out, (const uint16_t *)w->data + n * w->ld, (size_t)w->K * 2);
    else dequant_row(w, n, out);
}

// Rows [0, N) of w as bf16 (N, K), what every GEMM reads: a long prompt's copy of each layer
// (core.kernels.invariant.BlockLinear), and the tests' reference.
// ctypes: dequantize_bf16(ptr w, ptr out, i32 nthreads) -> void
void dequantize_bf16(const wmat *w, uint16_t *out, int nthreads) {
    if (is_x8(w->type)) {  // 16 rows at a time (N % 16 == 0)
#pragma omp parallel for schedule(static) num_threads(nthreads)
        for (int64_t g = 0; g < w->N / 16; g++) x8_rows_bf16(w, g, 0, 16, out + 16 * g * (int64_t)w->K, w->K);
        return;
    }
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t n = 0; n < w->N; n++) weight_row(w, n, out + n * w->K);
}
