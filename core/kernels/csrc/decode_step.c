// One forward of a Llama-family decoder over n new tokens, in one call: embedding, then per layer
// RMSNorm, q/k/v projections, rotary, the new keys and values written into the caller's cache,
// tree attention over the cache, output projection, residual, RMSNorm, gate/up, SiLU x up, down,
// residual; the final norm and the LM head. Plain steps (n = 1), tree verification (n rows, each
// seeing the committed context and its ancestors) and catch-ups all run this one function.
//
// Exact by construction: every stage is one of the row-invariant kernels (gemm_w on bf16 rows or
// GGUF blocks, rmsnorm_bf16, rotary_bf16, attention_bf16, silu_mul_bf16) or an elementwise bf16
// add, so a token's row computes the same bits alone or inside a tree. They are the kernels the
// transformers-driven path runs (core.invariant), with the same roundings between them, so the two
// paths give bit-identical logits (tests/test_step.py); this one skips ~2,000 Python and torch
// dispatches per forward.
#include <omp.h>
#include <stdlib.h>

#include "common.h"
#include "weights.h"

void rmsnorm_team(const uint16_t *x, int64_t ldx, const uint16_t *w, uint16_t *y, int64_t ldy, int M, int H,
                  float eps);
void rotary_bf16(const uint16_t *x, int64_t ldx, const uint16_t *cos, const uint16_t *sin, int64_t ldc,
                 uint16_t *out, int n, int heads, int hd);
void attention_team(const uint16_t *q, int64_t qs_row, int64_t qs_head, const uint16_t *k, const uint16_t *v,
                    int64_t kv_head, int64_t kv_pos, const int64_t *anc, int64_t anc_stride, const int64_t *na,
                    uint16_t *out, int n, int nh, int kvh, int hd, int64_t L, float scale, float *work,
                    int64_t per_thread);
int64_t attention_work_per_thread(const int64_t *na, const int64_t *anc, int64_t anc_stride, int n, int64_t L, int nh,
                                  int kvh, int hd, int nthreads);
void argmax_bf16(const uint16_t *x, int64_t ldx, int64_t *out, int M, int N, int nthreads);
void silu_mul_team(const uint16_t *g, int64_t ldg, const uint16_t *u, int64_t ldu, uint16_t *out, int64_t ldo,
                   int M, int H);

typedef struct {
    wmat q, k, v, o, gate, up, down;
    const uint16_t *bq, *bk, *bv;  // projection biases (Qwen2) or NULL
    const uint16_t *ln1, *ln2;     // input / post-attention RMSNorm weights (hidden,)
    uint16_t *kc, *vc;             // this layer's cache buffers (kv_heads, capacity, head_dim)
    int64_t kv_head;               // elements between kv heads in kc, vc (capacity * head_dim)
} step_layer;

typedef struct {
    int32_t layers, hidden, heads, kv_heads, head_dim, ffn, vocab, pad;
    float eps, scale;
    wmat embed, lm_head;
    const uint16_t *norm;        // final RMSNorm weight (hidden,)
    const uint16_t *cos, *sin;   // (max_pos, head_dim) bf16: the model's rotary embedding per position
    int64_t max_pos;
    step_layer *layer;
    const lm_screen *screen;     // the LM head's screen (lm_head WT_Q8_SPLIT), or NULL
} step_model;

enum { STEP_OK = 0, STEP_NO_MEMORY = -1, STEP_BAD_TOKEN = -2, STEP_BAD_POSITION = -3, STEP_BAD_WEIGHT = -4 };

#ifdef EAGLE_PROFILE
double stage_seconds[2][ST_COUNT], stage_mark;
int stage_set;
#endif

