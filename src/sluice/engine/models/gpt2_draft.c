/* A GPT-2 draft model's drafting, every round of a step in one call (float32, CPU).
 *
 * A small draft model spends most of a round in the framework, not in arithmetic: the
 * bundled 2-layer, 128-wide draft made about 30 torch calls a round, 0.35 ms, for a few
 * microseconds of products. Here each sequence runs its rounds one token at a time in C:
 * the catch-up tokens it is given (its last token, and any its draft cache lacks), then
 * each draft fed back in, K and V written to the draft's own paged cache as the torch model
 * would (native_draft.py drives it; paged_attention.c attends).
 *
 * A sequence drafts greedily (the first maximum, as argmax), or samples: from
 * q = softmax(logits / temperature) after its top-k and top-p, by inverse CDF at a uniform
 * it is given, and writes q, which the acceptance rule needs. The rule keeps the target's
 * distribution for any q the draft truly drew from, so q need only be what was drawn from:
 * it follows the torch sampler's filters (sampler.py's filter_logits) but finds top-p's edge
 * by bisection, keeping every token tied at the edge.
 *
 * The arithmetic is GPT-2's (Hugging Face's GPT2LMHeadModel with gelu_new and a tied head),
 * summed in another order than torch's; a draft only proposes tokens that the target then
 * verifies, so a last-bit difference can only change how many are accepted, never the
 * output.
 */
#include "paged_attention.c"

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
    const float *top_ps;       /* [num_seqs]: 1 is off */
    const double *uniforms;    /* [num_seqs, max_drafts] in [0, 1): draft d's draw */
    float *probs;              /* [num_seqs, max_drafts, vocab] out: each sampled draft's q */
} sluice_gpt2_draft_args;

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

/* out = x @ weight (+ bias), weight [n_in, n_out] row-major (HF's Conv1D; the LM head
 * transposed). With half weights: 64 outputs at a time held in eight vector registers
 * while every input's row adds in, so each output is written once and the FMAs of the
 * eight accumulators overlap; the rest one output at a time. Without: each output gets
 * four inputs' rows at a time, so it is read and written a quarter as often. */
static void affine(const float *restrict x, const weight_t *restrict weight,
                   const float *restrict bias, float *restrict out, int64_t n_in,
                   int64_t n_out) {
    int64_t o = 0;
#if SLUICE_HALF_WEIGHTS
    for (; o + 64 <= n_out; o += 64) {
        __m256 acc[8];
        for (int j = 0; j < 8; ++j)
            acc[j] = bias == NULL ? _mm256_setzero_ps() : _mm256_loadu_ps(bias + o + 8 * j);
        for (int64_t i = 0; i < n_in; ++i) {
            const __m256 xi = _mm256_set1_ps(x[i]);
            const weight_t *w = weight + i * n_out + o;
            for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(xi, load8(w + 8 * j), acc[j]);
        }
        for (int j = 0; j < 8; ++j) _mm256_storeu_ps(out + o + 8 * j, acc[j]);
    }
    for (; o < n_out; ++o) {
        float acc = bias == NULL ? 0.f : bias[o];
        for (int64_t i = 0; i < n_in; ++i) acc += x[i] * load1(weight + i * n_out + o);
        out[o] = acc;
    }
#else
    for (int64_t v = 0; v < n_out; ++v) out[v] = bias == NULL ? 0.f : bias[v];
    int64_t i = 0;
    for (; i + 4 <= n_in; i += 4) {
        const weight_t *w0 = weight + i * n_out, *w1 = w0 + n_out, *w2 = w1 + n_out,
                       *w3 = w2 + n_out;
        for (o = 0; o < n_out; ++o)
            out[o] += x[i] * load1(w0 + o) + x[i + 1] * load1(w1 + o) +
                      x[i + 2] * load1(w2 + o) + x[i + 3] * load1(w3 + o);
    }
    for (; i < n_in; ++i)
        for (o = 0; o < n_out; ++o) out[o] += x[i] * load1(weight + i * n_out + o);
#endif
}

typedef struct {
    float *hidden, *normed, *qkv, *attended, *inner, *logits, *scores, *work;
} scratch;

/* One token through the model at `position`, writing K/V; with `head`, its next-token
 * logits to s->logits (a catch-up token before the last needs none). */
