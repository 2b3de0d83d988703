// The AVX-512 instructions the kernels use, on AVX2 + FMA + F16C (x86-64-v3: every x86-64 CPU of the
// last decade without AVX-512, AMD Zen 1-3 and Intel's desktop chips among them). Included by common.h
// where the library is built with -DEAGLE_AVX2 (core.kernels.native: a CPU without avx512_bf16).
//
// A 512-bit vector is a pair of 256-bit halves (lo: lanes 0-7, hi: 8-15) and each intrinsic below
// computes, lane for lane, what its AVX-512 namesake computes: the same fp32 operations on the same
// lanes, in the same order (reductions pair lanes i and i + 8, then + 4, + 2, + 1 as GCC's
// _mm512_reduce_add_ps does), exact integer sums. So every kernel runs its one fixed instruction
// sequence per row here as well: a row computes the same bits alone or in a tree, by construction.
// Two AVX-512 instructions flush denormals and these do not: vdpbf16ps (dpbf16 below: the same two
// fused steps per lane) and vcvtneps2bf16 (cvtneps_pbh: torch's rounding). The library is built with
// -ffp-contract=off, so a multiply and an add the kernels write stay two roundings. The AVX-512 build
// fuses a few (objdump with and without: only the int8 draft GEMM's scaling, the LM-head screen's scalar
// bounds and the dequantizer's d q + m, where d q is exact), so across the two builds draft scores may
// differ in their last bits; the target's logits are the same sequence of operations in both.
// Masked loads read only the lanes their mask names (no fault past the end, as AVX-512's).
#pragma once
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define SH static inline __attribute__((always_inline))
typedef struct { __m256 lo, hi; } sh_ps;
typedef struct { __m256i lo, hi; } sh_si;

// ---- types: macros, so the kernels' own text compiles unchanged ---------------------------------
#define __m512 sh_ps
#define __m512i sh_si
#define __m512bh sh_si
#define AS_BH(v) (v)

SH sh_ps PS(__m256 lo, __m256 hi) { sh_ps r = {lo, hi}; return r; }
SH sh_si SI(__m256i lo, __m256i hi) { sh_si r = {lo, hi}; return r; }
// 16-bit mask -> two vectors of 8 all-ones / zero dword lanes
SH __m256i sh_m8(unsigned m) {
    const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)m), bit), bit);
}
SH __m256 sh_m8f(unsigned m) { return _mm256_castsi256_ps(sh_m8(m)); }
SH unsigned sh_bits(__m256 lo, __m256 hi) {  // sign bits of 16 lanes -> 16-bit mask
    return (unsigned)_mm256_movemask_ps(lo) | ((unsigned)_mm256_movemask_ps(hi) << 8);
}

// ---- float arithmetic ----------------------------------------------------------------------------
#define SH_F2(name, op)                                                                     \
    SH sh_ps name(sh_ps a, sh_ps b) { return PS(op(a.lo, b.lo), op(a.hi, b.hi)); }