// The stage times thread 0 gathered since the last call (seconds; the target's ST_COUNT in common.h's order,
// then the draft head's) into seconds[0 .. count-1], then zeroed; returns ST_COUNT, or -1 in a build
// without EAGLE_PROFILE.
// ctypes: step_profile(ptr seconds, i32 count) -> i32
int step_profile(double *seconds, int count) {
#ifdef EAGLE_PROFILE
    for (int i = 0; i < 2 * ST_COUNT; i++) {
        if (i < count) seconds[i] = stage_seconds[i / ST_COUNT][i % ST_COUNT];
        stage_seconds[i / ST_COUNT][i % ST_COUNT] = 0.0;
    }
    return ST_COUNT;
#else
    (void)seconds;
    (void)count;
    return -1;
#endif
}

// x = bf16(x + d), as torch's bf16 add, split over the team
static void add_team(uint16_t *x, const uint16_t *d, int64_t count) {
    int64_t tasks = (count + 255) / 256;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tasks; t++)
        for (int64_t i = 256 * t; i < count && i < 256 * (t + 1); i += 16) {
            __mmask16 m = count - i >= 16 ? 0xFFFF : (__mmask16)((1u << (count - i)) - 1u);
            __m512 s = _mm512_add_ps(bf16x16_to_ps_masked(x + i, m), bf16x16_to_ps_masked(d + i, m));
            _mm256_mask_storeu_epi16(x + i, m, to_bf16x16(s));
        }
}

static void keep_features(const uint16_t *x, int n, int H, int stage, const int32_t *ids, int nf, uint16_t *features) {
    for (int f = 0; f < nf; f++)
        if (ids[f] == stage)
            for (int i = 0; i < n; i++) memcpy(features + ((int64_t)i * nf + f) * H, x + (int64_t)i * H, (size_t)H * 2);
}

typedef struct {  // the step's activations, n rows each
    uint16_t *x, *h, *o, *q, *qr, *k, *kr, *v, *g, *u, *a;
} acts;

// One decoder layer on the team: every stage ends at a barrier (its worksharing loop's), so the
// next reads what the whole team wrote.
// Row i's key and value go to cache slot at + i (a target forward: at == committed; a head's draft
// round: after the draft nodes fed before it). ln1 NULL: no input norm (the EAGLE heads' layer).
static int layer_team(const step_model *m, const step_layer *L, const acts *t, const int64_t *positions, int n,
                      int64_t committed, int64_t at, const int64_t *anc, int64_t anc_stride, const int64_t *counts,
                      uint16_t *pack, uint16_t *scratch, float *attn_work, int64_t attn_per_thread) {
    int H = m->hidden, nh = m->heads, kvh = m->kv_heads, hd = m->head_dim, F = m->ffn;
    int64_t qw = (int64_t)nh * hd, kw = (int64_t)kvh * hd;
    const uint16_t *in = t->x;
    if (L->ln1) {
        rmsnorm_team(t->x, H, L->ln1, t->h, H, n, H, m->eps);
        in = t->h;
        STAGE(ST_NORM);
    }
    gemm_job qkv[3] = {{&L->q, L->bq, t->q, qw}, {&L->k, L->bk, t->k, kw}, {&L->v, L->bv, t->v, kw}};
    if (gemm_team(in, H, qkv, 3, n, H, pack, scratch)) return -1;
    STAGE(ST_QKV);
#pragma omp for schedule(static)
    for (int i = 0; i < n; i++) {  // rotary, then this row's key and value into its cache slot
        const uint16_t *c = m->cos + positions[i] * hd, *s = m->sin + positions[i] * hd;
        rotary_bf16(t->q + i * qw, qw, c, s, hd, t->qr + i * qw, 1, nh, hd);
        rotary_bf16(t->k + i * kw, kw, c, s, hd, t->kr + i * kw, 1, kvh, hd);
        for (int j = 0; j < kvh; j++) {
            int64_t slot = j * L->kv_head + (at + i) * hd;
            memcpy(L->kc + slot, t->kr + i * kw + (int64_t)j * hd, (size_t)hd * 2);
            memcpy(L->vc + slot, t->v + i * kw + (int64_t)j * hd, (size_t)hd * 2);
        }
    }
    STAGE(ST_ROTARY);
    attention_team(t->qr, qw, hd, L->kc, L->vc, L->kv_head, hd, anc, anc_stride, counts, t->q, n, nh, kvh, hd,
                   committed, m->scale, attn_work, attn_per_thread);  // q: attention out
    STAGE(ST_ATTENTION);
    gemm_job o = {&L->o, NULL, t->o, H};
    if (gemm_team(t->q, qw, &o, 1, n, (int)qw, pack, scratch)) return -1;
    STAGE(ST_O);
    add_team(t->x, t->o, (int64_t)n * H);
    STAGE(ST_ADD);
    rmsnorm_team(t->x, H, L->ln2, t->h, H, n, H, m->eps);
    STAGE(ST_NORM);
    gemm_job gu[2] = {{&L->gate, NULL, t->g, F}, {&L->up, NULL, t->u, F}};
    if (gemm_team(t->h, H, gu, 2, n, H, pack, scratch)) return -1;
    STAGE(ST_GATE_UP);
    silu_mul_team(t->g, F, t->u, F, t->a, F, n, F);
    STAGE(ST_SILU);
    gemm_job down = {&L->down, NULL, t->o, H};
    if (gemm_team(t->a, F, &down, 1, n, F, pack, scratch)) return -1;
    STAGE(ST_DOWN);
    add_team(t->x, t->o, (int64_t)n * H);
    STAGE(ST_ADD);
    return 0;
}

