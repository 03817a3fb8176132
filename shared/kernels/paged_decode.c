/* Paged decode attention for CPU: one query token per sequence, K and V read
 * in place through the block table (no gather copy), each grouped-query head
 * scored against its own KV head only.
 *
 * Layout (one layer): block b's K starts at k + b * block_stride and holds
 * [block_size, kv_heads, head_dim] contiguous values; V likewise. q and out
 * are [batch, heads, head_dim] contiguous; tables is [batch, width] block ids
 * and lens[b] <= width * block_size. Query head i reads KV head
 * i / (heads / kv_heads), as Hugging Face's repeat_kv does.
 *
 * Every (sequence, KV head) pair is one task computed start to end by one
 * thread in a fixed order, so a row's result does not depend on the batch it
 * is in or on the thread count. Math is fp32 for both storage dtypes: scores
 * for the whole context, an exact max-subtracted softmax, then the weighted
 * sum of V.
 *
 * Prefill (baton_paged_prefill_*) runs the same compiled task for each new
 * token of a prompt, over the context up to that token: a token's attention is
 * bitwise what decode computes for it. So the KV of tokens a decode instance
 * generated equals the KV a prefill recomputes for them (after a failover, a
 * preemption, or in the next turn of a chat served from cache): greedy and
 * seeded outputs stay identical on every path, in bf16 as in fp32.
 *
 * On AVX512-BF16 hosts, bf16 runs attention_tile.h instead, for decode and
 * prefill alike: bf16 dot products for scores and values, prefill rows in
 * tiles that share every K/V load (2x the prefill speed of the per-token
 * task), with the same promise of bitwise prefill = decode rows; on AMX hosts,
 * for head_dim a multiple of 64, its scores and values are tile products
 * (attention_amx.h), 3x faster again.
 *
 * Built on first use by shared/kernels/build.py, called through ctypes.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vector_math.h"

/* Sliding windows (window > 0): a token at position len - 1 attends to positions
 * window_start(len, window) .. len - 1; window 0 means the whole context. */
INLINE int64_t window_start(int64_t len, int64_t window) {
    return window > 0 && len > window ? len - window : 0;
}

/* A per-token task's keys: whole blocks before the window are skipped (`skip`
 * tokens), the `first` keys left before it get probability 0. Decode and
 * prefill compute the same span for a token, so its row stays bitwise equal. */
typedef struct {
    int64_t skip, first;
} Span;
INLINE Span window_span(int64_t len, int64_t window, int64_t block_size) {
    int64_t lo = window_start(len, window);
    Span sp = {lo / block_size * block_size, lo % block_size};
    return sp;
}

/* One (sequence, KV head) pair: its `group` query heads over `len` tokens, of
 * which the first `first` are outside the window (probability 0).
 * scratch holds group * (d + ceil(len / block_size) * block_size) floats. */
#define DEFINE_HEAD(NAME, T, LOAD, STORE)                                                  \
    INLINE void NAME(const T *q, const T *k, const T *v, T *out, const int64_t *table,    \
                     int64_t len, int64_t first, int64_t block_size, int64_t block_stride, \
                     int64_t tok_stride, int64_t group, const int64_t d, float scale,      \
                     float *scratch) {                                                     \
        float *acc = scratch;            /* [group, d] */                                  \
        float *s = acc + group * d;      /* [group, len] scores, then probabilities */     \
        for (int64_t g = 0; g < group; g++) {                                              \
            float qf[d];                                                                   \
            for (int64_t i = 0; i < d; i++) qf[i] = LOAD(q[g * d + i]) * scale;          \
            for (int64_t start = 0, bi = 0; start < len; start += block_size, bi++) {      \
                int64_t n = len - start < block_size ? len - start : block_size;          \
                const T *kb = k + table[bi] * block_stride;                                \
                for (int64_t t = 0; t < n; t++) {                                          \
                    const T *kt = kb + t * tok_stride;                                     \
                    float dot = 0.f;                                                       \
                    for (int64_t i = 0; i < d; i++) dot += qf[i] * LOAD(kt[i]);           \
                    s[g * len + start + t] = dot;                                          \
                }                                                                          \
            }                                                                              \
            float *sg = s + g * len;                                                       \
            float mx = sg[first];                                                          \
            for (int64_t t = first + 1; t < len; t++) mx = sg[t] > mx ? sg[t] : mx;        \
            float sum = 0.f;                                                               \
            for (int64_t t = 0; t < first; t++) sg[t] = 0.f;                               \
            for (int64_t t = first; t < len; t++) {                                        \
                sg[t] = exp_nonpositive(sg[t] - mx);                                       \
                sum += sg[t];                                                              \
            }                                                                              \
            float inv = 1.f / sum;                                                         \
            for (int64_t t = 0; t < len; t++) sg[t] *= inv;                                \
            for (int64_t i = 0; i < d; i++) acc[g * d + i] = 0.f;                          \
        }                                                                                  \
        for (int64_t start = 0, bi = 0; start < len; start += block_size, bi++) {          \
            int64_t n = len - start < block_size ? len - start : block_size;              \
            const T *vb = v + table[bi] * block_stride;                                    \
            for (int64_t t = 0; t < n; t++) {                                              \
                float vf[d];                                                               \
                const T *vt = vb + t * tok_stride;                                         \
                for (int64_t i = 0; i < d; i++) vf[i] = LOAD(vt[i]);                       \
                for (int64_t g = 0; g < group; g++) {                                      \
                    float p = s[g * len + start + t];                                      \
                    for (int64_t i = 0; i < d; i++) acc[g * d + i] += p * vf[i];           \
                }                                                                          \
            }                                                                              \
        }                                                                                  \
        for (int64_t i = 0; i < group * d; i++) out[i] = STORE(acc[i]);                    \
    }

