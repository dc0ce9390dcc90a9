/* A GPT-2 draft model's drafting, every round of a step in one call (float32, CPU).
 *
 * A small draft model spends most of a round in the framework, not in arithmetic: the
 * bundled 2-layer, 128-wide draft made about 30 torch calls a round, 0.35 ms, for a few
 * microseconds of products. Here the rounds run in C: each sequence's catch-up tokens (its
 * last token, and any its draft cache lacks), then each draft fed back in, K and V written
 * to the draft's own paged cache as the torch model would (native_draft.py drives it;
 * paged_attention.c attends). The sequences run together, a token of each at a time, so
 * each matrix is read once a round for all of them: reading the weights is most of a
 * round's time (one sequence's token, about 100 us, was mostly waiting for them).
 *
 * A sequence drafts greedily (the first maximum, as argmax), or samples: from
 * q = softmax(logits / temperature) after its top-k and top-p, by inverse CDF at a uniform
 * it is given, and writes q, which the acceptance rule needs. The rule keeps the target's
 * distribution for any q the draft truly drew from, so q need only be what was drawn from:
 * it is sampling.c's, the target's own filters.
 *
 * The arithmetic is GPT-2's (Hugging Face's GPT2LMHeadModel with gelu_new and a tied head),
 * summed in another order than torch's; a draft only proposes tokens that the target then
 * verifies, so a last-bit difference can only change how many are accepted, never the
 * output.
 */
#include "paged_attention.c"
#include "sampling.c"

#include <string.h>

/* A draft forward reads all of the draft's weights once a token, and on the CPU that read is
 * most of its time (the bundled draft: 1.5 MB of matrices and a 2 MB head, from L3 on
 * every round). So where the CPU converts half precision (F16C), the matrices and the head
 * are read as IEEE halves: half the bytes. Biases, norms and embeddings stay float32. */
#if defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#define SLUICE_HALF_WEIGHTS 1
typedef uint16_t weight_t;
#else
#define SLUICE_HALF_WEIGHTS 0
typedef float weight_t;
#endif

/* Whether sluice_gpt2_draft_f32 reads its matrices in half precision (else float32). */
int sluice_gpt2_draft_half_weights(void) { return SLUICE_HALF_WEIGHTS; }

typedef struct {
    const float *ln_1_weight, *ln_1_bias;
    const weight_t *c_attn_weight; /* [hidden, 3 * hidden] */
    const float *c_attn_bias;
    const weight_t *attn_proj_weight; /* [hidden, hidden] */
    const float *attn_proj_bias;
    const float *ln_2_weight, *ln_2_bias;
    const weight_t *c_fc_weight; /* [hidden, inner] */
    const float *c_fc_bias;
    const weight_t *mlp_proj_weight; /* [inner, hidden] */
    const float *mlp_proj_bias;
    float *k_cache, *v_cache; /* the layer's flat [slots + 1, heads, head_dim] */
} sluice_gpt2_layer;

typedef struct {
    const sluice_gpt2_layer *layers;
    const float *wte;  /* [vocab, hidden] */
    const weight_t *head; /* [hidden, vocab]: the LM head's weight, transposed */
    const float *wpe; /* [max_positions, hidden] */
    const float *ln_f_weight, *ln_f_bias;
    const int64_t *tables;       /* [num_seqs, table_stride] */
    const int64_t *forced;       /* every sequence's catch-up tokens, one after another */
    const int64_t *forced_start; /* [num_seqs + 1]: sequence s's are forced[start[s]:start[s+1]] */
    const int64_t *first_positions; /* [num_seqs] the position of each one's first forced token */
    const int64_t *num_drafts;      /* [num_seqs] drafts to make, >= 1 */
    int64_t *drafts;                /* [num_seqs, max_drafts] out */
    int64_t num_layers, vocab_size, hidden, inner, num_heads, max_positions;
    int64_t num_seqs, table_stride, max_drafts, block_size, num_blocks;
    float eps;
    int32_t num_threads;
    /* Sampling; every sequence drafts greedily when temperatures is NULL. */
    const float *temperatures; /* [num_seqs]: 0 drafts greedily */
    const int64_t *top_ks;     /* [num_seqs]: 0 is off */
    const double *top_ps;      /* [num_seqs]: 1 is off */
    const double *uniforms;    /* [num_seqs, max_drafts] in [0, 1): draft d's draw */
    float *probs;              /* [num_seqs, max_drafts, vocab] out: each sampled draft's q */
} sluice_gpt2_draft_args;

