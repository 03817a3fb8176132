/* Paged prefill attention for CPU: the newest n tokens of one sequence (the
 * query rows) attend causally to the sequence's whole context, whose K and V
 * (the new tokens' included) are read through its block table.
 *
 * Layout (one layer): as paged_decode.c. q and out are [n, heads, head_dim]
 * contiguous; query token i sits at position context_len - n + i and sees keys
 * 0 ..= that position. Query head j reads KV head j / (heads / kv_heads).
 *
 * The context's K and V are first copied, widened to fp32, into dense rows;
 * then each task (one KV head, 16 query tokens with all their query heads)
 * walks 16-key tiles in order with an online softmax. Query rows sit 16 to a
 * vector, one per lane, so a tile's scores are 16 vectors (one per key) and
 * its softmax needs no horizontal reduction. A row's arithmetic depends only
 * on its own query, position and the context, never on which rows share its
 * task: results are identical however a prompt is chunked, batched or
 * threaded. Math is fp32 for both storage dtypes.
 *
 * Built on first use by shared/kernels/build.py, called through ctypes.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vector_math.h"

#if defined(__AVX512F__)
#define KEY_TILE 16  /* keys per tile */
#define ROW_VEC 16   /* query rows per vector: rows sit in lanes */
#define TASK_TOKENS 16

/* fp32 K and V rows of one KV head for the keys of one tile (zeros past len). */
#define DEFINE_STAGE(NAME, T, LOAD)                                                          \
    static void NAME(const T *k, const T *v, const int64_t *table, int64_t len,             \
                     int64_t block_size, int64_t block_stride, int64_t tok_stride,            \
                     int64_t d, int64_t tile, float *kf, float *vf) {                        \
        for (int64_t j = 0; j < KEY_TILE; j++) {                                            \
            int64_t key = tile * KEY_TILE + j;                                              \
            float *krow = kf + key * d, *vrow = vf + key * d;                               \
            if (key >= len) {                                                               \
                memset(krow, 0, sizeof(float) * d);                                         \
                memset(vrow, 0, sizeof(float) * d);                                         \
                continue;                                                                   \
            }                                                                               \
            int64_t at = table[key / block_size] * block_stride + (key % block_size) * tok_stride; \
            for (int64_t i = 0; i < d; i++) {                                               \
                krow[i] = LOAD(k[at + i]);                                                  \
                vrow[i] = LOAD(v[at + i]);                                                  \
            }                                                                               \
        }                                                                                   \
    }

/* One task's query rows against every key tile up to the last one its newest
 * row sees. Rows go 16 to a vector (lane = row): qt holds the scaled queries
 * transposed, [rows / 16][d][16]; pos each row's position (-1: padding). A
 * tile's scores come out as one vector per key, so its softmax (max, exp, sum
 * over the tile's keys) is lane-wise with no horizontal reduction; s holds the
 * probabilities the same way, [rows / 16][KEY_TILE][16]. o, m, l, alpha: the
 * running output rows, maxima, sums and this tile's rescale factors. */
