/* Sampling tokens from logits, and the sampled speculative verify (float32, CPU).
 *
 * The torch sampler (sampler.py) makes about a dozen calls a step (shift, scale, softmax,
 * cumsum, searchsorted, log_softmax, gathers), each over the whole batch: 136 us for 4 rows
 * of 4,096 tokens at T=0.8, 2.5 ms for 64, where a row's arithmetic is a few microseconds.
 * Here each row is a few passes over its logits, in one call for the step.
 *
 * The filters are sampler.py's filter_rows: temperature (logits shifted by their maximum
 * first, so every weight is e^x for x <= 0), then top-k (keeping every token tied with the
 * k-th), then top-p (a token is kept while the mass above it is under top_p), then a draw
 * by inverse CDF: the first token whose cumulative mass, summed in double, passes the
 * uniform times the row's mass (acceptance.py and sampler.py's invert_cdf). One divergence:
 * top-p's edge is found by bisection, not a sort, and every token tied at the edge is kept;
 * only a token within 2^-24 under the last one kept can be kept or dropped otherwise than
 * by the sorted rule. A row's logprob is its token's under the unfiltered softmax, as the
 * torch path reports it.
 *
 * The verify is acceptance.py's accept_sampled_many for each sequence: draft x at position
 * j is kept when u_j q_j(x) < p_j(x); at the first rejection a token is drawn from
 * norm(max(0, p_j - q_j)) at u_{k + j}, else the bonus from p_k at u_{2k}; a deterministic
 * proposal's q is one-hot. Each sequence reads its uniforms in that layout, so a seeded
 * sequence gets the same tokens here as on the torch path, but where float rounding of p
 * differs. A row's p is only made when the rule reaches it.
 *
 * Greedy rows (sluice_greedy_f32) take each row's first maximum, as torch's argmax, and
 * its logprob where the row's request asked for one (the softmax's sum is most of the
 * work): the torch path's max, isfinite, log_softmax and gather, in a few passes a row.
 *
 * A row holding NaN or +inf, or only -inf, is not finite: it gets token -1 (sample) or its
 * sequence 0 tokens (verify), and the other rows go on. Returns 0, SLUICE_BAD_SHAPE for
 * arguments out of range (nothing is written), or SLUICE_NO_MEMORY.
 */
#include "kernel_common.c"

#include <float.h>
#include <string.h>

typedef struct {
    const float *logits;       /* [num_rows, vocab], rows `stride` floats apart */
    const float *temperatures; /* [num_rows]: > 0 */
    const int64_t *top_ks;     /* [num_rows]: 0 is off */
    const double *top_ps;      /* [num_rows]: 1 is off */
    const double *uniforms;    /* [num_rows] in [0, 1) */
    int64_t *tokens;           /* [num_rows] out: -1 for a row that is not finite */
    float *logprobs;           /* [num_rows] out */
    int64_t num_rows, vocab, stride;
    int32_t num_threads;
} sluice_sample_args;

typedef struct {
    const float *logits;         /* [num_rows, vocab], rows `stride` floats apart */
    const uint8_t *with_logprob; /* [num_rows]: 0 skips the row's logprob (NaN) */
    int64_t *tokens;             /* [num_rows] out: -1 for a row that is not finite */
    float *logprobs;             /* [num_rows] out */
    int64_t num_rows, vocab, stride;
    int32_t num_threads;
} sluice_greedy_args;