// A forward's work memory: the activations (n rows each), the GEMM's packed rows, per-thread
// GEMM scratch and per-thread attention scores. kin: the widest input the first GEMM reads.
typedef struct {
    acts t;
    uint16_t *work, *pack, *scratch;
    float *scores;            // attention's work, per_thread floats a thread (the team's, for attention_team)
    int kmax;
    int64_t per_thread;
    float *screen;            // lm_screen_team's shared work, or NULL
} step_mem;

static int step_mem_alloc(step_mem *s, const step_model *m, int n, int kin, int64_t committed, const int64_t *anc,
                          int64_t anc_stride, const int64_t *counts, int nthreads, int screened) {
    int H = m->hidden, F = m->ffn;
    int64_t qw = (int64_t)m->heads * m->head_dim, kw = (int64_t)m->kv_heads * m->head_dim;
    s->kmax = kin > F ? kin : F;
    s->kmax = s->kmax > qw ? s->kmax : (int)qw;
    int64_t act = 3 * (int64_t)H + 2 * qw + 3 * kw + 3 * (int64_t)F;
    s->per_thread = attention_work_per_thread(counts, anc, anc_stride, n, committed, m->heads, m->kv_heads,
                                              m->head_dim, nthreads);
    s->work = (uint16_t *)malloc((size_t)n * act * 2);
    s->pack = (uint16_t *)aligned_alloc(64, (size_t)pack_elems(n, s->kmax) * 2);
    s->scratch = (uint16_t *)malloc((size_t)nthreads * scratch_elems(s->kmax) * 2);
    s->scores = (float *)malloc((size_t)nthreads * s->per_thread * sizeof(float));
    s->screen = screened ? (float *)malloc((size_t)screen_work_floats(n, m->vocab, nthreads) * sizeof(float)) : NULL;
    if (!(s->work && s->pack && s->scratch && s->scores) || (screened && !s->screen)) return STEP_NO_MEMORY;
    acts *t = &s->t;
    t->x = s->work; t->h = t->x + (int64_t)n * H; t->o = t->h + (int64_t)n * H;
    t->q = t->o + (int64_t)n * H; t->qr = t->q + n * qw; t->k = t->qr + n * qw; t->kr = t->k + n * kw;
    t->v = t->kr + n * kw; t->g = t->v + n * kw; t->u = t->g + (int64_t)n * F; t->a = t->u + (int64_t)n * F;
    return STEP_OK;
}