/* tanh(y) = sign(y) (1 - e^-2|y|) / (1 + e^-2|y|), by exp_nonpositive: vectorised, where
 * libm's tanhf is a call per element (gelu_new's tanhf was a quarter of a 4-sequence draft:
 * about 10 ns each, 1,024 a token). Within about 1e-7 of tanhf. */
static inline float tanh_vectorisable(float y) {
    const float e = exp_nonpositive(-2.f * fabsf(y));
    const float magnitude = (1.f - e) / (1.f + e);
    return y < 0.f ? -magnitude : magnitude;
}

static void layer_norm(const float *x, const float *weight, const float *bias, float *out,
                       int64_t n, float eps) {
    float mean = 0.f, var = 0.f;
    for (int64_t i = 0; i < n; ++i) mean += x[i];
    mean /= (float)n;
    for (int64_t i = 0; i < n; ++i) var += (x[i] - mean) * (x[i] - mean);
    const float inv = 1.f / sqrtf(var / (float)n + eps);
    for (int64_t i = 0; i < n; ++i) out[i] = (x[i] - mean) * inv * weight[i] + bias[i];
}

#if SLUICE_HALF_WEIGHTS
static inline __m256 load8(const weight_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}
static inline float load1(const weight_t *p) { return _cvtsh_ss(*p); }
#else
static inline float load1(const weight_t *p) { return *p; }
#endif

/* Rows of out = x @ weight (+ bias) for outputs [begin, end): weight [n_in, n_out]
 * row-major (HF's Conv1D; the LM head transposed), x and out `nr` rows of `x_stride` and
 * `out_stride` floats. With half weights the outputs go `nv` vectors (8 each) at a time,
 * held in registers while every input's weight row adds into each of the nr rows: each
 * weight is read once for all rows, each output written once, and the nr * nv
 * accumulators' FMAs overlap. `nr` and `nv` are literals at each call, so this unrolls.
 * Float32 weights (no F16C) stream each weight row into a row's outputs instead. */
static inline __attribute__((always_inline)) void affine_block(
    const float *restrict x, int64_t x_stride, const weight_t *restrict weight,
    const float *restrict bias, float *restrict out, int64_t out_stride, int64_t n_in,
    int64_t n_out, int64_t begin, int64_t end, const int nr, const int nv) {
    int64_t o = begin;
#if SLUICE_HALF_WEIGHTS
    for (; o + 8 * nv <= end; o += 8 * nv) {
        __m256 acc[4][8]; /* [nr][nv] used; fixed bounds so that they stay in registers */
#pragma GCC unroll 4
        for (int r = 0; r < nr; ++r)
#pragma GCC unroll 8
            for (int v = 0; v < nv; ++v)
                acc[r][v] = bias == NULL ? _mm256_setzero_ps() : _mm256_loadu_ps(bias + o + 8 * v);
        for (int64_t i = 0; i < n_in; ++i) {
            __m256 w[8];
#pragma GCC unroll 8
            for (int v = 0; v < nv; ++v) w[v] = load8(weight + i * n_out + o + 8 * v);
#pragma GCC unroll 4
            for (int r = 0; r < nr; ++r) {
                const __m256 xi = _mm256_set1_ps(x[r * x_stride + i]);
#pragma GCC unroll 8
                for (int v = 0; v < nv; ++v) acc[r][v] = _mm256_fmadd_ps(xi, w[v], acc[r][v]);
            }
        }
#pragma GCC unroll 4
        for (int r = 0; r < nr; ++r)
#pragma GCC unroll 8
            for (int v = 0; v < nv; ++v) _mm256_storeu_ps(out + r * out_stride + o + 8 * v, acc[r][v]);
    }
    for (; o < end; ++o) /* the last few outputs, under a block's width */
        for (int r = 0; r < nr; ++r) {
            float acc = bias == NULL ? 0.f : bias[o];
            for (int64_t i = 0; i < n_in; ++i) acc += x[r * x_stride + i] * load1(weight + i * n_out + o);
            out[r * out_stride + o] = acc;
        }
#else
    /* Float32 weights: each row streams the weight rows into its outputs (vectorised by
     * the compiler), a row at a time. */
    (void)nv;
    for (int r = 0; r < nr; ++r) {
        float *restrict row = out + r * out_stride;
        for (o = begin; o < end; ++o) row[o] = bias == NULL ? 0.f : bias[o];
        for (int64_t i = 0; i < n_in; ++i) {
            const float xi = x[r * x_stride + i];
            const weight_t *w = weight + i * n_out;
            for (o = begin; o < end; ++o) row[o] += xi * w[o];
        }
    }
#endif
}

