/* A GPT-2 draft model's greedy drafting, every round of a step in one call (float32, CPU).
 *
 * A small draft model spends most of a round in the framework, not in arithmetic: the
 * bundled 2-layer, 128-wide draft made about 30 torch calls a round, 0.35 ms, for a few
 * microseconds of products. Here each sequence runs its rounds one token at a time in C:
 * the catch-up tokens it is given (its last token, and any its draft cache lacks), then
 * each greedy draft fed back in, K and V written to the draft's own paged cache as the
 * torch model would (native_draft.py drives it; paged_attention.c attends).
 *
 * The arithmetic is GPT-2's (Hugging Face's GPT2LMHeadModel with gelu_new and a tied head),
 * summed in another order than torch's; a draft only proposes tokens that the target then
 * verifies, so a last-bit difference can only change how many are accepted, never the
 * output.
 */
#include "paged_attention.c"

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
 * transposed): each output gets four inputs' rows at a time, so it is read and written a
 * quarter as often. */
static void affine(const float *restrict x, const weight_t *restrict weight,
                   const float *restrict bias, float *restrict out, int64_t n_in,
                   int64_t n_out) {
    for (int64_t o = 0; o < n_out; ++o) out[o] = bias == NULL ? 0.f : bias[o];
    int64_t i = 0;
    for (; i + 4 <= n_in; i += 4) {
        const weight_t *w0 = weight + i * n_out, *w1 = w0 + n_out, *w2 = w1 + n_out,
                       *w3 = w2 + n_out;
        int64_t o = 0;
#if SLUICE_HALF_WEIGHTS
        const __m256 x0 = _mm256_set1_ps(x[i]), x1 = _mm256_set1_ps(x[i + 1]);
        const __m256 x2 = _mm256_set1_ps(x[i + 2]), x3 = _mm256_set1_ps(x[i + 3]);
        for (; o + 8 <= n_out; o += 8) {
            __m256 acc = _mm256_loadu_ps(out + o);
            acc = _mm256_fmadd_ps(x0, load8(w0 + o), acc);
            acc = _mm256_fmadd_ps(x1, load8(w1 + o), acc);
            acc = _mm256_fmadd_ps(x2, load8(w2 + o), acc);
            acc = _mm256_fmadd_ps(x3, load8(w3 + o), acc);
            _mm256_storeu_ps(out + o, acc);
        }
#endif
        for (; o < n_out; ++o)
            out[o] += x[i] * load1(w0 + o) + x[i + 1] * load1(w1 + o) +
                      x[i + 2] * load1(w2 + o) + x[i + 3] * load1(w3 + o);
    }
    for (; i < n_in; ++i)
        for (int64_t o = 0; o < n_out; ++o) out[o] += x[i] * load1(weight + i * n_out + o);
}

typedef struct {
    float *hidden, *normed, *qkv, *attended, *inner, *logits, *scores;
} scratch;

/* One token through the model at `position`; returns its greedy next token. */
static int64_t forward_token(const sluice_gpt2_draft_args *a, const int64_t *table,
                             int64_t token, int64_t position, scratch *s, int *status) {
    const int64_t hidden = a->hidden, head_dim = a->hidden / a->num_heads;
    for (int64_t i = 0; i < hidden; ++i)
        s->hidden[i] = a->wte[token * hidden + i] + a->wpe[position * hidden + i];
    const int64_t block = table[position / a->block_size];
    if (block < 0 || block >= a->num_blocks) {
        *status |= SLUICE_BAD_BLOCK;
        return 0;
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
    layer_norm(s->hidden, a->ln_f_weight, a->ln_f_bias, s->normed, hidden, a->eps);
    affine(s->normed, a->head, NULL, s->logits, hidden, a->vocab_size);
    int64_t best = 0;
    for (int64_t v = 1; v < a->vocab_size; ++v)
        if (s->logits[v] > s->logits[best]) best = v; /* the first maximum, as argmax */
    return best;
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
    }
    int threads = a->num_threads < 1 ? 1 : a->num_threads;
    if (threads > a->num_seqs) threads = (int)a->num_seqs;
    int status = 0;
    const size_t floats =
        (size_t)(a->hidden * 6 + a->inner + a->vocab_size + a->max_positions * a->num_heads);
#pragma omp parallel num_threads(threads) reduction(| : status)
    {
        float *memory = (float *)malloc(sizeof(float) * floats);
        if (memory == NULL) status |= SLUICE_NO_MEMORY;
        scratch s = {memory, memory + a->hidden, memory + 2 * a->hidden,
                     memory + 5 * a->hidden, memory + 6 * a->hidden,
                     memory + 6 * a->hidden + a->inner,
                     memory + 6 * a->hidden + a->inner + a->vocab_size};
#pragma omp for schedule(dynamic, 1)
        for (int64_t q = 0; q < a->num_seqs; ++q) {
            if (memory == NULL) continue;
            const int64_t *table = a->tables + q * a->table_stride;
            const int64_t *forced = a->forced + a->forced_start[q];
            const int64_t num_forced = a->forced_start[q + 1] - a->forced_start[q];
            int64_t *drafts = a->drafts + q * a->max_drafts, position = a->first_positions[q];
            int64_t next = 0;
            for (int64_t i = 0; i < num_forced; ++i)
                next = forward_token(a, table, forced[i], position++, &s, &status);
            drafts[0] = next;
            for (int64_t d = 1; d < a->num_drafts[q]; ++d)
                drafts[d] = forward_token(a, table, drafts[d - 1], position++, &s, &status);
        }
        free(memory);
    }
    if (status & SLUICE_NO_MEMORY) return SLUICE_NO_MEMORY;
    return status & SLUICE_BAD_BLOCK ? SLUICE_BAD_BLOCK : status;
}