static void attend(const float *qt, const int32_t *pos, int64_t rows, const float *kf,
                   const float *vf, int64_t d, float *s, float *o, float *m, float *l,
                   float *alpha) {
    int64_t vecs = rows / ROW_VEC;
    int64_t last = 0;
    for (int64_t r = 0; r < rows; r++) last = pos[r] / KEY_TILE > last ? pos[r] / KEY_TILE : last;
    for (int64_t r = 0; r < rows; r++) {
        m[r] = -INFINITY;
        l[r] = 0.f;
    }
    memset(o, 0, sizeof(float) * rows * d);
    const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
    for (int64_t tile = 0; tile <= last; tile++) {
        int64_t k0 = tile * KEY_TILE;
        const float *kb = kf + k0 * d;
        for (int64_t rv = 0; rv < vecs; rv++) {
            __m512i posv = _mm512_loadu_si512(pos + rv * ROW_VEC);
            __mmask16 active = _mm512_cmpge_epi32_mask(posv, _mm512_set1_epi32((int32_t)k0));
            if (active == 0) continue; /* rows that see none of this tile stay as they were */
            const float *q = qt + rv * d * ROW_VEC;
            __m512 acc[KEY_TILE];
            for (int kk = 0; kk < KEY_TILE; kk++) acc[kk] = _mm512_setzero_ps();
            for (int64_t i = 0; i < d; i++) {
                __m512 qv = _mm512_loadu_ps(q + i * ROW_VEC);
                for (int kk = 0; kk < KEY_TILE; kk++)
                    acc[kk] = _mm512_fmadd_ps(_mm512_set1_ps(kb[kk * d + i]), qv, acc[kk]);
            }
            /* online softmax, lane-wise: keys past a row's position do not count */
            __m512 m_old = _mm512_loadu_ps(m + rv * ROW_VEC);
            __m512 m_new = m_old;
            __mmask16 valid[KEY_TILE];
            for (int kk = 0; kk < KEY_TILE; kk++) {
                valid[kk] = _mm512_cmpge_epi32_mask(posv, _mm512_set1_epi32((int32_t)(k0 + kk)));
                m_new = _mm512_mask_max_ps(m_new, valid[kk], m_new, acc[kk]);
            }
            __mmask16 seen_before = active & _mm512_cmp_ps_mask(m_old, neg_inf, _CMP_NEQ_OQ);
            __m512 a = _mm512_maskz_mov_ps(seen_before,
                                           vexp_nonpositive(_mm512_sub_ps(m_old, m_new)));
            __m512 sum = _mm512_setzero_ps();
            float *p = s + rv * KEY_TILE * ROW_VEC;
            for (int kk = 0; kk < KEY_TILE; kk++) {
                __m512 e = _mm512_maskz_mov_ps(valid[kk],
                                               vexp_nonpositive(_mm512_sub_ps(acc[kk], m_new)));
                _mm512_storeu_ps(p + kk * ROW_VEC, e);
                sum = _mm512_add_ps(sum, e);
            }
            __m512 l_new = _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(l + rv * ROW_VEC), a), sum);
            _mm512_mask_storeu_ps(l + rv * ROW_VEC, active, l_new);
            _mm512_mask_storeu_ps(m + rv * ROW_VEC, active, m_new);
            _mm512_storeu_ps(alpha + rv * ROW_VEC, a);
        }
        for (int64_t j = 0; j < d; j += 16) {
            __m512 vr[KEY_TILE];
            for (int kk = 0; kk < KEY_TILE; kk++) vr[kk] = _mm512_loadu_ps(vf + (k0 + kk) * d + j);
            for (int64_t r = 0; r < rows; r++) {
                if (pos[r] < k0) continue;
                const float *pr = s + (r / ROW_VEC) * KEY_TILE * ROW_VEC + r % ROW_VEC;
                __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(o + r * d + j), _mm512_set1_ps(alpha[r]));
                for (int kk = 0; kk < KEY_TILE; kk++)
                    acc = _mm512_fmadd_ps(_mm512_set1_ps(pr[kk * ROW_VEC]), vr[kk], acc);
                _mm512_storeu_ps(o + r * d + j, acc);
            }
        }
    }
}

DEFINE_STAGE(stage_f32, float, load_f32)
DEFINE_STAGE(stage_bf16, uint16_t, bf16_to_f32)

/* Entry points return 0 on success, 1 on arguments they do not handle, 2 when
 * scratch memory cannot be had. */