DEFINE_HEAD(head_f32, float, load_f32, store_f32)
DEFINE_HEAD(head_bf16, uint16_t, bf16_to_f32, f32_to_bf16)

#if defined(__AVX512F__)

/* AVX-512 path for head_dim a multiple of 16 (up to 256). Each K or V row is
 * loaded and widened to fp32 once and used for a chunk of `gc` query heads; the
 * chunk size and head_dim are compile-time constants in the specialized calls,
 * so the per-head vectors live in registers. Every sum is taken in one fixed
 * order (per-lane partial sums, then a fixed tree), so results stay independent
 * of the batch and the thread count. */
#define VMAX_CHUNK 16 /* 16-float vectors per row: head_dim <= 256 */
#define VMAX_GROUP 8  /* query heads per chunk */


/* Blocks sit anywhere in the pool, so the hardware prefetcher cannot follow a
 * table: while a block is read, the same rows of the block PREFETCH_BLOCKS
 * further on are requested (two blocks ahead measured best here: one block of
 * compute is shorter than a DRAM miss). Past the end it re-touches this block. */
#define PREFETCH_BLOCKS 2

INLINE int64_t block_ahead(const int64_t *table, int64_t bi, int64_t start, int64_t len,
                           int64_t block_size) {
    return table[start + PREFETCH_BLOCKS * block_size < len ? bi + PREFETCH_BLOCKS : bi];
}

INLINE void prefetch_row(const void *row, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch((const char *)row + off, _MM_HINT_T0);
}

/* Lane i of the result is the sum of all lanes of a_i. Tokens never mix, and
 * each input goes through the same additions whichever slot it is in. */
INLINE __m128 vsum4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
    __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
    __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23));
    __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23));
    __m512 t = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(t), _mm512_extractf32x8_ps(t, 1));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* Scores s[g, t] = q[g] . k[t] for query heads g < gc sharing one KV head,
 * four tokens at a time so that one reduction serves four dot products. */
#define DEFINE_SCORES(NAME, T, VLOAD)                                                       \
    INLINE void NAME(const float *qf, const T *k, const int64_t *table, int64_t len,       \
                     int64_t block_size, int64_t block_stride, int64_t tok_stride,          \
                     const int64_t gc, const int64_t d, float *s, int64_t s_stride) {       \
        const int64_t c = d / 16;                                                           \
        for (int64_t start = 0, bi = 0; start < len; start += block_size, bi++) {          \
            int64_t n = len - start < block_size ? len - start : block_size;              \
            const T *kb = k + table[bi] * block_stride;                                    \
            const T *kn = k + block_ahead(table, bi, start, len, block_size) * block_stride; \
            for (int64_t t = 0; t < n; t += 4) {                                           \
                int64_t m = n - t < 4 ? n - t : 4;                                         \
                __m512 acc[VMAX_GROUP][4];                                                  \
                for (int64_t u = 0; u < 4; u++) {                                          \
                    if (u >= m) {                                                          \
                        for (int64_t g = 0; g < gc; g++) acc[g][u] = _mm512_setzero_ps();  \
                        continue;                                                          \
                    }                                                                      \
                    prefetch_row(kn + (t + u) * tok_stride, d * (int64_t)sizeof(T));       \
                    const T *row = kb + (t + u) * tok_stride;                              \
                    __m512 kr[VMAX_CHUNK];                                                  \
                    kr[0] = VLOAD(row); /* c >= 1: no read of an unset register */         \
                    for (int64_t j = 1; j < c; j++) kr[j] = VLOAD(row + 16 * j);           \
                    for (int64_t g = 0; g < gc; g++) {                                     \
                        __m512 a = _mm512_mul_ps(kr[0], _mm512_loadu_ps(qf + g * d));      \
                        for (int64_t j = 1; j < c; j++)                                    \
                            a = _mm512_fmadd_ps(kr[j], _mm512_loadu_ps(qf + g * d + 16 * j), a); \
                        acc[g][u] = a;                                                     \
                    }                                                                      \
                }                                                                          \
                for (int64_t g = 0; g < gc; g++) {                                         \
                    __m128 r = vsum4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]);          \
                    _mm_mask_storeu_ps(s + g * s_stride + start + t, (__mmask8)((1u << m) - 1u), r); \
                }                                                                          \
            }                                                                              \
        }                                                                                  \
    }

