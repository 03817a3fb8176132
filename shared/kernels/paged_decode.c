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
 * Built on first use by shared/kernels/build.py, called through ctypes.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))

INLINE float bf16_to_f32(uint16_t x) {
    union { uint32_t u; float f; } c = {.u = (uint32_t)x << 16};
    return c.f;
}

INLINE uint16_t f32_to_bf16(float f) {
    union { float f; uint32_t u; } c = {.f = f};
    if ((c.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((c.u >> 16) | 0x40u); /* NaN */
    return (uint16_t)((c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16); /* nearest even, as torch */
}

INLINE float load_f32(float x) { return x; }
INLINE float store_f32(float x) { return x; }

/* exp(x) for x <= 0 (scores minus their max): Cody-Waite reduction and a
 * degree-6 polynomial, within 2 ulp; plain arithmetic so loops of it vectorize. */
INLINE float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    int32_t ni = (int32_t)(x * 1.44269504f - 0.5f); /* truncation: round to nearest, x <= 0 */
    float n = (float)ni;
    float r = x - n * 0.693145752f - n * 1.42860677e-6f;
    float p = 1.f / 720.f;
    p = p * r + 1.f / 120.f;
    p = p * r + 1.f / 24.f;
    p = p * r + 1.f / 6.f;
    p = p * r + 0.5f;
    p = p * r + 1.f;
    p = p * r + 1.f;
    union { uint32_t u; float f; } scale = {.u = (uint32_t)(ni + 127) << 23};
    return p * scale.f;
}

/* One (sequence, KV head) pair: its `group` query heads over `len` tokens.
 * scratch holds group * (d + ceil(len / block_size) * block_size) floats. */
#define DEFINE_HEAD(NAME, T, LOAD, STORE)                                                  \
    INLINE void NAME(const T *q, const T *k, const T *v, T *out, const int64_t *table,    \
                     int64_t len, int64_t block_size, int64_t block_stride,                \
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
            float mx = sg[0];                                                              \
            for (int64_t t = 1; t < len; t++) mx = sg[t] > mx ? sg[t] : mx;                \
            float sum = 0.f;                                                               \
            for (int64_t t = 0; t < len; t++) {                                            \
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

/* Entry points return 0 on success, 1 on arguments they do not handle, 2 when
 * scratch memory cannot be had. head_dim is specialized for 64 and 128 (the
 * common Llama sizes) so the inner loops unroll into whole vector registers. */
#define DEFINE_ENTRY(NAME, HEAD, T)                                                        \
    int NAME(const T *q, const T *k, const T *v, T *out, const int64_t *tables,          \
             const int64_t *lens, int64_t batch, int64_t width, int64_t heads,            \
             int64_t kv_heads, int64_t d, int64_t block_size, int64_t block_stride,       \
             float scale, int threads) {                                                  \
        if (kv_heads <= 0 || heads % kv_heads != 0 || d <= 0 || block_size <= 0) return 1; \
        int64_t group = heads / kv_heads, tok_stride = kv_heads * d;                      \
        int64_t per_thread = group * (d + width * block_size);                            \
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
                    const T *qh = q + off, *kh = k + h * d, *vh = v + h * d;              \
                    const int64_t *tb = tables + b * width;                               \
                    if (d == 64)                                                          \
                        HEAD(qh, kh, vh, out + off, tb, lens[b], block_size, block_stride, \
                             tok_stride, group, 64, scale, scratch);                      \
                    else if (d == 128)                                                    \
                        HEAD(qh, kh, vh, out + off, tb, lens[b], block_size, block_stride, \
                             tok_stride, group, 128, scale, scratch);                     \
                    else                                                                  \
                        HEAD(qh, kh, vh, out + off, tb, lens[b], block_size, block_stride, \
                             tok_stride, group, d, scale, scratch);                       \
                }                                                                         \
            free(scratch);                                                                \
        }                                                                                 \
        return failed ? 2 : 0;                                                            \
    }

DEFINE_ENTRY(baton_paged_decode_f32, head_f32, float)
DEFINE_ENTRY(baton_paged_decode_bf16, head_bf16, uint16_t)
