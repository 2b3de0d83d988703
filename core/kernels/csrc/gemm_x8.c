// W4A8: y = x @ w.T (+ bias) with 8-bit integer activations against a GGUF's 4- and 8-bit
// weight blocks, as llama.cpp computes (issue 30, the integer-activation design).
//
// Why: the W4A16 path (dequant.c + gemm_amx.c) rebuilds every weight as bf16 before a
// multiply; that reconstruction was 37% of a plain step. Here each row of x is quantized once
// per call, per block of 32 (d = max|x| / 127, q = round(x / d), int8), and a block's dot
// product with a weight block is one chain of VNNI vpdpbusd on the raw 4-bit codes: 64
// multiply-adds per instruction, nothing rebuilt.
//
// Numerics (these are the reference numerics of `--weights w4a8`, not the bf16 path's):
//   Q4 weights (Q4_1: w = d_w q + m_w; Q4_0: m_w = -8 d_w, exact), per block b:
//     acc = fma(d_w * d_x, float(sum q_w q_x), acc);  acc = fma(m_w, d_x * float(sum q_x), acc)
//   Q8 weights (Q8_0, stored + 128 as unsigned bytes): acc = fma(d_w * d_x, float(sum (q_w+128) q_x - 128 sum q_x), acc)
// over b = 0, 1, ... in order, then + bias in fp32 and one round to bf16 (nearest even).
// Integer sums are exact and every output element runs this same fixed sequence of fp32
// operations whatever M is and wherever its row sits, so a row computes the same bits alone
// (a plain step) or inside a tree: row-invariant by construction.
//
// Weight layout (core.quant.pack_x8; N % 16 == 0): per group of 16 output rows g and block
// column kb, contiguous, groups in order:
//   WT_Q4_X8: 256 bytes of codes (4 vectors; vector p, dword j = row j's code bytes 4p..4p+3:
//             low nibbles = elements 4p..4p+3, high = 16+4p..16+4p+3, GGUF's own nibble order),
//             16 fp16 d_w, 16 fp16 m_w                                   -> 320 bytes
//   WT_Q8_X8: 512 bytes (vector t, dword j = row j's elements 4t..4t+3, + 128), 16 fp16 d_w -> 544 bytes
//   WT_Q5_X8: Q4_X8's 256 bytes of low 4 bits, 64 bytes of fifth bits (byte i, bit t: the code at byte i of
//             operand vector t, i.e. row i / 4's element 4t + i % 4), 16 fp16 d_w, 16 fp16 m_w -> 384 bytes;
//             codes u in 0..31 and w = d_w u + m_w (Q5_1; Q5_0: m_w = -16 d_w, exact), Q4's fp32 steps
//   WT_Q6_X8: GGUF's Q6_K, its super-blocks of 8 block columns kept together: per group and super-block, 16 fp16
//             d_w (32 bytes), then per block column Q4_X8's 256 bytes of low 4 bits, two 64-byte planes (plane c,
//             byte i, bit t: bit 4 + c of the code at byte i of operand vector t), 16 int8 s0_w, 16 int8 s1_w ->
//             32 + 8 x 416 = 3,360 bytes, 420 a block column (Q6_K's own 6.5625 bits a weight);
//             codes u in 0..63, w = d_w s_w (u - 32) with s_w = s0_w for K positions 0-15 of the
//             block, s1_w for 16-31 (its 16-value sub-blocks). Per block, with a row's half sums S0, S1 of q_x:
//               T = s0_w (sum_0-15 u q_x - 32 S0) + s1_w (sum_16-31 u q_x - 32 S1)   (exact: |T| < 2^24)
//               acc = fma(d_w * d_x, float(T), acc)
//             so a block adds the exact product of the file's weights and the quantized row, rounded twice.
//   WT_Q40_X8: GGUF's Q4_0 (w = d_w (u - 8)): Q4_X8's 256 bytes of codes, 16 fp16 d_w -> 288 bytes (Q4_0's own 4.5
//             bits a weight); Q4's fp32 steps with m_w = -8 d_w computed in fp32 (exact): the bits of a Q4_0
//             weight packed as Q4_X8, in 10% fewer bytes.
//   WT_Q4K_X8: GGUF's Q4_K, its super-blocks kept together as WT_Q6_X8's: per group and super-block, a
//             header of 16 fp16 d_w and 16 fp16 dmin_w (64 bytes), then per block column Q4_X8's 256 bytes of
//             codes, the 16 rows' 6-bit scales sc_w and minimums mn_w (one byte each) -> 64 + 8 x 288 = 2,368
//             bytes, 296 a block column (Q4_K's 4.5 bits a weight, plus an eighth of a bit). w = d_w sc_w u -
//             dmin_w mn_w, and D = d_w sc_w, M = -dmin_w mn_w are exact in fp32 (11 x 6 bits), so a block runs
//             Q4's fp32 steps on D and M: the file's own values, not D and M rounded to fp16.
//   WT_Q5K_X8: GGUF's Q5_K as WT_Q4K_X8, each block column Q5_X8's 256 bytes of low 4 bits and 64 of fifth bits,
//             then sc_w and mn_w -> 64 + 8 x 352 = 2,880 bytes, 360 a block column (5.6 bits a weight); codes
//             u in 0..31, w = d_w sc_w u - dmin_w mn_w, Q4's fp32 steps on D and M as WT_Q4K_X8's.
// so one vector holds 4 consecutive K positions of 16 output rows (vpdpbusd's layout) and a
// thread reads its groups front to back.
#include "common.h"
#include "weights.h"
#include <omp.h>

#define ROWS_X8 8  // rows of x per pass in the LM head screen's first pass (accumulators in registers)
#define AMX_X8_MIN_ROWS 13  // from this many rows AMX-INT8 serves, where the CPU has it. Measured (forward
                            // ms): 2026-12-02, one Intel VM, VNNI 8 rows a pass: 8 rows 5.9 VNNI / 6.0 AMX,
                            // 10 rows 6.8 / 6.5, 16 rows 9.7 / 7.8; 2026-12-05, another, VNNI 16 rows a pass:
                            // 9 rows 14.0 / 17.5-19.4, 12 rows 17.2-18.3 / 20.5-21.5, 16 rows 22.1-22.6 / 21.5-23.8

// WT_Q8_SPLIT (the LM head where core.kernels.step screens it): a Q8_X8 weight's unsigned codes
// u = q + 128 split as u = 16 h + l into two arrays, so that a pass over h alone bounds every
// logit (lm_screen_team) and only the rows that may be the maximum read l:
//   part one, per group and block column: 256 bytes of h in Q4_X8's nibble order, 16 fp16 d_w (288 bytes);
//   part two, after all of part one, per group and block column: 256 bytes of l, the same order.
// u is rebuilt exactly ((h << 4) | l per byte), so its integer sums, and every logit, are Q8_X8's bit for bit.
int x8_group_bytes(int type) {
    return type == WT_Q4_X8 ? 320 : type == WT_Q8_SPLIT || type == WT_Q40_X8 ? 288 : type == WT_Q5_X8 ? 384
         : type == WT_Q6_X8 ? 420 : type == WT_Q4K_X8 ? 296 : type == WT_Q5K_X8 ? 360 : 544;
}

// The layouts that keep GGUF's super-blocks (8 block columns behind a header of their 16 rows' d, and dmin):
// a block column's bytes past the header, 0 for the others (x8_group_bytes = super-block bytes / 8).
static inline int super_column_bytes(int type) {
    return type == WT_Q4K_X8 ? 288 : type == WT_Q5K_X8 ? 352 : type == WT_Q6_X8 ? 416 : 0;
}
static inline int is_k_quant(int type) { return type == WT_Q4K_X8 || type == WT_Q5K_X8; }  // a scale and min per block

// The header of block column kb's super-block in a group's bytes wg (super_column_bytes(type) > 0).
static inline const uint8_t *super_header(int type, const uint8_t *wg, int kb) {
    return wg + (int64_t)(kb / 8) * 8 * x8_group_bytes(type);
}

// Block column kb's codes in a group's bytes wg (every layout but WT_Q8_SPLIT's, which split_hi / split_lo address).
static inline const uint8_t *x8_block(int type, const uint8_t *wg, int kb) {
    if (super_column_bytes(type))
        return super_header(type, wg, kb) + (type == WT_Q6_X8 ? 32 : 64) + (kb % 8) * super_column_bytes(type);
    return wg + (int64_t)kb * x8_group_bytes(type);
}

// The same for group g of w (the prompt's tiles: csrc/dequant.c).
const uint8_t *x8_block_at(const wmat *w, int64_t g, int kb) {
    return x8_block(w->type, (const uint8_t *)w->data + g * (w->K / 32) * x8_group_bytes(w->type), kb);
}

