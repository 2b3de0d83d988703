// Decoding attention on AMX bf16 tiles (head_dim 64) for the rows with at least attn_amx_min keys,
// plain steps, tree verification and the head's rounds alike (attention_team sends a row here by
// the machine, the shape and the row's own key count, never by the rows beside it).
//
// Why: the vector kernel (attention_bf16.c) spends ~10 thread cycles per (row, query head, key):
// two vdpbf16ps, a lane reduction, exp, four FMAs of p @ V. Here the query heads of one kv head
// and the rows of a call (up to 16 queries) share every tile product: one TDPBF16PS scores 16
// keys against all of them over 32 dims, one multiplies 32 keys' p into 16 value dims for all.
//
// Per (row i, query head h), query m of its task (up to 16 / g rows of one kv head):
//   scores  s_j = (q . k_slot) * scale: S^T = K Q^T on tiles, K straight from the cache (16 slots
//           a tile, 32 dims each of two A tiles), Q^T packed in pairs of dims (the B tile), then
//           each 16 x 16 block transposed to a row of scores per query. Each score is one
//           accumulation chain over the 64 dims that reads only its key row and its query column,
//           so it is the same whichever slot or tile column it has.
//   softmax m = max_j s_j over the row's keys in logical order (the context 0 .. L-1, then its
//           ancestors and itself); p_j = bf16(exp(s_j - m)); d = sum p_j (16 lanes in logical key
//           order, reduce16's tree).
//   p @ V   O = sum_j p_j v_j on tiles, 32 logical keys a product (A: p of the 32 keys, B: their
//           value rows packed in pairs of keys), blocks in logical order from key 0. Blocks wholly
//           inside the context are shared by every query of the task; the rest (the tree's part)
//           are gathered per row in logical order (absent keys: p = 0 and a zero value row). A
//           product's element reads only its query's p row and one value column, so a row's O
//           is the same alone or beside other rows, and its blocks hold the same keys at the same
//           places whether its keys sit in a tree's slots or in plain decoding's. (The tiles' sums
//           depend on where each product sits: measured, a zero moved inside a block changes the
//           result, so logical blocks are what makes this exact, not zeros.)
//   out     bf16(O * (1 / d)).
// Keys go in segments of SEG logical keys from key 0, a task each (kv head, up to 16 / g rows,
// segment), so one row's long context spreads over the team; where a row has several, each keeps
// its own max m_s and sum d_s, and the merge takes M = max m_s, O = sum O_s e^(m_s - M), d = sum
// d_s e^(m_s - M) in segment order (from 0 with fused multiply-adds: one segment is left as it is).
// So a token's row is bit-identical alone (a plain step) or inside any tree, at any thread count.
// The numbers differ from the vector kernel's (the tile's own summation, p rounded to bf16 for the
// product as bf16 attention does): a row's kernel follows from its key count alone.
#include <omp.h>
#include <stdlib.h>

#include "common.h"

int amx_serves(int N, int K);
void amx_begin(void);
void amx_config(const int rows[8], const int colsb[8]);

static int attn_amx = 0;
static int64_t attn_amx_min = 256;  // a row's keys (its context and its ancestors) from which tiles serve it

// Where AMX attention serves at all, from how many keys a row is computed on tiles (keys >= 0: set
// it first). A row's kernel depends on its own key count only, as its bits must: the same token has
// the same count alone (a plain step) or in a tree. Below it the vector kernel is faster: using the
// tiles at all slows the cores (measured: one tile product per layer made a one-row forward at 128
// keys 10-25% slower), which attention's saving pays for only over a longer context.
// ctypes: attn_amx_min_keys(i64 keys) -> i64
int64_t attn_amx_min_keys(int64_t keys) {
    if (keys >= 0) attn_amx_min = keys;
    return attn_amx_min;
}

#ifndef __AMX_TILE__
int attn_amx_enable(int want) { (void)want; return 0; }
int attn_amx_serves(int hd, int g) { (void)hd; (void)g; return 0; }
int64_t attn_amx_work(const int64_t *na, const int64_t *anc, int64_t anc_stride, int n, int64_t L, int nh, int kvh,
                      int nthreads) {
    (void)na; (void)anc; (void)anc_stride; (void)n; (void)L; (void)nh; (void)kvh; (void)nthreads;
    return 0;
}
void attention_amx_team(const uint16_t *q, int64_t qs_row, int64_t qs_head, const uint16_t *k, const uint16_t *v,
                        int64_t kv_head, int64_t kv_pos, const int64_t *anc, int64_t anc_stride, const int64_t *na,
                        uint16_t *out, int n, const int *rows, int nr, int nh, int kvh, int64_t L, float scale,
                        float *work) {
    (void)rows; (void)nr; (void)q; (void)qs_row; (void)qs_head; (void)k; (void)v; (void)kv_head; (void)kv_pos;
    (void)anc;
    (void)anc_stride; (void)na; (void)out; (void)n; (void)nh; (void)kvh; (void)L; (void)scale; (void)work;
}
#else