/* acc[g] = sum_t p[g, t] * v[t] for query heads g < gc, written to out scaled by inv[g]. */
#define DEFINE_VALUES(NAME, T, VLOAD, STORE)                                                \
    INLINE void NAME(const float *p, int64_t p_stride, const T *v, const int64_t *table,   \
                     int64_t len, int64_t block_size, int64_t block_stride,                \
                     int64_t tok_stride, const int64_t gc, const int64_t d,                \
                     const float *inv, T *out) {                                           \
        const int64_t c = d / 16;                                                           \
        __m512 acc[VMAX_GROUP][VMAX_CHUNK];                                                 \
        for (int64_t g = 0; g < gc; g++)                                                   \
            for (int64_t j = 0; j < c; j++) acc[g][j] = _mm512_setzero_ps();               \
        for (int64_t start = 0, bi = 0; start < len; start += block_size, bi++) {          \
            int64_t n = len - start < block_size ? len - start : block_size;              \
            const T *vb = v + table[bi] * block_stride;                                    \
            const T *vn = v + block_ahead(table, bi, start, len, block_size) * block_stride; \
            for (int64_t t = 0; t < n; t++) {                                              \
                prefetch_row(vn + t * tok_stride, d * (int64_t)sizeof(T));                 \
                __m512 vr[VMAX_CHUNK];                                                      \
                for (int64_t j = 0; j < c; j++) vr[j] = VLOAD(vb + t * tok_stride + 16 * j); \
                for (int64_t g = 0; g < gc; g++) {                                         \
                    __m512 pg = _mm512_set1_ps(p[g * p_stride + start + t]);               \
                    for (int64_t j = 0; j < c; j++)                                        \
                        acc[g][j] = _mm512_fmadd_ps(pg, vr[j], acc[g][j]);                 \
                }                                                                          \
            }                                                                              \
        }                                                                                  \
        for (int64_t g = 0; g < gc; g++) {                                                 \
            float row[16];                                                                 \
            for (int64_t j = 0; j < c; j++) {                                              \
                _mm512_storeu_ps(row, _mm512_mul_ps(acc[g][j], _mm512_set1_ps(inv[g])));   \
                for (int i = 0; i < 16; i++) out[g * d + 16 * j + i] = STORE(row[i]);      \
            }                                                                              \
        }                                                                                  \
    }

/* Turns scores into unnormalized probabilities exp(s - max) in place; returns 1 / sum. */
INLINE float vsoftmax_unnormalized(float *s, int64_t len) {
    __m512 vmx = _mm512_set1_ps(-INFINITY);
    int64_t t = 0;
    for (; t + 16 <= len; t += 16) vmx = _mm512_max_ps(vmx, _mm512_loadu_ps(s + t));
    __mmask16 tail = (__mmask16)((1u << (len - t)) - 1u);
    vmx = _mm512_mask_max_ps(vmx, tail, vmx, _mm512_maskz_loadu_ps(tail, s + t));
    __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(vmx));
    __m512 sum = _mm512_setzero_ps();
    for (t = 0; t + 16 <= len; t += 16) {
        __m512 e = vexp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + t), mx));
        _mm512_storeu_ps(s + t, e);
        sum = _mm512_add_ps(sum, e);
    }
    __m512 e = vexp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + t), mx));
    _mm512_mask_storeu_ps(s + t, tail, e);
    sum = _mm512_mask_add_ps(sum, tail, sum, e);
    return 1.f / _mm512_reduce_add_ps(sum);
}

/* One (sequence, KV head) pair in chunks of gc query heads. scratch holds
 * group * (d + 1 + ceil(len / block_size) * block_size) floats. */