static void step_mem_free(step_mem *s) {
    free(s->work);
    free(s->pack);
    free(s->scratch);
    free(s->scores);
    free(s->screen);
}

// tokens, positions (n,); row i sees cache slots [0, committed) and committed + anc[i][0 .. counts[i]-1];
// its own key and value go to slot at + i (a tree or a plain step: at == committed; the branches of
// core.decoding.batched: committed 0, at the cache's length, each row's ancestors its own branch).
// features (n, nf * H) or NULL: the hidden state after stage ids[f] (0: embeddings, l + 1: decoder layer l).
// hidden (n, H): after the final norm; logits (n, vocab) or NULL. only_max: the caller reads only each
// row's argmax (greedy), so a screened LM head (m->screen) may leave -inf where a logit cannot be the
// row's maximum (lm_screen_team).
// choices (n,) or NULL: each row's argmax of its logits (argmax_bf16, the kernel greedy decoding's
// choice runs on), found in this call while the logits are in cache. One OpenMP team for the whole
// forward. Returns STEP_OK or a STEP_* error.
// ctypes: decode_step(ptr m, ptr tokens, ptr positions, i32 n, i64 committed, i64 at, ptr anc, i64 anc_stride,
//                     ptr counts, ptr feature_ids, i32 nf, ptr features, ptr hidden, ptr logits,
//                     ptr choices, i32 only_max, i32 nthreads) -> i32
int decode_step(const step_model *m, const int64_t *tokens, const int64_t *positions, int n, int64_t committed,
                int64_t at, const int64_t *anc, int64_t anc_stride, const int64_t *counts, const int32_t *feature_ids,
                int nf, uint16_t *features, uint16_t *hidden, uint16_t *logits, int64_t *choices, int only_max,
                int nthreads) {
    int H = m->hidden;
    for (int i = 0; i < n; i++) {
        if (tokens[i] < 0 || tokens[i] >= m->embed.N) return STEP_BAD_TOKEN;
        if (positions[i] < 0 || positions[i] >= m->max_pos) return STEP_BAD_POSITION;
    }
    step_mem s;
    int screened = logits && only_max && screen_fits(&m->lm_head, m->screen, n, scratch_elems(H) * 2);
    int status = step_mem_alloc(&s, m, n, H, committed, anc, anc_stride, counts, nthreads, screened);
    if (status == STEP_OK) {
        const acts *t = &s.t;
#pragma omp parallel num_threads(nthreads)
        {
            int me = omp_get_thread_num(), bad = 0;
            uint16_t *mine = s.scratch + me * scratch_elems(s.kmax);
            amx_begin();
            STAGE(-1);
#pragma omp for schedule(static)
            for (int i = 0; i < n; i++) weight_row(&m->embed, tokens[i], t->x + (int64_t)i * H);
            STAGE(ST_EMBED);
            if (features) {  // the same branch on every thread: the single's barrier only where it runs
#pragma omp single
                keep_features(t->x, n, H, 0, feature_ids, nf, features);
                STAGE(ST_FEATURES);
            }
            for (int l = 0; l < m->layers && !bad; l++) {  // every thread takes the same path (bad is shared in value)
                bad = layer_team(m, &m->layer[l], t, positions, n, committed, at, anc, anc_stride, counts, s.pack,
                                 mine, s.scores, s.per_thread);
                if (features) {
#pragma omp single
                    keep_features(t->x, n, H, l + 1, feature_ids, nf, features);
                    STAGE(ST_FEATURES);
                }
            }
            if (!bad) {
                rmsnorm_team(t->x, H, m->norm, hidden, H, n, H, m->eps);
                STAGE(ST_FINAL_NORM);
                gemm_job lm = {&m->lm_head, NULL, logits, m->vocab};
                if (screened) bad = lm_screen_team(hidden, H, &m->lm_head, m->screen, logits, m->vocab, n, mine,
                                                   scratch_elems(H) * 2, s.screen);
                else if (logits) {
                    bad = gemm_team(hidden, H, &lm, 1, n, H, s.pack, mine);
                    STAGE(ST_LM_HEAD);
                }
            }
            amx_end();
            if (bad) {
#pragma omp atomic write
                status = STEP_BAD_WEIGHT;  // a weight type the kernels do not read (core.quant checks at load)
            }
        }
    }
    step_mem_free(&s);
    if (status == STEP_OK && logits && choices) argmax_bf16(logits, m->vocab, choices, n, m->vocab, nthreads);
    return status;
}