/* affine_block over `n_rows` rows (in fours) for outputs [begin, end). */
static void affine_rows(const float *restrict x, int64_t x_stride, const weight_t *restrict weight,
                        const float *restrict bias, float *restrict out, int64_t out_stride,
                        int64_t n_rows, int64_t n_in, int64_t n_out, int64_t begin, int64_t end) {
    for (int64_t r = 0; r < n_rows; r += 4) {
        const float *xr = x + r * x_stride;
        float *outr = out + r * out_stride;
        switch (n_rows - r < 4 ? n_rows - r : 4) {
            case 1: affine_block(xr, x_stride, weight, bias, outr, out_stride, n_in, n_out, begin, end, 1, 8); break;
            case 2: affine_block(xr, x_stride, weight, bias, outr, out_stride, n_in, n_out, begin, end, 2, 4); break;
            case 3: affine_block(xr, x_stride, weight, bias, outr, out_stride, n_in, n_out, begin, end, 3, 2); break;
            default: affine_block(xr, x_stride, weight, bias, outr, out_stride, n_in, n_out, begin, end, 4, 2); break;
        }
    }
}

/* out = x @ weight (+ bias) for n_rows rows (x [n_rows, n_in], out [n_rows, n_out]). */
static void affine(const float *x, const weight_t *weight, const float *bias, float *out,
                   int64_t n_rows, int64_t n_in, int64_t n_out) {
    affine_rows(x, n_in, weight, bias, out, n_out, n_rows, n_in, n_out, 0, n_out);
}

/* Outputs a thread of the LM head takes at a time: a multiple of every block's width. */
#define HEAD_CHUNK 512

/* The LM head (no bias), its outputs split among `threads` in chunks. */
static void head_affine(const float *x, const weight_t *weight, float *out, int64_t n_rows,
                        int64_t n_in, int64_t n_out, int threads) {
    const int64_t chunks = (n_out + HEAD_CHUNK - 1) / HEAD_CHUNK;
#pragma omp parallel for num_threads(threads) if (threads > 1 && chunks > 1) schedule(static)
    for (int64_t c = 0; c < chunks; ++c) {
        const int64_t end = (c + 1) * HEAD_CHUNK < n_out ? (c + 1) * HEAD_CHUNK : n_out;
        affine_rows(x, n_in, weight, NULL, out, n_out, n_rows, n_in, n_out, c * HEAD_CHUNK, end);
    }
}

/* A round's scratch: [rows, width] arrays, a row per sequence that runs. */
typedef struct {
    float *hidden, *normed, *qkv, *attended, *inner, *logits, *scores, *work;
} scratch;

/* One token of each of `n` sequences (`seqs`, their `tokens` at `positions`) through the
 * model, writing their K/V (every block was checked); the first `n_head` of them (those
 * whose next token is wanted) get their logits in s->logits. */