typedef struct {
    const float *logits;         /* sequence s's k_s + 1 rows from row draft_start[s] + s */
    const float *const *q;       /* [num_seqs]: each one's [k_s, vocab] q, NULL: one-hot */
    const int64_t *draft_tokens; /* sequence s's k_s drafts from draft_start[s] */
    const int64_t *draft_start;  /* [num_seqs + 1] */
    const float *temperatures;   /* [num_seqs]: > 0 */
    const int64_t *top_ks;       /* [num_seqs] */
    const double *top_ps;        /* [num_seqs] */
    const double *uniforms;      /* sequence s's 2 k_s + 1 from 2 draft_start[s] + s */
    int64_t *tokens;             /* out: sequence s's emitted tokens from draft_start[s] + s */
    float *logprobs;             /* out: their logprobs, in the same places */
    int64_t *num_emitted;        /* [num_seqs] out: 1 .. k_s + 1; 0: a row was not finite */
    int64_t num_seqs, vocab;
    int32_t num_threads;
} sluice_verify_args;

/* The first maximum of values[0, n), as torch's argmax. */
static inline int64_t first_max(const float *values, int64_t n) {
    int64_t best = 0;
    for (int64_t v = 1; v < n; ++v)
        if (values[v] > values[best]) best = v;
    return best;
}

/* The maximum of row[0, n), NaN passed over: 64 running maxima, which the compiler makes
 * a few independent vectors (a plain reduction may not be vectorised where NaN must be
 * honoured, and one vector of maxima waits on its own latency at every step). */
static float row_max(const float *row, int64_t n) {
    float lanes[64];
    for (int l = 0; l < 64; ++l) lanes[l] = -INFINITY;
    int64_t v = 0;
    for (; v + 64 <= n; v += 64)
        for (int l = 0; l < 64; ++l) lanes[l] = row[v + l] > lanes[l] ? row[v + l] : lanes[l];
    for (int64_t t = v; t < n; ++t) lanes[0] = row[t] > lanes[0] ? row[t] : lanes[0];
    float top = lanes[0];
    for (int l = 1; l < 64; ++l) top = lanes[l] > top ? lanes[l] : top;
    return top;
}

/* The first index of row[0, n) that holds `value`, which it must hold: 64 values at a time
 * compared at once, then the one run holding it searched. */
static int64_t first_index_of(const float *row, int64_t n, float value) {
    int64_t v = 0;
    for (; v + 64 <= n; v += 64) {
        int hit = 0;
        for (int l = 0; l < 64; ++l) hit |= row[v + l] == value;
        if (hit) break;
    }
    while (row[v] != value) ++v;
    return v;
}

/* Whether a row is finite (no NaN, no +inf, some value above -inf); its maximum in *max.
 * NaN and +inf are the values not <= FLT_MAX. */
static int row_finite(const float *row, int64_t n, float *max) {
    int64_t bad = 0;
    for (int64_t v = 0; v < n; ++v) bad += !(row[v] <= FLT_MAX);
    *max = row_max(row, n);
    return bad == 0 && *max > -INFINITY;
}

