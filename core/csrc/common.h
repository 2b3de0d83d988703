// Shared by the decoding kernels: bf16 <-> fp32 and the fixed lane-reduction tree.
#pragma once
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline uint16_t to_bf16(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
static inline float from_bf16(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }

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

static inline void store16(__m512 s, float *out) {  // out[a] = sum of accumulator a
    float lanes[16];
    _mm512_storeu_ps(lanes, s);
    for (int a = 0; a < 16; a++) out[a] = lanes[4 * (a & 3) + (a >> 2)];
}