SH_F2(sh_add_ps, _mm256_add_ps)
SH_F2(sh_sub_ps, _mm256_sub_ps)
SH_F2(sh_mul_ps, _mm256_mul_ps)
SH_F2(sh_div_ps, _mm256_div_ps)
SH_F2(sh_max_ps, _mm256_max_ps)
SH_F2(sh_min_ps, _mm256_min_ps)
SH_F2(sh_and_ps, _mm256_and_ps)
#define _mm512_add_ps sh_add_ps
#define _mm512_sub_ps sh_sub_ps
#define _mm512_mul_ps sh_mul_ps
#define _mm512_div_ps sh_div_ps
#define _mm512_max_ps sh_max_ps
#define _mm512_min_ps sh_min_ps
#define _mm512_and_ps sh_and_ps
// the rounding-mode forms: the kernels pass round-to-nearest (the default), to keep two roundings
#define _mm512_mul_round_ps(a, b, r) sh_mul_ps(a, b)
#define _mm512_add_round_ps(a, b, r) sh_add_ps(a, b)
SH sh_ps sh_fmadd_ps(sh_ps a, sh_ps b, sh_ps c) { return PS(_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)); }
SH sh_ps sh_fnmadd_ps(sh_ps a, sh_ps b, sh_ps c) { return PS(_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)); }
#define _mm512_fmadd_ps sh_fmadd_ps
#define _mm512_fnmadd_ps sh_fnmadd_ps
SH sh_ps sh_set1_ps(float f) { __m256 v = _mm256_set1_ps(f); return PS(v, v); }
SH sh_ps sh_setzero_ps(void) { __m256 v = _mm256_setzero_ps(); return PS(v, v); }
SH sh_ps sh_setr_ps(float a, float b, float c, float d, float e, float f, float g, float h, float i, float j, float k,
                    float l, float m, float n, float o, float p) {
    return PS(_mm256_setr_ps(a, b, c, d, e, f, g, h), _mm256_setr_ps(i, j, k, l, m, n, o, p));
}
#define _mm512_set1_ps sh_set1_ps
#define _mm512_setzero_ps sh_setzero_ps
#undef _mm512_setr_ps
#define _mm512_setr_ps sh_setr_ps
SH sh_ps sh_loadu_ps(const void *p) { const float *f = (const float *)p; return PS(_mm256_loadu_ps(f), _mm256_loadu_ps(f + 8)); }
SH void sh_storeu_ps(void *p, sh_ps v) { float *f = (float *)p; _mm256_storeu_ps(f, v.lo); _mm256_storeu_ps(f + 8, v.hi); }
#define _mm512_loadu_ps sh_loadu_ps
#define _mm512_load_ps sh_loadu_ps
#define _mm512_storeu_ps sh_storeu_ps
SH float sh_cvtss_f32(sh_ps v) { return _mm256_cvtss_f32(v.lo); }
#define _mm512_cvtss_f32 sh_cvtss_f32
// nearest (even) integer value, as roundscale with _MM_FROUND_TO_NEAREST_INT
#define _mm512_roundscale_ps(a, imm) \
    PS(_mm256_round_ps((a).lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), _mm256_round_ps((a).hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC))
// a * 2^n for integral n (exp512: n in [-126, 127] as its caller clamps): two exact power-of-two steps
SH __m256 sh_scalef8(__m256 a, __m256 n) {
    __m256i k = _mm256_cvtps_epi32(n), h = _mm256_srai_epi32(k, 1), g = _mm256_sub_epi32(k, h);
    __m256 ph = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(h, _mm256_set1_epi32(127)), 23));
    __m256 pg = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(g, _mm256_set1_epi32(127)), 23));
    return _mm256_mul_ps(_mm256_mul_ps(a, ph), pg);
}
SH sh_ps sh_scalef_ps(sh_ps a, sh_ps n) { return PS(sh_scalef8(a.lo, n.lo), sh_scalef8(a.hi, n.hi)); }
#define _mm512_scalef_ps sh_scalef_ps
// getexp: floor(log2 |x|) as a float; getmant(x, [1, 2), sign zero): |x| / 2^getexp (normal x > 0)
SH __m256 sh_getexp8(__m256 x) {
    __m256i e = _mm256_srli_epi32(_mm256_and_si256(_mm256_castps_si256(x), _mm256_set1_epi32(0x7f800000)), 23);
    return _mm256_cvtepi32_ps(_mm256_sub_epi32(e, _mm256_set1_epi32(127)));
}
SH __m256 sh_getmant8(__m256 x) {
    __m256i m = _mm256_and_si256(_mm256_castps_si256(x), _mm256_set1_epi32(0x007fffff));
    return _mm256_castsi256_ps(_mm256_or_si256(m, _mm256_set1_epi32(0x3f800000)));
}
SH sh_ps sh_getexp_ps(sh_ps x) { return PS(sh_getexp8(x.lo), sh_getexp8(x.hi)); }
#define _mm512_getexp_ps sh_getexp_ps
#define _mm512_getmant_ps(x, interval, sign) PS(sh_getmant8((x).lo), sh_getmant8((x).hi))