// Tiles on (the GEMM's tile state granted and on); off: the vector kernel serves every shape.
// ctypes: attn_amx_enable(i32 want) -> i32
int attn_amx_enable(int want) {
    attn_amx = want != 0 && amx_serves(16, 32);
    return attn_amx;
}

int attn_amx_serves(int hd, int g) { return attn_amx && hd == 64 && g >= 1 && g <= 16; }

// Scores, two blocks of 16 slots at a time: tiles 0-1 and 5-6 K (16 slots x 32 dims), 2-3 Q^T
// (16 dim pairs x N queries), 4 and 7 S^T (16 x N).
static void config_scores(int N) {
    const int rows[8] = {16, 16, 16, 16, 16, 16, 16, 16}, colsb[8] = {64, 64, 4 * N, 4 * N, 4 * N, 64, 64, 4 * N};
    amx_config(rows, colsb);
}

// p @ V for M queries: tile 0 P (M x 32 keys), 1-4 O (M x 16 dims each), 5-7 V (16 key pairs x 16 dims).
static void config_pv(int M) {
    const int rows[8] = {M, M, M, M, M, 16, 16, 16}, colsb[8] = {64, 64, 64, 64, 64, 64, 64, 64};
    amx_config(rows, colsb);
}

// The cache slots a call's rows read past L: 1 + the largest ancestor offset.
static int64_t tree_slots(const int64_t *na, const int64_t *anc, int64_t anc_stride, int n) {
    int64_t most = 0;
    for (int i = 0; i < n; i++)
        for (int64_t a = 0; a < na[i]; a++) {
            int64_t slot = anc[i * anc_stride + a] + 1;
            most = slot > most ? slot : most;
        }
    return most;
}

static int64_t most_keys(const int64_t *na, int n, int64_t L) {
    int64_t most = 0;
    for (int i = 0; i < n; i++) most = L + na[i] > most ? L + na[i] : most;
    return most;
}

enum { QMAX = 16, SEG = 512 };  // queries a task holds; keys a segment holds (a multiple of 32)

// One call's shape for the tiles. A row's keys split into segments of SEG logical keys (0 .. SEG - 1,
// SEG .. 2 SEG - 1, ...): a task scores, weighs and sums one segment for up to 16 / g rows of one kv
// head, so a long context spreads over the team whatever the rows; a row's segments then merge.
typedef struct {
    int g, per, groups, segs;  // heads per kv head, rows per task, row groups (of all n), segments of the longest row
    int64_t L, tree, ss;       // context, tree slots past it, a task's score row length
} shape;

static shape shape_of(const int64_t *na, const int64_t *anc, int64_t anc_stride, int n, int64_t L, int nh, int kvh) {
    shape c;
    c.g = nh / kvh;
    c.per = QMAX / c.g;
    c.groups = (n + c.per - 1) / c.per;
    c.L = L;
    c.tree = tree_slots(na, anc, anc_stride, n);
    c.segs = (int)((most_keys(na, n, L) + SEG - 1) / SEG);
    c.ss = SEG + (c.tree + 31) / 32 * 32;
    return c;
}

enum { FIXED = 512 /* qt */ + 1024 /* vb */ + 1024 /* o */ + 16 /* inv */ + 1024 /* kz */ + 512 /* stage */ + 128 };
static int64_t private_floats(const shape *c) { return QMAX * c->ss + QMAX * SEG / 2 + FIXED; }
// Where a row has more than one segment, each segment's partial result: O (64 floats), max, sum per query.
static int64_t partial_floats(const shape *c, int kvh) {
    return c->segs > 1 ? (int64_t)kvh * c->groups * c->segs * QMAX * 66 : 0;
}

// One thread's work floats on a team of nthreads (the partials spread over the team, then its own).
int64_t attn_amx_work(const int64_t *na, const int64_t *anc, int64_t anc_stride, int n, int64_t L, int nh, int kvh,
                      int nthreads) {
    shape c = shape_of(na, anc, anc_stride, n, L, nh, kvh);
    return (partial_floats(&c, kvh) + nthreads - 1) / nthreads + private_floats(&c);
}

