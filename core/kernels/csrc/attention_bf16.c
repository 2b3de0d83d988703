// Decoding attention for bf16 on AVX-512: each (row, head) attends to its keys in plain
// decoding's order, one fixed instruction sequence, so a row is bit-identical alone (a plain
// step) or inside a draft tree, whatever the tree and the thread count.
//
// Row i sees keys 0 .. L-1 (the committed context, cache slots 0 .. L-1) and then its
// ancestors and itself (cache slots L + anc[i][0 .. na[i]-1], root first). Per (row, head):
//   s_j = (q . k_j) * scale   fp32: vdpbf16ps over head_dim in 32-wide chunks, 16 keys at a
//                              time, lanes added in reduce16's fixed tree
//   m = max s_j; e_j = exp(s_j - m) (exp512, our own polynomial); d = sum e_j (16 lanes in
//   key order, then the fixed tree); out = (sum_j e_j v_j) / d, fp32 in key order, one round
//   to bf16.
#include <omp.h>
#include <stdlib.h>

#include "common.h"

int attn_amx_serves(int hd, int g);
int64_t attn_amx_work(const int64_t *na, const int64_t *anc, int64_t anc_stride, int n, int64_t L, int nh, int kvh,
                      int nthreads);
void attention_amx_team(const uint16_t *q, int64_t qs_row, int64_t qs_head, const uint16_t *k, const uint16_t *v,
                        int64_t kv_head, int64_t kv_pos, const int64_t *anc, int64_t anc_stride, const int64_t *na,
                        uint16_t *out, int n, const int *rows, int nr, int nh, int kvh, int64_t L, float scale,
                        float *work);
int64_t attn_amx_min_keys(int64_t keys);
void amx_end(void);
int64_t attention_work_per_thread(const int64_t *na, const int64_t *anc, int64_t anc_stride, int n, int64_t L, int nh,
                                  int kvh, int hd, int nthreads);
static int64_t score_cap(const int64_t *na, int n, int64_t L);


// p @ V for tn heads x cn value vectors (16 lanes each, tn * cn <= 16, cn even) over keys
// 0 .. count-1: o[t * cn + c] += e_t[j] * v_j[...] in key order (s: tn rows of e, `cap` apart).
// Each 32 values of a value row become two fp32 vectors in one instruction each: c = 2p holds
// the even elements of values 32p .. 32p + 31 (c0 included), c = 2p + 1 the odd ones (pv_out
// puts them back in order). Always inlined, so the calls with constant shapes below get their
// accumulators in registers.
static inline __attribute__((always_inline)) void pv(int tn, int cn, __m512 *o, const float *s, int64_t cap,
                                                     const uint16_t *vh, int64_t kv_pos, int c0, int64_t count,
                                                     int64_t L, const int64_t *anc_row) {
    const __m512i odd = _mm512_set1_epi32((int)0xFFFF0000);
    __m512 acc[16];
    for (int a = 0; a < tn * cn; a++) acc[a] = o[a];
    for (int64_t j = 0; j < count; j++) {
        const uint16_t *vr = vh + key_slot(j, L, anc_row) * kv_pos + 16 * c0;
        __m512 vv[16];
        for (int c = 0; c < cn; c += 2) {  // exact: a bf16 is the top half of its fp32
            __m512i z = _mm512_loadu_si512(vr + 16 * c);
            vv[c] = _mm512_castsi512_ps(_mm512_slli_epi32(z, 16));
            vv[c + 1] = _mm512_castsi512_ps(_mm512_and_si512(z, odd));
        }
        for (int t = 0; t < tn; t++) {
            __m512 e = _mm512_set1_ps(s[t * cap + j]);
            for (int c = 0; c < cn; c++) acc[t * cn + c] = _mm512_fmadd_ps(e, vv[c], acc[t * cn + c]);
        }
    }
    for (int a = 0; a < tn * cn; a++) o[a] = acc[a];
}