// ---- reductions: GCC's _mm512_reduce_*_ps tree (lanes i, i + 8; then i + 4; i + 2; i + 1) -------------
SH float sh_reduce8(__m256 v, int max) {
    __m128 a = _mm256_castps256_ps128(v), b = _mm256_extractf128_ps(v, 1);
    __m128 c = max ? _mm_max_ps(b, a) : _mm_add_ps(b, a);
    __m128 d = _mm_shuffle_ps(c, c, _MM_SHUFFLE(1, 0, 3, 2));
    __m128 e = max ? _mm_max_ps(c, d) : _mm_add_ps(c, d);
    __m128 f = _mm_shuffle_ps(e, e, _MM_SHUFFLE(2, 3, 0, 1));
    return _mm_cvtss_f32(max ? _mm_max_ps(e, f) : _mm_add_ps(e, f));
}
SH float sh_reduce_add_ps(sh_ps v) { return sh_reduce8(_mm256_add_ps(v.hi, v.lo), 0); }
SH float sh_reduce_max_ps(sh_ps v) { return sh_reduce8(_mm256_max_ps(v.hi, v.lo), 1); }
#define _mm512_reduce_add_ps sh_reduce_add_ps
#define _mm512_reduce_max_ps sh_reduce_max_ps
SH int32_t sh_reduce_add_epi32(sh_si v) {
    int32_t t[16], s = 0;
    memcpy(t, &v.lo, 32); memcpy(t + 8, &v.hi, 32);
    for (int i = 0; i < 16; i++) s += t[i];  // integers: any order
    return s;
}
#define _mm512_reduce_add_epi32 sh_reduce_add_epi32
SH int32_t sh_mask_reduce_min_epi32(unsigned k, sh_si v) {
    int32_t t[16], m = INT32_MAX;
    memcpy(t, &v.lo, 32); memcpy(t + 8, &v.hi, 32);
    for (int i = 0; i < 16; i++) if ((k >> i) & 1 && t[i] < m) m = t[i];
    return m;
}
#define _mm512_mask_reduce_min_epi32 sh_mask_reduce_min_epi32

// ---- compares and masks --------------------------------------------------------------------------
#define _mm512_cmp_ps_mask(a, b, imm) sh_bits(_mm256_cmp_ps((a).lo, (b).lo, imm), _mm256_cmp_ps((a).hi, (b).hi, imm))
SH unsigned sh_cmpgt_epu32_mask(sh_si a, sh_si b) {
    const __m256i s = _mm256_set1_epi32(INT32_MIN);  // unsigned order = signed order of x ^ 0x80000000
    __m256i lo = _mm256_cmpgt_epi32(_mm256_xor_si256(a.lo, s), _mm256_xor_si256(b.lo, s));
    __m256i hi = _mm256_cmpgt_epi32(_mm256_xor_si256(a.hi, s), _mm256_xor_si256(b.hi, s));
    return sh_bits(_mm256_castsi256_ps(lo), _mm256_castsi256_ps(hi));
}
#define _mm512_cmpgt_epu32_mask sh_cmpgt_epu32_mask
SH sh_ps sh_mask_mov_ps(sh_ps src, unsigned k, sh_ps a) {
    return PS(_mm256_blendv_ps(src.lo, a.lo, sh_m8f(k)), _mm256_blendv_ps(src.hi, a.hi, sh_m8f(k >> 8)));
}
SH sh_si sh_mask_mov_epi32(sh_si src, unsigned k, sh_si a) {
    return SI(_mm256_blendv_epi8(src.lo, a.lo, sh_m8(k)), _mm256_blendv_epi8(src.hi, a.hi, sh_m8(k >> 8)));
}
#define _mm512_mask_mov_ps sh_mask_mov_ps
#define _mm512_mask_mov_epi32 sh_mask_mov_epi32
#define _mm512_mask_blend_ps(k, a, b) sh_mask_mov_ps(a, k, b)
#define _mm512_maskz_mov_ps(k, a) sh_mask_mov_ps(sh_setzero_ps(), k, a)
#define _mm512_mask_max_ps(src, k, a, b) sh_mask_mov_ps(src, k, sh_max_ps(a, b))
#define _mm512_mask_add_ps(src, k, a, b) sh_mask_mov_ps(src, k, sh_add_ps(a, b))
#define _mm512_mask_mul_ps(src, k, a, b) sh_mask_mov_ps(src, k, sh_mul_ps(a, b))
#define _mm512_mask_or_epi32(src, k, a, b) sh_mask_mov_epi32(src, k, sh_or_si512(a, b))

// ---- integer ---------------------------------------------------------------------------------------
#define SH_I2(name, op)                                                                     \
    SH sh_si name(sh_si a, sh_si b) { return SI(op(a.lo, b.lo), op(a.hi, b.hi)); }