// The 16 rows' D and M of a 4- or 5-bit block column b (w = D u + M, exact in fp32): Q4_X8's and Q5_X8's stored
// fp16 d and m; Q40's d and -8 d; Q4K's and Q5K's d sc and -dmin mn from its super-block's header (x8_block(type,
// wg, kb) = b).
static inline void block_scales(int type, const uint8_t *wg, int kb, const uint8_t *b, __m512 *d, __m512 *m) {
    if (is_k_quant(type)) {
        const uint8_t *head = super_header(type, wg, kb), *s = b + super_column_bytes(type) - 32;
        __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)s)));
        __m512 mn = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(s + 16))));
        *d = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)head)), sc);
        *m = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(head + 32))), _mm512_sub_ps(_mm512_setzero_ps(), mn));
        return;
    }
    int off = type == WT_Q5_X8 ? 320 : 256;
    *d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(b + off)));
    *m = type == WT_Q40_X8 ? _mm512_mul_ps(*d, _mm512_set1_ps(-8.0f))
                           : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(b + off + 32)));
}

// Block column kb of group g of a WT_Q8_SPLIT weight: its h part (256 bytes, then 16 fp16 d_w) and its l part.
static inline const uint8_t *split_hi(const wmat *w, int64_t g, int kb) {
    return (const uint8_t *)w->data + (g * (w->K / 32) + kb) * 288;
}
static inline const uint8_t *split_lo(const wmat *w, int64_t g, int kb) {
    int64_t KB = w->K / 32;
    return (const uint8_t *)w->data + (int64_t)(w->N / 16) * KB * 288 + (g * KB + kb) * 256;
}
// One block column of 4-bit codes in Q4_X8's nibble order (256 bytes) -> the 8 operand vectors of
// block_isum (vector p: K positions 4p..4p+3 of the 16 rows, low nibbles; 4 + p: 16 + 4p.., high).
static inline void nibble_codes(const uint8_t *codes, __m512i *ops) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int p = 0; p < 4; p++) {
        __m512i z = _mm512_loadu_si512(codes + 64 * p);
        ops[p] = _mm512_and_si512(z, low);
        ops[4 + p] = _mm512_and_si512(_mm512_srli_epi16(z, 4), low);
    }
}

// A 64-byte plane of code bits (byte i, bit t: a bit of the code at byte i of operand vector t) ORed into
// the 8 operand vectors as bit `bit` of each code byte.
static inline void or_plane(const uint8_t *plane, int bit, __m512i *ops) {
    const __m512i one = _mm512_set1_epi8(1);
    __m512i p = _mm512_loadu_si512(plane);
    for (int t = 0; t < 8; t++)  // per 16-bit lane: the bit shifted in from the next byte is masked off
        ops[t] = _mm512_or_si512(ops[t], _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(p, t), one), bit));
}

// One block column of a WT_Q5_X8 weight -> the 8 operand vectors (codes 0..31): nibble_codes' low 4 bits,
// the fifth from the plane after them.
static inline void q5_codes(const uint8_t *b, __m512i *ops) {
    nibble_codes(b, ops);
    or_plane(b + 256, 4, ops);
}

// One block column of a WT_Q6_X8 weight -> the 8 operand vectors (codes 0..63): q5_codes' five bits, the
// sixth from the second plane.
static inline void q6_codes(const uint8_t *b, __m512i *ops) {
    q5_codes(b, ops);
    or_plane(b + 320, 5, ops);
}

// A thread reads its share of a layer's 4-bit weights front to back, group after group; each block
// asks for the bytes PREFETCH_AHEAD further on, so the stream runs ahead of the integer work.
// Measured (Intel AMX VM, 2 threads, 36 hand-written prompts, processes alternating): plain
// decoding 195.5 / 193.6 -> 240.5 / 247.8 tok/s, eagle 231.3 / 234.4 -> 274.2 / 272.1; 8 KB as
// 4, 2 KB less; the hardware prefetcher alone leaves the stream short of the memory's bandwidth.
// Near the end of a thread's share the requests run into the next one's or past the weight: a
// prefetch never faults, so nothing guards them.
#define PREFETCH_AHEAD 4096
static inline void prefetch_ahead(const uint8_t *p, int n) {
    for (int l = 0; l < n; l += 64) _mm_prefetch((const char *)p + PREFETCH_AHEAD + l, _MM_HINT_T0);
}

// The LM head's weights (Q8_X8, or the split parts the screen reads): on AVX2 each block asks for the
// bytes PREFETCH_AHEAD further on, as the layers' do; elsewhere a group asks for the whole group two
// ahead (prefetch_bytes). Measured (AMD EPYC Zen 3 VM, AVX2, 2 threads, forwards interleaved in one
// process, the same bits either way): one row 4.68 -> 4.36 ms screened, 5.20 -> 4.73 ms full; 4 rows
// 8.94 -> 8.58 / 9.79 -> 9.55. A group's bytes asked for at once (81 lines) stall the loads behind them
// there. The AVX-512 builds keep what was measured on them (not re-measured: no such machine at hand).
#ifdef EAGLE_AVX2
#define LM_STREAM 1
#else
#define LM_STREAM 0
#endif

// Bring n bytes at p into L2 ahead of the stream (the LM head's next groups).
static inline void prefetch_bytes(const void *p, int64_t n) {
    for (int64_t off = 0; off < n; off += 64) _mm_prefetch((const char *)p + off, _MM_HINT_T1);
}

// The 8 vectors of u (Q8_X8's order: vector t = K positions 4t..4t+3 of the 16 rows) from the two parts.
static inline void split_codes(const uint8_t *hi, const uint8_t *lo, __m512i *u) {
    const __m512i low = _mm512_set1_epi8(0x0F), high = _mm512_set1_epi8((char)0xF0);
    for (int p = 0; p < 4; p++) {
        __m512i h = _mm512_loadu_si512(hi + 64 * p), l = _mm512_loadu_si512(lo + 64 * p);
        u[p] = _mm512_or_si512(_mm512_slli_epi16(_mm512_and_si512(h, low), 4), _mm512_and_si512(l, low));
        u[4 + p] = _mm512_or_si512(_mm512_and_si512(h, high), _mm512_and_si512(_mm512_srli_epi16(l, 4), low));
    }
}

// One row of x -> q (K int8), and per block: d (fp32), d * sum q (fp32), sum q (int32), and where h is given the
// sum of its first 16 q (int32: Q6 weights scale the block's halves apart).
static void quantize_row_x8(const uint16_t *x, int K, int8_t *q, float *d, float *ds, int32_t *s, int32_t *h) {
    const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    for (int kb = 0; kb < K / 32; kb++) {
        __m512 a = bf16x16_to_ps(x + 32 * kb), b = bf16x16_to_ps(x + 32 * kb + 16);
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(a, sign), _mm512_and_ps(b, sign)));
        float dd = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
        const __m512 lim = _mm512_set1_ps(127.0f), nlim = _mm512_set1_ps(-127.0f);
        __m512 fa = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(a, _mm512_set1_ps(id)), nlim), lim);
        __m512 fb = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(b, _mm512_set1_ps(id)), nlim), lim);
        __m512i ia = _mm512_cvt_roundps_epi32(fa, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m512i ib = _mm512_cvt_roundps_epi32(fb, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm_storeu_si128((__m128i *)(q + 32 * kb), _mm512_cvtepi32_epi8(ia));
        _mm_storeu_si128((__m128i *)(q + 32 * kb + 16), _mm512_cvtepi32_epi8(ib));
        int32_t sum;
        if (h) {
            h[kb] = _mm512_reduce_add_epi32(ia);
            sum = h[kb] + _mm512_reduce_add_epi32(ib);
        } else {
            sum = _mm512_reduce_add_epi32(_mm512_add_epi32(ia, ib));
        }
        d[kb] = dd;
        s[kb] = sum;
        ds[kb] = dd * (float)sum;
    }
}

// Where quantize_x8 puts row m's parts in `work` (x8_work_bytes(M, K) bytes).
typedef struct {
    int8_t *q;        // (M, K)
    float *d, *ds;    // (M, K / 32)
    int32_t *s;       // (M, K / 32)
    int32_t *h;       // (M, K / 32): the sum of each block's first 16 q
} qrows;

static qrows x8_parts(void *work, int M, int K) {
    qrows r;
    int64_t blocks = (int64_t)M * (K / 32);
    r.q = (int8_t *)work;
    r.d = (float *)((char *)work + (((int64_t)M * K + 63) & ~(int64_t)63));
    r.ds = r.d + blocks;
    r.s = (int32_t *)(r.ds + blocks);
    r.h = r.s + blocks;
    return r;
}

int64_t x8_work_bytes(int M, int K) { return (((int64_t)M * K + 63) & ~(int64_t)63) + (int64_t)M * (K / 32) * 16; }