// pv's even / odd accumulators of 32 values -> the 32 values in order, bf16, at dst.
static inline void pv_out(__m512 even, __m512 odd, __m512 iv, uint16_t *dst) {
    const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    __m512 a = _mm512_mul_ps(even, iv), b = _mm512_mul_ps(odd, iv);
    _mm256_storeu_si256((__m256i *)dst, to_bf16x16(_mm512_permutex2var_ps(a, lo, b)));
    _mm256_storeu_si256((__m256i *)(dst + 16), to_bf16x16(_mm512_permutex2var_ps(a, hi, b)));
}

// One head's scores s[0 .. count), their lane maxima vmax -> e_j = exp(s_j - max) in place; returns 1 / sum e_j
// (16 lanes in key order, then reduce16's tree).
static inline __attribute__((always_inline)) float softmax_in_place(float *s, int64_t count, __m512 vmax) {
    __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
    __m512 dsum = _mm512_setzero_ps();
    for (int64_t j0 = 0; j0 < count; j0 += 16) {
        __mmask16 valid = count - j0 >= 16 ? 0xFFFF : (__mmask16)((1u << (count - j0)) - 1u);
        __m512 e = _mm512_maskz_mov_ps(valid, exp512(_mm512_sub_ps(_mm512_loadu_ps(s + j0), m)));
        _mm512_storeu_ps(s + j0, e);
        dsum = _mm512_add_ps(dsum, e);
    }
    return 1.0f / hsum16(dsum);
}

#ifdef EAGLE_AVX2
// AVX2, head_dim 64: the scores of tn query heads (tn <= QK_HEADS, the g heads of one kv head) in one sweep
// over the keys: each key row is loaded and split into its even and odd fp32 halves once for all of them
// (vdpbf16ps's emulation splits both operands at every call), then per head and lane the instruction's two
// fused steps in its order (odd products, then even), chunk after chunk: the bits the generic loop below
// gives each head alone. Then per head reduce16's tree, the scale, the mask: row t's scores at s + t * cap.
#define QK_HEADS 4
static void qk_shared(const uint16_t *q, int64_t qs_head, int tn, const uint16_t *kh, int64_t kv_pos,
                      int64_t count, int64_t L, const int64_t *anc_row, float scale, float *s, int64_t cap) {
    const __m256i odd = _mm256_set1_epi32((int)0xFFFF0000u);
    __m256 qe[QK_HEADS][4], qo[QK_HEADS][4];  // head t, chunk c half h -> [t][2 c + h]
    for (int t = 0; t < tn; t++)
        for (int v = 0; v < 4; v++) {
            __m256i z = _mm256_loadu_si256((const __m256i *)(q + t * qs_head + 16 * v));
            qe[t][v] = _mm256_castsi256_ps(_mm256_slli_epi32(z, 16));
            qo[t][v] = _mm256_castsi256_ps(_mm256_and_si256(z, odd));
        }
    for (int64_t j0 = 0; j0 < count; j0 += 16) {
        __m512 acc[QK_HEADS][16];
        for (int u = 0; u < 16; u++) {
            int64_t j = j0 + u, slot = j < count ? key_slot(j, L, anc_row) : 0;
            const uint16_t *kr = kh + slot * kv_pos;
            __m256 ke[4], ko[4];
            for (int v = 0; v < 4; v++) {
                __m256i z = _mm256_loadu_si256((const __m256i *)(kr + 16 * v));
                ke[v] = _mm256_castsi256_ps(_mm256_slli_epi32(z, 16));
                ko[v] = _mm256_castsi256_ps(_mm256_and_si256(z, odd));
            }
            for (int t = 0; t < tn; t++) {
                __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
                for (int c = 0; c < 2; c++) {  // vdpbf16ps on chunk c: lanes 0-7 from half 2c, 8-15 from 2c + 1
                    lo = _mm256_fmadd_ps(qe[t][2 * c], ke[2 * c], _mm256_fmadd_ps(qo[t][2 * c], ko[2 * c], lo));
                    hi = _mm256_fmadd_ps(qe[t][2 * c + 1], ke[2 * c + 1], _mm256_fmadd_ps(qo[t][2 * c + 1], ko[2 * c + 1], hi));
                }
                acc[t][u] = PS(lo, hi);
            }
        }
        __mmask16 valid = count - j0 >= 16 ? 0xFFFF : (__mmask16)((1u << (count - j0)) - 1u);
        for (int t = 0; t < tn; t++) {
            __m512 sv = _mm512_mul_ps(in_order16(reduce16(acc[t])), _mm512_set1_ps(scale));
            _mm512_storeu_ps(s + t * cap + j0, _mm512_mask_blend_ps(valid, _mm512_set1_ps(-INFINITY), sv));
        }
    }
}

