// Rotary position embedding on bf16 rows, as transformers' apply_rotary_pos_emb computes it
// in bf16: out = bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)), rotate_half(x) = (-x2, x1)
// for the two halves of each head. A product of two bf16 values is exact in fp32 and each
// step rounds as torch's bf16 ops do, so the result is bit for bit torch's; one call instead
// of the seven ops per tensor (the draft head's q and k, every call).
#include "common.h"

// x: n rows (stride ldx) of heads * hd; cos, sin: n rows of hd (stride ldc); out: (n, heads, hd)
// ctypes: rotary_bf16(ptr x, i64 ldx, ptr cos, ptr sin, i64 ldc, ptr out, i32 n, i32 heads, i32 hd) -> void
void rotary_bf16(const uint16_t *x, int64_t ldx, const uint16_t *cos, const uint16_t *sin, int64_t ldc,
                 uint16_t *out, int n, int heads, int hd) {
    int half = hd / 2;
    for (int i = 0; i < n; i++) {
        const uint16_t *c = cos + i * ldc, *s = sin + i * ldc;
        for (int h = 0; h < heads; h++) {
            const uint16_t *xh = x + i * ldx + h * hd;
            uint16_t *o = out + ((int64_t)i * heads + h) * hd;
            int j = 0;
            for (; j + 16 <= half; j += 16) {
                __m512 x1 = bf16x16_to_ps(xh + j), x2 = bf16x16_to_ps(xh + half + j);
                __m512 c1 = bf16x16_to_ps(c + j), c2 = bf16x16_to_ps(c + half + j);
                __m512 s1 = bf16x16_to_ps(s + j), s2 = bf16x16_to_ps(s + half + j);
                // bf16 -> fp32 of a rounded value: the same bits torch keeps between ops
#define R(v) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16x16(v)), 16))
                __m512 lo = _mm512_add_ps(R(_mm512_mul_ps(x1, c1)), R(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), x2), s1)));
                __m512 hi = _mm512_add_ps(R(_mm512_mul_ps(x2, c2)), R(_mm512_mul_ps(x1, s2)));
#undef R
                _mm256_storeu_si256((__m256i *)(o + j), to_bf16x16(lo));
                _mm256_storeu_si256((__m256i *)(o + half + j), to_bf16x16(hi));
            }
            for (; j < half; j++) {
                float x1 = from_bf16(xh[j]), x2 = from_bf16(xh[half + j]);
                float lo = from_bf16(to_bf16(x1 * from_bf16(c[j]))) + from_bf16(to_bf16(-x2 * from_bf16(s[j])));
                float hi = from_bf16(to_bf16(x2 * from_bf16(c[half + j]))) + from_bf16(to_bf16(x1 * from_bf16(s[half + j])));
                o[j] = to_bf16(lo);
                o[half + j] = to_bf16(hi);
            }
        }
    }
}