#define DEFINE_ENTRY(NAME, STAGE, T, LOAD, STORE)                                            \
    int NAME(const T *q, const T *k, const T *v, T *out, const int64_t *table, int64_t n,  \
             int64_t context_len, int64_t heads, int64_t kv_heads, int64_t d,               \
             int64_t block_size, int64_t block_stride, float scale, int threads) {          \
        if (kv_heads <= 0 || heads % kv_heads != 0 || d <= 0 || d % 16 != 0 || d > 256 ||   \
            block_size <= 0 || n <= 0 || n > context_len || context_len > INT32_MAX)       \
            return 1;                                                                       \
        int64_t group = heads / kv_heads, tok_stride = kv_heads * d;                        \
        int64_t tiles = (context_len + KEY_TILE - 1) / KEY_TILE, prefix = context_len - n;  \
        int64_t span = tiles * KEY_TILE * d; /* floats per KV head, K and V each */        \
        float *kf = malloc(sizeof(float) * span * kv_heads);                                \
        float *vf = malloc(sizeof(float) * span * kv_heads);                                \
        if (kf == NULL || vf == NULL) {                                                     \
            free(kf);                                                                       \
            free(vf);                                                                       \
            return 2;                                                                       \
        }                                                                                   \
        _Pragma("omp parallel for num_threads(threads) schedule(static) collapse(2)")       \
        for (int64_t h = 0; h < kv_heads; h++)                                              \
            for (int64_t t = 0; t < tiles; t++)                                             \
                STAGE(k + h * d, v + h * d, table, context_len, block_size, block_stride,   \
                      tok_stride, d, t, kf + h * span, vf + h * span);   \
        int64_t chunks = (n + TASK_TOKENS - 1) / TASK_TOKENS;                               \
        int64_t max_rows = (TASK_TOKENS * group + ROW_VEC - 1) / ROW_VEC * ROW_VEC;   \
        int64_t per_thread = max_rows * (2 * d + KEY_TILE + 3);                 \
        int failed = 0;                                                                     \
        _Pragma("omp parallel num_threads(threads) reduction(|: failed)")                   \
        {                                                                                   \
            float *scratch = malloc(sizeof(float) * per_thread);                            \
            int32_t *pos = malloc(sizeof(int32_t) * max_rows);                              \
            failed = scratch == NULL || pos == NULL;                                        \
            _Pragma("omp for schedule(dynamic, 1) collapse(2)")                             \
            for (int64_t c = chunks - 1; c >= 0; c--) /* longest first */                 \
                for (int64_t h = 0; h < kv_heads; h++) {                                    \
                    if (scratch == NULL || pos == NULL) continue;                           \
                    int64_t t0 = c * TASK_TOKENS, t1 = t0 + TASK_TOKENS < n ? t0 + TASK_TOKENS : n; \
                    int64_t rows = (t1 - t0) * group;                                       \
                    int64_t padded = (rows + ROW_VEC - 1) / ROW_VEC * ROW_VEC;        \
                    float *qt = scratch, *o = qt + padded * d, *s = o + padded * d;         \
                    float *m = s + padded * KEY_TILE, *l = m + padded, *alpha = l + padded; \
                    for (int64_t t = t0; t < t1; t++)                                       \
                        for (int64_t g = 0; g < group; g++) {                               \
                            int64_t r = (t - t0) * group + g;                               \
                            const T *src = q + (t * heads + h * group + g) * d;             \
                            float *dst = qt + (r / ROW_VEC) * d * ROW_VEC + r % ROW_VEC;    \
                            for (int64_t i = 0; i < d; i++) dst[i * ROW_VEC] = LOAD(src[i]) * scale; \
                            pos[r] = (int32_t)(prefix + t);                                 \
                        }                                                                   \
                    for (int64_t r = rows; r < padded; r++) {                               \
                        float *dst = qt + (r / ROW_VEC) * d * ROW_VEC + r % ROW_VEC;        \
                        for (int64_t i = 0; i < d; i++) dst[i * ROW_VEC] = 0.f;             \
                        pos[r] = -1; /* padding: sees nothing */                            \
                    }                                                                       \
                    attend(qt, pos, padded, kf + h * span, vf + h * span, d, s, o, m, l, alpha); \
                    for (int64_t r = 0; r < rows; r++) {                                    \
                        int64_t t = t0 + r / group, g = r % group;                          \
                        T *dst = out + (t * heads + h * group + g) * d;                     \
                        float inv = 1.f / l[r];                                             \
                        for (int64_t i = 0; i < d; i++) dst[i] = STORE(o[r * d + i] * inv); \
                    }                                                                       \
                }                                                                           \
            free(scratch);                                                                  \
            free(pos);                                                                      \
        }                                                                                   \
        free(kf);                                                                           \
        free(vf);                                                                           \
        return failed ? 2 : 0;                                                              \
    }

DEFINE_ENTRY(baton_paged_prefill_f32, stage_f32, float, load_f32, store_f32)
DEFINE_ENTRY(baton_paged_prefill_bf16, stage_bf16, uint16_t, bf16_to_f32, f32_to_bf16)

int baton_paged_prefill_available(void) { return 1; }
#else
int baton_paged_prefill_available(void) { return 0; }
#endif