// One head's scores s[0 .. count) (-inf past count, to the next 16) -> e_j = exp(s_j - max) in place, and 1 / sum
// e_j at inv; the scores' lane maxima as attention_team's own loop gathers them, then softmax_in_place.
static void softmax_row(float *s, int64_t count, float *inv) {
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    for (int64_t j0 = 0; j0 < count; j0 += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(s + j0));
    *inv = softmax_in_place(s, count, vmax);
}
#endif

// q (n, nh, hd) with strides (qs_row, qs_head); k, v (kvh, T, hd) with strides (kv_head, kv_pos);
// anc (n, anc_stride) int64 cache-slot offsets past L; na (n,) counts; out (n, nh, hd) contiguous.
// One task per (row, kv head): its g query heads share each key and value row, so a value row
// is converted to fp32 once for all of them (GQA), while every (row, head) still takes its own
// fixed sequence of operations (the same bits as one head at a time). Where that leaves fewer
// tasks than twice the team (a plain step's one row: 3 kv heads on 2 threads, one of them idle a
// third of the time), one task per (row, head) instead: the same bits, spread evenly.
//
// One team's share of the (row, kv head) units; call from every thread of a parallel region (or
// alone). work: the team's attention_work_per_thread floats per thread, per_thread apart (the vector
// kernel's: a thread's own g rows of cap >= L + max(na) + 16 scores, then g sums). Where this machine
// runs attention on AMX tiles (attn_amx_serves: by head_dim and heads per kv head), the rows with at
// least attn_amx_min_keys(-1) keys go there (a row's kernel follows from its own key count, never
// from the rows beside it: csrc/attention_amx.c).
void attention_team(const uint16_t *q, int64_t qs_row, int64_t qs_head, const uint16_t *k, const uint16_t *v,
                    int64_t kv_head, int64_t kv_pos, const int64_t *anc, int64_t anc_stride, const int64_t *na,
                    uint16_t *out, int n, int nh, int kvh, int hd, int64_t L, float scale, float *work,
                    int64_t per_thread) {
    int g = nh / kvh, chunks = hd / 32, ov = hd / 16;
    int vrows[n], arows[n], nv = 0, nr = 0;  // rows for the vector kernel, for the tiles
    int64_t from = attn_amx_serves(hd, g) ? attn_amx_min_keys(-1) : INT64_MAX;
    for (int i = 0; i < n; i++) {
        if (L + na[i] >= from) arows[nr++] = i;
        else vrows[nv++] = i;
    }
    if (nr) attention_amx_team(q, qs_row, qs_head, k, v, kv_head, kv_pos, anc, anc_stride, na, out, n, arows, nr, nh,
                               kvh, L, scale, work);
    if (!nv) return;
    int64_t cap = score_cap(na, n, L);
    float *s = work + omp_get_thread_num() * per_thread, *inv = s + g * cap;
#ifdef EAGLE_AVX2
    // Each thread an even share of the (row, head) pairs, in order; within it a kv head's heads are one task
    // (qk_shared reads each key once for all of them, pv each value). A plain step's row: heads 0-3 and 4-8
    // (kv heads {0}, {1} and {1}, {2} on two threads), where whole kv heads would give one thread two of three.
    int64_t pairs = (int64_t)nv * nh, nt = omp_get_num_threads(), me = omp_get_thread_num(), p1 = pairs * (me + 1) / nt;
    {
        for (int64_t p = pairs * me / nt; p < p1;) {
            int i = vrows[p / nh], h0 = (int)(p % nh), kh_i = h0 / g;
            int hg = g > QK_HEADS ? 1 : (int)((kh_i + 1) * g - h0 < p1 - p ? (kh_i + 1) * g - h0 : p1 - p);
            int gb = hg < 8 ? hg : 8, cc = (16 / gb < ov ? 16 / gb : ov) & ~1;  // heads x value vectors per p @ V pass
            p += hg;
#else
    int hg = nv * kvh >= 2 * omp_get_num_threads() ? g : 1;  // query heads per task
    int gb = hg < 8 ? hg : 8, cc = (16 / gb < ov ? 16 / gb : ov) & ~1;  // heads x value vectors per p @ V pass, <= 16
    {
#pragma omp for schedule(static)
        for (int unit = 0; unit < nv * (nh / hg); unit++) {
            int i = vrows[unit / (nh / hg)], h0 = unit % (nh / hg) * hg, kh_i = h0 / g;
#endif
            int64_t count = L + na[i];
            const uint16_t *kh = k + kh_i * kv_head, *vh = v + kh_i * kv_head;
#ifdef EAGLE_AVX2
            if (chunks == 2) qk_shared(q + i * qs_row + h0 * qs_head, qs_head, hg, kh, kv_pos, count, L,
                                       anc + i * anc_stride, scale, s, cap);
#endif
            for (int t = 0; t < hg; t++) {
                int h = h0 + t;
                float *st = s + t * cap;
#ifdef EAGLE_AVX2
                if (chunks == 2) {  // scores written by qk_shared: the softmax below
                    softmax_row(st, count, inv + t);
                    continue;
                }
#endif
                const uint16_t *qv = q + i * qs_row + h * qs_head;
                __m512bh qc[8];
                for (int c = 0; c < chunks; c++) qc[c] = AS_BH(_mm512_loadu_si512(qv + 32 * c));
                // scores, 16 keys at a time; key slots past `count` point at slot 0 and are masked
                __m512 vmax = _mm512_set1_ps(-INFINITY);
                for (int64_t j0 = 0; j0 < count; j0 += 16) {
                    __m512 acc[16];
                    for (int u = 0; u < 16; u++) {
                        int64_t j = j0 + u, slot = j < count ? key_slot(j, L, anc + i * anc_stride) : 0;
                        const uint16_t *kr = kh + slot * kv_pos;
                        __m512 a = _mm512_setzero_ps();
                        for (int c = 0; c < chunks; c++) a = _mm512_dpbf16_ps(a, qc[c], AS_BH(_mm512_loadu_si512(kr + 32 * c)));
                        acc[u] = a;
                    }
                    __m512 sv = _mm512_mul_ps(in_order16(reduce16(acc)), _mm512_set1_ps(scale));
                    __mmask16 valid = count - j0 >= 16 ? 0xFFFF : (__mmask16)((1u << (count - j0)) - 1u);
                    sv = _mm512_mask_blend_ps(valid, _mm512_set1_ps(-INFINITY), sv);
                    _mm512_storeu_ps(st + j0, sv);
                    vmax = _mm512_max_ps(vmax, sv);
                }
                inv[t] = softmax_in_place(st, count, vmax);
            }
            // out = sum_j e_j v_j, key order, fp32: up to 16 accumulators (heads x value vectors) a pass
            for (int t0 = 0; t0 < hg; t0 += gb) {
                int tn = hg - t0 < gb ? hg - t0 : gb;
                for (int c0 = 0; c0 < ov; c0 += cc) {
                    int cn = ov - c0 < cc ? ov - c0 : cc;
                    __m512 o[16];
                    for (int a = 0; a < tn * cn; a++) o[a] = _mm512_setzero_ps();
                    const float *e0 = s + t0 * cap;
                    const int64_t *ar = anc + i * anc_stride;
                    // constant shapes: SmolLM2 (3 heads per kv head, head_dim 64), Llama-3.1-8B (4, 128:
                    // two passes), Vicuna / Llama-2 7B (no GQA, 128), and the other small ones
                    if (tn == 3 && cn == 4) pv(3, 4, o, e0, cap, vh, kv_pos, c0, count, L, ar);
                    else if (tn == 4 && cn == 4) pv(4, 4, o, e0, cap, vh, kv_pos, c0, count, L, ar);
                    else if (tn == 2 && cn == 4) pv(2, 4, o, e0, cap, vh, kv_pos, c0, count, L, ar);
                    else if (tn == 2 && cn == 8) pv(2, 8, o, e0, cap, vh, kv_pos, c0, count, L, ar);
                    else if (tn == 1 && cn == 4) pv(1, 4, o, e0, cap, vh, kv_pos, c0, count, L, ar);
                    else if (tn == 1 && cn == 8) pv(1, 8, o, e0, cap, vh, kv_pos, c0, count, L, ar);
                    else if (tn == 1 && cn == 16) pv(1, 16, o, e0, cap, vh, kv_pos, c0, count, L, ar);
                    else pv(tn, cn, o, e0, cap, vh, kv_pos, c0, count, L, ar);  // the same sums, not unrolled
                    for (int t = 0; t < tn; t++) {
                        uint16_t *dst = out + ((int64_t)i * nh + h0 + t0 + t) * hd + 16 * c0;
                        __m512 iv = _mm512_set1_ps(inv[t0 + t]);
                        for (int c = 0; c < cn; c += 2) pv_out(o[t * cn + c], o[t * cn + c + 1], iv, dst + 16 * c);
                    }
                }
            }
        }
    }
#ifdef EAGLE_AVX2
#pragma omp barrier  // as the worksharing loop ends elsewhere: every row's output written
#endif
}

// The score rows' length every row of this call fits in.
static int64_t score_cap(const int64_t *na, int n, int64_t L) {
    int64_t most = 0;
    for (int i = 0; i < n; i++) most = na[i] > most ? na[i] : most;
    return L + most + 16;
}

// Alone, on its own team; 0, or -1 where the score buffers could not be had.
// ctypes: attention_bf16(ptr q, i64 qs_row, i64 qs_head, ptr k, ptr v, i64 kv_head, i64 kv_pos,
//                        ptr anc, i64 anc_stride, ptr na, ptr out, i32 n, i32 nh, i32 kvh, i32 hd,
//                        i64 L, f32 scale, i32 nthreads) -> i32
int attention_bf16(const uint16_t *q, int64_t qs_row, int64_t qs_head, const uint16_t *k, const uint16_t *v,
                   int64_t kv_head, int64_t kv_pos, const int64_t *anc, int64_t anc_stride, const int64_t *na,
                   uint16_t *out, int n, int nh, int kvh, int hd, int64_t L, float scale, int nthreads) {
    int64_t per = attention_work_per_thread(na, anc, anc_stride, n, L, nh, kvh, hd, nthreads);
    float *work = (float *)malloc((size_t)nthreads * per * sizeof(float));
    if (!work) return -1;
#pragma omp parallel num_threads(nthreads)
    {
        attention_team(q, qs_row, qs_head, k, v, kv_head, kv_pos, anc, anc_stride, na, out, n, nh, kvh, hd, L, scale,
                       work, per);
        amx_end();  // the tiles' state, where the AMX kernel served
    }
    free(work);
    return 0;
}

// One thread's work floats for a call on a team of nthreads: the vector kernel's g * cap + g, or
// the AMX kernel's need.
int64_t attention_work_per_thread(const int64_t *na, const int64_t *anc, int64_t anc_stride, int n, int64_t L, int nh,
                                  int kvh, int hd, int nthreads) {
    int g = nh / kvh;
    int64_t vec = g * score_cap(na, n, L) + g;
    if (!attn_amx_serves(hd, g)) return vec;
    int64_t amx = attn_amx_work(na, anc, anc_stride, n, L, nh, kvh, nthreads);
    return amx > vec ? amx : vec;
}