// 16 x 16 fp32 in registers, transposed: r[i] lane j <-> r[j] lane i.
static inline void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
        r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xDD);
        t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xDD);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
        r[i + 4] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0x88);
        r[i + 12] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0xDD);
    }
}

// 16 slots' S^T block (stage, 16 x 16, N columns valid) -> rows of sq (query m: slots c .. c + 15).
static inline void scatter_scores(const float *stage, float *sq, int64_t ss, int64_t c, int N) {
    __m512 r[16];
    for (int u = 0; u < 16; u++) r[u] = _mm512_load_ps(stage + 16 * u);
    transpose16(r);
    for (int m = 0; m < N; m++) _mm512_storeu_ps(sq + m * ss + c, r[m]);
}

// Two value rows (64 dims each; NULL: zeros) -> row p of the four B tiles, keys interleaved:
// tile t holds dims {8l + r + 4 (t & 1) + 32 (t >> 1)}, l, r < 4, in that order (unpack's lanes).
static inline void pack_pair(const uint16_t *a, const uint16_t *b, uint16_t *vb, int p) {
    __m512i a0 = a ? _mm512_loadu_si512(a) : _mm512_setzero_si512(), a1 = a ? _mm512_loadu_si512(a + 32) : a0;
    __m512i b0 = b ? _mm512_loadu_si512(b) : _mm512_setzero_si512(), b1 = b ? _mm512_loadu_si512(b + 32) : b0;
    _mm512_store_si512(vb + 0 * 512 + 32 * p, _mm512_unpacklo_epi16(a0, b0));
    _mm512_store_si512(vb + 1 * 512 + 32 * p, _mm512_unpackhi_epi16(a0, b0));
    _mm512_store_si512(vb + 2 * 512 + 32 * p, _mm512_unpacklo_epi16(a1, b1));
    _mm512_store_si512(vb + 3 * 512 + 32 * p, _mm512_unpackhi_epi16(a1, b1));
}

// O (tiles 1-4) += P (rows at p, ps elements apart) x the packed values vb, config_pv's tiles.
static inline void pv_block(const uint16_t *p, int64_t ps, const uint16_t *vb) {
    _tile_loadd(0, p, ps * 2);
    _tile_loadd(5, vb, 64);
    _tile_dpbf16ps(1, 0, 5);
    _tile_loadd(6, vb + 512, 64);
    _tile_dpbf16ps(2, 0, 6);
    _tile_loadd(7, vb + 1024, 64);
    _tile_dpbf16ps(3, 0, 7);
    _tile_loadd(5, vb + 1536, 64);
    _tile_dpbf16ps(4, 0, 5);
}

static inline void o_load(const float *o) {
    _tile_loadd(1, o, 256); _tile_loadd(2, o + 16, 256); _tile_loadd(3, o + 32, 256); _tile_loadd(4, o + 48, 256);
}
static inline void o_store(float *o) {
    _tile_stored(1, o, 256); _tile_stored(2, o + 16, 256); _tile_stored(3, o + 32, 256); _tile_stored(4, o + 48, 256);
}

// A key or value row (64 bf16, two cache lines) on its way to L1, two blocks of 32 ahead of use
// (the cache is cold: every forward streams ~96 MB of weights between a layer's calls).
static inline void prefetch_row(const uint16_t *row) {
    _mm_prefetch((const char *)row, _MM_HINT_T0);
    _mm_prefetch((const char *)(row + 32), _MM_HINT_T0);
}

// 16 of query row sm's scores, scaled, for logical keys j0 .. j0 + 15 of segment [s0, ...): the
// context's at column j - s0, the tree's at tcol + its slot past L; -inf from `count` on.
static inline __m512 logical16(const float *sm, int64_t j0, int64_t count, int64_t s0, int64_t L, int64_t tcol,
                               const int64_t *ar, __m512 sc) {
    __mmask16 valid = count - j0 >= 16 ? 0xFFFF : (__mmask16)((1u << (count - j0)) - 1u);
    __m512 s;
    if (j0 + 16 <= L) s = _mm512_loadu_ps(sm + (j0 - s0));
    else {
        float t[16];
        for (int u = 0; u < 16; u++) {
            int64_t j = j0 + u;
            t[u] = j >= count ? 0.0f : j < L ? sm[j - s0] : sm[tcol + ar[j - L]];
        }
        s = _mm512_loadu_ps(t);
    }
    return _mm512_mask_blend_ps(valid, _mm512_set1_ps(-INFINITY), _mm512_mul_ps(s, sc));
}