SH_I2(sh_and_si512, _mm256_and_si256)
SH_I2(sh_or_si512, _mm256_or_si256)
SH_I2(sh_xor_si512, _mm256_xor_si256)
SH_I2(sh_add_epi32, _mm256_add_epi32)
SH_I2(sh_sub_epi32, _mm256_sub_epi32)
SH_I2(sh_add_epi64, _mm256_add_epi64)
SH_I2(sh_unpacklo_epi16, _mm256_unpacklo_epi16)
SH_I2(sh_unpackhi_epi16, _mm256_unpackhi_epi16)
SH_I2(sh_unpacklo_epi32, _mm256_unpacklo_epi32)
SH_I2(sh_unpackhi_epi32, _mm256_unpackhi_epi32)
SH_I2(sh_unpacklo_epi64, _mm256_unpacklo_epi64)
SH_I2(sh_unpackhi_epi64, _mm256_unpackhi_epi64)
#define _mm512_and_si512 sh_and_si512
#define _mm512_or_si512 sh_or_si512
#define _mm512_xor_si512 sh_xor_si512
#define _mm512_add_epi32 sh_add_epi32
#define _mm512_sub_epi32 sh_sub_epi32
#define _mm512_add_epi64 sh_add_epi64
#define _mm512_unpacklo_epi16 sh_unpacklo_epi16
#define _mm512_unpackhi_epi16 sh_unpackhi_epi16
#define _mm512_unpacklo_epi32 sh_unpacklo_epi32
#define _mm512_unpackhi_epi32 sh_unpackhi_epi32
#define _mm512_unpacklo_epi64 sh_unpacklo_epi64
#define _mm512_unpackhi_epi64 sh_unpackhi_epi64
SH_F2(sh_unpacklo_ps, _mm256_unpacklo_ps)
SH_F2(sh_unpackhi_ps, _mm256_unpackhi_ps)
#define _mm512_unpacklo_ps sh_unpacklo_ps
#define _mm512_unpackhi_ps sh_unpackhi_ps
#define _mm512_slli_epi32(a, n) SI(_mm256_slli_epi32((a).lo, n), _mm256_slli_epi32((a).hi, n))
#define _mm512_srli_epi32(a, n) SI(_mm256_srli_epi32((a).lo, n), _mm256_srli_epi32((a).hi, n))
#define _mm512_slli_epi16(a, n) SI(_mm256_slli_epi16((a).lo, n), _mm256_slli_epi16((a).hi, n))
#define _mm512_srli_epi16(a, n) SI(_mm256_srli_epi16((a).lo, n), _mm256_srli_epi16((a).hi, n))
#define _mm512_srli_epi64(a, n) SI(_mm256_srli_epi64((a).lo, n), _mm256_srli_epi64((a).hi, n))
SH __m256i sh_mullo64(__m256i a, __m256i b) {  // low 64 bits of a * b per lane
    __m256i lo = _mm256_mul_epu32(a, b);
    __m256i cross = _mm256_add_epi64(_mm256_mul_epu32(_mm256_srli_epi64(a, 32), b), _mm256_mul_epu32(a, _mm256_srli_epi64(b, 32)));
    return _mm256_add_epi64(lo, _mm256_slli_epi64(cross, 32));
}
SH_I2(sh_mullo_epi64, sh_mullo64)
#define _mm512_mullo_epi64 sh_mullo_epi64
SH sh_si sh_set1_epi32(int v) { __m256i x = _mm256_set1_epi32(v); return SI(x, x); }
SH sh_si sh_set1_epi64(long long v) { __m256i x = _mm256_set1_epi64x(v); return SI(x, x); }
SH sh_si sh_set1_epi8(char v) { __m256i x = _mm256_set1_epi8(v); return SI(x, x); }
SH sh_si sh_setzero_si512(void) { __m256i x = _mm256_setzero_si256(); return SI(x, x); }
SH sh_si sh_setr_epi32(int a, int b, int c, int d, int e, int f, int g, int h, int i, int j, int k, int l, int m,
                       int n, int o, int p) {
    return SI(_mm256_setr_epi32(a, b, c, d, e, f, g, h), _mm256_setr_epi32(i, j, k, l, m, n, o, p));
}
SH sh_si sh_setr_epi64(long long a, long long b, long long c, long long d, long long e, long long f, long long g,
                       long long h) {
    return SI(_mm256_setr_epi64x(a, b, c, d), _mm256_setr_epi64x(e, f, g, h));
}
#define _mm512_set1_epi32 sh_set1_epi32
#define _mm512_set1_epi64 sh_set1_epi64
#define _mm512_set1_epi8 sh_set1_epi8
#define _mm512_setzero_si512 sh_setzero_si512
#undef _mm512_setr_epi32
#define _mm512_setr_epi32 sh_setr_epi32
#undef _mm512_setr_epi64
#define _mm512_setr_epi64 sh_setr_epi64
SH sh_si sh_loadu_si512(const void *p) {
    const __m256i *q = (const __m256i *)p;
    return SI(_mm256_loadu_si256(q), _mm256_loadu_si256(q + 1));
}
SH void sh_storeu_si512(void *p, sh_si v) { __m256i *q = (__m256i *)p; _mm256_storeu_si256(q, v.lo); _mm256_storeu_si256(q + 1, v.hi); }
#define _mm512_loadu_si512 sh_loadu_si512
#define _mm512_load_si512 sh_loadu_si512
#define _mm512_storeu_si512 sh_storeu_si512
#define _mm512_store_si512 sh_storeu_si512

