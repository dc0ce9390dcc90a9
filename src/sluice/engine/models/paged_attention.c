/* Attention of a step's query rows over the paged KV cache, read in place (float32, CPU).
 *
 * The torch path (step.py) copies every sequence's keys and values out of the cache by
 * block table, then attends: at 64 decoding sequences that copy was most of the step. This
 * kernel walks each row's block table and reads K and V where they lie, once.
 *
 * Built and loaded by native_attention.py (cc -O3 -march=native -fopenmp), called through
 * ctypes with one struct of pointers and sizes. Row r is the query at packed token
 * rows[r]; it attends to keys 0 .. row_lens[r] - 1 of sequence row_seqs[r], whose block
 * table is tables[row_seqs[r]]. Query head h reads KV head h / (num_heads / num_kv_heads)
 * (grouped-query attention). The output is written to the same packed token of out.
 *
 * Numerics: scores in float32, softmax with the row maximum subtracted (expf), values
 * accumulated in float32, as the eager attention of Hugging Face models does. The dot
 * products are summed in vector lanes (-fassociative-math), so the last bits differ from
 * torch's, as its own kernels differ from each other.
 *
 * With k_new, the kernel first writes each row's new K and V to its slot: the step's two
 * index_copy calls a layer, each a parallel region of its own, folded into this one.
 *
 * Returns 0, or SLUICE_BAD_BLOCK when a block table or a slot names a block outside the
 * cache (no read or write outside the cache happens; nothing is written then), or
 * SLUICE_BAD_SHAPE.
 */
#include "kernel_common.c"

#include <string.h>

typedef struct {
    const float *q;          /* [num_tokens, num_heads, head_dim], rows q_stride apart */
    float *out;              /* [num_tokens, num_heads, head_dim] */
    const float *k_cache;    /* [num_blocks * block_size (+ more), num_kv_heads, head_dim] */
    const float *v_cache;
    const int64_t *rows;     /* [num_rows] packed token of each query row */
    const int64_t *row_seqs; /* [num_rows] index into tables */
    const int64_t *row_lens; /* [num_rows] keys the row attends to */
    const int64_t *tables;   /* [num_seqs, table_stride] physical block ids */
    int64_t num_rows;
    int64_t q_stride;
    int64_t table_stride;
    int64_t num_heads;
    int64_t num_kv_heads;
    int64_t head_dim;
    int64_t block_size;
    int64_t num_blocks;
    float scale;
    int32_t num_threads;
    /* NULL, or the step's new keys and values, row t of each at k_new + t * new_stride
     * (heads contiguous): row r's token's K and V are written to cache slot slots[r]
     * before any row attends (a decode's key is the last one it reads). */
    const float *k_new;
    const float *v_new;
    const int64_t *slots; /* [num_rows] */
    int64_t new_stride;
} sluice_paged_attention_args;

/* One query row, every head: scores over its keys, softmax, weighted values. `dim` is a
 * literal at each call site below, so the inner loops are unrolled and vectorised. */