// Scores of N queries (qt's tiles loaded) for slots [a, b) -> sq columns col + (slot - a), 32 at a
// time (the last through kz: the cache may end there).
static void score_run(const uint16_t *kh, int64_t kv_pos, int64_t a, int64_t b, float *sq, int64_t ss, int64_t col,
                      int N, uint16_t *kz, float *stage) {
    for (int64_t s0 = a; s0 < b; s0 += 32) {
        int64_t lda = kv_pos * 2;
        for (int64_t j = s0 + 64; j < s0 + 96 && j < b; j++) prefetch_row(kh + j * kv_pos);
        const uint16_t *ka = kh + s0 * kv_pos, *kb = ka + 16 * kv_pos;
        if (s0 + 32 > b) {
            memset(kz, 0, 32 * 64 * 2);
            for (int64_t j = s0; j < b; j++) memcpy(kz + (j - s0) * 64, kh + j * kv_pos, 128);
            ka = kz;
            kb = kz + 16 * 64;
            lda = 128;
        }
        _tile_zero(4);
        _tile_zero(7);
        _tile_loadd(0, ka, lda);
        _tile_loadd(1, ka + 32, lda);
        _tile_loadd(5, kb, lda);
        _tile_loadd(6, kb + 32, lda);
        _tile_dpbf16ps(4, 0, 2);
        _tile_dpbf16ps(7, 5, 2);
        _tile_dpbf16ps(4, 1, 3);
        _tile_dpbf16ps(7, 6, 3);
        _tile_stored(4, stage, 64);
        _tile_stored(7, stage + 256, 64);
        scatter_scores(stage, sq, ss, col + (s0 - a), N);
        scatter_scores(stage + 256, sq, ss, col + (s0 - a) + 16, N);
    }
}