// ---- casts and conversions --------------------------------------------------------------------------
SH sh_ps sh_castsi512_ps(sh_si a) { return PS(_mm256_castsi256_ps(a.lo), _mm256_castsi256_ps(a.hi)); }
SH sh_si sh_castps_si512(sh_ps a) { return SI(_mm256_castps_si256(a.lo), _mm256_castps_si256(a.hi)); }
#define _mm512_castsi512_ps sh_castsi512_ps
#define _mm512_castps_si512 sh_castps_si512
SH sh_si sh_castsi256_si512(__m256i a) { return SI(a, _mm256_setzero_si256()); }  // upper half: zero here, undefined there
#define _mm512_castsi256_si512 sh_castsi256_si512
#define _mm512_inserti64x4(a, b, imm) ((imm) ? SI((a).lo, b) : SI(b, (a).hi))
SH sh_ps sh_cvtepi32_ps(sh_si a) { return PS(_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)); }
#define _mm512_cvtepi32_ps sh_cvtepi32_ps
// round to nearest even (the kernels ask for it; MXCSR's default)
#define _mm512_cvt_roundps_epi32(a, r) SI(_mm256_cvtps_epi32((a).lo), _mm256_cvtps_epi32((a).hi))
SH sh_ps sh_cvtph_ps(__m256i h) {
    return PS(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)));
}
#define _mm512_cvtph_ps sh_cvtph_ps
SH sh_si sh_cvtepu16_epi32(__m256i a) {
    return SI(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(a)), _mm256_cvtepu16_epi32(_mm256_extracti128_si256(a, 1)));
}
SH sh_si sh_cvtepi8_epi32(__m128i a) { return SI(_mm256_cvtepi8_epi32(a), _mm256_cvtepi8_epi32(_mm_srli_si128(a, 8))); }
SH sh_si sh_cvtepu8_epi32(__m128i a) { return SI(_mm256_cvtepu8_epi32(a), _mm256_cvtepu8_epi32(_mm_srli_si128(a, 8))); }
#define _mm512_cvtepu16_epi32 sh_cvtepu16_epi32
#define _mm512_cvtepi8_epi32 sh_cvtepi8_epi32
#define _mm512_cvtepu8_epi32 sh_cvtepu8_epi32
// truncations (vpmovdb, vpmovdw, vpmovqd: the low bits of each lane)
SH __m128i sh_cvtepi32_epi8(sh_si a) {
    const __m256i pick = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                          0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    // each 128-bit lane's 4 low bytes in its dword 0: lanes 0-3, 4-7 (lo); 8-11, 12-15 (hi)
    __m256i l = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(a.lo, pick), _mm256_setr_epi32(0, 4, 0, 0, 0, 0, 0, 0));
    __m256i h = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(a.hi, pick), _mm256_setr_epi32(0, 0, 0, 4, 0, 0, 0, 0));
    return _mm256_castsi256_si128(_mm256_blend_epi32(l, h, 0x0C));
}
#define _mm512_cvtepi32_epi8 sh_cvtepi32_epi8
SH __m256i sh_cvtepi32_epi16(sh_si a) {
    const __m256i pick = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1,
                                          0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1);
    __m256i l = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(a.lo, pick), _MM_SHUFFLE(3, 1, 2, 0));
    __m256i h = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(a.hi, pick), _MM_SHUFFLE(3, 1, 2, 0));
    return _mm256_permute2x128_si256(l, h, 0x20);
}
#define _mm512_cvtepi32_epi16 sh_cvtepi32_epi16
SH __m256i sh_cvtepi64_epi32(sh_si a) {
    const __m256i even = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);
    __m256i l = _mm256_permutevar8x32_epi32(a.lo, even), h = _mm256_permutevar8x32_epi32(a.hi, even);
    return _mm256_permute2x128_si256(l, h, 0x20);
}
#define _mm512_cvtepi64_epi32 sh_cvtepi64_epi32
// fp32 -> bf16, nearest even, NaN kept quiet (torch's rounding; the instruction would also flush denormals)
SH __m256i sh_cvtneps_pbh(sh_ps v) {
    sh_si u = sh_castps_si512(v);
    const __m256i one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7fff), abs = _mm256_set1_epi32(0x7fffffff);
    const __m256i inf = _mm256_set1_epi32(0x7f800000), quiet = _mm256_set1_epi32(0x40);
    __m256i r[2], x[2] = {u.lo, u.hi};
    for (int h = 0; h < 2; h++) {
        __m256i t = _mm256_add_epi32(x[h], _mm256_add_epi32(bias, _mm256_and_si256(_mm256_srli_epi32(x[h], 16), one)));
        __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(x[h], abs), inf);
        r[h] = _mm256_blendv_epi8(_mm256_srli_epi32(t, 16), _mm256_or_si256(_mm256_srli_epi32(x[h], 16), quiet), nan);
    }
    return sh_cvtepi32_epi16(SI(r[0], r[1]));
}
#define _mm512_cvtneps_pbh sh_cvtneps_pbh

