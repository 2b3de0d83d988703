// Draft scoring: per row of bf16 logits, the k best tokens as log-probabilities (log-softmax,
// clamped at 0) and their indices, best first; on equal logits the lower index comes first.
// One pass finds the maximum and the k best, a second sums the exponentials. Drafting only:
// the target's own choices never go through it (they are core.verify's exact argmax).
#include "common.h"

#define MAX_K 64

// Insert (v, i) into the descending list of `*count` entries (at most k kept); an equal
// value goes after the ones already there (they have lower indices).
static inline void insert(float *vals, int64_t *idx, int *count, int k, float v, int64_t i) {
    int pos = *count < k ? *count : k - 1;
    if (*count >= k && !(v > vals[k - 1])) return;
    while (pos > 0 && v > vals[pos - 1]) {
        vals[pos] = vals[pos - 1];
        idx[pos] = idx[pos - 1];
        pos--;
    }
    vals[pos] = v;
    idx[pos] = i;
    if (*count < k) (*count)++;
}

static void topk_row(const uint16_t *x, int N, int k, float *out_v, int64_t *out_i) {
    float vals[MAX_K];
    int64_t idx[MAX_K];
    int count = 0;
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    for (int n = 0; n < N; n += 16) {
        __mmask16 valid = N - n >= 16 ? 0xFFFF : (__mmask16)((1u << (N - n)) - 1u);
        __m512 v = bf16x16_to_ps_masked(x + n, valid);
        vmax = _mm512_mask_max_ps(vmax, valid, vmax, v);
        // lanes that may enter the list: all while it fills, then those above its last entry
        __mmask16 cand = count < k ? valid
                                   : valid & _mm512_cmp_ps_mask(v, _mm512_set1_ps(vals[k - 1]), _CMP_GT_OQ);
        while (cand) {
            int lane = __builtin_ctz(cand);
            cand &= cand - 1;
            float f = from_bf16(x[n + lane]);
            if (f == f) insert(vals, idx, &count, k, f, n + lane);
        }
    }
    float m = _mm512_reduce_max_ps(vmax);
    __m512 sum = _mm512_setzero_ps(), vm = _mm512_set1_ps(m);
    for (int n = 0; n < N; n += 16) {
        __mmask16 valid = N - n >= 16 ? 0xFFFF : (__mmask16)((1u << (N - n)) - 1u);
        __m512 v = bf16x16_to_ps_masked(x + n, valid);
        sum = _mm512_mask_add_ps(sum, valid, sum, exp512(_mm512_sub_ps(v, vm)));
    }
    float lse = m + logf(_mm512_reduce_add_ps(sum));
    for (int j = 0; j < k; j++) {
        float lp = j < count ? vals[j] - lse : -INFINITY;
        out_v[j] = lp > 0.0f ? 0.0f : lp;
        out_i[j] = j < count ? idx[j] : 0;
    }
}

// 0, or -1 for k outside 1 .. MAX_K (topk_row keeps its candidates on the stack).
// ctypes: topk_logprobs_bf16(ptr x, i64 ldx, ptr vals, ptr idx, i32 M, i32 N, i32 k, i32 nthreads) -> i32
int topk_logprobs_bf16(const uint16_t *x, int64_t ldx, float *vals, int64_t *idx, int M, int N, int k,
                       int nthreads) {
    if (k < 1 || k > MAX_K) return -1;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (M > 1)
    for (int m = 0; m < M; m++) topk_row(x + m * ldx, N, k, vals + (int64_t)m * k, idx + (int64_t)m * k);
    return 0;
}
