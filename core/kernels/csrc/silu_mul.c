// The Llama MLP's act(gate) * up in bf16: out = bf16(bf16(silu(g)) * u), silu(g) = g / (1 + e^-g)
// in fp32 with exp512 (common.h), the two roundings torch's bf16 ops make. Every element takes
// the same vector instructions (a masked vector for a row's tail, never a scalar libm path),
// so an element's bits do not depend on the row count, its place in the row or the threads:
// row-invariant by construction (torch's own SiLU splits work by a grain size, and its scalar
// tail uses another exp than its vector body).
#include "common.h"

static inline __m512 round_bf16(__m512 v) {  // fp32 -> bf16 -> fp32
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16x16(v)), 16));
}

void silu_mul_row(const uint16_t *g, const uint16_t *u, uint16_t *out, int H) {
    for (int h = 0; h < H; h += 16) {
        __mmask16 m = H - h >= 16 ? 0xFFFF : (__mmask16)((1u << (H - h)) - 1u);
        __m512 gv = bf16x16_to_ps_masked(g + h, m), uv = bf16x16_to_ps_masked(u + h, m);
        __m512 s = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
        _mm256_mask_storeu_epi16(out + h, m, to_bf16x16(_mm512_mul_ps(round_bf16(s), uv)));
    }
}

#define SILU_CHUNK 256  // elements per task (a multiple of 16): a single row still splits over the team

// g, u: M rows (strides ldg, ldu) of H; out: M rows of H (stride ldo). Split over the enclosing team.
void silu_mul_team(const uint16_t *g, int64_t ldg, const uint16_t *u, int64_t ldu, uint16_t *out, int64_t ldo,
                   int M, int H) {
    int per_row = (H + SILU_CHUNK - 1) / SILU_CHUNK;
#pragma omp for schedule(static)
    for (int t = 0; t < M * per_row; t++) {
        int m = t / per_row, h = t % per_row * SILU_CHUNK, len = H - h < SILU_CHUNK ? H - h : SILU_CHUNK;
        silu_mul_row(g + m * ldg + h, u + m * ldu + h, out + m * ldo + h, len);
    }
}

// ctypes: silu_mul_bf16(ptr g, i64 ldg, ptr u, i64 ldu, ptr out, i64 ldo, i32 M, i32 H, i32 nthreads) -> void
void silu_mul_bf16(const uint16_t *g, int64_t ldg, const uint16_t *u, int64_t ldu, uint16_t *out, int64_t ldo,
                   int M, int H, int nthreads) {
#pragma omp parallel num_threads(nthreads) if ((int64_t)M * H > SILU_CHUNK)
    silu_mul_team(g, ldg, u, ldu, out, ldo, M, H);
}