// ---- shuffles and permutes ----------------------------------------------------------------------------
// 128-bit lane k of a (0-3) for each half of the result: permute2f128 over (a.lo, a.hi) takes k as is
#define _mm512_shuffle_f32x4(a, b, imm) \
    PS(_mm256_permute2f128_ps((a).lo, (a).hi, ((imm) & 3) | ((((imm) >> 2) & 3) << 4)), \
       _mm256_permute2f128_ps((b).lo, (b).hi, (((imm) >> 4) & 3) | ((((imm) >> 6) & 3) << 4)))
#define _mm512_shuffle_i32x4(a, b, imm) \
    SI(_mm256_permute2x128_si256((a).lo, (a).hi, ((imm) & 3) | ((((imm) >> 2) & 3) << 4)), \
       _mm256_permute2x128_si256((b).lo, (b).hi, (((imm) >> 4) & 3) | ((((imm) >> 6) & 3) << 4)))
#define _mm512_shuffle_ps(a, b, imm) PS(_mm256_shuffle_ps((a).lo, (b).lo, imm), _mm256_shuffle_ps((a).hi, (b).hi, imm))
// lanes of (lo, hi) picked by idx & 15
SH __m256 sh_perm16(__m256 lo, __m256 hi, __m256i idx) {
    __m256 from_hi = _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28));  // bit 3 -> the sign bit
    return _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, idx), _mm256_permutevar8x32_ps(hi, idx), from_hi);
}
SH sh_ps sh_permutexvar_ps(sh_si idx, sh_ps a) {
    return PS(sh_perm16(a.lo, a.hi, idx.lo), sh_perm16(a.lo, a.hi, idx.hi));
}
#define _mm512_permutexvar_ps sh_permutexvar_ps
SH sh_si sh_permutexvar_epi32(sh_si idx, sh_si a) { return sh_castps_si512(sh_permutexvar_ps(idx, sh_castsi512_ps(a))); }
#define _mm512_permutexvar_epi32 sh_permutexvar_epi32
SH sh_ps sh_permutex2var_ps(sh_ps a, sh_si idx, sh_ps b) {
    __m256 lo[2], r[2];
    __m256i ix[2] = {idx.lo, idx.hi};
    for (int h = 0; h < 2; h++) {
        __m256 from_b = _mm256_castsi256_ps(_mm256_slli_epi32(ix[h], 27));  // bit 4 -> the sign bit
        lo[h] = sh_perm16(a.lo, a.hi, ix[h]);
        r[h] = _mm256_blendv_ps(lo[h], sh_perm16(b.lo, b.hi, ix[h]), from_b);
    }
    return PS(r[0], r[1]);
}
#define _mm512_permutex2var_ps sh_permutex2var_ps
// 32 words of a picked by idx & 31: vpshufb within each 128-bit quarter of a (broadcast to both lanes),
// then the quarter chosen by bits 3 and 4 of the index (the Q4 dequantizer's 16-entry table lookup)
SH __m256i sh_perm32w(__m256i idx, __m256i q0, __m256i q1, __m256i q2, __m256i q3) {
    __m256i i = _mm256_and_si256(idx, _mm256_set1_epi16(31));
    __m256i ctrl = _mm256_add_epi16(_mm256_mullo_epi16(_mm256_and_si256(i, _mm256_set1_epi16(7)), _mm256_set1_epi16(0x0202)),
                                    _mm256_set1_epi16(0x0100));
    __m256i b3 = _mm256_cmpeq_epi16(_mm256_and_si256(i, _mm256_set1_epi16(8)), _mm256_set1_epi16(8));
    __m256i b4 = _mm256_cmpeq_epi16(_mm256_and_si256(i, _mm256_set1_epi16(16)), _mm256_set1_epi16(16));
    __m256i r01 = _mm256_blendv_epi8(_mm256_shuffle_epi8(q0, ctrl), _mm256_shuffle_epi8(q1, ctrl), b3);
    __m256i r23 = _mm256_blendv_epi8(_mm256_shuffle_epi8(q2, ctrl), _mm256_shuffle_epi8(q3, ctrl), b3);
    return _mm256_blendv_epi8(r01, r23, b4);
}
SH sh_si sh_permutexvar_epi16(sh_si idx, sh_si a) {
    __m256i q0 = _mm256_permute2x128_si256(a.lo, a.lo, 0x00), q1 = _mm256_permute2x128_si256(a.lo, a.lo, 0x11);
    __m256i q2 = _mm256_permute2x128_si256(a.hi, a.hi, 0x00), q3 = _mm256_permute2x128_si256(a.hi, a.hi, 0x11);
    return SI(sh_perm32w(idx.lo, q0, q1, q2, q3), sh_perm32w(idx.hi, q0, q1, q2, q3));
}
#define _mm512_permutexvar_epi16 sh_permutexvar_epi16