// Row m of x into a's parts (halves: with the first-half sums, which only Q6 weights read).
static inline void quantize_into(const uint16_t *x, int64_t ldx, int K, const qrows *a, int m, int halves) {
    int64_t KB = K / 32;
    quantize_row_x8(x + m * ldx, K, a->q + (int64_t)m * K, a->d + m * KB, a->ds + m * KB, a->s + m * KB,
                    halves ? a->h + m * KB : NULL);
}

static inline __m512i bcast4(const int8_t *p) { int32_t v; memcpy(&v, p, 4); return _mm512_set1_epi32(v); }

// One block's 16 integer sums per half of its K positions (s[0]: 0-15, s[1]: 16-31; Q6's two scales): ops[r]
// holds K positions 4r..4r+3 of the 16 output rows (unsigned bytes), qx the row's 32 signed codes; two chains of
// four vpdpbusd. block_isum: their sum (exact).
#ifndef EAGLE_AVX2
static inline void block_isum_halves(const __m512i *ops, const int8_t *qx, __m512i *s) {
    __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
    for (int p = 0; p < 4; p++) {
        s0 = _mm512_dpbusd_epi32(s0, ops[p], bcast4(qx + 4 * p));
        s1 = _mm512_dpbusd_epi32(s1, ops[4 + p], bcast4(qx + 16 + 4 * p));
    }
    s[0] = s0;
    s[1] = s1;
}
static inline __m512i block_isum(const __m512i *ops, const int8_t *qx) {
    __m512i s[2];
    block_isum_halves(ops, qx, s);
    return _mm512_add_epi32(s[0], s[1]);
}
#define block_isum_nibbles block_isum  // codes below 16 (Q4, the screen's h): the same instructions
#define block_isum_q5 block_isum       // and below 32 (Q5)
#else
// AVX2 has no vpdpbusd. vpmaddubsw multiplies unsigned by signed bytes and adds pairs into 16 bits,
// saturating; for codes below 16 a pair is at most 2 x 15 x 127 = 3,810, so the block's 8 vectors
// add up in 16 bits (<= 30,480) and one vpmaddwd by 1 gives each dword its 4 lanes' sum: the same
// integers as vpdpbusd's, at a quarter of the emulated instruction's work. Codes below 32 (five_bit, Q5):
// a pair is at most 7,874, so four vectors add up in 16 bits (<= 31,496): the low and the high K
// positions' sums apart, each widened by its own vpmaddwd (`five_bit` is a constant where inlined).
static inline __m256i isum_codes8(const __m256i *ops, int half, const int8_t *qx, int five_bit) {
    __m256i s = _mm256_setzero_si256(), s1 = _mm256_setzero_si256(), ones = _mm256_set1_epi16(1);
    for (int p = 0; p < 4; p++) {
        int32_t lo, hi;
        memcpy(&lo, qx + 4 * p, 4);
        memcpy(&hi, qx + 16 + 4 * p, 4);
        s = _mm256_add_epi16(s, _mm256_maddubs_epi16(ops[2 * p + half], _mm256_set1_epi32(lo)));
        __m256i t = _mm256_maddubs_epi16(ops[2 * (4 + p) + half], _mm256_set1_epi32(hi));
        if (five_bit) s1 = _mm256_add_epi16(s1, t);
        else s = _mm256_add_epi16(s, t);
    }
    __m256i sum = _mm256_madd_epi16(s, ones);
    return five_bit ? _mm256_add_epi32(sum, _mm256_madd_epi16(s1, ones)) : sum;
}
static inline __m512i block_isum_nibbles(const __m512i *ops, const int8_t *qx) {
    const __m256i *o = (const __m256i *)ops;  // ops[r] = (lo, hi): o[2 r + half]
    __m512i r = {isum_codes8(o, 0, qx, 0), isum_codes8(o, 1, qx, 0)};
    return r;
}
static inline __m512i block_isum_q5(const __m512i *ops, const int8_t *qx) {
    const __m256i *o = (const __m256i *)ops;
    __m512i r = {isum_codes8(o, 0, qx, 1), isum_codes8(o, 1, qx, 1)};
    return r;
}
#endif

#ifdef EAGLE_AVX2
// Codes below 64: a vpmaddubsw pair is at most 2 x 63 x 127 = 16,002, so two vectors add up in 16 bits
// (<= 32,004) before vpmaddwd widens them: operand vectors t0 .. t0 + 3 (K positions 4 t0 ..), rows of `half`.
static inline __m256i isum_codes6(const __m256i *o, int half, const int8_t *qx, int t0) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i r = _mm256_setzero_si256();
    for (int t = t0; t < t0 + 4; t += 2) {
        int32_t v0, v1;
        memcpy(&v0, qx + 4 * t, 4);
        memcpy(&v1, qx + 4 * t + 4, 4);
        __m256i s = _mm256_add_epi16(_mm256_maddubs_epi16(o[2 * t + half], _mm256_set1_epi32(v0)),
                                     _mm256_maddubs_epi16(o[2 * (t + 1) + half], _mm256_set1_epi32(v1)));
        r = _mm256_add_epi32(r, _mm256_madd_epi16(s, ones));
    }
    return r;
}
static inline void block_isum_halves(const __m512i *ops, const int8_t *qx, __m512i *s) {
    const __m256i *o = (const __m256i *)ops;  // ops[t] = (rows 0-7, rows 8-15): o[2 t + half]
    __m512i s0 = {isum_codes6(o, 0, qx, 0), isum_codes6(o, 1, qx, 0)};
    __m512i s1 = {isum_codes6(o, 0, qx, 4), isum_codes6(o, 1, qx, 4)};
    s[0] = s0;
    s[1] = s1;
}
#endif

// AMX-INT8 (Intel Sapphire Rapids and later) from AMX_X8_MIN_ROWS rows: one TDPBSUD multiplies
// 16 rows of x by a block of 16 output rows, a 16th of VNNI's integer instructions per row (the
// unpacking and the tile store / reload per block make it pay only from AMX_X8_MIN_ROWS rows, and on some hosts not at all). Its integer block sums are VNNI's exactly (integers), and the fp32 steps
// after them are the same instructions in the same order (block_q4_fp32 / block_q8_fp32): a row's bits do not
// depend on which of the two computed it, so a plain step (1 row, VNNI) and a row of a large tree (AMX)
// agree by construction.
static int x8_amx = 0;

// 1 where AMX-INT8 now serves the 8-bit-activation GEMMs of AMX_X8_MIN_ROWS rows and more, else 0.
// ctypes: x8_amx_enable(i32 want) -> i32
int x8_amx_enable(int want) {  // want: this CPU has amx_int8 (core.native checks the flag)
#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
    x8_amx = want != 0 && amx_serves(16, 32);  // never without the tile state Linux granted (else SIGILL)
#else
    (void)want;
    x8_amx = 0;
#endif
    return x8_amx;
}

// The fp32 part of one block for one row, shared by the VNNI and the AMX paths (see the header).
static inline __m512 block_q4_fp32(__m512 acc, __m512i isum, __m512 dw, __m512 mw, float d, float ds) {
    acc = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(d)), _mm512_cvtepi32_ps(isum), acc);
    return _mm512_fmadd_ps(mw, _mm512_set1_ps(ds), acc);
}
static inline __m512 block_q8_fp32(__m512 acc, __m512i isum, __m512 dw, float d, int32_t s) {
    __m512i t = _mm512_sub_epi32(isum, _mm512_set1_epi32(128 * s));
    return _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(d)), _mm512_cvtepi32_ps(t), acc);
}

#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
// Block kb's 8 B-operand rows (4 K positions x 16 output rows each) into b (rows 64 bytes apart).
static inline void b_rows(const wmat *w, int64_t g, int kb, const uint8_t *blk, uint8_t *b) {
    int type = w->type;
    if (type == WT_Q8_SPLIT) {
        __m512i u[8];
        split_codes(blk, split_lo(w, g, kb), u);
        for (int t = 0; t < 8; t++) _mm512_store_si512(b + 64 * t, u[t]);
    } else if (is_nibbles(type)) {
        __m512i ops[8];
        nibble_codes(blk, ops);
        for (int t = 0; t < 8; t++) _mm512_store_si512(b + 64 * t, ops[t]);
    } else {
        memcpy(b, blk, 512);
    }
}