static void forward_token(const sluice_gpt2_draft_args *a, const int64_t *table,
                          int64_t token, int64_t position, int head, scratch *s, int *status) {
    const int64_t hidden = a->hidden, head_dim = a->hidden / a->num_heads;
    for (int64_t i = 0; i < hidden; ++i)
        s->hidden[i] = a->wte[token * hidden + i] + a->wpe[position * hidden + i];
    const int64_t block = table[position / a->block_size];
    if (block < 0 || block >= a->num_blocks) {
        *status |= SLUICE_BAD_BLOCK;
        return;
    }
    const int64_t slot = block * a->block_size + position % a->block_size;
    const int64_t zero = 0, length = position + 1;
    for (int64_t l = 0; l < a->num_layers; ++l) {
        const sluice_gpt2_layer *layer = a->layers + l;
        layer_norm(s->hidden, layer->ln_1_weight, layer->ln_1_bias, s->normed, hidden, a->eps);
        affine(s->normed, layer->c_attn_weight, layer->c_attn_bias, s->qkv, hidden, 3 * hidden);
        for (int64_t i = 0; i < hidden; ++i) {
            layer->k_cache[slot * hidden + i] = s->qkv[hidden + i];
            layer->v_cache[slot * hidden + i] = s->qkv[2 * hidden + i];
        }
        const sluice_paged_attention_args attention = {
            .q = s->qkv, .out = s->attended, .k_cache = layer->k_cache,
            .v_cache = layer->v_cache, .rows = &zero, .row_seqs = &zero, .row_lens = &length,
            .tables = table, .num_rows = 1, .q_stride = 3 * hidden,
            .table_stride = a->table_stride, .num_heads = a->num_heads,
            .num_kv_heads = a->num_heads, .head_dim = head_dim, .block_size = a->block_size,
            .num_blocks = a->num_blocks, .scale = 1.f / sqrtf((float)head_dim),
            .num_threads = 1,
        };
        *status |= attend_row_any(&attention, 0, s->scores);
        affine(s->attended, layer->attn_proj_weight, layer->attn_proj_bias, s->normed, hidden,
               hidden);
        for (int64_t i = 0; i < hidden; ++i) s->hidden[i] += s->normed[i];
        layer_norm(s->hidden, layer->ln_2_weight, layer->ln_2_bias, s->normed, hidden, a->eps);
        affine(s->normed, layer->c_fc_weight, layer->c_fc_bias, s->inner, hidden, a->inner);
        for (int64_t i = 0; i < a->inner; ++i) { /* gelu_new: GELU, tanh approximation */
            const float x = s->inner[i];
            s->inner[i] = 0.5f * x * (1.f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
        }
        affine(s->inner, layer->mlp_proj_weight, layer->mlp_proj_bias, s->normed, a->inner,
               hidden);
        for (int64_t i = 0; i < hidden; ++i) s->hidden[i] += s->normed[i];
    }
    if (!head) return;
    layer_norm(s->hidden, a->ln_f_weight, a->ln_f_bias, s->normed, hidden, a->eps);
    affine(s->normed, a->head, NULL, s->logits, hidden, a->vocab_size);
}

static int64_t argmax(const float *values, int64_t n) {
    int64_t best = 0;
    for (int64_t v = 1; v < n; ++v)
        if (values[v] > values[best]) best = v; /* the first maximum, as torch's argmax */
    return best;
}

/* The k-th largest of values[0, n), 1 <= k <= n: quickselect on a copy in work. */
static float kth_largest(const float *values, float *work, int64_t n, int64_t k) {
    memcpy(work, values, sizeof(float) * (size_t)n);
    int64_t lo = 0, hi = n - 1;
    const int64_t target = k - 1; /* its index in descending order */
    while (lo < hi) {
        const float pivot = work[lo + (hi - lo) / 2];
        int64_t i = lo, j = hi;
        while (i <= j) { /* Hoare's partition, descending */
            while (work[i] > pivot) ++i;
            while (work[j] < pivot) --j;
            if (i <= j) {
                const float t = work[i];
                work[i++] = work[j];
                work[j--] = t;
            }
        }
        if (target <= j) hi = j;
        else if (target >= i) lo = i;
        else break; /* between the two parts: every value there is the pivot */
    }
    return work[target];
}

/* The mass of the weights above `edge`. */
static double mass_above(const float *weights, int64_t n, float edge) {
    double mass = 0.0;
    for (int64_t v = 0; v < n; ++v)
        if (weights[v] > edge) mass += weights[v];
    return mass;
}

/* Bisections for top-p's edge: the weights are at most 1, so 2^-24 apart at the end. */
#define TOP_P_BISECTIONS 24

/* A token drawn from q = softmax(logits / temperature) after top-k and top-p, by inverse
 * CDF at `uniform`; q is written to `q` (vocab floats). */
static int64_t sample_token(const float *logits, int64_t vocab, float temperature,
                            int64_t top_k, float top_p, double uniform, float *q, float *work) {
    float max = logits[0];
    for (int64_t v = 1; v < vocab; ++v) max = logits[v] > max ? logits[v] : max;
    for (int64_t v = 0; v < vocab; ++v) q[v] = expf((logits[v] - max) / temperature);
    if (top_k > 0 && top_k < vocab) { /* keep the k largest, and any tied with the k-th */
        const float kth = kth_largest(q, work, vocab, top_k);
        for (int64_t v = 0; v < vocab; ++v) q[v] = q[v] < kth ? 0.f : q[v];
    }
    double total = 0.0;
    for (int64_t v = 0; v < vocab; ++v) total += q[v];
    if (top_p < 1.f) {
        /* Keep a token while the mass above it is under top_p. That mass, as a function of
         * an edge, falls at the tokens' weights, so the last token kept is the weight where
         * it falls under top_p: bisect for it between `low` (the mass above is not under
         * top_p; at 0 it is all) and `high` (under; at 1, the maximum's weight, it is none),
         * and keep every token above `low`. Only a token within 2^-24 under the last one
         * kept can differ from the sorted rule's choice. */
        float low = 0.f, high = 1.f;
        const double limit = (double)top_p * total;
        for (int i = 0; i < TOP_P_BISECTIONS; ++i) {
            const float middle = 0.5f * (low + high);
            if (mass_above(q, vocab, middle) < limit) high = middle;
            else low = middle;
        }
        total = 0.0;
        for (int64_t v = 0; v < vocab; ++v) {
            q[v] = q[v] > low ? q[v] : 0.f;
            total += q[v];
        }
    }
    const double target = uniform * total;
    double cumulative = 0.0;
    int64_t chosen = -1, last = 0;
    for (int64_t v = 0; v < vocab; ++v) {
        if (q[v] > 0.f) {
            cumulative += q[v];
            last = v;
            if (chosen < 0 && cumulative > target) chosen = v;
        }
        q[v] = (float)(q[v] / total);
    }
    return chosen < 0 ? last : chosen; /* past the end only by rounding */
}

/* Sequence q's draft d from the logits just computed. */
static int64_t next_token(const sluice_gpt2_draft_args *a, int64_t q, int64_t d, scratch *s) {
    if (a->temperatures == NULL || a->temperatures[q] == 0.f)
        return argmax(s->logits, a->vocab_size);
    const int64_t at = q * a->max_drafts + d;
    return sample_token(s->logits, a->vocab_size, a->temperatures[q], a->top_ks[q],
                        a->top_ps[q], a->uniforms[at], a->probs + at * a->vocab_size, s->work);
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
            !(a->top_ps[s] > 0.f && a->top_ps[s] <= 1.f) || a->probs == NULL)
            return SLUICE_BAD_SHAPE;
        for (int64_t d = 0; d < a->num_drafts[s]; ++d) {
            const double u = a->uniforms[s * a->max_drafts + d];
            if (!(u >= 0.0 && u < 1.0)) return SLUICE_BAD_SHAPE;
        }
    }
    int threads = a->num_threads < 1 ? 1 : a->num_threads;
    if (threads > a->num_seqs) threads = (int)a->num_seqs;
    int status = 0;
    const size_t floats = (size_t)(a->hidden * 6 + a->inner + 2 * a->vocab_size +
                                   a->max_positions * a->num_heads);
