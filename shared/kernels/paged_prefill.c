/* Paged prefill attention for CPU: the newest n tokens of one sequence (the
 * query rows) attend causally to the sequence's whole context, whose K and V
 * (the new tokens' included) are read through its block table.
 *
 * Layout (one layer): as paged_decode.c. q and out are [n, heads, head_dim]
 * contiguous; query token i sits at position context_len - n + i and sees keys
 * 0 ..= that position. Query head j reads KV head j / (heads / kv_heads).
 *
 * The context's K is first copied, widened to fp32, into 16-key tiles stored
 * transposed ([head_dim][16]), and V into fp32 rows; then each task (one KV
 * head, a run of query tokens with all their query heads) walks the key tiles
 * in order with an online softmax: scores of 8 query rows at a time against a
 * tile in registers, then the tile's probabilities times V. A row's arithmetic
 * depends only on its own query, position and the context, never on which
 * rows share its task: results are identical however a prompt is chunked,
 * batched or threaded. Math is fp32 for both storage dtypes.
 *
 * Built on first use by shared/kernels/build.py, called through ctypes.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vector_math.h"

#if defined(__AVX512F__)
#define KEY_TILE 16  /* keys per tile: one vector of scores per query row */
#define ROW_BLOCK 8  /* query rows scored together against one tile */
#define TASK_TOKENS 16

/* Tile-transposed K and fp32 V of KV head h for keys [0, len). */
#define DEFINE_STAGE(NAME, T, LOAD)                                                          \
    static void NAME(const T *k, const T *v, const int64_t *table, int64_t len,             \
                     int64_t block_size, int64_t block_stride, int64_t tok_stride,            \
                     int64_t d, int64_t tile, float *kt, float *vf) {                        \
        for (int64_t j = 0; j < KEY_TILE; j++) {                                            \
            int64_t key = tile * KEY_TILE + j;                                              \
            float *vrow = vf + key * d;                                                     \
            if (key >= len) {                                                               \
                for (int64_t i = 0; i < d; i++) kt[i * KEY_TILE + j] = 0.f;                \
                memset(vrow, 0, sizeof(float) * d);                                         \
                continue;                                                                   \
            }                                                                               \
            int64_t at = table[key / block_size] * block_stride + (key % block_size) * tok_stride; \
            for (int64_t i = 0; i < d; i++) {                                               \
                kt[i * KEY_TILE + j] = LOAD(k[at + i]);                                     \
                vrow[i] = LOAD(v[at + i]);                                                  \
            }                                                                               \
        }                                                                                   \
    }

/* Query rows [0, rows) (scaled fp32 in qf, rows padded to ROW_BLOCK) of one task
 * against every key tile up to the last one its newest row sees. */