/* The logprob of `token` under softmax(row), the row's maximum being `max`. */
static float logprob_of(const float *row, int64_t n, float max, int64_t token) {
    float total = 0.f; /* in float32, as torch's log_softmax sums */
    for (int64_t v = 0; v < n; ++v) total += exp_nonpositive(row[v] - max);
    return (row[token] - max) - logf(total);
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

/* A positive float's bits, which order as the floats do. */
static inline int32_t float_bits(float x) {
    union { float f; int32_t i; } u = {.f = x};
    return u.i;
}

static inline float bits_float(int32_t i) {
    union { int32_t i; float f; } u = {.i = i};
    return u.f;
}

/* Top-p's edge over `weights` (non-negative, the largest 1, summing to `total`): the
 * smallest weight kept, when a token is kept while the mass of the tokens above it is under
 * `top_p` of the total (sampler.py's rule), every token tied with the edge kept too.
 *
 * The mass above an edge falls at the tokens' weights, so the edge is found by bisection
 * between `low` (the mass above it is not under top_p; just under the smallest weight it is
 * all) and `high` (it is; at 1, the largest weight, it is none), on the floats' bits: in about 30 steps the two are
 * adjacent floats, and the tokens kept are exactly those of at least `high`. Each step
 * looks only at the weights between the two (copied to `work`): those above `high` are
 * counted once, those at or below `low` never again; bisecting the bits halves the range
 * of log-weights, so a long tail of unlikely tokens drops out in the first steps. */
static float top_p_edge(const float *weights, int64_t vocab, double total, double top_p,
                        float *work) {
    const double limit = top_p * total;
    double above_high = 0.0; /* the mass of the weights above `high` */
    float smallest = 1.f;
    for (int64_t v = 0; v < vocab; ++v)
        smallest = weights[v] > 0.f && weights[v] < smallest ? weights[v] : smallest;
    int32_t low = float_bits(smallest) - 1, high = float_bits(1.f);
    /* The weights between the two, read from `from`, the next step's written to `to`. */
    const float *from = weights;
    float *to = work;
    int64_t m = vocab;
    while (high - low > 1 && m > 1) {
        const int32_t middle_bits = low + (high - low) / 2;
        const float middle = bits_float(middle_bits);
        double mass = above_high;
        for (int64_t c = 0; c < m; ++c) mass += from[c] > middle ? from[c] : 0.f;
        const int under = mass < limit;
        const float floor = under ? bits_float(low) : middle, ceiling = under ? middle : bits_float(high);
        int64_t kept = 0;
        for (int64_t c = 0; c < m; ++c) {
            to[kept] = from[c];
            kept += from[c] > floor && from[c] <= ceiling;
        }
        if (under) {
            high = middle_bits;
            above_high = mass;
        } else {
            low = middle_bits;
        }
        m = kept;
        from = to;
        to = to == work ? work + vocab : work;
    }
    /* One weight left between the two (m is never 0: the mass above `low` reaches the limit
     * and the mass above `high` does not): it is the edge. */
    return m == 1 ? from[0] : bits_float(high);
}

/* q = softmax(logits / temperature) after top-k and top-p (vocab floats; `max` is the
 * logits' maximum, `work` 2 vocab floats of scratch). */
static void filtered_probs(const float *logits, int64_t vocab, float max, float temperature,
                           int64_t top_k, double top_p, float *q, float *work) {
    const float inverse = 1.f / temperature;
    for (int64_t v = 0; v < vocab; ++v) q[v] = exp_nonpositive((logits[v] - max) * inverse);
    if (top_k > 0 && top_k < vocab) { /* keep the k largest, and any tied with the k-th */
        const float kth = kth_largest(q, work, vocab, top_k);
        for (int64_t v = 0; v < vocab; ++v) q[v] = q[v] < kth ? 0.f : q[v];
    }
    double total = 0.0;
    for (int64_t v = 0; v < vocab; ++v) total += q[v];
    if (top_p < 1.0) { /* keep a token while the mass above it is under top_p */
        const float edge = top_p_edge(q, vocab, total, top_p, work);
        total = 0.0;
        for (int64_t v = 0; v < vocab; ++v) {
            q[v] = q[v] >= edge ? q[v] : 0.f;
            total += q[v];
        }
    }
    const float scale = (float)(1.0 / total);
    for (int64_t v = 0; v < vocab; ++v) q[v] *= scale;
}

/* Weights summed at once in invert_cdf before a block is scanned token by token. */
#define CDF_BLOCK 64

/* The first token whose cumulative weight (in double) passes `uniform` of the row's mass;
 * past the end only by rounding: the last token with any. The row has some mass. Whole
 * blocks are skipped by their sums (vectorised), so only the block holding the token is
 * scanned one weight at a time. */
static int64_t invert_cdf(const float *weights, int64_t vocab, double uniform) {
    double total = 0.0;
    for (int64_t v = 0; v < vocab; ++v) total += weights[v];
    const double target = uniform * total;
    double cumulative = 0.0;
    for (int64_t begin = 0; begin < vocab; begin += CDF_BLOCK) {
        const int64_t end = begin + CDF_BLOCK < vocab ? begin + CDF_BLOCK : vocab;
        double block = 0.0;
        for (int64_t v = begin; v < end; ++v) block += weights[v];
        if (cumulative + block <= target) {
            cumulative += block;
            continue;
        }
        for (int64_t v = begin; v < end; ++v) {
            cumulative += weights[v];
            if (weights[v] > 0.f && cumulative > target) return v;
        }
    }
    int64_t last = vocab - 1;
    while (last > 0 && !(weights[last] > 0.f)) --last;
    return last;
}

/* A token drawn from q (the filtered distribution, written to `q`) at `uniform` (`work`: 2
 * vocab floats of scratch). */
static inline int64_t sample_token(const float *logits, int64_t vocab, float temperature,
                            int64_t top_k, double top_p, double uniform, float *q, float *work) {
    const float max = row_max(logits, vocab);
    filtered_probs(logits, vocab, max, temperature, top_k, top_p, q, work);
    return invert_cdf(q, vocab, uniform);
}

static int bad_filter(float temperature, int64_t top_k, double top_p) {
    return !(temperature > 0.f) || isinf(temperature) || top_k < 0 ||
           !(top_p > 0.0 && top_p <= 1.0);
}

static int bad_uniform(double u) { return !(u >= 0.0 && u < 1.0); }

int sluice_sample_f32(const sluice_sample_args *a) {
    if (a->num_rows < 0 || a->vocab <= 0 || a->stride < a->vocab) return SLUICE_BAD_SHAPE;
    for (int64_t r = 0; r < a->num_rows; ++r)
        if (bad_filter(a->temperatures[r], a->top_ks[r], a->top_ps[r]) ||
            bad_uniform(a->uniforms[r]))
            return SLUICE_BAD_SHAPE;
    const int64_t vocab = a->vocab;
    const int threads = a->num_threads < 1 ? 1 : a->num_threads;
    int status = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && a->num_rows >= 8)
    {
        float *scratch = (float *)malloc(sizeof(float) * (size_t)(3 * vocab));
        if (scratch == NULL) {
#pragma omp atomic
            status |= SLUICE_NO_MEMORY;
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < a->num_rows; ++r) {
            if (scratch == NULL) continue;
            const float *row = a->logits + r * a->stride;
            float max;
            if (!row_finite(row, vocab, &max)) {
                a->tokens[r] = -1;
                a->logprobs[r] = NAN;
                continue;
            }
            filtered_probs(row, vocab, max, a->temperatures[r], a->top_ks[r], a->top_ps[r],
                           scratch, scratch + vocab);
            const int64_t token = invert_cdf(scratch, vocab, a->uniforms[r]);
            a->tokens[r] = token;
            a->logprobs[r] = logprob_of(row, vocab, max, token);
        }
        free(scratch);
    }
    return status;
}