#define DEFINE_HEAD_V(NAME, T, SCORES, VALUES, LOAD)                                        \
    INLINE void NAME(const T *q, const T *k, const T *v, T *out, const int64_t *table,    \
                     int64_t len, int64_t first, int64_t block_size, int64_t block_stride, \
                     int64_t tok_stride, int64_t group, const int64_t gc, const int64_t d, \
                     float scale, float *scratch) {                                        \
        float *qf = scratch;             /* [group, d] */                                   \
        float *inv = qf + group * d;     /* [group] */                                      \
        float *s = inv + group;          /* [group, len] */                                 \
        for (int64_t i = 0; i < group * d; i++) qf[i] = LOAD(q[i]) * scale;               \
        for (int64_t g = 0; g < group; g += gc)                                            \
            SCORES(qf + g * d, k, table, len, block_size, block_stride, tok_stride, gc, d, \
                   s + g * len, len);                                                      \
        for (int64_t g = 0; g < group; g++) {                                              \
            for (int64_t t = 0; t < first; t++) s[g * len + t] = 0.f; /* before the window */ \
            inv[g] = vsoftmax_unnormalized(s + g * len + first, len - first);             \
        }                                                                                  \
        for (int64_t g = 0; g < group; g += gc)                                            \
            VALUES(s + g * len, len, v, table, len, block_size, block_stride, tok_stride,  \
                   gc, d, inv + g, out + g * d);                                           \
    }

DEFINE_SCORES(scores_f32, float, vload_f32)
DEFINE_SCORES(scores_bf16, uint16_t, vload_bf16)
DEFINE_VALUES(values_f32, float, vload_f32, store_f32)
DEFINE_VALUES(values_bf16, uint16_t, vload_bf16, f32_to_bf16)
DEFINE_HEAD_V(vhead_f32, float, scores_f32, values_f32, load_f32)
DEFINE_HEAD_V(vhead_bf16, uint16_t, scores_bf16, values_bf16, bf16_to_f32)
#define HAVE_VECTOR_HEAD 1
#include "attention_tile.h"
#endif
#include "attention_avx2.h" /* AVX2 without AVX-512: the fp32 tile */

/* One task: picks the vector path where it applies, else the portable one.
 * head_dim 64 and 128 (the common Llama sizes) and groups up to VMAX_GROUP are
 * specialized so that the inner loops unroll into whole vector registers. */
#if defined(HAVE_VECTOR_HEAD)
#define VECTOR_CASES(VHEAD, D)                                                              \
    switch (group) {                                                                        \
    case 1: VHEAD(ARGS, group, 1, D, scale, scratch); return;                              \
    case 2: VHEAD(ARGS, group, 2, D, scale, scratch); return;                              \
    case 3: VHEAD(ARGS, group, 3, D, scale, scratch); return;                              \
    case 4: VHEAD(ARGS, group, 4, D, scale, scratch); return;                              \
    case 5: VHEAD(ARGS, group, 5, D, scale, scratch); return;                              \
    case 6: VHEAD(ARGS, group, 6, D, scale, scratch); return;                              \
    case 7: VHEAD(ARGS, group, 7, D, scale, scratch); return;                              \
    case 8: VHEAD(ARGS, group, 8, D, scale, scratch); return;                              \
    default: VHEAD(ARGS, group, 1, D, scale, scratch); return;                             \
    }
#define VECTOR_PATH(VHEAD)                                                                  \
    if (d == 64) { VECTOR_CASES(VHEAD, 64) }                                                \
    if (d == 128) { VECTOR_CASES(VHEAD, 128) }                                              \
    if (d % 16 == 0 && d <= 16 * VMAX_CHUNK) {                                              \
        VHEAD(ARGS, group, 1, d, scale, scratch);                                           \
        return;                                                                             \
    }
#else
#define VECTOR_PATH(VHEAD)
#endif

#define ARGS q, k, v, out, table, len, first, block_size, block_stride, tok_stride
/* noinline: decode and prefill call this one compiled copy, so no caller's
 * inlining (and FP contraction) can make their arithmetic differ. */
#define DEFINE_TASK(NAME, T, HEAD, VHEAD)                                                   \
    __attribute__((noinline)) static void NAME(const T *q, const T *k, const T *v, T *out, const int64_t *table,    \
                     int64_t len, int64_t first, int64_t block_size, int64_t block_stride, \
                     int64_t tok_stride, int64_t group, int64_t d, float scale,            \
                     float *scratch) {                                                     \
        VECTOR_PATH(VHEAD)                                                                  \
        if (d == 64)                                                                        \
            HEAD(ARGS, group, 64, scale, scratch);                                          \
        else if (d == 128)                                                                  \
            HEAD(ARGS, group, 128, scale, scratch);                                         \
        else                                                                                \
            HEAD(ARGS, group, d, scale, scratch);                                           \
    }

DEFINE_TASK(task_f32, float, head_f32, vhead_f32)
DEFINE_TASK(task_bf16, uint16_t, head_bf16, vhead_bf16)
#undef ARGS