// ---- masked loads and stores (only the named lanes are touched) -----------------------------------
SH sh_ps sh_maskz_loadu_ps(unsigned k, const void *p) {
    const float *f = (const float *)p;
    return PS(_mm256_maskload_ps(f, sh_m8(k)), _mm256_maskload_ps(f + 8, sh_m8(k >> 8)));
}
#define _mm512_maskz_loadu_ps sh_maskz_loadu_ps
SH void sh_mask_storeu_ps(void *p, unsigned k, sh_ps v) {
    float *f = (float *)p;
    _mm256_maskstore_ps(f, sh_m8(k), v.lo);
    _mm256_maskstore_ps(f + 8, sh_m8(k >> 8), v.hi);
}
#define _mm512_mask_storeu_ps sh_mask_storeu_ps
#define _mm512_mask_storeu_epi32(p, k, v) sh_mask_storeu_ps(p, k, sh_castsi512_ps(v))
SH sh_si sh_maskz_loadu_epi64(unsigned k, const void *p) {
    const long long *q = (const long long *)p;
    const __m256i bit = _mm256_setr_epi64x(1, 2, 4, 8), bit2 = _mm256_setr_epi64x(16, 32, 64, 128);
    __m256i m0 = _mm256_cmpeq_epi64(_mm256_and_si256(_mm256_set1_epi64x(k), bit), bit);
    __m256i m1 = _mm256_cmpeq_epi64(_mm256_and_si256(_mm256_set1_epi64x(k), bit2), bit2);
    return SI(_mm256_maskload_epi64(q, m0), _mm256_maskload_epi64(q + 4, m1));
}
#define _mm512_maskz_loadu_epi64 sh_maskz_loadu_epi64
SH sh_si sh_maskz_loadu_epi16(uint32_t k, const void *p) {  // 32 words
    uint16_t t[32] = {0};
    const uint16_t *q = (const uint16_t *)p;
    if (k == 0xFFFFFFFFu) return sh_loadu_si512(p);
    for (int j = 0; j < 32; j++) if ((k >> j) & 1) t[j] = q[j];
    return sh_loadu_si512(t);
}
#define _mm512_maskz_loadu_epi16 sh_maskz_loadu_epi16
SH sh_si sh_maskz_loadu_epi8(uint64_t k, const void *p) {  // 64 bytes
    uint8_t t[64] = {0};
    const uint8_t *q = (const uint8_t *)p;
    if (k == ~(uint64_t)0) return sh_loadu_si512(p);
    for (int j = 0; j < 64; j++) if ((k >> j) & 1) t[j] = q[j];
    return sh_loadu_si512(t);
}
#define _mm512_maskz_loadu_epi8 sh_maskz_loadu_epi8
// the AVX-512VL forms on 256 bits (16 words)
SH __m256i sh_maskz_loadu_epi16_256(unsigned k, const void *p) {
    uint16_t t[16] = {0};
    const uint16_t *q = (const uint16_t *)p;
    if ((k & 0xFFFF) == 0xFFFF) return _mm256_loadu_si256((const __m256i *)p);
    for (int j = 0; j < 16; j++) if ((k >> j) & 1) t[j] = q[j];
    return _mm256_loadu_si256((const __m256i *)t);
}
SH void sh_mask_storeu_epi16_256(void *p, unsigned k, __m256i v) {
    uint16_t t[16], *q = (uint16_t *)p;
    if ((k & 0xFFFF) == 0xFFFF) { _mm256_storeu_si256((__m256i *)p, v); return; }
    _mm256_storeu_si256((__m256i *)t, v);
    for (int j = 0; j < 16; j++) if ((k >> j) & 1) q[j] = t[j];
}
#define _mm256_maskz_loadu_epi16 sh_maskz_loadu_epi16_256
#define _mm256_mask_storeu_epi16 sh_mask_storeu_epi16_256