int sluice_greedy_f32(const sluice_greedy_args *a) {
    if (a->num_rows < 0 || a->vocab <= 0 || a->stride < a->vocab) return SLUICE_BAD_SHAPE;
    const int64_t vocab = a->vocab;
    const int threads = a->num_threads < 1 ? 1 : a->num_threads;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && a->num_rows >= 16)
    for (int64_t r = 0; r < a->num_rows; ++r) {
        const float *row = a->logits + r * a->stride;
        float max;
        if (!row_finite(row, vocab, &max)) {
            a->tokens[r] = -1;
            a->logprobs[r] = NAN;
            continue;
        }
        const int64_t token = first_index_of(row, vocab, max);
        a->tokens[r] = token;
        a->logprobs[r] = a->with_logprob[r] ? logprob_of(row, vocab, max, token) : NAN;
    }
    return 0;
}

/* Sequence s's verify (sluice_verify_f32); `p` holds vocab floats, `work` 2 vocab. */
static void verify_one(const sluice_verify_args *a, int64_t s, float *p, float *work) {
    const int64_t vocab = a->vocab, first = a->draft_start[s], k = a->draft_start[s + 1] - first;
    const float *rows = a->logits + (first + s) * vocab;
    const float *q = a->q[s];
    const int64_t *drafts = a->draft_tokens + first;
    const double *u = a->uniforms + 2 * first + s;
    int64_t *tokens = a->tokens + first + s;
    float *logprobs = a->logprobs + first + s;
    const float temperature = a->temperatures[s];
    const double top_p = a->top_ps[s];
    const int64_t top_k = a->top_ks[s];
    float maxes[k + 1];
    for (int64_t j = 0; j <= k; ++j)
        if (!row_finite(rows + j * vocab, vocab, &maxes[j])) {
            a->num_emitted[s] = 0;
            return;
        }
    int64_t j = 0;
    for (; j < k; ++j) {
        const float *row = rows + j * vocab;
        filtered_probs(row, vocab, maxes[j], temperature, top_k, top_p, p, work);
        const int64_t x = drafts[j];
        const double q_x = q == NULL ? 1.0 : (double)q[j * vocab + x];
        if (u[j] * q_x < (double)p[x]) { /* kept */
            tokens[j] = x;
            continue;
        }
        /* Rejected: a draw from norm(max(0, p - q)); no residual mass means p <= q
         * everywhere, so p == q and x could only be rejected by rounding: draw from p. */
        double mass = 0.0;
        for (int64_t v = 0; v < vocab; ++v) {
            const float q_v = q == NULL ? (v == x ? 1.f : 0.f) : q[j * vocab + v];
            work[v] = p[v] - q_v > 0.f ? p[v] - q_v : 0.f;
            mass += work[v];
        }
        tokens[j] = invert_cdf(mass > 0.0 ? work : p, vocab, u[k + j]);
        break;
    }
    if (j == k) { /* every draft kept: the bonus, from p_k */
        filtered_probs(rows + k * vocab, vocab, maxes[k], temperature, top_k, top_p, p, work);
        tokens[k] = invert_cdf(p, vocab, u[2 * k]);
    }
    for (int64_t i = 0; i <= j; ++i)
        logprobs[i] = logprob_of(rows + i * vocab, vocab, maxes[i], tokens[i]);
    a->num_emitted[s] = j + 1;
}