// One task: kv head kh, rows rows[0 .. R - 1] (their g query heads each: N = R g queries), logical
// keys [s0, s0 + SEG) of each. part NULL (the call's rows have one segment): out = bf16(O / d);
// else the segment's O (dims in order), max and sum per query, at part + 66 m, for the merge.
static void task(const uint16_t *q, int64_t qs_row, int64_t qs_head, const uint16_t *kh, const uint16_t *vh,
                 int64_t kv_pos, const int64_t *anc, int64_t anc_stride, const int64_t *na, uint16_t *out, int nh,
                 int kh_i, const int *rows, int R, int64_t s0, const shape *c, float scale, float *part,
                 float *work) {
    int g = c->g, N = R * g, head0 = kh_i * g;  // query m: row rows[m / g], head head0 + m % g
    int64_t L = c->L, ss = c->ss, s1 = s0 + SEG;
    int64_t cend = s1 < L ? s1 : L, nctx = cend > s0 ? cend - s0 : 0, tcol = (nctx + 31) / 32 * 32;
    float *sq = work;                                 // (16, ss): context slots from s0, then the tree's at tcol
    uint16_t *pb = (uint16_t *)(sq + QMAX * ss);      // (16, SEG) bf16 p of keys s0 .. in logical order
    uint16_t *qt = pb + QMAX * SEG;                   // (2, 16, 16) dim pairs of Q^T
    uint16_t *vb = (uint16_t *)(((uintptr_t)(qt + 1024) + 63) & ~(uintptr_t)63);  // (4, 16, 32) values
    float *o = (float *)(vb + 2048);                  // (16, 64) O, tile column order
    float *inv = o + 1024;                            // (16,) 1 / d
    uint16_t *kz = (uint16_t *)(inv + 16);            // (32, 64) a run's last slots' keys, zero past its end
    float *stage = (float *)(kz + 2048);              // (2, 16, 16) two S^T blocks
    int64_t count[QMAX];
    int live = 0;
    for (int r = 0; r < R; r++) {
        count[r] = L + na[rows[r]];
        live |= count[r] > s0;
    }
    if (!live) return;

    // Q^T: qt[half][pair][m] = the dims (32 half + 2 pair, + 1) of query m
    for (int m = 0; m < N; m++) {
        const uint32_t *qm = (const uint32_t *)(q + (int64_t)rows[m / g] * qs_row + (int64_t)(head0 + m % g) * qs_head);
        for (int pr = 0; pr < 32; pr++) ((uint32_t *)qt)[(pr / 16) * 256 + (pr % 16) * 16 + m] = qm[pr];
    }
    config_scores(N);
    _tile_loadd(2, qt, 64);
    _tile_loadd(3, qt + 512, 64);
    score_run(kh, kv_pos, s0, s0 + nctx, sq, ss, 0, N, kz, stage);
    if (s1 > L) score_run(kh, kv_pos, L, L + c->tree, sq, ss, tcol, N, kz, stage);

    // softmax per query over its keys in this segment, logical order
    __m512 sc = _mm512_set1_ps(scale);
    for (int m = 0; m < N; m++) {
        int r = m / g;
        const int64_t *ar = anc + (int64_t)rows[r] * anc_stride;
        int64_t end = count[r] < s1 ? count[r] : s1;
        const float *sm = sq + m * ss;
        uint16_t *pm = pb + (int64_t)m * SEG;
        if (end <= s0) {
            memset(pm, 0, SEG * 2);
            continue;
        }
        __m512 vmax = _mm512_set1_ps(-INFINITY), dsum = _mm512_setzero_ps();
        for (int64_t j0 = s0; j0 < end; j0 += 16)
            vmax = _mm512_max_ps(vmax, logical16(sm, j0, end, s0, L, tcol, ar, sc));
        float mx = _mm512_reduce_max_ps(vmax);
        for (int64_t j0 = s0; j0 < s1; j0 += 16) {
            __m256i pv = _mm256_setzero_si256();
            if (j0 < end) {  // exp(-inf) = 0 past the row's keys
                pv = to_bf16x16(exp512(_mm512_sub_ps(logical16(sm, j0, end, s0, L, tcol, ar, sc), _mm512_set1_ps(mx))));
                dsum = _mm512_add_ps(dsum, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(pv), 16)));
            }
            _mm256_storeu_si256((__m256i *)(pm + (j0 - s0)), pv);
        }
        float d = hsum16(dsum);
        inv[m] = 1.0f / d;
        if (part) {
            part[66 * m + 64] = mx;
            part[66 * m + 65] = d;
        }
    }

    // p @ V: the blocks wholly inside the context for all N queries, then each row's own blocks
    int64_t shared = L / 32 * 32 < s1 ? L / 32 * 32 : s1;
    config_pv(N);
    _tile_zero(1); _tile_zero(2); _tile_zero(3); _tile_zero(4);
    for (int64_t b0 = s0; b0 < shared; b0 += 32) {
        const uint16_t *vr = vh + b0 * kv_pos;
        for (int64_t j = b0 + 64; j < b0 + 96 && j < shared; j++) prefetch_row(vh + j * kv_pos);
        for (int p = 0; p < 16; p++) pack_pair(vr + 2 * p * kv_pos, vr + (2 * p + 1) * kv_pos, vb, p);
        pv_block(pb + (b0 - s0), SEG, vb);
    }
    o_store(o);
    if (N != g) config_pv(g);
    int64_t first = shared > s0 ? shared : s0;
    for (int r = 0; r < R; r++) {
        const int64_t *ar = anc + (int64_t)rows[r] * anc_stride;
        int64_t end = count[r] < s1 ? count[r] : s1;
        if (end <= first) continue;
        float *orow = o + (int64_t)r * g * 64;
        o_load(orow);
        for (int64_t b0 = first; b0 < end; b0 += 32) {
            for (int p = 0; p < 16; p++) {
                int64_t j = b0 + 2 * p;
                const uint16_t *a = j < end ? vh + key_slot(j, L, ar) * kv_pos : NULL;
                const uint16_t *b = j + 1 < end ? vh + key_slot(j + 1, L, ar) * kv_pos : NULL;
                pack_pair(a, b, vb, p);
            }
            pv_block(pb + (int64_t)r * g * SEG + (b0 - s0), SEG, vb);
        }
        o_store(orow);
    }

    // O in dim order: out = bf16(O / d), or the partial
    const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i hi = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int m = 0; m < N; m++) {
        if (count[m / g] <= s0) continue;
        const float *om = o + (int64_t)m * 64;
        __m512 iv = _mm512_set1_ps(inv[m]);
        uint16_t *dst = out + ((int64_t)rows[m / g] * nh + head0 + m % g) * 64;
        for (int half = 0; half < 2; half++) {
            __m512 t0 = _mm512_loadu_ps(om + 32 * half), t1 = _mm512_loadu_ps(om + 32 * half + 16);
            __m512 a = _mm512_permutex2var_ps(t0, lo, t1), b = _mm512_permutex2var_ps(t0, hi, t1);
            if (part) {
                _mm512_storeu_ps(part + 66 * m + 32 * half, a);
                _mm512_storeu_ps(part + 66 * m + 32 * half + 16, b);
            } else {
                _mm256_storeu_si256((__m256i *)(dst + 32 * half), to_bf16x16(_mm512_mul_ps(a, iv)));
                _mm256_storeu_si256((__m256i *)(dst + 32 * half + 16), to_bf16x16(_mm512_mul_ps(b, iv)));
            }
        }
    }
}