static inline __attribute__((always_inline)) int attend_row(
    const sluice_paged_attention_args *a, int64_t r, float *scores, const int64_t dim) {
    const int64_t heads = a->num_heads, group = a->num_heads / a->num_kv_heads;
    const int64_t row_floats = a->num_kv_heads * dim, block_size = a->block_size;
    const int64_t len = a->row_lens[r];
    const int64_t *table = a->tables + a->row_seqs[r] * a->table_stride;
    const float *q = a->q + a->rows[r] * a->q_stride;
    float *o = a->out + a->rows[r] * heads * dim;
    for (int64_t start = 0; start < len; start += block_size) {
        const int64_t block = table[start / block_size];
        if (block < 0 || block >= a->num_blocks) return SLUICE_BAD_BLOCK;
        const int64_t count = len - start < block_size ? len - start : block_size;
        const float *k = a->k_cache + block * block_size * row_floats;
        const float *v_block = a->v_cache + block * block_size * row_floats;
        const int64_t after = start + block_size;
        const int64_t next = after < len ? table[after / block_size] : -1;
        const float *k_next =
            next >= 0 && next < a->num_blocks ? a->k_cache + next * block_size * row_floats : NULL;
        for (int64_t s = 0; s < count; ++s, k += row_floats) {
            /* The cache is read from memory (a step reads every context, each layer once:
             * far more than the caches hold), so ask for the next block's keys and this
             * block's values while this block's keys are multiplied: blocks lie anywhere,
             * where the hardware prefetcher only follows runs within a page. */
            for (int64_t f = 0; f < row_floats; f += 16) { /* a 64-byte line each */
                if (k_next != NULL) __builtin_prefetch(k_next + s * row_floats + f, 0, 3);
                __builtin_prefetch(v_block + s * row_floats + f, 0, 2);
            }
            for (int64_t h = 0; h < heads; ++h) {
                const float *qh = q + h * dim, *kh = k + (h / group) * dim;
                float dot = 0.f;
                for (int64_t d = 0; d < dim; ++d) dot += qh[d] * kh[d];
                scores[h * len + start + s] = dot * a->scale;
            }
        }
    }
    for (int64_t h = 0; h < heads; ++h) {
        float *sh = scores + h * len, top = -INFINITY, sum = 0.f;
        for (int64_t j = 0; j < len; ++j) top = sh[j] > top ? sh[j] : top;
        for (int64_t j = 0; j < len; ++j) {
            sh[j] = exp_nonpositive(sh[j] - top);
            sum += sh[j];
        }
        const float inv = 1.f / sum;
        for (int64_t j = 0; j < len; ++j) sh[j] *= inv;
        for (int64_t d = 0; d < dim; ++d) o[h * dim + d] = 0.f;
    }
    for (int64_t start = 0; start < len; start += block_size) {
        const int64_t block = table[start / block_size];
        const int64_t count = len - start < block_size ? len - start : block_size;
        const float *v = a->v_cache + block * block_size * row_floats;
        for (int64_t s = 0; s < count; ++s, v += row_floats) {
            for (int64_t h = 0; h < heads; ++h) {
                const float p = scores[h * len + start + s];
                const float *vh = v + (h / group) * dim;
                float *oh = o + h * dim;
                for (int64_t d = 0; d < dim; ++d) oh[d] += p * vh[d];
            }
        }
    }
    return 0;
}

static int attend_row_any(const sluice_paged_attention_args *a, int64_t r, float *scores) {
    switch (a->head_dim) {
        case 32: return attend_row(a, r, scores, 32);
        case 64: return attend_row(a, r, scores, 64);
        case 128: return attend_row(a, r, scores, 128);
        default: return attend_row(a, r, scores, a->head_dim);
    }
}

int sluice_paged_attention_f32(const sluice_paged_attention_args *a) {
    if (a->num_rows < 0 || a->num_heads <= 0 || a->num_kv_heads <= 0 || a->head_dim <= 0 ||
        a->block_size <= 0 || a->num_heads % a->num_kv_heads != 0 ||
        a->q_stride < a->num_heads * a->head_dim)
        return SLUICE_BAD_SHAPE;
    int64_t max_len = 0;
    for (int64_t r = 0; r < a->num_rows; ++r) {
        if (a->row_lens[r] <= 0 || a->row_lens[r] > a->table_stride * a->block_size)
            return SLUICE_BAD_SHAPE;
        max_len = a->row_lens[r] > max_len ? a->row_lens[r] : max_len;
    }
    const int64_t row_floats = a->num_kv_heads * a->head_dim;
    if (a->k_new != NULL) {
        if (a->v_new == NULL || a->slots == NULL || a->new_stride < row_floats)
            return SLUICE_BAD_SHAPE;
        for (int64_t r = 0; r < a->num_rows; ++r)
            if (a->slots[r] < 0 || a->slots[r] >= a->num_blocks * a->block_size)
                return SLUICE_BAD_BLOCK;
    }
    int threads = a->num_threads < 1 ? 1 : a->num_threads;
    if (threads > a->num_rows) threads = (int)a->num_rows;
    int status = 0;
    if (a->num_rows == 0) return 0;
#pragma omp parallel num_threads(threads) reduction(| : status)
    {
        if (a->k_new != NULL) {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < a->num_rows; ++r) {
                const int64_t from = a->rows[r] * a->new_stride, to = a->slots[r] * row_floats;
                memcpy((float *)a->k_cache + to, a->k_new + from, sizeof(float) * row_floats);
                memcpy((float *)a->v_cache + to, a->v_new + from, sizeof(float) * row_floats);
            }
        } /* the loop's barrier: every new key is in place before a row attends */
        float *scores = (float *)malloc(sizeof(float) * (size_t)(max_len * a->num_heads));
        if (scores == NULL) {
            status |= SLUICE_NO_MEMORY;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < a->num_rows; ++r) {
            if (scores != NULL) status |= attend_row_any(a, r, scores);
        }
        free(scores);
    }
    if (status & SLUICE_NO_MEMORY) return SLUICE_NO_MEMORY;
    return status & SLUICE_BAD_BLOCK ? SLUICE_BAD_BLOCK : status;
}