/* Entry points return 0 on success, 1 on arguments they do not handle, 2 when
 * scratch memory cannot be had. */
#define DEFINE_ENTRY(NAME, TASK, T)                                                        \
    int NAME(const T *q, const T *k, const T *v, T *out, const int64_t *tables,          \
             const int64_t *lens, int64_t batch, int64_t width, int64_t heads,            \
             int64_t kv_heads, int64_t d, int64_t block_size, int64_t block_stride,       \
             float scale, int64_t window, int threads) {                                  \
        if (kv_heads <= 0 || heads % kv_heads != 0 || d <= 0 || block_size <= 0) return 1; \
        int64_t group = heads / kv_heads, tok_stride = kv_heads * d;                      \
        int64_t per_thread = group * (d + 1 + width * block_size);                        \
        int failed = 0;                                                                   \
        _Pragma("omp parallel num_threads(threads) reduction(|: failed)")                 \
        {                                                                                 \
            float *scratch = malloc(sizeof(float) * per_thread);                          \
            failed = scratch == NULL;                                                     \
            _Pragma("omp for schedule(dynamic, 1) collapse(2)")                           \
            for (int64_t b = 0; b < batch; b++)                                           \
                for (int64_t h = 0; h < kv_heads; h++) {                                  \
                    if (scratch == NULL || lens[b] <= 0) continue;                        \
                    int64_t off = (b * heads + h * group) * d;                            \
                    Span sp = window_span(lens[b], window, block_size);                   \
                    TASK(q + off, k + h * d, v + h * d, out + off,                        \
                         tables + b * width + sp.skip / block_size, lens[b] - sp.skip,    \
                         sp.first, block_size, block_stride, tok_stride, group, d, scale, \
                         scratch);                                                        \
                }                                                                         \
            free(scratch);                                                                \
        }                                                                                 \
        return failed ? 2 : 0;                                                            \
    }

#if !defined(HAVE_ATTENTION_AVX2)
DEFINE_ENTRY(baton_paged_decode_f32, task_f32, float)
#else
DEFINE_ENTRY(decode_f32_untiled, task_f32, float)
/* fp32 decode on AVX2: each (sequence, KV head) pair is a tile of the group's
 * query heads over the sequence's keys. */
int baton_paged_decode_f32(const float *q, const float *k, const float *v, float *out,
                           const int64_t *tables, const int64_t *lens, int64_t batch,
                           int64_t width, int64_t heads, int64_t kv_heads, int64_t d,
                           int64_t block_size, int64_t block_stride, float scale, int64_t window,
                           int threads) {
    if (kv_heads <= 0 || heads % kv_heads != 0 || d <= 0 || block_size <= 0) return 1;
    if (!avx2_supports(d))
        return decode_f32_untiled(q, k, v, out, tables, lens, batch, width, heads, kv_heads, d,
                                  block_size, block_stride, scale, window, threads);
    int64_t align = avx2_align(block_size);
    int64_t group = heads / kv_heads, tok_stride = kv_heads * d;
    int64_t per_thread = avx2_rows_scratch(group, width * block_size, d);
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(|: failed)
    {
        float *scratch = thread_scratch(ROWS_SLOT, per_thread);
        failed = scratch == NULL;
#pragma omp for schedule(dynamic, 1) collapse(2)
        for (int64_t b = 0; b < batch; b++)
            for (int64_t h = 0; h < kv_heads; h++) {
                if (scratch == NULL || lens[b] <= 0) continue;
                int64_t off = (b * heads + h * group) * d;
                int64_t ks = window_start(lens[b], window) / align * align;
                avx2_tile(q + off, heads * d, heads * d, 1, group, NULL, NULL, 0, k + h * d,
                          v + h * d, out + off, tables + b * width + ks / block_size, ks,
                          lens[b] - ks, window, block_size, block_stride, tok_stride, d, scale,
                          scratch);
            }
    }
    return failed ? 2 : 0;
}
#endif
#if !defined(HAVE_ATTENTION_TILE)
DEFINE_ENTRY(baton_paged_decode_bf16, task_bf16, uint16_t)
#else
DEFINE_ENTRY(decode_bf16_untiled, task_bf16, uint16_t)
/* bf16 decode: each (sequence, KV head) pair is a tile of the group's query
 * heads over the sequence's keys, transposed first. */
