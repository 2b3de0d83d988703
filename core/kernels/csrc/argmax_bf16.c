// Greedy choice over bf16 logits: per row, the index of the first maximum (NaN counts as the
// maximum, as torch.argmax has it). Exact: bf16 -> fp32 loses nothing, and the comparison is
// the same. Rows in parallel; a row's answer does not depend on the others.
#include "common.h"

static int64_t argmax_row(const uint16_t *x, int N) {
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    __m512i vidx = _mm512_set1_epi32(0x7fffffff), lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __mmask16 nan = 0, seen = 0;
    for (int n = 0; n < N; n += 16) {
        __mmask16 valid = N - n >= 16 ? 0xFFFF : (__mmask16)((1u << (N - n)) - 1u);
        __m512 v = bf16x16_to_ps_masked(x + n, valid);
        __m512i idx = _mm512_add_epi32(lane, _mm512_set1_epi32(n));
        // strictly greater keeps each lane's first maximum; a lane's first value always counts
        __mmask16 take = valid & (_mm512_cmp_ps_mask(v, vmax, _CMP_GT_OQ) | (__mmask16)~seen);
        vmax = _mm512_mask_mov_ps(vmax, take, v);
        vidx = _mm512_mask_mov_epi32(vidx, take, idx);
        seen |= valid;
        nan |= valid & _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    }
    if (nan) {  // rare: the first NaN, as torch.argmax answers
        for (int n = 0; n < N; n++) { float f = from_bf16(x[n]); if (f != f) return n; }
    }
    float m = _mm512_reduce_max_ps(_mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), seen, vmax));
    __mmask16 best = seen & _mm512_cmp_ps_mask(vmax, _mm512_set1_ps(m), _CMP_EQ_OQ);
    return _mm512_mask_reduce_min_epi32(best, vidx);
}

// ctypes: argmax_bf16(ptr x, i64 ldx, ptr out, i32 M, i32 N, i32 nthreads) -> void
void argmax_bf16(const uint16_t *x, int64_t ldx, int64_t *out, int M, int N, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (M > 1)
    for (int m = 0; m < M; m++) out[m] = argmax_row(x + m * ldx, N);
}