// The EAGLE-1/2 head (core.head.EagleHead) over n new rows, in one call: xin (n, 2H) = cat(the
// target's embedding of t_{j+1}, feature f_j) -> fc (+ bias) -> its decoder layers (no input
// norm, as published) -> out (n, H). Row i sees head-cache slots [0, committed) and committed +
// anc[i][0 .. counts[i]-1]; its key and value go to slot at + i (a catch-up: at == committed; a
// draft round: after the nodes fed before it). The layers' stages are decode_step's kernels.
// ctypes: head_step(ptr m, ptr fc, ptr fc_bias, ptr xin, ptr positions, i32 n, i64 committed, i64 at,
//                   ptr anc, i64 anc_stride, ptr counts, ptr out, i32 nthreads) -> i32
int head_step(const step_model *m, const wmat *fc, const uint16_t *fc_bias, const uint16_t *xin,
              const int64_t *positions, int n, int64_t committed, int64_t at, const int64_t *anc,
              int64_t anc_stride, const int64_t *counts, uint16_t *out, int nthreads) {
    int H = m->hidden;
    for (int i = 0; i < n; i++)
        if (positions[i] < 0 || positions[i] >= m->max_pos) return STEP_BAD_POSITION;
    if (fc->K != 2 * H || fc->N != H) return STEP_BAD_WEIGHT;
    step_mem s;
    int status = step_mem_alloc(&s, m, n, 2 * H, committed, anc, anc_stride, counts, nthreads, 0);
#ifdef EAGLE_PROFILE
    stage_set = 1;  // the draft head's stages
#endif
    if (status == STEP_OK) {
        const acts *t = &s.t;
#pragma omp parallel num_threads(nthreads)
        {
            int me = omp_get_thread_num(), bad = 0;
            uint16_t *mine = s.scratch + me * scratch_elems(s.kmax);
            amx_begin();
            STAGE(-1);
            gemm_job in = {fc, fc_bias, t->x, H};
            bad = gemm_team(xin, 2 * H, &in, 1, n, 2 * H, s.pack, mine);
            STAGE(ST_HEAD_FC);
            for (int l = 0; l < m->layers && !bad; l++)
                bad = layer_team(m, &m->layer[l], t, positions, n, committed, at, anc, anc_stride, counts, s.pack, mine,
                                 s.scores, s.per_thread);
            amx_end();
            if (bad) {
#pragma omp atomic write
                status = STEP_BAD_WEIGHT;
            }
        }
        if (status == STEP_OK) memcpy(out, t->x, (size_t)n * H * 2);
    }
#ifdef EAGLE_PROFILE
    stage_set = 0;
#endif
    step_mem_free(&s);
    return status;
}

int gemm_s8(const uint16_t *x, int64_t ldx, const int8_t *w, const float *wscale, const int32_t *wsum,
            const uint16_t *bias, uint16_t *y, int64_t ldy, int M, int N, int K, int nthreads);
int topk_logprobs_bf16(const uint16_t *x, int64_t ldx, float *vals, int64_t *idx, int M, int N, int k, int nthreads);