int baton_paged_decode_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v,
                            uint16_t *out, const int64_t *tables, const int64_t *lens,
                            int64_t batch, int64_t width, int64_t heads, int64_t kv_heads,
                            int64_t d, int64_t block_size, int64_t block_stride, float scale,
                            int64_t window, int threads) {
    if (kv_heads <= 0 || heads % kv_heads != 0 || d <= 0 || block_size <= 0) return 1;
    if (!tile_supports(d, block_size))
        return decode_bf16_untiled(q, k, v, out, tables, lens, batch, width, heads, kv_heads, d,
                                   block_size, block_stride, scale, window, threads);
    int amx = attention_amx(d);
    int64_t align = tile_align(block_size);
    int64_t group = heads / kv_heads, tok_stride = kv_heads * d, most = width * block_size;
    int64_t per_thread = rows_scratch_floats(group, most, d);
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(|: failed)
    {
        float *scratch = thread_scratch(ROWS_SLOT, per_thread);
        failed = scratch == NULL;
        tiles_begin(amx);
#pragma omp for schedule(dynamic, 1) collapse(2)
        for (int64_t b = 0; b < batch; b++)
            for (int64_t h = 0; h < kv_heads; h++) {
                if (scratch == NULL || lens[b] <= 0) continue;
                int64_t off = (b * heads + h * group) * d;
                int64_t ks = window_start(lens[b], window) / align * align;
                tile_bf16(q + off, heads * d, heads * d, 1, group, NULL, 0, k + h * d,
                          v + h * d, NULL,
                          out + off, tables + b * width + ks / block_size, lens[b] - ks,
                          window, block_size, block_stride, tok_stride, d, scale, scratch, amx);
            }
        tiles_end(amx);
    }
    return failed ? 2 : 0;
}
#endif

/* Prefill: q and out are [n, heads, head_dim], the newest n of context_len
 * tokens of one sequence whose blocks are table[0 .. ceil(context_len /
 * block_size)); token t attends to tokens 0 ..= context_len - n + t. Each
 * (token, KV head) pair is a decode task over that many tokens. */
#define DEFINE_PREFILL(NAME, TASK, T)                                                      \
    int NAME(const T *q, int64_t q_stride, const T *k, const T *v, T *out,                \
             const int64_t *table, int64_t n, int64_t context_len, int64_t heads,         \
             int64_t kv_heads, int64_t d, int64_t block_size, int64_t block_stride,       \
             int64_t num_blocks, float scale, int64_t window, int threads) {              \
        if (prefill_refused(table, n, context_len, heads, kv_heads, d, block_size,        \
                            num_blocks))                                                  \
            return 1;                                                                     \
        int64_t group = heads / kv_heads, tok_stride = kv_heads * d;                      \
        int64_t prefix = context_len - n;                                                 \
        int64_t width = (context_len + block_size - 1) / block_size;                      \
        int64_t per_thread = group * (d + 1 + width * block_size);                        \
        int failed = 0;                                                                   \
        _Pragma("omp parallel num_threads(threads) reduction(|: failed)")                 \
        {                                                                                 \
            float *scratch = malloc(sizeof(float) * per_thread);                          \
            failed = scratch == NULL;                                                     \
            _Pragma("omp for schedule(dynamic, 1) collapse(2)")                           \
            for (int64_t t = n - 1; t >= 0; t--) /* longest first */                     \
                for (int64_t h = 0; h < kv_heads; h++) {                                  \
                    if (scratch == NULL) continue;                                        \
                    int64_t off = (t * heads + h * group) * d;                            \
                    Span sp = window_span(prefix + t + 1, window, block_size);            \
                    TASK(q + t * q_stride + h * group * d, k + h * d, v + h * d, out + off, \
                         table + sp.skip / block_size, prefix + t + 1 - sp.skip, sp.first, \
                         block_size, block_stride, tok_stride, group, d, scale, scratch); \
                }                                                                         \
            free(scratch);                                                                \
        }                                                                                 \
        return failed ? 2 : 0;                                                            \
    }

/* A prefill's arguments it cannot take: shapes, or a block id outside the pool. */
static int prefill_refused(const int64_t *table, int64_t n, int64_t context_len, int64_t heads,
                           int64_t kv_heads, int64_t d, int64_t block_size, int64_t num_blocks) {
    if (kv_heads <= 0 || heads % kv_heads != 0 || d <= 0 || block_size <= 0 || n <= 0 ||
        n > context_len)
        return 1;
    for (int64_t i = 0; i < (context_len + block_size - 1) / block_size; i++)
        if (table[i] < 0 || table[i] >= num_blocks) return 1;
    return 0;
}

#if !defined(HAVE_ATTENTION_AVX2)
DEFINE_PREFILL(baton_paged_prefill_f32, task_f32, float)
#else
DEFINE_PREFILL(prefill_f32_untiled, task_f32, float)
/* fp32 prefill on AVX2: each KV head's context keys transposed and values packed
 * once, then tiles of consecutive prompt tokens per KV head, longest first. */
