// Gumbel noise keyed by (key, token id): sampling's randomness as a function of where the token
// goes and which token it is (core/decoding/gumbel.py), so plain sampling and tree verification
// read the same number for the same choice. Per id: h = mix64(key + (id + 1) * golden) (the
// splitmix64 finaliser, 64-bit lanes), u = (2 * (h >> 41) + 1) / 2^24 in (0, 1), exact in fp32,
// g = -log(-log u). core.decoding.gumbel.noise_reference computes the same hash in torch.
#include "common.h"

static inline __m512i mix64x8(__m512i z) {
    z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 30)), _mm512_set1_epi64((long long)0xBF58476D1CE4E5B9ULL));
    z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 27)), _mm512_set1_epi64((long long)0x94D049BB133111EBULL));
    return _mm512_xor_si512(z, _mm512_srli_epi64(z, 31));
}

// log x for positive normal x: x = 2^e m with m in (0.71, 1.42], log m = 2 atanh(s) for
// s = (m - 1) / (m + 1), |s| < 0.172, the series to s^9 (next term < 3e-9 relative).
static inline __m512 log512(__m512 x) {
    const __m512 one = _mm512_set1_ps(1.0f);
    __m512 m = _mm512_getmant_ps(x, _MM_MANT_NORM_1_2, _MM_MANT_SIGN_zero);  // [1, 2)
    __m512 e = _mm512_getexp_ps(x);
    __mmask16 big = _mm512_cmp_ps_mask(m, _mm512_set1_ps(1.41421356f), _CMP_GT_OQ);
    m = _mm512_mask_mul_ps(m, big, m, _mm512_set1_ps(0.5f));  // exact
    e = _mm512_mask_add_ps(e, big, e, one);
    __m512 s = _mm512_div_ps(_mm512_sub_ps(m, one), _mm512_add_ps(m, one));
    __m512 s2 = _mm512_mul_ps(s, s);
    __m512 p = _mm512_set1_ps(1.0f / 9.0f);
    p = _mm512_fmadd_ps(p, s2, _mm512_set1_ps(1.0f / 7.0f));
    p = _mm512_fmadd_ps(p, s2, _mm512_set1_ps(1.0f / 5.0f));
    p = _mm512_fmadd_ps(p, s2, _mm512_set1_ps(1.0f / 3.0f));
    p = _mm512_fmadd_ps(p, s2, one);
    __m512 logm = _mm512_mul_ps(_mm512_add_ps(s, s), p);
    return _mm512_fmadd_ps(e, _mm512_set1_ps(0.693147182f), logm);
}

// 8 ids -> their 23-bit draws (h >> 41), as int32 lanes
static inline __m256i draw8(__m512i key, __m512i id) {
    const __m512i golden = _mm512_set1_epi64((long long)0x9E3779B97F4A7C15ULL);
    __m512i z = _mm512_add_epi64(key, _mm512_mullo_epi64(_mm512_add_epi64(id, _mm512_set1_epi64(1)), golden));
    return _mm512_cvtepi64_epi32(_mm512_srli_epi64(mix64x8(z), 41));
}

// 16 ids (a: the first 8, b: the next 8) -> their Gumbel noise: u = (2q + 1) / 2^24 (exact), -log(-log u)
static inline __m512 gumbel16(__m512i key, __m512i a, __m512i b) {
    __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(draw8(key, a)), draw8(key, b), 1);
    __m512 u = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_add_epi32(q, q), _mm512_set1_epi32(1))),
                             _mm512_set1_ps(1.0f / 16777216.0f));
    return _mm512_sub_ps(_mm512_setzero_ps(), log512(_mm512_sub_ps(_mm512_setzero_ps(), log512(u))));
}

// out[i] = g(key, ids[i]) for i < n (ids NULL: the ids 0 .. n - 1).
// ctypes: gumbel_noise(i64 key, ptr ids, ptr out, i64 n) -> void
void gumbel_noise(int64_t key, const int64_t *ids, float *out, int64_t n) {
    const __m512i k = _mm512_set1_epi64(key);
    const __m512i lane = _mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7);
    for (int64_t i = 0; i < n; i += 16) {
        int64_t left = n - i;
        __mmask16 valid = left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1u);
        __m512i a, b;
        if (ids) {
            a = _mm512_maskz_loadu_epi64((__mmask8)(valid & 0xFF), ids + i);
            b = _mm512_maskz_loadu_epi64((__mmask8)(valid >> 8), ids + i + 8);
        } else {
            a = _mm512_add_epi64(lane, _mm512_set1_epi64(i));
            b = _mm512_add_epi64(lane, _mm512_set1_epi64(i + 8));
        }
        _mm512_mask_storeu_ps(out + i, valid, gumbel16(k, a, b));
    }
}

// Candidates gathered for one gumbel16: their ids (increasing) and values, and each lane's best so far.
typedef struct {
    int64_t ids[16];
    float vals[16];
    int count;
    __m512 best;
    __m512i best_i;
} gumbel_pick;

// Score the gathered candidates (fewer than 16: the rest masked off) and keep each lane's first maximum.
static inline void pick_flush(gumbel_pick *p, __m512i key) {
    __mmask16 live = p->count == 16 ? 0xFFFF : (__mmask16)((1u << p->count) - 1u);
    __m512i a = _mm512_maskz_loadu_epi64((__mmask8)(live & 0xFF), p->ids);
    __m512i b = _mm512_maskz_loadu_epi64((__mmask8)(live >> 8), p->ids + 8);
    __m512 s = _mm512_add_ps(_mm512_maskz_loadu_ps(live, p->vals), gumbel16(key, a, b));
    __mmask16 take = live & _mm512_cmp_ps_mask(s, p->best, _CMP_GT_OQ);  // strictly greater: a lane's first
    int32_t i32[16];
    for (int j = 0; j < 16; j++) i32[j] = j < p->count ? (int32_t)p->ids[j] : 0;
    p->best = _mm512_mask_mov_ps(p->best, take, s);
    p->best_i = _mm512_mask_mov_epi32(p->best_i, take, _mm512_loadu_si512(i32));
    p->count = 0;
}