// Rows [m0, m0 + rows) (rows <= 16) of one group on tiles (amx_begin's 16 x 64-byte shapes), four
// blocks per round: tile 4 holds 16 rows of x over two blocks (64 bytes), tiles 6 and 7 the
// weights of the first and the second block in their half of K (the other half zero), tiles 0-3
// the four blocks' integer sums, stored to memory and finished in fp32 as VNNI's.
static void group_amx(const wmat *w, int64_t g, const uint8_t *wg, int KB, const qrows *a, int K, int m0, int rows,
                      __m512 *acc) {
    int gb = x8_group_bytes(w->type);
    uint8_t b[4][1024] __attribute__((aligned(64)));
    int32_t c[4][16][16] __attribute__((aligned(64)));
    for (int h = 0; h < 4; h++) memset(b[h] + (h % 2 ? 0 : 512), 0, 512);  // the halves that stay zero
    for (int kb = 0; kb < KB; kb += 4) {
        int n = KB - kb < 4 ? KB - kb : 4;
        if (is_nibbles(w->type)) prefetch_ahead(x8_block(w->type, wg, kb), 4 * gb);
        for (int h = 0; h < 4; h++) {
            uint8_t *half = b[h] + (h % 2 ? 512 : 0);
            if (h < n) b_rows(w, g, kb + h, x8_block(w->type, wg, kb + h), half);
            else memset(half, 0, 512);
        }
        // blocks kb, kb + 1 (x in tile A over 64 bytes, each block's weights in its half of B) -> C tiles
#define TILE_PAIR(A, C0, C1, k0, B0, B1)                                                     \
        _tile_loadd(A, a->q + (int64_t)m0 * K + 32 * (k0), K); /* rows past M: ignored */ \
        _tile_loadd(6, B0, 64);                                                           \
        _tile_loadd(7, B1, 64);                                                           \
        _tile_zero(C0);                                                                   \
        _tile_zero(C1);                                                                   \
        _tile_dpbsud(C0, A, 6);                                                           \
        _tile_dpbsud(C1, A, 7);
        TILE_PAIR(4, 0, 1, kb, b[0], b[1])
        if (n > 2) { TILE_PAIR(5, 2, 3, kb + 2, b[2], b[3]) }
#undef TILE_PAIR
        _tile_stored(0, c[0], 64);
        _tile_stored(1, c[1], 64);
        if (n > 2) {
            _tile_stored(2, c[2], 64);
            _tile_stored(3, c[3], 64);
        }
        for (int h = 0; h < n; h++) {
            const uint8_t *blk = x8_block(w->type, wg, kb + h);
            int nib = is_nibbles(w->type);
            __m512 dw, mw;
            if (nib) block_scales(w->type, wg, kb + h, blk, &dw, &mw);
            else dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + (w->type == WT_Q8_X8 ? 512 : 256))));
            for (int i = 0; i < rows; i++) {
                int64_t blkid = (int64_t)(m0 + i) * KB + kb + h;
                __m512i isum = _mm512_load_si512(c[h][i]);
                acc[i] = nib ? block_q4_fp32(acc[i], isum, dw, mw, a->d[blkid], a->ds[blkid])
                             : block_q8_fp32(acc[i], isum, dw, a->d[blkid], a->s[blkid]);
            }
        }
    }
}
#endif

// Rows [m0, m0 + rows) (rows <= 16) of one 16-row group of a 4-bit weight (Q4_X8, Q40_X8, Q4K_X8: `type`, a
// constant where inlined) -> acc[i]
#ifdef EAGLE_AVX2
// AVX2 (16 vector registers): one half of the group (8 output rows) at a time, its 8 code vectors kept in
// registers across the rows of x (both halves' 16 spill: every product then reloads its operand). The
// same integers (isum_codes8's, summed in another order: exact) and block_q4_fp32's steps per lane.
static inline void group_q4(int type, const uint8_t *w, int KB, const qrows *a, int K, int m0, int rows, __m512 *acc) {
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const int gb = x8_group_bytes(type);
    for (int kb = 0; kb < KB; kb++) {
        const uint8_t *b = x8_block(type, w, kb);
        prefetch_ahead(b, gb);
        __m512 dw, mw;
        block_scales(type, w, kb, b, &dw, &mw);
        for (int h = 0; h < 2; h++) {
            __m256i ops[8];
            for (int p = 0; p < 4; p++) {
                __m256i z = _mm256_loadu_si256((const __m256i *)(b + 64 * p + 32 * h));
                ops[p] = _mm256_and_si256(z, low);
                ops[4 + p] = _mm256_and_si256(_mm256_srli_epi16(z, 4), low);
            }
            __m256 dwh = h ? dw.hi : dw.lo, mwh = h ? mw.hi : mw.lo;
            for (int i = 0; i < rows; i++) {
                int64_t m = m0 + i, blk = m * KB + kb;
                const int8_t *qx = a->q + m * K + 32 * kb;
                __m256i s = _mm256_setzero_si256();
                for (int p = 0; p < 4; p++) {
                    int32_t lo, hi;
                    memcpy(&lo, qx + 4 * p, 4);
                    memcpy(&hi, qx + 16 + 4 * p, 4);
                    s = _mm256_add_epi16(s, _mm256_maddubs_epi16(ops[p], _mm256_set1_epi32(lo)));
                    s = _mm256_add_epi16(s, _mm256_maddubs_epi16(ops[4 + p], _mm256_set1_epi32(hi)));
                }
                __m256 isum = _mm256_cvtepi32_ps(_mm256_madd_epi16(s, ones));
                __m256 *ah = h ? &acc[i].hi : &acc[i].lo;
                __m256 t = _mm256_fmadd_ps(_mm256_mul_ps(dwh, _mm256_set1_ps(a->d[blk])), isum, *ah);
                *ah = _mm256_fmadd_ps(mwh, _mm256_set1_ps(a->ds[blk]), t);
            }
        }
    }
}
#endif

// Rows [m0, m0 + rows) (rows <= 16) of one 16-row group of a 4-bit weight (`type`: Q4_X8, Q40_X8, Q4K_X8) or a
// 5-bit one (Q5_X8, Q5K_X8) -> acc[i]: the block column's codes rebuilt once (low nibbles: K positions 0-15, high:
// 16-31; Q5: the fifth bits' plane), then per row the block's integer sums and block_q4_fp32's steps on the
// block's D and M (block_scales). `type` is a constant where inlined. The AVX2 build's 4-bit weights take
// group_q4 (above) instead.
static inline void group_q45(int type, const uint8_t *w, int KB, const qrows *a, int K, int m0, int rows,
                             __m512 *acc) {
    const int gb = x8_group_bytes(type), five_bit = type == WT_Q5_X8 || type == WT_Q5K_X8;
    for (int kb = 0; kb < KB; kb++) {
        const uint8_t *b = x8_block(type, w, kb);
        prefetch_ahead(b, gb);
        __m512i ops[8];
        __m512 dw, mw;
        if (five_bit) q5_codes(b, ops);
        else nibble_codes(b, ops);
        block_scales(type, w, kb, b, &dw, &mw);
        for (int i = 0; i < rows; i++) {
            int64_t m = m0 + i, blk = m * KB + kb;
            const int8_t *qx = a->q + m * K + 32 * kb;
            __m512i isum = five_bit ? block_isum_q5(ops, qx) : block_isum_nibbles(ops, qx);
            acc[i] = block_q4_fp32(acc[i], isum, dw, mw, a->d[blk], a->ds[blk]);
        }
    }
}
#ifndef EAGLE_AVX2
static inline void group_q4(int type, const uint8_t *w, int KB, const qrows *a, int K, int m0, int rows, __m512 *acc) {
    group_q45(type, w, KB, a, K, m0, rows, acc);
}
#endif

// Rows [m0, m0 + rows) (rows <= 16) of one 16-row group of a Q6_X8 weight -> acc[i]: the block column's codes
// rebuilt once, then per row the two halves' integer sums and the header's exact T, one fp32 multiply-add.
static inline void group_q6(const uint8_t *w, int KB, const qrows *a, int K, int m0, int rows, __m512 *acc) {
    for (int kb = 0; kb < KB; kb++) {
        const uint8_t *b = x8_block(WT_Q6_X8, w, kb);
        prefetch_ahead(b, 420);
        __m512i ops[8];
        q6_codes(b, ops);
        __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)super_header(WT_Q6_X8, w, kb)));
        __m512 s0w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 384))));
        __m512 s1w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 400))));
        for (int i = 0; i < rows; i++) {
            int64_t m = m0 + i, blk = m * KB + kb;
            __m512i s[2];
            block_isum_halves(ops, a->q + m * K + 32 * kb, s);
            int32_t h0 = a->h[blk], h1 = a->s[blk] - h0;
            __m512 i0 = _mm512_cvtepi32_ps(_mm512_sub_epi32(s[0], _mm512_set1_epi32(32 * h0)));  // |i| <= 65,024
            __m512 i1 = _mm512_cvtepi32_ps(_mm512_sub_epi32(s[1], _mm512_set1_epi32(32 * h1)));
            __m512 t = _mm512_fmadd_ps(s0w, i0, _mm512_mul_ps(s1w, i1));  // exact: each product and T below 2^24
            acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(a->d[blk])), t, acc[i]);
        }
    }
}