int sluice_verify_f32(const sluice_verify_args *a) {
    if (a->num_seqs < 0 || a->vocab <= 0 || a->draft_start[0] != 0) return SLUICE_BAD_SHAPE;
    for (int64_t s = 0; s < a->num_seqs; ++s) {
        const int64_t first = a->draft_start[s], k = a->draft_start[s + 1] - first;
        if (k < 0 || k > 64 || bad_filter(a->temperatures[s], a->top_ks[s], a->top_ps[s]))
            return SLUICE_BAD_SHAPE;
        for (int64_t j = 0; j < k; ++j)
            if (a->draft_tokens[first + j] < 0 || a->draft_tokens[first + j] >= a->vocab)
                return SLUICE_BAD_SHAPE;
        for (int64_t i = 2 * first + s; i <= 2 * (first + k) + s; ++i)
            if (bad_uniform(a->uniforms[i])) return SLUICE_BAD_SHAPE;
    }
    const int64_t vocab = a->vocab;
    const int threads = a->num_threads < 1 ? 1 : a->num_threads;
    int status = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && a->num_seqs >= 4)
    {
        float *scratch = (float *)malloc(sizeof(float) * (size_t)(3 * vocab));
        if (scratch == NULL) {
#pragma omp atomic
            status |= SLUICE_NO_MEMORY;
        }
#pragma omp for schedule(static)
        for (int64_t s = 0; s < a->num_seqs; ++s)
            if (scratch != NULL) verify_one(a, s, scratch, scratch + vocab);
        free(scratch);
    }
    return status;
}