// A token can win only if its value plus its noise reaches the score of the row's first largest value
// (top + its noise, s0), and no noise exceeds GUMBEL_MAX (u <= 1 - 2^-24: -log(-log u) = 16.6355):
// so only values >= s0 - GUMBEL_MAX - slack need noise. The slack covers the two roundings of a score
// (0.1, and 2^-20 of s0 where the values are large); never looser than top - reach.
#define GUMBEL_MAX 16.64f
static inline float score_floor(float top, int64_t top_id, __m512i key, float reach) {
    __m512i id = _mm512_set1_epi64(top_id);
    float s0 = top + _mm512_cvtss_f32(gumbel16(key, id, id));
    float floor_ = s0 - GUMBEL_MAX - 0.1f - fabsf(s0) * 0x1p-20f;
    return floor_ > top - reach ? floor_ : top - reach;
}

// Values i .. i + 15 of a row (valid lanes; the rest 0): x's, or the bf16 logits divided by t
// (IEEE division, as torch's `logits.float() / temperature`).
static inline __m512 row_block(const float *x, const uint16_t *logits, __m512 t, int64_t i, __mmask16 valid) {
    return logits ? _mm512_div_ps(bf16x16_to_ps_masked(logits + i, valid), t) : _mm512_maskz_loadu_ps(valid, x + i);
}

// gumbel_argmax and gumbel_argmax_bf16: the row is x, or logits / temperature.
static int64_t gumbel_argmax_row(const float *x, const uint16_t *logits, float temperature, int64_t n, int64_t key,
                                 float reach) {
    const __m512 t = _mm512_set1_ps(temperature);
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 valid = n - i >= 16 ? 0xFFFF : (__mmask16)((1u << (n - i)) - 1u);
        vmax = _mm512_mask_max_ps(vmax, valid, vmax, row_block(x, logits, t, i, valid));
    }
    float top = _mm512_reduce_max_ps(vmax);
    if (!(top > -INFINITY)) return -1;
    int64_t top_id = 0;  // the first largest value (the same division, lane by lane)
    while ((logits ? from_bf16(logits[top_id]) / temperature : x[top_id]) != top) top_id++;
    const __m512i k = _mm512_set1_epi64(key);
    const __m512 floor_ = _mm512_set1_ps(score_floor(top, top_id, k, reach));
    gumbel_pick p;
    p.count = 0;
    p.best = _mm512_set1_ps(-INFINITY);
    p.best_i = _mm512_set1_epi32(0x7fffffff);
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 valid = n - i >= 16 ? 0xFFFF : (__mmask16)((1u << (n - i)) - 1u);
        __m512 v = row_block(x, logits, t, i, valid);
        unsigned cand = valid & _mm512_cmp_ps_mask(v, floor_, _CMP_GE_OQ);
        if (!cand) continue;
        float lanes[16];
        _mm512_storeu_ps(lanes, v);
        for (; cand; cand &= cand - 1) {
            int lane = __builtin_ctz(cand);
            p.ids[p.count] = i + lane;
            p.vals[p.count] = lanes[lane];
            if (++p.count == 16) pick_flush(&p, k);
        }
    }
    if (p.count) pick_flush(&p, k);
    float m = _mm512_reduce_max_ps(p.best);
    __mmask16 at = _mm512_cmp_ps_mask(p.best, _mm512_set1_ps(m), _CMP_EQ_OQ);
    return _mm512_mask_reduce_min_epi32(at, p.best_i);
}

// The Gumbel-max over one row: argmax_i x[i] + g(key, i), the first maximum, for x (n,) fp32
// (-inf: dropped). Only tokens within `reach` of the row's largest x can win (the noise is bounded:
// core/decoding/gumbel.py, REACH), and of those only the ones score_floor keeps: the others get no
// noise. The candidates are gathered 16 at a time, in increasing id order, and each set draws its
// noise in one gumbel16: a row's few hundred candidates lie scattered over as many blocks of 16 ids,
// and noise for every lane of those blocks cost the AVX2 VM 0.22 ms a row. A lane's noise depends on
// its id alone, so every score is the same number either way, and so is the first maximum. -1 when
// no token is finite.
// ctypes: gumbel_argmax(ptr x, i64 n, i64 key, f32 reach) -> i64
int64_t gumbel_argmax(const float *x, int64_t n, int64_t key, float reach) {
    return gumbel_argmax_row(x, NULL, 1.0f, n, key, reach);
}

// gumbel_argmax over logits / temperature, read from bf16 logits (n,) as they leave the LM head: each
// value float(logits[i]) / temperature, IEEE division as torch's `logits.float() / temperature`
// (core.decoding.gumbel.shaped_logits without top-k or top-p), so the same draw, without the two fp32
// copies of the row. -1 when no token is finite.
// ctypes: gumbel_argmax_bf16(ptr logits, i64 n, i64 key, f32 temperature, f32 reach) -> i64
int64_t gumbel_argmax_bf16(const uint16_t *logits, int64_t n, int64_t key, float temperature, float reach) {
    return gumbel_argmax_row(NULL, logits, temperature, n, key, reach);
}