static void attend(const float *qf, const int64_t *pos, int64_t rows, const float *kt,
                   const float *vf, int64_t d, float *s, float *o, float *m, float *l,
                   float *alpha) {
    int64_t last = pos[rows - 1] / KEY_TILE;
    for (int64_t r = 0; r < rows; r++) {
        m[r] = -INFINITY;
        l[r] = 0.f;
    }
    memset(o, 0, sizeof(float) * rows * d);
    for (int64_t tile = 0; tile <= last; tile++) {
        const float *kb = kt + tile * d * KEY_TILE;
        int64_t k0 = tile * KEY_TILE;
        for (int64_t r0 = 0; r0 < rows; r0 += ROW_BLOCK) {
            __m512 acc[ROW_BLOCK];
            for (int r = 0; r < ROW_BLOCK; r++) acc[r] = _mm512_setzero_ps();
            for (int64_t i = 0; i < d; i++) {
                __m512 kv = _mm512_loadu_ps(kb + i * KEY_TILE);
                for (int r = 0; r < ROW_BLOCK; r++)
                    acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(qf[(r0 + r) * d + i]), kv, acc[r]);
            }
            for (int r = 0; r < ROW_BLOCK; r++) _mm512_storeu_ps(s + (r0 + r) * KEY_TILE, acc[r]);
        }
        /* online softmax; rows that see none of this tile are left exactly as they were */
        for (int64_t r = 0; r < rows; r++) {
            int64_t seen = pos[r] - k0 + 1;
            if (seen <= 0) {
                alpha[r] = 0.f; /* marks the row idle for this tile */
                continue;
            }
            __mmask16 valid = seen >= KEY_TILE ? (__mmask16)0xffff : (__mmask16)((1u << seen) - 1u);
            __m512 x = _mm512_loadu_ps(s + r * KEY_TILE);
            float mx = _mm512_mask_reduce_max_ps(valid, x);
            float m_new = mx > m[r] ? mx : m[r];
            float a = m[r] == -INFINITY ? 0.f : exp_nonpositive(m[r] - m_new);
            __m512 p = _mm512_maskz_mov_ps(valid, vexp_nonpositive(_mm512_sub_ps(x, _mm512_set1_ps(m_new))));
            _mm512_storeu_ps(s + r * KEY_TILE, p);
            l[r] = l[r] * a + _mm512_reduce_add_ps(p);
            m[r] = m_new;
            alpha[r] = a;
        }
        for (int64_t j = 0; j < d; j += 16) {
            __m512 vr[KEY_TILE];
            for (int k = 0; k < KEY_TILE; k++) vr[k] = _mm512_loadu_ps(vf + (k0 + k) * d + j);
            for (int64_t r = 0; r < rows; r++) {
                if (pos[r] < k0) continue;
                const float *pr = s + r * KEY_TILE;
                __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(o + r * d + j), _mm512_set1_ps(alpha[r]));
                for (int k = 0; k < KEY_TILE; k++) acc = _mm512_fmadd_ps(_mm512_set1_ps(pr[k]), vr[k], acc);
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
            block_size <= 0 || n <= 0 || n > context_len)                                  \
            return 1;                                                                       \
        int64_t group = heads / kv_heads, tok_stride = kv_heads * d;                        \
        int64_t tiles = (context_len + KEY_TILE - 1) / KEY_TILE, prefix = context_len - n;  \
        int64_t span = tiles * KEY_TILE * d; /* floats per KV head, K and V each */        \
        float *kt = malloc(sizeof(float) * span * kv_heads);                                \
        float *vf = malloc(sizeof(float) * span * kv_heads);                                \
        if (kt == NULL || vf == NULL) {                                                     \
            free(kt);                                                                       \
            free(vf);                                                                       \
            return 2;                                                                       \
        }                                                                                   \
        _Pragma("omp parallel for num_threads(threads) schedule(static) collapse(2)")       \
        for (int64_t h = 0; h < kv_heads; h++)                                              \
            for (int64_t t = 0; t < tiles; t++)                                             \
                STAGE(k + h * d, v + h * d, table, context_len, block_size, block_stride,   \
                      tok_stride, d, t, kt + h * span + t * KEY_TILE * d, vf + h * span);   \
        int64_t chunks = (n + TASK_TOKENS - 1) / TASK_TOKENS;                               \
        int64_t max_rows = (TASK_TOKENS * group + ROW_BLOCK - 1) / ROW_BLOCK * ROW_BLOCK;   \
        int64_t per_thread = max_rows * (3 * d + KEY_TILE + 3) + max_rows;                 \
        int failed = 0;                                                                     \
        _Pragma("omp parallel num_threads(threads) reduction(|: failed)")                   \
        {                                                                                   \
            float *scratch = malloc(sizeof(float) * per_thread);                            \
            int64_t *pos = malloc(sizeof(int64_t) * max_rows);                              \
            failed = scratch == NULL || pos == NULL;                                        \
            _Pragma("omp for schedule(dynamic, 1) collapse(2)")                             \
            for (int64_t c = chunks - 1; c >= 0; c--) /* longest first */                 \
                for (int64_t h = 0; h < kv_heads; h++) {                                    \
                    if (scratch == NULL || pos == NULL) continue;                           \
                    int64_t t0 = c * TASK_TOKENS, t1 = t0 + TASK_TOKENS < n ? t0 + TASK_TOKENS : n; \
                    int64_t rows = (t1 - t0) * group;                                       \
                    int64_t padded = (rows + ROW_BLOCK - 1) / ROW_BLOCK * ROW_BLOCK;        \
                    float *qf = scratch, *o = qf + padded * d, *s = o + padded * d;         \
                    float *m = s + padded * KEY_TILE, *l = m + padded, *alpha = l + padded; \
                    for (int64_t t = t0; t < t1; t++)                                       \
                        for (int64_t g = 0; g < group; g++) {                               \
                            int64_t r = (t - t0) * group + g;                               \
                            const T *src = q + (t * heads + h * group + g) * d;             \
                            for (int64_t i = 0; i < d; i++) qf[r * d + i] = LOAD(src[i]) * scale; \
                            pos[r] = prefix + t;                                            \
                        }                                                                   \
                    for (int64_t r = rows; r < padded; r++) {                               \
                        memset(qf + r * d, 0, sizeof(float) * d);                           \
                        pos[r] = -1; /* padding: sees nothing */                            \
                    }                                                                       \
                    attend(qf, pos, rows, kt + h * span, vf + h * span, d, s, o, m, l, alpha); \
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
        free(kt);                                                                           \
        free(vf);                                                                           \
        return failed ? 2 : 0;                                                              \
    }

DEFINE_ENTRY(baton_paged_prefill_f32, stage_f32, float, load_f32, store_f32)
DEFINE_ENTRY(baton_paged_prefill_bf16, stage_bf16, uint16_t, bf16_to_f32, f32_to_bf16)

int baton_paged_prefill_available(void) { return 1; }
#else
int baton_paged_prefill_available(void) { return 0; }
#endif