static void forward_rows(const sluice_gpt2_draft_args *a, const int64_t *seqs,
                         const int64_t *tokens, const int64_t *positions, int64_t n,
                         int64_t n_head, scratch *s, int threads, int *status) {
    const int64_t hidden = a->hidden, head_dim = a->hidden / a->num_heads, inner = a->inner;
    for (int64_t r = 0; r < n; ++r)
        for (int64_t i = 0; i < hidden; ++i)
            s->hidden[r * hidden + i] =
                a->wte[tokens[r] * hidden + i] + a->wpe[positions[r] * hidden + i];
    for (int64_t l = 0; l < a->num_layers; ++l) {
        const sluice_gpt2_layer *layer = a->layers + l;
        for (int64_t r = 0; r < n; ++r)
            layer_norm(s->hidden + r * hidden, layer->ln_1_weight, layer->ln_1_bias,
                       s->normed + r * hidden, hidden, a->eps);
        affine(s->normed, layer->c_attn_weight, layer->c_attn_bias, s->qkv, n, hidden, 3 * hidden);
        for (int64_t r = 0; r < n; ++r) {
            const int64_t *table = a->tables + seqs[r] * a->table_stride;
            const int64_t position = positions[r], length = position + 1, zero = 0;
            const int64_t slot = table[position / a->block_size] * a->block_size +
                                 position % a->block_size;
            const float *qkv = s->qkv + r * 3 * hidden;
            for (int64_t i = 0; i < hidden; ++i) {
                layer->k_cache[slot * hidden + i] = qkv[hidden + i];
                layer->v_cache[slot * hidden + i] = qkv[2 * hidden + i];
            }
            const sluice_paged_attention_args attention = {
                .q = qkv, .out = s->attended + r * hidden, .k_cache = layer->k_cache,
                .v_cache = layer->v_cache, .rows = &zero, .row_seqs = &zero,
                .row_lens = &length, .tables = table, .num_rows = 1, .q_stride = 3 * hidden,
                .table_stride = a->table_stride, .num_heads = a->num_heads,
                .num_kv_heads = a->num_heads, .head_dim = head_dim,
                .block_size = a->block_size, .num_blocks = a->num_blocks,
                .scale = 1.f / sqrtf((float)head_dim), .num_threads = 1,
            };
            *status |= attend_row_any(&attention, 0, s->scores);
        }
        affine(s->attended, layer->attn_proj_weight, layer->attn_proj_bias, s->normed, n,
               hidden, hidden);
        for (int64_t i = 0; i < n * hidden; ++i) s->hidden[i] += s->normed[i];
        for (int64_t r = 0; r < n; ++r)
            layer_norm(s->hidden + r * hidden, layer->ln_2_weight, layer->ln_2_bias,
                       s->normed + r * hidden, hidden, a->eps);
        affine(s->normed, layer->c_fc_weight, layer->c_fc_bias, s->inner, n, hidden, inner);
        for (int64_t i = 0; i < n * inner; ++i) { /* gelu_new: GELU, tanh approximation */
            const float x = s->inner[i];
            s->inner[i] = 0.5f * x * (1.f + tanh_vectorisable(0.7978845608028654f * (x + 0.044715f * x * x * x)));
        }
        affine(s->inner, layer->mlp_proj_weight, layer->mlp_proj_bias, s->normed, n, inner,
               hidden);
        for (int64_t i = 0; i < n * hidden; ++i) s->hidden[i] += s->normed[i];
    }
    for (int64_t r = 0; r < n_head; ++r)
        layer_norm(s->hidden + r * hidden, a->ln_f_weight, a->ln_f_bias, s->normed + r * hidden,
                   hidden, a->eps);
    if (n_head > 0) head_affine(s->normed, a->head, s->logits, n_head, hidden, a->vocab_size, threads);
}

/* Sequence q's draft d from its `logits`. */
static int64_t next_token(const sluice_gpt2_draft_args *a, int64_t q, int64_t d,
                          const float *logits, float *work) {
    if (a->temperatures == NULL || a->temperatures[q] == 0.f) return first_max(logits, a->vocab_size);
    const int64_t at = q * a->max_drafts + d;
    return sample_token(logits, a->vocab_size, a->temperatures[q], a->top_ks[q], a->top_ps[q],
                        a->uniforms[at], a->probs + at * a->vocab_size, work);
}

