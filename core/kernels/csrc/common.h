// Shared by the decoding kernels: bf16 <-> fp32 and the fixed lane-reduction tree.
#pragma once
#include <immintrin.h>
#ifdef EAGLE_AVX2  // a CPU without AVX-512: the same kernels on AVX2 halves (avx2.h)
#include "avx2.h"
#else
#define AS_BH(v) ((__m512bh)(v))  // 32 bf16 in a vector register, as vdpbf16ps reads them
#endif
#ifdef EAGLE_AMX_EMULATE  // tests only: tile instructions as C functions (amx_emulate.h)
#include "amx_emulate.h"
#endif
#include <math.h>
#include <stdint.h>
#include <string.h>

// Where a forward's time goes (EAGLE_CHAT_PROFILE=1 builds with -DEAGLE_PROFILE; scripts/step_stages.py):
// thread 0 adds the wall time since its previous mark to stage_seconds[stage_set][i] at each STAGE(i),
// after the stage's closing barrier, so a stage's time includes the wait for the slowest thread; set 0
// holds the target's forwards (decode_step), set 1 the draft head's (head_step). Without the flag STAGE is
// nothing and the objects are the same as before it existed.
enum { ST_FEATURES, ST_NORM, ST_QKV, ST_ROTARY, ST_ATTENTION, ST_O, ST_ADD, ST_GATE_UP, ST_SILU, ST_DOWN, ST_EMBED,
       ST_FINAL_NORM, ST_LM_HEAD, ST_SCREEN_ONE, ST_SCREEN_CENTRE, ST_SCREEN_TWO, ST_HEAD_FC, ST_COUNT };
#ifdef EAGLE_PROFILE
#include <omp.h>
#include <time.h>
extern double stage_seconds[2][ST_COUNT], stage_mark;
extern int stage_set;
static inline void stage_clock(int i) {
    if (omp_get_thread_num()) return;
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    double now = t.tv_sec + t.tv_nsec * 1e-9;
    if (i >= 0) stage_seconds[stage_set][i] += now - stage_mark;
    stage_mark = now;
}
#define STAGE(i) stage_clock(i)
#else
#define STAGE(i) ((void)0)
#endif

static inline uint16_t to_bf16(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
static inline float from_bf16(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }

// Attention: the cache slot of a row's j-th key, the context (slots 0 .. L-1), then its ancestors
// and itself (slots L + anc_row[0 ..], root first).
static inline int64_t key_slot(int64_t j, int64_t L, const int64_t *anc_row) { return j < L ? j : L + anc_row[j - L]; }

// 16 accumulators -> their 16 lane sums, one per lane: acc a = 4l + j lands in lane 4j + l.
// Every accumulator's 16 lanes are added in the same halving tree (8, 4, 2, 1 apart).
static inline __m512 reduce16(const __m512 *a) {
    __m512 t[8], v[4], x[2];
    for (int p = 0; p < 8; p++)
        t[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], 0xEE));
    for (int r = 0; r < 4; r++)
        v[r] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * r], t[2 * r + 1], 0x88),
                             _mm512_shuffle_f32x4(t[2 * r], t[2 * r + 1], 0xDD));
    for (int s = 0; s < 2; s++)
        x[s] = _mm512_add_ps(_mm512_shuffle_ps(v[2 * s], v[2 * s + 1], 0x44),
                             _mm512_shuffle_ps(v[2 * s], v[2 * s + 1], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(x[0], x[1], 0x88), _mm512_shuffle_ps(x[0], x[1], 0xDD));
}

// The sum of one vector's 16 lanes, in reduce16's tree.
static inline float hsum16(__m512 v) {
    __m512 lanes[16] = {v};  // the other 15 accumulators are zero
    return _mm512_cvtss_f32(reduce16(lanes));  // accumulator 0 lands in lane 0
}

static inline __m512 bf16x16_to_ps_masked(const uint16_t *p, __mmask16 m) {  // exact; masked lanes 0
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
static inline __m512 bf16x16_to_ps(const uint16_t *p) { return bf16x16_to_ps_masked(p, 0xFFFF); }

// reduce16's lanes put back in accumulator order: lane a = sum of accumulator a.
static inline __m512 in_order16(__m512 s) {
    const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(idx, s);
}

// r[i] lane j -> r[j] lane i: a 16 x 16 matrix of 32-bit values transposed in registers (unpacks within
// 128-bit lanes, then lanes exchanged). Moves bits only.
static inline void transpose16x16_epi32(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {  // r[4 i + c] lane L: column 4 L + c of rows 4 i .. 4 i + 3
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int c = 0; c < 4; c++) {
        __m512i ab_lo = _mm512_shuffle_i32x4(r[c], r[4 + c], _MM_SHUFFLE(1, 0, 1, 0));
        __m512i ab_hi = _mm512_shuffle_i32x4(r[c], r[4 + c], _MM_SHUFFLE(3, 2, 3, 2));
        __m512i cd_lo = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], _MM_SHUFFLE(1, 0, 1, 0));
        __m512i cd_hi = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], _MM_SHUFFLE(3, 2, 3, 2));
        t[c] = _mm512_shuffle_i32x4(ab_lo, cd_lo, _MM_SHUFFLE(2, 0, 2, 0));       // column c
        t[4 + c] = _mm512_shuffle_i32x4(ab_lo, cd_lo, _MM_SHUFFLE(3, 1, 3, 1));   // column 4 + c
        t[8 + c] = _mm512_shuffle_i32x4(ab_hi, cd_hi, _MM_SHUFFLE(2, 0, 2, 0));   // column 8 + c
        t[12 + c] = _mm512_shuffle_i32x4(ab_hi, cd_hi, _MM_SHUFFLE(3, 1, 3, 1));  // column 12 + c
    }
    for (int i = 0; i < 16; i++) r[i] = t[i];
}

// to_bf16 on 16 lanes, bit for bit (round to nearest even; NaN kept quiet).
static inline __m256i to_bf16x16(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                                     _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
    __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                            _mm512_set1_epi32(0x7f800000));
    r = _mm512_mask_or_epi32(_mm512_srli_epi32(r, 16), nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(r);
}

// e^x, Cephes expf on [-87, 88] (below: e^-87); |rel err| < 2e-7. The attention softmax and the
// draft top-k's log-sum-exp.
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}