int baton_paged_prefill_f32(const float *q, int64_t q_stride, const float *k, const float *v,
                            float *out, const int64_t *table, int64_t n, int64_t context_len,
                            int64_t heads, int64_t kv_heads, int64_t d, int64_t block_size,
                            int64_t block_stride, int64_t num_blocks, float scale,
                            int64_t window, int threads) {
    if (prefill_refused(table, n, context_len, heads, kv_heads, d, block_size, num_blocks))
        return 1;
    if (!avx2_supports(d))
        return prefill_f32_untiled(q, q_stride, k, v, out, table, n, context_len, heads,
                                   kv_heads, d, block_size, block_stride, num_blocks, scale,
                                   window, threads);
    int64_t align = avx2_align(block_size);
    int64_t group = heads / kv_heads, tok_stride = kv_heads * d, prefix = context_len - n;
    int64_t per = group >= AVX2_TILE_ROWS ? 1 : AVX2_TILE_ROWS / group;
    int64_t tiles = (n + per - 1) / per;
    int64_t pad = avx2_keys_padded(context_len), head_keys = d * pad;
    /* the caller's thread keeps the keys' and values' buffers; the team's threads
     * their own rows */
    float *kt = thread_scratch(KEYS_SLOT, kv_heads * head_keys);
    float *vp = thread_scratch(VALUES_SLOT, kv_heads * head_keys);
    if (kt == NULL || vp == NULL) return 2;
    /* values before every row's window are never read (and may be gone) */
    int64_t skip = window_start(prefix + 1, window) / block_size * block_size;
    int64_t per_thread = avx2_rows_scratch(per * group, context_len, d);
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(|: failed)
    {
#pragma omp for schedule(dynamic, 1) collapse(2)
        for (int64_t h = 0; h < kv_heads; h++)
            for (int64_t c = 0; c < pad; c += 256) {
                avx2_transpose_keys(k + h * d, table, context_len, block_size, block_stride,
                                    tok_stride, d, kt + h * head_keys + c * d, c,
                                    c + 256 < pad ? c + 256 : pad);
                int64_t lo = c > skip ? c : skip, hi = c + 256 < context_len ? c + 256 : context_len;
                avx2_pack_values(v + h * d, table, block_size, block_stride, tok_stride, d,
                                 vp + h * head_keys, pad, lo, hi);
            }
        float *scratch = thread_scratch(ROWS_SLOT, per_thread);
        failed = scratch == NULL;
#pragma omp for schedule(dynamic, 1) collapse(2)
        for (int64_t i = tiles - 1; i >= 0; i--) /* longest first */
            for (int64_t h = 0; h < kv_heads; h++) {
                if (scratch == NULL) continue;
                int64_t t0 = i * per, nt = n - t0 < per ? n - t0 : per;
                int64_t off = (t0 * heads + h * group) * d;
                /* keys from the first row's window on, at decode's aligned start */
                int64_t ks = window_start(prefix + t0 + 1, window) / align * align;
                avx2_tile(q + t0 * q_stride + h * group * d, q_stride, heads * d, nt, group,
                          kt + h * head_keys + ks * d, vp + h * head_keys, pad, k + h * d,
                          v + h * d, out + off, table + ks / block_size, ks,
                          prefix + t0 + 1 - ks, window, block_size, block_stride, tok_stride,
                          d, scale, scratch);
            }
    }
    return failed ? 2 : 0;
}
#endif
#if !defined(HAVE_ATTENTION_TILE)
DEFINE_PREFILL(baton_paged_prefill_bf16, task_bf16, uint16_t)
#else
DEFINE_PREFILL(prefill_bf16_untiled, task_bf16, uint16_t)
/* bf16 prefill: each KV head's context keys transposed once, then tiles of
 * tile_tokens(group, amx) consecutive prompt tokens per KV head, longest first. */