#ifdef EAGLE_AVX2
// AVX2: a block's codes u = 16 h + l split into nibbles once per half of the group (8 output rows), not
// once per row: vector t of each (K positions 4t .. 4t + 3) against the row's 4 codes there, the two sums
// exact in 16 bits (isum_codes8's bound), u's sum = 16 sum(h) + sum(l); then block_q8_fp32's steps per lane.
static inline void half_q8(const __m256i *oh, const __m256i *ol, int h, __m256 dwh, const qrows *a, int K, int KB,
                           int kb, const int *rows, int m0, int count, __m512 *acc) {
    for (int c = 0; c < count; c++) {
        int64_t m = rows ? rows[c] : m0 + c, blk = m * KB + kb;
        const int8_t *qx = a->q + m * K + 32 * kb;
        __m256i sh = _mm256_setzero_si256(), sl = _mm256_setzero_si256();
        for (int t = 0; t < 8; t++) {
            int32_t v;
            memcpy(&v, qx + 4 * t, 4);
            __m256i xb = _mm256_set1_epi32(v);
            sh = _mm256_add_epi16(sh, _mm256_maddubs_epi16(oh[t], xb));
            sl = _mm256_add_epi16(sl, _mm256_maddubs_epi16(ol[t], xb));
        }
        __m256i isum = _mm256_add_epi32(_mm256_madd_epi16(sh, _mm256_set1_epi16(16)), _mm256_madd_epi16(sl, _mm256_set1_epi16(1)));
        __m256i t8 = _mm256_sub_epi32(isum, _mm256_set1_epi32(128 * a->s[blk]));
        __m256 *ah = h ? &acc[c].hi : &acc[c].lo;
        *ah = _mm256_fmadd_ps(_mm256_mul_ps(dwh, _mm256_set1_ps(a->d[blk])), _mm256_cvtepi32_ps(t8), *ah);
    }
}

static inline void group_q8(const uint8_t *w, int KB, const qrows *a, int K, int m0, int rows, __m512 *acc) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int kb = 0; kb < KB; kb++) {
        const uint8_t *b = w + (int64_t)kb * 544;
        prefetch_ahead(b, 544);
        __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(b + 512)));
        for (int h = 0; h < 2; h++) {
            __m256i oh[8], ol[8];
            for (int t = 0; t < 8; t++) {
                __m256i u = _mm256_loadu_si256((const __m256i *)(b + 64 * t + 32 * h));
                oh[t] = _mm256_and_si256(_mm256_srli_epi16(u, 4), low);
                ol[t] = _mm256_and_si256(u, low);
            }
            half_q8(oh, ol, h, h ? dw.hi : dw.lo, a, K, KB, kb, NULL, m0, rows, acc);
        }
    }
}

// Half h of a WT_Q8_SPLIT block's two parts (h codes at hi, l codes at lo) as half_q8's operands, in Q4_X8's
// nibble order: vector p the low nibbles (K positions 4p ..), 4 + p the high ones (16 + 4p ..).
static inline void split_half(const uint8_t *hi, const uint8_t *lo, int h, __m256i *oh, __m256i *ol) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int p = 0; p < 4; p++) {
        __m256i zh = _mm256_loadu_si256((const __m256i *)(hi + 64 * p + 32 * h));
        __m256i zl = _mm256_loadu_si256((const __m256i *)(lo + 64 * p + 32 * h));
        oh[p] = _mm256_and_si256(zh, low);
        oh[4 + p] = _mm256_and_si256(_mm256_srli_epi16(zh, 4), low);
        ol[p] = _mm256_and_si256(zl, low);
        ol[4 + p] = _mm256_and_si256(_mm256_srli_epi16(zl, 4), low);
    }
}

// Group g of a WT_Q8_SPLIT weight, half h (8 rows of W) for the rows of x listed in rows[h] (none: the half is
// skipped), into acc[h][c]'s lanes of that half.
static inline void group_q8s_halves(const wmat *w, int64_t g, int KB, const qrows *a, int K, const int *const *rows,
                                    const int *count, __m512 *const *acc, int stream) {
    for (int kb = 0; kb < KB; kb++) {
        const uint8_t *hi = split_hi(w, g, kb), *lo = split_lo(w, g, kb);
        if (stream) {  // a weight's groups in order (x8_group), not the screen's chosen few
            prefetch_ahead(hi, 288);
            prefetch_ahead(lo, 256);
        }
        __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(hi + 256)));
        for (int h = 0; h < 2; h++) {
            if (!count[h]) continue;
            __m256i oh[8], ol[8];
            split_half(hi, lo, h, oh, ol);
            half_q8(oh, ol, h, h ? dw.hi : dw.lo, a, K, KB, kb, rows[h], 0, count[h], acc[h]);
        }
    }
}

static inline void group_q8s(const wmat *w, int64_t g, int KB, const qrows *a, int K, const int *rows, int count,
                             __m512 *acc, int stream) {
    const int *both[2] = {rows, rows}, counts[2] = {count, count};
    __m512 *accs[2] = {acc, acc};  // half 0 writes the low lanes, half 1 the high ones
    group_q8s_halves(w, g, KB, a, K, both, counts, accs, stream);
}
#else
// The same for a Q8_X8 weight.
static inline void group_q8(const uint8_t *w, int KB, const qrows *a, int K, int m0, int rows, __m512 *acc) {
    for (int kb = 0; kb < KB; kb++) {
        const uint8_t *b = w + (int64_t)kb * 544;
        __m512i v[8];
        for (int t = 0; t < 8; t++) v[t] = _mm512_loadu_si512(b + 64 * t);
        __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(b + 512)));
        for (int i = 0; i < rows; i++) {
            int64_t m = m0 + i, blk = m * KB + kb;
            acc[i] = block_q8_fp32(acc[i], block_isum(v, a->q + m * K + 32 * kb), dw, a->d[blk], a->s[blk]);
        }
    }
}

// The same for a WT_Q8_SPLIT weight, the listed rows of x: u rebuilt from its two parts, then Q8_X8's
// integer and fp32 steps.
static inline void group_q8s(const wmat *w, int64_t g, int KB, const qrows *a, int K, const int *rows, int count,
                             __m512 *acc, int stream) {
    (void)stream;  // the group-ahead prefetch serves here (LM_STREAM)
    for (int kb = 0; kb < KB; kb++) {
        const uint8_t *hi = split_hi(w, g, kb);
        __m512i u[8];
        split_codes(hi, split_lo(w, g, kb), u);
        __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(hi + 256)));
        for (int c = 0; c < count; c++) {
            int64_t m = rows[c], blk = m * KB + kb;
            acc[c] = block_q8_fp32(acc[c], block_isum(u, a->q + m * K + 32 * kb), dw, a->d[blk], a->s[blk]);
        }
    }
}

#endif

// One 16-row group of one job, every row of x.
static void x8_group(const gemm_job *job, int g, const qrows *a, int M, int K) {
    const wmat *w = job->w;
    int KB = K / 32, n0 = 16 * g;
    const uint8_t *wg = (const uint8_t *)w->data + (int64_t)g * KB * x8_group_bytes(w->type);
    __m512 b = job->bias ? bf16x16_to_ps(job->bias + n0) : _mm512_setzero_ps();
    if (!LM_STREAM && w->type == WT_Q8_X8 && g + 2 < w->N / 16)  // the LM head: its next groups, ahead of the stream
        prefetch_bytes(wg + 2 * KB * 544, KB * 544);
    if (!LM_STREAM && w->type == WT_Q8_SPLIT && g + 2 < w->N / 16) {
        prefetch_bytes(split_hi(w, g + 2, 0), KB * 288);
        prefetch_bytes(split_lo(w, g + 2, 0), KB * 256);
    }
    // VNNI takes up to 16 rows a pass as AMX does: each pass unpacks the group's 4-bit codes again
    // (a pass of 8 rows then one of 1 cost a 9-row forward 20% more than 8 rows on the Intel VM)
    int chunk = 16, amx = x8_amx && M >= AMX_X8_MIN_ROWS && (is_nibbles(w->type) || w->type == WT_Q8_X8 ||
                                                                w->type == WT_Q8_SPLIT);  // Q5, Q6: VNNI at every M
    (void)amx;  // a build without AMX flags has only VNNI
    for (int m0 = 0; m0 < M; m0 += chunk) {
        int rows = M - m0 < chunk ? M - m0 : chunk;
        __m512 acc[16];
        for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
        if (amx) group_amx(w, g, wg, KB, a, K, m0, rows, acc);
        else
#endif
        if (w->type == WT_Q4_X8) group_q4(WT_Q4_X8, wg, KB, a, K, m0, rows, acc);
        else if (w->type == WT_Q40_X8) group_q4(WT_Q40_X8, wg, KB, a, K, m0, rows, acc);
        else if (w->type == WT_Q4K_X8) group_q4(WT_Q4K_X8, wg, KB, a, K, m0, rows, acc);
        else if (w->type == WT_Q5_X8) group_q45(WT_Q5_X8, wg, KB, a, K, m0, rows, acc);
        else if (w->type == WT_Q5K_X8) group_q45(WT_Q5K_X8, wg, KB, a, K, m0, rows, acc);
        else if (w->type == WT_Q6_X8) group_q6(wg, KB, a, K, m0, rows, acc);
        else if (w->type == WT_Q8_SPLIT) {
            int list[16];
            for (int i = 0; i < rows; i++) list[i] = m0 + i;
            group_q8s(w, g, KB, a, K, list, rows, acc, 1);
        }
        else group_q8(wg, KB, a, K, m0, rows, acc);
        for (int i = 0; i < rows; i++)
            _mm256_storeu_si256((__m256i *)(job->y + (int64_t)(m0 + i) * job->ldy + n0), to_bf16x16(_mm512_add_ps(acc[i], b)));
    }
}