// head_step_top, its features row i read from row rows[i] of `features` (rows NULL: row i): spec_step_greedy
// passes the accepted path's rows of the forward's hidden states.
static int head_top_rows(const step_model *m, const wmat *fc, const uint16_t *fc_bias, const int64_t *tokens,
                         const uint16_t *embed, int64_t n_embed, const uint16_t *features, const int64_t *rows, int n,
                         int64_t committed, uint16_t *out, const int8_t *lm_q, const float *lm_scale,
                         const int32_t *lm_sums, int vocab, uint16_t *logits, float *vals, int64_t *idx, int k,
                         int nthreads) {
    if (n < 1) return STEP_BAD_POSITION;
    int H = m->hidden;
    for (int i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= n_embed) return STEP_BAD_TOKEN;
    // causal: row i sees the new rows 0 .. i (KeyLayout.causal), one list read with stride 0
    int64_t *slots = malloc((size_t)n * 3 * sizeof(int64_t));
    uint16_t *xin = malloc((size_t)n * 2 * H * sizeof(uint16_t));
    if (!slots || !xin) {
        free(slots);
        free(xin);
        return STEP_NO_MEMORY;
    }
    int64_t *positions = slots + 2 * n;
    for (int i = 0; i < n; i++) {
        slots[i] = i, slots[n + i] = i + 1, positions[i] = committed + i;
        memcpy(xin + (int64_t)i * 2 * H, embed + tokens[i] * H, (size_t)H * 2);
        memcpy(xin + (int64_t)i * 2 * H + H, features + (rows ? rows[i] : (int64_t)i) * H, (size_t)H * 2);
    }
    int status = head_step(m, fc, fc_bias, xin, positions, n, committed, committed, slots, 0, slots + n, out, nthreads);
    free(slots);
    free(xin);
    if (status != STEP_OK) return status;
    if (gemm_s8(out + (int64_t)(n - 1) * H, H, lm_q, lm_scale, lm_sums, NULL, logits, vocab, 1, vocab, H, nthreads))
        return STEP_NO_MEMORY;
    if (topk_logprobs_bf16(logits, vocab, vals, idx, 1, vocab, k, nthreads)) return STEP_BAD_WEIGHT;
    return STEP_OK;
}

// A catch-up and the next root's proposal in one call: head_step over the n accepted rows (causal
// among themselves, after the `committed` cached ones: row i sees slots [0, committed + i]), then
// the draft LM head (int8 rows with per-row scales, gemm_s8) on the last row, and that row's k best
// log-probabilities (topk_logprobs_bf16). The same kernels in the same order as the three calls
// from Python, so the same bits (tests/test_headstep.py); it saves their dispatch, about a third of
// a catch-up. Its inputs are gathered here: row i of xin is embed[tokens[i]] (the target's
// embedding (n_embed, H) bf16: the bits Python's lookup gives), then features row i (n, H) bf16;
// row i's position is committed + i. logits (vocab,) bf16 is the caller's scratch; vals (k,)
// fp32, idx (k,) int64.
// ctypes: head_step_top(ptr m, ptr fc, ptr fc_bias, ptr tokens, ptr embed, i64 n_embed, ptr features,
//                       i32 n, i64 committed, ptr out, ptr lm_q, ptr lm_scale, ptr lm_sums, i32 vocab,
//                       ptr logits, ptr vals, ptr idx, i32 k, i32 nthreads) -> i32
int head_step_top(const step_model *m, const wmat *fc, const uint16_t *fc_bias, const int64_t *tokens,
                  const uint16_t *embed, int64_t n_embed, const uint16_t *features, int n, int64_t committed,
                  uint16_t *out, const int8_t *lm_q, const float *lm_scale, const int32_t *lm_sums, int vocab,
                  uint16_t *logits, float *vals, int64_t *idx, int k, int nthreads) {
    return head_top_rows(m, fc, fc_bias, tokens, embed, n_embed, features, NULL, n, committed, out, lm_q, lm_scale,
                         lm_sums, vocab, logits, vals, idx, k, nthreads);
}