int sluice_gpt2_draft_f32(const sluice_gpt2_draft_args *a) {
    if (a->num_seqs <= 0 || a->hidden <= 0 || a->num_heads <= 0 ||
        a->hidden % a->num_heads != 0 || a->max_drafts <= 0 || a->block_size <= 0)
        return SLUICE_BAD_SHAPE;
    for (int64_t s = 0; s < a->num_seqs; ++s) {
        const int64_t num_forced = a->forced_start[s + 1] - a->forced_start[s];
        const int64_t last = a->first_positions[s] + num_forced + a->num_drafts[s] - 2;
        if (num_forced < 1 || a->num_drafts[s] < 1 || a->num_drafts[s] > a->max_drafts ||
            a->first_positions[s] < 0 || last >= a->max_positions ||
            last >= a->table_stride * a->block_size)
            return SLUICE_BAD_SHAPE;
        for (int64_t i = a->forced_start[s]; i < a->forced_start[s + 1]; ++i)
            if (a->forced[i] < 0 || a->forced[i] >= a->vocab_size) return SLUICE_BAD_SHAPE;
        if (a->temperatures == NULL || a->temperatures[s] == 0.f) continue;
        if (!(a->temperatures[s] > 0.f) || isinf(a->temperatures[s]) || a->top_ks[s] < 0 ||
            !(a->top_ps[s] > 0.0 && a->top_ps[s] <= 1.0) || a->probs == NULL)
            return SLUICE_BAD_SHAPE;
        for (int64_t d = 0; d < a->num_drafts[s]; ++d) {
            const double u = a->uniforms[s * a->max_drafts + d];
            if (!(u >= 0.0 && u < 1.0)) return SLUICE_BAD_SHAPE;
        }
    }
    /* Every block a token will be written to, checked before anything is. */
    for (int64_t q = 0; q < a->num_seqs; ++q) {
        const int64_t *table = a->tables + q * a->table_stride;
        const int64_t runs = a->forced_start[q + 1] - a->forced_start[q] + a->num_drafts[q] - 1;
        for (int64_t p = a->first_positions[q]; p < a->first_positions[q] + runs; ++p)
            if (table[p / a->block_size] < 0 || table[p / a->block_size] >= a->num_blocks)
                return SLUICE_BAD_BLOCK;
    }
    const int64_t n = a->num_seqs, hidden = a->hidden;
    const size_t floats = (size_t)(n * (6 * hidden + a->inner + a->vocab_size) +
                                   a->max_positions * a->num_heads + 2 * a->vocab_size);
    float *memory = (float *)malloc(sizeof(float) * floats);
    int64_t *lanes = (int64_t *)malloc(sizeof(int64_t) * (size_t)(4 * n));
    if (memory == NULL || lanes == NULL) {
        free(memory);
        free(lanes);
        return SLUICE_NO_MEMORY;
    }
    scratch s = {memory, memory + n * hidden, memory + 2 * n * hidden, memory + 5 * n * hidden,
                 memory + 6 * n * hidden, memory + n * (6 * hidden + a->inner),
                 memory + n * (6 * hidden + a->inner + a->vocab_size),
                 memory + n * (6 * hidden + a->inner + a->vocab_size) +
                     a->max_positions * a->num_heads};
    int64_t *seqs = lanes, *tokens = lanes + n, *positions = lanes + 2 * n, *drafts_at = lanes + 3 * n;
    const int threads = a->num_threads < 1 ? 1 : a->num_threads;
    int status = 0;
    /* Round t runs token t of every sequence that has one: its catch-up tokens, then its
     * drafts but the last. A sequence with F catch-up tokens wants logits from round F - 1
     * on (its draft t - F + 1); those sequences go first in the round's rows. */
    for (int64_t t = 0;; ++t) {
        int64_t m = 0, m_head = 0;
        for (int pass = 0; pass < 2; ++pass)
            for (int64_t q = 0; q < n; ++q) {
                const int64_t num_forced = a->forced_start[q + 1] - a->forced_start[q];
                if (t >= num_forced + a->num_drafts[q] - 1) continue;
                const int head = t >= num_forced - 1;
                if (head != (pass == 0)) continue;
                seqs[m] = q;
                positions[m] = a->first_positions[q] + t;
                tokens[m] = t < num_forced ? a->forced[a->forced_start[q] + t]
                                           : a->drafts[q * a->max_drafts + t - num_forced];
                drafts_at[m] = t - (num_forced - 1);
                m_head += head;
                ++m;
            }
        if (m == 0) break;
        forward_rows(a, seqs, tokens, positions, m, m_head, &s, threads, &status);
        for (int64_t r = 0; r < m_head; ++r)
            a->drafts[seqs[r] * a->max_drafts + drafts_at[r]] =
                next_token(a, seqs[r], drafts_at[r], s.logits + r * a->vocab_size, s.work);
    }
    free(memory);
    free(lanes);
    return status & SLUICE_BAD_BLOCK ? SLUICE_BAD_BLOCK : status;
}