int is_x8(int type) {
    return is_nibbles(type) || type == WT_Q8_X8 || type == WT_Q8_SPLIT || type == WT_Q5_X8 || type == WT_Q6_X8 ||
           type == WT_Q5K_X8;
}

int gemm_x8_team(const uint16_t *x, int64_t ldx, const gemm_job *jobs, int count, int M, int K, void *shared,
                 void *mine, int64_t mine_bytes) {
    for (int j = 0; j < count; j++)
        if (!is_x8(jobs[j].w->type) || jobs[j].w->K != K || K % 32 || jobs[j].w->N % 16) return -1;
    int KB = K / 32;
    // A decoding step's few rows: every thread quantizes them all into its own memory (the same
    // bits), so no barrier waits between quantizing and multiplying (one per GEMM instead of two;
    // on a busy machine each costs a wake-up). AMX reads 16 rows: the memory holds them.
    int own = M <= 16 && x8_work_bytes(16, K) <= mine_bytes;
    qrows a = x8_parts(own ? mine : shared, M, K);
    int halves = 0;
    for (int j = 0; j < count; j++) halves |= jobs[j].w->type == WT_Q6_X8;
    if (own) {
        for (int m = 0; m < M; m++) quantize_into(x, ldx, K, &a, m, halves);
    } else {
#pragma omp for schedule(static)
        for (int m = 0; m < M; m++) quantize_into(x, ldx, K, &a, m, halves);
    }
    int first[9], total = 0;  // job j's groups are [first[j], first[j + 1]) of the batch's
    for (int j = 0; j < count && j < 8; j++) { first[j] = total; total += jobs[j].w->N / 16; }
    first[count] = total;
#pragma omp for schedule(static)
    for (int t = 0; t < total; t++) {
        int j = 0;
        while (t >= first[j + 1]) j++;
        x8_group(&jobs[j], t - first[j], &a, M, K);
    }
    return 0;
}

// 4 code vectors (dword j: row j's codes at 4 consecutive K positions; the 4 vectors' positions in K order) ->
// codes[i] lane L: row 4 L + i's 16 codes in K order (a 4 x 4 transpose of dwords per 128-bit lane).
static inline void rows_of_codes(const __m512i *z, uint8_t codes[4][64]) {
    __m512i t0 = _mm512_unpacklo_epi32(z[0], z[1]), t1 = _mm512_unpackhi_epi32(z[0], z[1]);
    __m512i t2 = _mm512_unpacklo_epi32(z[2], z[3]), t3 = _mm512_unpackhi_epi32(z[2], z[3]);
    _mm512_store_si512(codes[0], _mm512_unpacklo_epi64(t0, t2));
    _mm512_store_si512(codes[1], _mm512_unpackhi_epi64(t0, t2));
    _mm512_store_si512(codes[2], _mm512_unpacklo_epi64(t1, t3));
    _mm512_store_si512(codes[3], _mm512_unpackhi_epi64(t1, t3));
}

// Block column kb of rows 16 g + j0 .. 16 g + j0 + rows - 1 of a 4-bit weight (WT_Q4_X8, WT_Q40_X8, WT_Q4K_X8)
// as bf16 (the converter's values, bf16(D q + M)), row j0 + r's 32 values at out + r * ldo: a prompt's weights
// (every layer once per prefill chunk, ~70x a scalar loop's speed), the embedding lookup (x8_row). A block's
// 256 code bytes hold row j's codes for values 4p .. 4p + 3 (low nibbles) and 16 + 4p .. 19 + 4p (high) at byte
// 64 p + 4 j; rows_of_codes gathers each row's 16 code bytes in value order. D q is exact (at most 11 + 6 + 4
// bits), so D q + M rounds once, as in gguf (Q4_0: d (q - 8) exactly; Q4_K: d sc q - dmin mn, one rounding).
void q4x8_block(const wmat *w, int64_t g, int kb, int j0, int rows, uint16_t *out, int64_t ldo) {
    uint8_t codes[4][64] __attribute__((aligned(64)));
    float d[16], m[16];
    const uint8_t *wg = (const uint8_t *)w->data + g * (w->K / 32) * x8_group_bytes(w->type);
    const uint8_t *b = x8_block(w->type, wg, kb);
    __m512i z[4];
    for (int p = 0; p < 4; p++) z[p] = _mm512_loadu_si512(b + 64 * p);
    rows_of_codes(z, codes);
    __m512 dv, mv;
    block_scales(w->type, wg, kb, b, &dv, &mv);
    _mm512_storeu_ps(d, dv);
    _mm512_storeu_ps(m, mv);
    for (int j = j0; j < j0 + rows; j++) {
        __m512i q = _mm512_cvtepu8_epi32(_mm_load_si128((const __m128i *)(codes[j & 3] + 16 * (j >> 2))));
        __m512 dj = _mm512_set1_ps(d[j]), mj = _mm512_set1_ps(m[j]);
        __m512 lo = _mm512_add_ps(_mm512_mul_ps(dj, _mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(15)))), mj);
        __m512 hi = _mm512_add_ps(_mm512_mul_ps(dj, _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4))), mj);
        uint16_t *o = out + (int64_t)(j - j0) * ldo;
        _mm256_storeu_si256((__m256i *)o, to_bf16x16(lo));
        _mm256_storeu_si256((__m256i *)(o + 16), to_bf16x16(hi));
    }
}

// The same for a WT_Q5_X8, WT_Q5K_X8, WT_Q6_X8, WT_Q8_X8 or WT_Q8_SPLIT weight: the block's 8 code vectors (what
// the GEMM multiplies) transposed to rows, then the converter's values: Q5 bf16(D u + M) (D u exact), Q6 bf16(d (s
// (u - 32))) (s (u - 32) exact), Q8 bf16(d (u - 128)).
static void x8_block_bf16(const wmat *w, int64_t g, int kb, int j0, int rows, uint16_t *out, int64_t ldo) {
    int type = w->type, five = type == WT_Q5_X8 || type == WT_Q5K_X8;
    const uint8_t *wg = (const uint8_t *)w->data + g * (w->K / 32) * x8_group_bytes(type);
    const uint8_t *b = type == WT_Q8_SPLIT ? split_hi(w, g, kb) : x8_block(type, wg, kb);
    __m512i u[8];
    if (five) q5_codes(b, u);
    else if (type == WT_Q6_X8) q6_codes(b, u);
    else if (type == WT_Q8_SPLIT) split_codes(b, split_lo(w, g, kb), u);
    else for (int t = 0; t < 8; t++) u[t] = _mm512_loadu_si512(b + 64 * t);
    uint8_t codes[2][4][64] __attribute__((aligned(64)));  // K positions 0-15, 16-31
    rows_of_codes(u, codes[0]);
    rows_of_codes(u + 4, codes[1]);
    float d[16], m[16], s[2][16];
    if (five) {
        __m512 dv, mv;
        block_scales(type, wg, kb, b, &dv, &mv);
        _mm512_storeu_ps(d, dv);
        _mm512_storeu_ps(m, mv);
    } else {
        const uint8_t *dp = type == WT_Q6_X8 ? super_header(type, wg, kb) : b + (type == WT_Q8_SPLIT ? 256 : 512);
        _mm512_storeu_ps(d, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)dp)));
    }
    if (type == WT_Q6_X8)
        for (int h = 0; h < 2; h++)
            _mm512_storeu_ps(s[h], _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 384 + 16 * h)))));
    __m512i zero = _mm512_set1_epi32(type == WT_Q6_X8 ? 32 : five ? 0 : 128);
    for (int j = j0; j < j0 + rows; j++) {
        uint16_t *o = out + (int64_t)(j - j0) * ldo;
        __m512 dj = _mm512_set1_ps(d[j]);
        for (int h = 0; h < 2; h++) {
            __m512i q = _mm512_cvtepu8_epi32(_mm_load_si128((const __m128i *)(codes[h][j & 3] + 16 * (j >> 2))));
            __m512 c = _mm512_cvtepi32_ps(_mm512_sub_epi32(q, zero)), v;
            if (five) v = _mm512_add_ps(_mm512_mul_ps(dj, c), _mm512_set1_ps(m[j]));
            else if (type == WT_Q6_X8) v = _mm512_mul_ps(dj, _mm512_mul_ps(c, _mm512_set1_ps(s[h][j])));
            else v = _mm512_mul_ps(dj, c);
            _mm256_storeu_si256((__m256i *)(o + 16 * h), to_bf16x16(v));
        }
    }
}

