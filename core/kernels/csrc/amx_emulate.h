// AMX tiles emulated in C, for testing the tile code paths on a CPU without them (EAGLE_CHAT_KERNELS=amx-emulated
// builds the AVX-512 library with -DEAGLE_AMX_EMULATE; core.kernels.native). Never a serving path: a tile product
// here is a loop of vector instructions, many times slower than the one instruction it stands for.
//
// Each intrinsic the kernels use is replaced by a function over per-thread tile registers that follows the Intel
// SDM's definition: LDTILECFG's palette-1 layout (colsb at byte 16, rows at byte 48 of the 64-byte config), loads
// and stores of rows x colsb bytes (a load zeroes the rest of the tile), TDPBF16PS as two fp32 additions per pair
// of K (each bf16 product is exact in fp32; denormals kept, where the instruction flushes them), TDPBSUD as signed
// bytes of A times unsigned bytes of B summed in 32-bit integers (wrapping). Vectorised (AVX-512, as the build).
// The tests that need tiles then run on every AVX-512 machine: addressing, tile shapes, which rows and columns
// hold what, and the row invariance the kernels promise (tests/test_amx_emulated.py).
#pragma once
#include <stdint.h>
#include <string.h>

typedef struct {
    uint8_t rows[8];
    uint16_t colsb[8];
    uint8_t data[8][16][64];
} amx_tiles;

extern __thread amx_tiles amx_emulated;  // defined in gemm_amx.c: each OpenMP thread has its own tiles

static inline void amx_emu_loadconfig(const void *config) {
    const uint8_t *c = (const uint8_t *)config;
    for (int t = 0; t < 8; t++) {
        memcpy(&amx_emulated.colsb[t], c + 16 + 2 * t, 2);
        amx_emulated.rows[t] = c[48 + t];
    }
    memset(amx_emulated.data, 0, sizeof amx_emulated.data);
}

static inline void amx_emu_load(int t, const void *base, int64_t stride) {
    memset(amx_emulated.data[t], 0, sizeof amx_emulated.data[t]);
    for (int r = 0; r < amx_emulated.rows[t]; r++)
        memcpy(amx_emulated.data[t][r], (const uint8_t *)base + r * stride, amx_emulated.colsb[t]);
}

static inline void amx_emu_store(int t, void *base, int64_t stride) {
    for (int r = 0; r < amx_emulated.rows[t]; r++)
        memcpy((uint8_t *)base + r * stride, amx_emulated.data[t][r], amx_emulated.colsb[t]);
}

static inline void amx_emu_zero(int t) { memset(amx_emulated.data[t], 0, sizeof amx_emulated.data[t]); }

// c[m][n] (fp32) += a[m][2k] b[k][2n], then += a[m][2k + 1] b[k][2n + 1], for k over a's colsb / 4 in order. A bf16
// product is exact in fp32, so each fused multiply-add rounds once, as the instruction's two additions do.
// Unlike the instruction, denormal inputs and results are kept (it flushes them to zero): no test reaches them.
static inline void amx_emu_dpbf16ps(int c, int a, int b) {
    amx_tiles *s = &amx_emulated;
    int K = s->colsb[a] / 4;
    __m512 even[16], odd[16];  // b's row k as fp32: its even and its odd bf16, lane n = column n of c
    for (int k = 0; k < K; k++) {
        __m512i w = _mm512_loadu_si512(s->data[b][k]);
        even[k] = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
        odd[k] = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32((int)0xffff0000u)));
    }
    __mmask16 cols = (__mmask16)((1u << (s->colsb[c] / 4)) - 1);
    for (int m = 0; m < s->rows[c]; m++) {
        __m512 acc = _mm512_maskz_loadu_ps(cols, s->data[c][m]);
        for (int k = 0; k < K; k++) {
            uint32_t pair;
            memcpy(&pair, s->data[a][m] + 4 * k, 4);
            acc = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_set1_epi32((int)(pair << 16))), even[k], acc);
            acc = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_set1_epi32((int)(pair & 0xffff0000u))), odd[k], acc);
        }
        _mm512_mask_storeu_ps(s->data[c][m], cols, acc);
    }
}

// c[m][n] (int32) += sum over i < 4 of int8 a[m][4k + i] * uint8 b[k][4n + i], wrapping: vpdpbusd with b's row k as
// its unsigned operand and a's four bytes, repeated, as its signed one
static inline void amx_emu_dpbsud(int c, int a, int b) {
    amx_tiles *s = &amx_emulated;
    __mmask16 cols = (__mmask16)((1u << (s->colsb[c] / 4)) - 1);
    for (int m = 0; m < s->rows[c]; m++) {
        __m512i acc = _mm512_maskz_loadu_epi32(cols, s->data[c][m]);
        for (int k = 0; k < s->colsb[a] / 4; k++) {
            int32_t quad;
            memcpy(&quad, s->data[a][m] + 4 * k, 4);
            acc = _mm512_dpbusd_epi32(acc, _mm512_loadu_si512(s->data[b][k]), _mm512_set1_epi32(quad));
        }
        _mm512_mask_storeu_epi32(s->data[c][m], cols, acc);
    }
}

#undef _tile_loadconfig
#undef _tile_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_release
#undef _tile_dpbf16ps
#undef _tile_dpbsud
#define _tile_loadconfig(config) amx_emu_loadconfig(config)
#define _tile_loadd(t, base, stride) amx_emu_load((t), (base), (stride))
#define _tile_stored(t, base, stride) amx_emu_store((t), (base), (stride))
#define _tile_zero(t) amx_emu_zero(t)
#define _tile_release() ((void)0)
#define _tile_dpbf16ps(c, a, b) amx_emu_dpbf16ps((c), (a), (b))
#define _tile_dpbsud(c, a, b) amx_emu_dpbsud((c), (a), (b))