// A greedy speculative step in one call: decode_step over the tree's n rows (only_max: a screened LM
// head may serve; each row's argmax into choices, its final hidden state, the EAGLE-1 head's feature,
// into hidden), the walk down the tree (from the root, the child holding its parent's argmax: the last
// such child, as core.decoding.verify.walk's table keeps; siblings hold distinct tokens), then
// head_step_top on the accepted path: the path's tokens after the root and the bonus token (the last
// accepted row's argmax), with the path rows' hidden states, after the head cache's head_committed
// entries (head_out: room for n rows). The head's arguments come last, as core.kernels.step.HeadCall
// holds them. parents (n,): parents[0] == -1, each parent before its children. path (n,): the accepted
// rows, root first. seconds (2,): the wall time of the target's part (forward, argmax, walk) and of the
// head's. Returns the path's length (>= 1) or a STEP_* error. The kernels are decode_step's and
// head_step_top's, called in turn, so the bits are theirs; what the one call saves is the Python between
// them, which runs on cold caches after a forward has streamed the weights.
// ctypes: spec_step_greedy(ptr m, ptr tokens, ptr positions, i32 n, i64 committed, ptr anc, i64 anc_stride,
//                          ptr counts, ptr parents, ptr hidden, ptr logits, ptr choices, i32 only_max, ptr path,
//                          ptr seconds, i32 nthreads, i64 head_committed, ptr hm, ptr fc, ptr fc_bias, ptr embed,
//                          i64 n_embed, ptr head_out, ptr lm_q, ptr lm_scale, ptr lm_sums, i32 vocab,
//                          ptr head_logits, ptr vals, ptr idx, i32 k) -> i32
int spec_step_greedy(const step_model *m, const int64_t *tokens, const int64_t *positions, int n, int64_t committed,
                     const int64_t *anc, int64_t anc_stride, const int64_t *counts, const int64_t *parents,
                     uint16_t *hidden, uint16_t *logits, int64_t *choices, int only_max, int64_t *path,
                     double *seconds, int nthreads, int64_t head_committed, const step_model *hm, const wmat *fc,
                     const uint16_t *fc_bias, const uint16_t *embed, int64_t n_embed, uint16_t *head_out,
                     const int8_t *lm_q, const float *lm_scale, const int32_t *lm_sums, int vocab,
                     uint16_t *head_logits, float *vals, int64_t *idx, int k) {
    if (n < 1 || parents[0] != -1) return STEP_BAD_POSITION;
    for (int i = 1; i < n; i++)
        if (parents[i] < 0 || parents[i] >= i) return STEP_BAD_POSITION;
    double t0 = omp_get_wtime();
    int status = decode_step(m, tokens, positions, n, committed, committed, anc, anc_stride, counts, NULL, 0, NULL,
                             hidden, logits, choices, only_max, nthreads);
    if (status != STEP_OK) return status;
    int len = 1, node = 0;
    path[0] = 0;
    for (;;) {
        int next = -1;
        for (int i = node + 1; i < n; i++)
            if (parents[i] == node && tokens[i] == choices[node]) next = i;
        if (next < 0) break;
        path[len++] = next;
        node = next;
    }
    double t1 = omp_get_wtime();
    int64_t *ct = malloc((size_t)len * sizeof(int64_t));
    if (!ct) return STEP_NO_MEMORY;
    for (int i = 0; i < len; i++) ct[i] = i + 1 < len ? tokens[path[i + 1]] : choices[node];
    status = head_top_rows(hm, fc, fc_bias, ct, embed, n_embed, hidden, path, len, head_committed, head_out, lm_q,
                           lm_scale, lm_sums, vocab, head_logits, vals, idx, k, nthreads);
    free(ct);
    seconds[0] = t1 - t0;
    seconds[1] = omp_get_wtime() - t1;
    return status == STEP_OK ? len : status;
}