// Rows 16 g + j0 .. 16 g + j0 + rows - 1 of an X8 weight as bf16 (the converter's values), row j0 + r at out + r
// * ldo: the embedding lookup (x8_row) and the prefill's dequantized copy (dequant.c's dequantize_bf16).
void x8_rows_bf16(const wmat *w, int64_t g, int j0, int rows, uint16_t *out, int64_t ldo) {
    for (int kb = 0; kb < w->K / 32; kb++) {
        if (is_nibbles(w->type)) q4x8_block(w, g, kb, j0, rows, out + 32 * kb, ldo);
        else x8_block_bf16(w, g, kb, j0, rows, out + 32 * kb, ldo);
    }
}

// Row n of an X8 weight as bf16.
void x8_row(const wmat *w, int64_t n, uint16_t *out) { x8_rows_bf16(w, n / 16, (int)(n % 16), 1, out, 0); }

// ---- The screened LM head (greedy decoding reads only each row's maximum) --------------------
//
// A row's logit over W (the Q8 codes, u = 16 h + l) is A x + D x, with A the weight h gives alone
// (u ~ 16 h + 7.5) and D = W - A (|D| <= 7.5 d per weight). Pass one reads h (288 of Q8_X8's 544
// bytes a block) and bounds every logit from above: A x + C z + bound, z = U x, C = D U^T, bound
// = e1 rho + e2 |z| + e3 |U y| + s S, y = x - U^T z, rho = |y| (Cauchy-Schwarz on what U leaves; the
// final hidden states lie mostly in a few directions, so rho is ~0.6 |x| at rank 32 and most
// groups of 16 rows fall far below the row's best). Pass two computes the exact logits (Q8_X8's
// integer sums and fp32 steps, bit for bit) of the group with the best centre, then of every group
// whose bound reaches that maximum less half a bf16 step; the others are -inf. Exact by
// construction: every token whose bf16 logit can equal or pass the maximum is computed exactly.
// All arithmetic of pass one is fp32; its rounding is covered by slack far above fp32's (2^-14
// relative on |W||x| terms, 2^-10 on the norms), and x here is the activation as quantized (the
// exact pass multiplies that too).

// Pass one's bound per group of 16 rows of W, or on AVX2 per half group (8 rows): there the exact pass
// computes a half at a time (half_q8), and a group whose best bound reaches the maximum often reaches it
// in one half only.
#ifdef EAGLE_AVX2
#define SCREEN_PARTS 2
#else
#define SCREEN_PARTS 1
#endif

int64_t screen_work_floats(int M, int N, int nthreads) {
    return (int64_t)M * (N / 16) * SCREEN_PARTS + (int64_t)nthreads * M * 2 + M;
}

static int64_t screen_mine_bytes(int M, int K, int r) {
    return x8_work_bytes(16, K) + ((int64_t)M * (r + 4) + K + 64) * 4 + 64;
}

int screen_fits(const wmat *w, const lm_screen *sc, int M, int64_t mine_bytes) {
    return sc && w->type == WT_Q8_SPLIT && M >= 1 && M <= 16 && sc->rank >= 1 && sc->rank <= 64 && w->K % 32 == 0 &&
           w->N % 16 == 0 && screen_mine_bytes(M, w->K, sc->rank) <= mine_bytes;
}

// out = U v (r values, or only their squares' sum where out is NULL); returns |U v|^2.
static float project(const float *U, int r, int K, const float *v, float *out) {
    float sq = 0.0f;
    for (int j = 0; j < r; j++) {
        __m512 acc = _mm512_setzero_ps();
        for (int k = 0; k < K; k += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(U + (int64_t)j * K + k), _mm512_loadu_ps(v + k), acc);
        float t = _mm512_reduce_add_ps(acc);
        if (out) out[j] = t;
        sq += t * t;
    }
    return sq;
}

// Row m: z (r), and the bound's scalars b[0..3] = rho', |z|', |U y|', S; b[0] = -1 where x is not finite.
static void screen_row(const lm_screen *sc, const qrows *a, int K, int m, float *xh, float *z, float *b) {
    int r = sc->rank, KB = K / 32;
    __m512 xx = _mm512_setzero_ps();
    for (int k = 0; k < K; k += 16) {
        __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(a->q + (int64_t)m * K + k)))),
                                 _mm512_set1_ps(a->d[(int64_t)m * KB + k / 32]));
        _mm512_storeu_ps(xh + k, v);
        xx = _mm512_fmadd_ps(v, v, xx);
    }
    float X = sqrtf(_mm512_reduce_add_ps(xx)), Z2 = project(sc->basis, r, K, xh, z);
    __m512 yy = _mm512_setzero_ps();
    for (int k = 0; k < K; k += 16) {  // y = x - U^T z, in place of x
        __m512 v = _mm512_loadu_ps(xh + k);
        for (int j = 0; j < r; j++) v = _mm512_fnmadd_ps(_mm512_loadu_ps(sc->basis + (int64_t)j * K + k), _mm512_set1_ps(z[j]), v);
        _mm512_storeu_ps(xh + k, v);
        yy = _mm512_fmadd_ps(v, v, yy);
    }
    float rho = sqrtf(_mm512_reduce_add_ps(yy)), W2 = project(sc->basis, r, K, xh, NULL);
    float Z = sqrtf(Z2) * (1.0f + 0x1p-10f), lift = 0x1p-10f, err = (float)(r + 2) * 0x1p-22f * (X + sqrtf((float)r) * Z);
    b[0] = rho * (1.0f + lift) + err;
    b[1] = Z;
    b[2] = sqrtf(W2) * (1.0f + lift) + err + sqrtf((float)r) * (float)K * 0x1p-23f * b[0];
    b[3] = 0x1p-14f * (X + Z);
    if (!(X < INFINITY) || !(Z < INFINITY) || !(b[0] < INFINITY) || !(b[2] < INFINITY)) b[0] = -1.0f;
}

// Pass one over group g, rows [m0, m0 + rows): each row's largest upper bound in the group (in each half
// of it: SCREEN_PARTS), and the thread's best centre so far.
static void screen_group(const wmat *w, const lm_screen *sc, int64_t g, const qrows *a, int K, int m0, int rows,
                         const float *z, const float *b, float *gmax, int64_t G, float *bestv, int32_t *bestg) {
    int KB = K / 32, r = sc->rank;
    __m512 acc[ROWS_X8];
    for (int i = 0; i < rows; i++) acc[i] = _mm512_setzero_ps();
    for (int kb = 0; kb < KB; kb++) {
        const uint8_t *hi = split_hi(w, g, kb);
        if (LM_STREAM) prefetch_ahead(hi, 288);
        __m512i ops[8];
        nibble_codes(hi, ops);
        __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(hi + 256)));
        for (int i = 0; i < rows; i++) {
            int64_t m = m0 + i, blk = m * KB + kb;
            // sum q_x (16 h + 7.5 - 128) = (32 sum q_x h - 241 sum q_x) / 2: an exact integer, halved in d
            __m512i ia = _mm512_sub_epi32(_mm512_slli_epi32(block_isum_nibbles(ops, a->q + m * K + 32 * kb), 5),
                                          _mm512_set1_epi32(241 * a->s[blk]));
            acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(0.5f * a->d[blk])), _mm512_cvtepi32_ps(ia), acc[i]);
        }
    }
    const uint16_t *proj = sc->proj + g * r * 16;
    for (int j = 0; j < r; j++) {
        __m512 c = bf16x16_to_ps(proj + 16 * j);
        for (int i = 0; i < rows; i++) acc[i] = _mm512_fmadd_ps(c, _mm512_set1_ps(z[(m0 + i) * r + j]), acc[i]);
    }
    const float *cf = sc->coef + g * 64;
    __m512 e1 = _mm512_loadu_ps(cf), e2 = _mm512_loadu_ps(cf + 16), e3 = _mm512_loadu_ps(cf + 32), es = _mm512_loadu_ps(cf + 48);
    for (int i = 0; i < rows; i++) {
        const float *bi = b + (m0 + i) * 4;
        __m512 bound = _mm512_fmadd_ps(e1, _mm512_set1_ps(bi[0]), _mm512_mul_ps(e2, _mm512_set1_ps(bi[1])));
        bound = _mm512_fmadd_ps(es, _mm512_set1_ps(bi[3]), _mm512_fmadd_ps(e3, _mm512_set1_ps(bi[2]), bound));
        bound = _mm512_mul_ps(bound, _mm512_set1_ps(1.0f + 0x1p-10f));
        __m512 reach = _mm512_add_ps(acc[i], bound);
#ifdef EAGLE_AVX2
        gmax[((m0 + i) * G + g) * 2] = sh_reduce8(reach.lo, 1);
        gmax[((m0 + i) * G + g) * 2 + 1] = sh_reduce8(reach.hi, 1);
#else
        gmax[(m0 + i) * G + g] = _mm512_reduce_max_ps(reach);
#endif
        float centre = _mm512_reduce_max_ps(acc[i]);
        if (centre > bestv[m0 + i]) {
            bestv[m0 + i] = centre;
            bestg[m0 + i] = (int32_t)g;
        }
    }
}