// ---- dot products --------------------------------------------------------------------------------
// vpdpbusd: per dword lane, src + the 4 products of a's unsigned bytes and b's signed bytes, exact.
// vpmaddubsw saturates (255 x -128 pairs), so a's bytes are split into nibbles (each pair sum <= 2 x 15 x 128).
SH __m256i sh_dpbusd8(__m256i src, __m256i a, __m256i b) {
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1), sixteen = _mm256_set1_epi16(16);
    __m256i l = _mm256_maddubs_epi16(_mm256_and_si256(a, low), b);
    __m256i h = _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(a, 4), low), b);
    return _mm256_add_epi32(src, _mm256_add_epi32(_mm256_madd_epi16(l, ones), _mm256_madd_epi16(h, sixteen)));
}
SH sh_si sh_dpbusd_epi32(sh_si src, sh_si a, sh_si b) { return SI(sh_dpbusd8(src.lo, a.lo, b.lo), sh_dpbusd8(src.hi, a.hi, b.hi)); }
#define _mm512_dpbusd_epi32 sh_dpbusd_epi32
// vdpbf16ps: per fp32 lane i, acc + a[2i+1] b[2i+1], then + a[2i] b[2i] (bf16 products are exact in
// fp32, so each step is one fused multiply-add, as the instruction's two rounded additions).
SH __m256 sh_dpbf16_8(__m256 acc, __m256i a, __m256i b) {
    const __m256i hi = _mm256_set1_epi32((int)0xFFFF0000u);
    __m256 ao = _mm256_castsi256_ps(_mm256_and_si256(a, hi)), bo = _mm256_castsi256_ps(_mm256_and_si256(b, hi));
    __m256 ae = _mm256_castsi256_ps(_mm256_slli_epi32(a, 16)), be = _mm256_castsi256_ps(_mm256_slli_epi32(b, 16));
    return _mm256_fmadd_ps(ae, be, _mm256_fmadd_ps(ao, bo, acc));
}
SH sh_ps sh_dpbf16_ps(sh_ps acc, sh_si a, sh_si b) { return PS(sh_dpbf16_8(acc.lo, a.lo, b.lo), sh_dpbf16_8(acc.hi, a.hi, b.hi)); }
#define _mm512_dpbf16_ps sh_dpbf16_ps