int baton_paged_prefill_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k,
                             const uint16_t *v, uint16_t *out, const int64_t *table, int64_t n,
                             int64_t context_len, int64_t heads, int64_t kv_heads, int64_t d,
                             int64_t block_size, int64_t block_stride, int64_t num_blocks,
                             float scale, int64_t window, int threads) {
    if (prefill_refused(table, n, context_len, heads, kv_heads, d, block_size, num_blocks))
        return 1;
    if (!tile_supports(d, block_size))
        return prefill_bf16_untiled(q, q_stride, k, v, out, table, n, context_len, heads,
                                    kv_heads, d, block_size, block_stride, num_blocks, scale,
                                    window, threads);
    int amx = attention_amx(d);
    int64_t align = tile_align(block_size);
    int64_t group = heads / kv_heads, tok_stride = kv_heads * d, prefix = context_len - n;
    int64_t per = tile_tokens(group, amx), tiles = (n + per - 1) / per;
    int64_t pad = keys_padded(context_len), kw = keys_width(context_len);
    int64_t head_keys = keys_scratch_floats(d, context_len);
    /* the caller's thread keeps the keys' buffer; the team's threads their own */
    int32_t *kt = (int32_t *)thread_scratch(KEYS_SLOT, kv_heads * head_keys);
    if (kt == NULL) return 2;
    /* AMX: V's key pairs too, once per KV head, zero before every row's window (as
     * large as the keys' buffer; both stay with the calling thread for its next call) */
    int64_t pairs = (context_len + 31) / 32 * 16, head_vals = pairs * 2 * d;
    uint16_t *vt = NULL;
    if (amx && (vt = (uint16_t *)thread_scratch(VALUES_SLOT, kv_heads * head_vals / 2)) == NULL)
        return 2;
    int64_t per_thread = rows_scratch_floats(per * group, context_len, d);
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(|: failed)
    {
#pragma omp for schedule(dynamic, 1) collapse(2)
        for (int64_t h = 0; h < kv_heads; h++)
            for (int64_t c = 0; c < pad; c += 256)
                transpose_keys(k + h * d, table, context_len, block_size, block_stride,
                               tok_stride, d, kt + h * head_keys, kw, c,
                               c + 256 < pad ? c + 256 : pad, c);
#if defined(HAVE_AMX)
        int64_t skip = window_start(prefix + 1, window); /* before every row's window */
        if (vt != NULL) {
#pragma omp for schedule(dynamic, 1) collapse(2)
            for (int64_t h = 0; h < kv_heads; h++)
                for (int64_t kk = 0; kk < pairs; kk += 128)
                    value_pairs(v + h * d, table, skip, context_len, block_size, block_stride,
                                tok_stride, d, 0, d, kk, pairs - kk < 128 ? pairs - kk : 128,
                                vt + h * head_vals + kk * 2 * d);
        }
#endif
        float *scratch = thread_scratch(ROWS_SLOT, per_thread);
        failed = scratch == NULL;
        tiles_begin(amx);
#pragma omp for schedule(dynamic, 1) collapse(2)
        for (int64_t i = tiles - 1; i >= 0; i--) /* longest first */
            for (int64_t h = 0; h < kv_heads; h++) {
                if (scratch == NULL) continue;
                int64_t t0 = i * per, nt = n - t0 < per ? n - t0 : per;
                int64_t off = (t0 * heads + h * group) * d;
                /* keys from the first row's window on, at decode's aligned start */
                int64_t ks = window_start(prefix + t0 + 1, window) / align * align;
                tile_bf16(q + t0 * q_stride + h * group * d, q_stride, heads * d, nt, group,
                          kt + h * head_keys + ks, kw,
                          k + h * d, v + h * d, vt != NULL ? vt + h * head_vals + ks * d : NULL,
                          out + off, table + ks / block_size,
                          prefix + t0 + 1 - ks, window, block_size, block_stride, tok_stride,
                          d, scale, scratch, amx);
            }
        tiles_end(amx);
    }
    return failed ? 2 : 0;
}
#endif

/* K/V writes: row i of k_new / v_new (kv_heads * head_dim values, row_bytes
 * long; rows src_stride bytes apart) goes to token offsets[i] of block
 * blocks[i]. Plain copies, so the pool holds exactly what an indexed write
 * would store; a prompt's rows are split over the threads (its slots are
 * fresh, rarely in cache: one core's stores ran at ~4 GB/s, 3 ms of a
 * 512-token prefill). Returns 1, writing nothing, when an index is out of
 * range. */
#define WRITE_ROWS_PER_THREAD 64
int baton_paged_write(const char *k_new, const char *v_new, int64_t k_src_stride,
                      int64_t v_src_stride, char *k, char *v, const int64_t *blocks,
                      const int64_t *offsets, int64_t n, int64_t num_blocks, int64_t block_size,
                      int64_t row_bytes, int64_t block_stride, int threads) {
    for (int64_t i = 0; i < n; i++)
        if (blocks[i] < 0 || blocks[i] >= num_blocks || offsets[i] < 0 || offsets[i] >= block_size)
            return 1;
    if (threads > n / WRITE_ROWS_PER_THREAD) threads = (int)(n / WRITE_ROWS_PER_THREAD);
    if (threads < 1) threads = 1; /* decode's few rows: this thread alone */
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t i = 0; i < n; i++) {
        int64_t at = blocks[i] * block_stride + offsets[i] * row_bytes;
        memcpy(k + at, k_new + i * k_src_stride, (size_t)row_bytes);
        memcpy(v + at, v_new + i * v_src_stride, (size_t)row_bytes);
    }
    return 0;
}