#ifdef EAGLE_AVX2
// Pass two on AVX2: the exact logits of each half h of group g (8 rows of W) for the rows of x listed in
// rows[h] (group_q8s's steps per lane, so Q8_X8's bits), -inf in the halves a row does not reach.
static void screen_exact_halves(const wmat *w, int64_t g, const qrows *a, int K, int rows[2][16], const int *count,
                                uint16_t *y, int64_t ldy) {
    __m512 acc[2][16];
    for (int h = 0; h < 2; h++)
        for (int c = 0; c < count[h]; c++) acc[h][c] = _mm512_setzero_ps();
    const int *lists[2] = {rows[0], rows[1]};
    __m512 *accs[2] = {acc[0], acc[1]};
    group_q8s_halves(w, g, K / 32, a, K, lists, count, accs, 0);
    for (int h = 0; h < 2; h++)
        for (int c = 0; c < count[h]; c++) {  // + a zero bias, as x8_group adds; this half's 8 bf16 values
            __m256i v = to_bf16x16(_mm512_add_ps(acc[h][c], _mm512_setzero_ps()));
            __m128i half = h ? _mm256_extracti128_si256(v, 1) : _mm256_castsi256_si128(v);
            _mm_storeu_si128((__m128i *)(y + (int64_t)rows[h][c] * ldy + 16 * g + 8 * h), half);
        }
}
#else
// Pass two: the exact logits of group g for the listed rows (group_q8s's steps, so Q8_X8's bits).
static void screen_exact(const wmat *w, int64_t g, const qrows *a, int K, const int *rows, int count, uint16_t *y,
                         int64_t ldy) {
    __m512 acc[16];
    for (int c = 0; c < count; c++) acc[c] = _mm512_setzero_ps();
    group_q8s(w, g, K / 32, a, K, rows, count, acc, 0);
    for (int c = 0; c < count; c++)  // + a zero bias, as x8_group adds
        _mm256_storeu_si256((__m256i *)(y + (int64_t)rows[c] * ldy + 16 * g), to_bf16x16(_mm512_add_ps(acc[c], _mm512_setzero_ps())));
}
#endif

int lm_screen_team(const uint16_t *x, int64_t ldx, const wmat *w, const lm_screen *sc, uint16_t *y, int64_t ldy,
                   int M, void *mine, int64_t mine_bytes, float *shared) {
    if (!screen_fits(w, sc, M, mine_bytes)) return -1;
    int K = w->K, KB = K / 32, r = sc->rank, me = omp_get_thread_num(), nt = omp_get_num_threads();
    int64_t G = w->N / 16;
    qrows a = x8_parts(mine, M, K);
    float *z = (float *)(((uintptr_t)mine + x8_work_bytes(16, K) + 63) & ~(uintptr_t)63);
    float *b = z + M * r, *xh = b + M * 4;
    for (int m = 0; m < M; m++) {  // every thread quantizes the rows into its own memory (the same bits)
        quantize_into(x, ldx, K, &a, m, 0);
        screen_row(sc, &a, K, m, xh, z + m * r, b + m * 4);
    }
    // shared: each row's largest bound per group or half group (M x G x SCREEN_PARTS), then per thread and
    // row its best centre and that centre's group (nt x M each), then each row's threshold (M)
    float *gmax = shared, *centres = shared + M * G * SCREEN_PARTS, *th = centres + (int64_t)nt * M * 2;
    int32_t *groups = (int32_t *)(centres + (int64_t)nt * M);
    float *bestv = centres + me * M;
    int32_t *bestg = groups + me * M;
    for (int i = 0; i < M; i++) { bestv[i] = -INFINITY; bestg[i] = 0; }
    STAGE(ST_LM_HEAD);  // the rows quantized and projected, by every thread
#pragma omp for schedule(static)
    for (int64_t g = 0; g < G; g++) {
        if (!LM_STREAM && g + 2 < G) prefetch_bytes(split_hi(w, g + 2, 0), KB * 288);
        for (int m0 = 0; m0 < M; m0 += ROWS_X8)
            screen_group(w, sc, g, &a, K, m0, M - m0 < ROWS_X8 ? M - m0 : ROWS_X8, z, b, gmax, G, bestv, bestg);
    }
    STAGE(ST_SCREEN_ONE);
#pragma omp for schedule(static)
    for (int i = 0; i < M; i++) {  // the exact maximum of the group with the best centre
        int64_t g = 0;
        float best = -INFINITY;
        for (int t = 0; t < nt; t++) {
            float v = centres[t * M + i];
            int32_t gt = groups[t * M + i];
            if (v > best || (v == best && gt < g)) { best = v; g = gt; }
        }
        __m512 acc = _mm512_setzero_ps();
        group_q8s(w, g, KB, &a, K, &i, 1, &acc, 0);
        uint16_t e16[16];
        _mm256_storeu_si256((__m256i *)e16, to_bf16x16(acc));
        float v = -INFINITY;
        for (int j = 0; j < 16; j++) v = from_bf16(e16[j]) > v ? from_bf16(e16[j]) : v;
        // a bf16 value >= v needs an fp32 logit >= v less half a step below v (a step is at most 2^-7 |v|)
        th[i] = b[i * 4] < 0.0f || !(best > -INFINITY) || !(v > -INFINITY && v < INFINITY)
                    ? -INFINITY : v - fabsf(v) * 0x1p-7f - 0x1p-100f;
    }
    STAGE(ST_SCREEN_CENTRE);
    const __m256i minus_inf = _mm256_set1_epi16((short)0xFF80);
#ifdef EAGLE_AVX2
#pragma omp for schedule(static)
    for (int64_t g = 0; g < G; g++) {
        int rows[2][16], count[2] = {0, 0};
        for (int i = 0; i < M; i++)
            for (int h = 0; h < 2; h++) {
                if (!(gmax[(i * G + g) * 2 + h] < th[i])) rows[h][count[h]++] = i;  // NaN bounds count as reaching
                else _mm_storeu_si128((__m128i *)(y + (int64_t)i * ldy + 16 * g + 8 * h), _mm256_castsi256_si128(minus_inf));
            }
        if (count[0] || count[1]) screen_exact_halves(w, g, &a, K, rows, count, y, ldy);
    }
#else
#pragma omp for schedule(static)
    for (int64_t g = 0; g < G; g++) {
        int rows[16], count = 0;
        for (int i = 0; i < M; i++) {
            if (!(gmax[i * G + g] < th[i])) rows[count++] = i;  // NaN bounds count as reaching
            else _mm256_storeu_si256((__m256i *)(y + (int64_t)i * ldy + 16 * g), minus_inf);
        }
        if (count) screen_exact(w, g, &a, K, rows, count, y, ldy);
    }
#endif
    STAGE(ST_SCREEN_TWO);  // the loop's closing barrier: every group written
    return 0;
}

// lm_screen_team on its own team (tests, core.kernels.screen.screened_logits): y (M, N) as a greedy
// step's LM head leaves it. 0; -1 where the screen cannot serve (w not split, M > 16) or memory failed.
// ctypes: lm_screen_w(ptr x, i64 ldx, ptr w, ptr sc, ptr y, i64 ldy, i32 M, i32 nthreads) -> i32
int lm_screen_w(const uint16_t *x, int64_t ldx, const wmat *w, const lm_screen *sc, uint16_t *y, int64_t ldy, int M,
              int nthreads) {
    int64_t mine_bytes = screen_mine_bytes(16, w->K, sc->rank);
    if (!screen_fits(w, sc, M, mine_bytes)) return -1;
    char *mine = (char *)malloc((size_t)nthreads * mine_bytes);
    float *shared = (float *)malloc((size_t)screen_work_floats(M, w->N, nthreads) * sizeof(float));
    int status = mine && shared ? 0 : -1;
    if (!status) {
#pragma omp parallel num_threads(nthreads)
        {
            int s = lm_screen_team(x, ldx, w, sc, y, ldy, M, mine + omp_get_thread_num() * mine_bytes, mine_bytes, shared);
            if (s) {
#pragma omp atomic write
                status = s;
            }
        }
    }
    free(mine);
    free(shared);
    return status;
}