#pragma omp parallel num_threads(threads) reduction(| : status)
    {
        float *memory = (float *)malloc(sizeof(float) * floats);
        if (memory == NULL) status |= SLUICE_NO_MEMORY;
        scratch s = {memory, memory + a->hidden, memory + 2 * a->hidden,
                     memory + 5 * a->hidden, memory + 6 * a->hidden,
                     memory + 6 * a->hidden + a->inner,
                     memory + 6 * a->hidden + a->inner + a->vocab_size,
                     memory + 6 * a->hidden + a->inner + a->vocab_size +
                         a->max_positions * a->num_heads};
#pragma omp for schedule(dynamic, 1)
        for (int64_t q = 0; q < a->num_seqs; ++q) {
            if (memory == NULL) continue;
            const int64_t *table = a->tables + q * a->table_stride;
            const int64_t *forced = a->forced + a->forced_start[q];
            const int64_t num_forced = a->forced_start[q + 1] - a->forced_start[q];
            int64_t *drafts = a->drafts + q * a->max_drafts, position = a->first_positions[q];
            for (int64_t i = 0; i < num_forced; ++i)
                forward_token(a, table, forced[i], position++, i == num_forced - 1, &s, &status);
            drafts[0] = next_token(a, q, 0, &s);
            for (int64_t d = 1; d < a->num_drafts[q]; ++d) {
                forward_token(a, table, drafts[d - 1], position++, 1, &s, &status);
                drafts[d] = next_token(a, q, d, &s);
            }
        }
        free(memory);
    }
    if (status & SLUICE_NO_MEMORY) return SLUICE_NO_MEMORY;
    return status & SLUICE_BAD_BLOCK ? SLUICE_BAD_BLOCK : status;
}