// A query's segments (k of them, `stride` floats apart as task leaves them) merged in order: M =
// the largest of their maxima; O = sum O_s e^(m_s - M), d = sum d_s e^(m_s - M) (fused multiply-adds
// from 0: one segment leaves O and d as they are, so such a row has the direct path's bits).
static void merge(const float *part, int64_t stride, int k, uint16_t *dst) {
    float M = -INFINITY;
    for (int s = 0; s < k; s++) M = part[s * stride + 64] > M ? part[s * stride + 64] : M;
    __m512 o[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    __m512 d = _mm512_setzero_ps();
    for (int s = 0; s < k; s++) {
        const float *ps = part + s * stride;
        __m512 f = exp512(_mm512_set1_ps(ps[64] - M));
        for (int v = 0; v < 4; v++) o[v] = _mm512_fmadd_ps(_mm512_loadu_ps(ps + 16 * v), f, o[v]);
        d = _mm512_fmadd_ps(_mm512_set1_ps(ps[65]), f, d);
    }
    __m512 iv = _mm512_set1_ps(1.0f / _mm512_cvtss_f32(d));
    for (int v = 0; v < 4; v++) _mm256_storeu_si256((__m256i *)(dst + 16 * v), to_bf16x16(_mm512_mul_ps(o[v], iv)));
}

// The team's share of the tasks (kv head, up to 16 / g of rows[0 .. nr - 1], segment), then, where
// a row has more than one segment, of the merges by query. work: the team's attention work (per
// thread attn_amx_work floats or more, the partials first). Leaves the GEMM's tile shapes configured
// (amx_begin).
void attention_amx_team(const uint16_t *q, int64_t qs_row, int64_t qs_head, const uint16_t *k, const uint16_t *v,
                        int64_t kv_head, int64_t kv_pos, const int64_t *anc, int64_t anc_stride, const int64_t *na,
                        uint16_t *out, int n, const int *rows, int nr, int nh, int kvh, int64_t L, float scale,
                        float *work) {
    shape c = shape_of(na, anc, anc_stride, n, L, nh, kvh);  // the layout attn_amx_work sized
    float *part = work, *mine = work + partial_floats(&c, kvh) + omp_get_thread_num() * private_floats(&c);
    mine = (float *)(((uintptr_t)mine + 63) & ~(uintptr_t)63);
    int per = c.per, groups = (nr + per - 1) / per, ran = 0;  // this call's row groups (of rows[])
#pragma omp for schedule(static)
    for (int unit = 0; unit < kvh * groups * c.segs; unit++) {
        int seg = unit % c.segs, grp = unit / c.segs % groups, kh_i = unit / c.segs / groups, first = grp * per;
        int R = nr - first < per ? nr - first : per;
        float *pp = c.segs > 1 ? part + (((int64_t)kh_i * c.groups + grp) * c.segs + seg) * QMAX * 66 : NULL;
        task(q, qs_row, qs_head, k + kh_i * kv_head, v + kh_i * kv_head, kv_pos, anc, anc_stride, na, out, nh, kh_i,
             rows + first, R, (int64_t)seg * SEG, &c, scale, pp, mine);
        ran = 1;
    }
    if (ran) amx_begin();
    if (c.segs > 1) {
#pragma omp for schedule(static)
        for (int u = 0; u < nr * nh; u++) {
            int pos = u / nh, h = u % nh, i = rows[pos], grp = pos / per, m = (pos % per) * c.g + h % c.g;
            int kh_i = h / c.g, segs = (int)((L + na[i] + SEG - 1) / SEG);
            merge(part + ((int64_t)kh_i * c.groups + grp) * c.segs * QMAX * 66 + 66 * m, QMAX * 66, segs,
                  out + ((int64_t)i * nh + h) * 64);
        }
    }
}
#endif
