/* The decoder's row-wise ops for CPU, fp32 and bf16: RMSNorm, rotary position
 * embedding (in place on the fused QKV rows), SwiGLU's silu(gate) * up and
 * GeGLU's gelu_tanh(gate) * up.
 *
 * torch runs each of these as several ops with a temporary per op (RoPE is
 * eight: two slices, a negation, a concatenation, two products and a sum);
 * here each is one pass over its rows. Math is fp32; a bf16 result is rounded
 * where torch's bf16 ops round (after the normalization and again after the
 * weight; each RoPE product and the sum; silu and the product), so bf16
 * results match torch's path and Hugging Face's except where fp32 sums are
 * ordered differently.
 *
 * Rows are independent and each is computed start to end by one thread, so a
 * row's result does not depend on its batch or the thread count.
 *
 * Built on first use by shared/kernels/build.py, called through ctypes.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "vector_math.h"

/* One thread for a few rows: a parallel region costs more than they do. */
#define PARALLEL_ROWS "omp parallel for if (rows >= 16) num_threads(threads) schedule(static)"

INLINE float round_f32(float x) { return x; }
INLINE float round_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }

/* One row's RMSNorm: out = round(round(x / rms(x)) * w), x `width` long; with y, first
 * x = round(x + y) in place (a residual add). The sum of squares is the plain loop
 * (vectorized by the compiler as it always was: bf16 results stay torch's bits, and a
 * changed order flipped a greedy answer of the default model); the add and the scaling
 * are elementwise, in AVX-512. */
#if defined(__AVX512F__)
#define NORM_ADD_VECTOR(VLOAD, VSTORE, VROUND)                                              \
    for (; i + 16 <= width; i += 16)                                                        \
        VSTORE(x + i, VROUND(_mm512_add_ps(VLOAD(x + i), VLOAD(y + i))));
#define NORM_SCALE_VECTOR(VLOAD, VSTORE, VROUND)                                            \
    for (__m512 vinv = _mm512_set1_ps(inv); i + 16 <= width; i += 16)                       \
        VSTORE(out + i, _mm512_mul_ps(VROUND(_mm512_mul_ps(VLOAD(x + i), vinv)), VLOAD(w + i)));
#else
#define NORM_ADD_VECTOR(VLOAD, VSTORE, VROUND)
#define NORM_SCALE_VECTOR(VLOAD, VSTORE, VROUND)
#endif
#define DEFINE_NORM_ROW(NAME, T, LOAD, STORE, ROUND, VLOAD, VSTORE, VROUND)                 \
    INLINE void NAME(T *x, const T *y, const T *w, T *out, int64_t width, float eps) {      \
        int64_t i = 0;                                                                      \
        if (y != NULL) {                                                                    \
            NORM_ADD_VECTOR(VLOAD, VSTORE, VROUND)                                          \
            for (; i < width; i++) x[i] = STORE(ROUND(LOAD(x[i]) + LOAD(y[i])));            \
        }                                                                                   \
        float ss = 0.f;                                                                     \
        for (int64_t j = 0; j < width; j++) ss += LOAD(x[j]) * LOAD(x[j]);                 \
        float inv = 1.f / sqrtf(ss / (float)width + eps);                                   \
        i = 0;                                                                              \
        NORM_SCALE_VECTOR(VLOAD, VSTORE, VROUND)                                            \
        for (; i < width; i++) out[i] = STORE(ROUND(LOAD(x[i]) * inv) * LOAD(w[i]));       \
    }

/* out[r] = the norm of row r of x (rows of `width`). */
#define DEFINE_RMS_NORM(NAME, T, ROW)                                                       \
    void NAME(const T *x, const T *w, T *out, int64_t rows, int64_t width, float eps,       \
              int threads) {                                                                \
        _Pragma(PARALLEL_ROWS)                                                              \
        for (int64_t r = 0; r < rows; r++)                                                  \
            ROW((T *)(x + r * width), NULL, w, out + r * width, width, eps);                \
    }

/* The residual add and the norm after it in one pass: h[r] = round(h[r] + y[r]) (in
 * place), out[r] = the norm of the new h[r]; both as the add and rms_norm give. */
#define DEFINE_ADD_RMS_NORM(NAME, T, ROW)                                                   \
    void NAME(T *h, const T *y, const T *w, T *out, int64_t rows, int64_t width, float eps, \
              int threads) {                                                                \
        _Pragma(PARALLEL_ROWS)                                                              \
        for (int64_t r = 0; r < rows; r++)                                                  \
            ROW(h + r * width, y + r * width, w, out + r * width, width, eps);              \
    }

/* RMSNorm in place of `heads` head_dim-wide slices of each row (rows `stride`
 * values apart; Gemma's QK-norm on the fused QKV rows), each as rms_norm does
 * a row of width d. */
#define DEFINE_HEAD_RMS_NORM(NAME, T, ROW)                                                  \
    void NAME(T *x, int64_t rows, int64_t stride, int64_t heads, int64_t d, const T *w,     \
              float eps, int threads) {                                                     \
        int64_t n = rows * heads;                                                           \
        _Pragma("omp parallel for if (n >= 16) num_threads(threads) schedule(static)")      \
        for (int64_t i = 0; i < n; i++) {                                                   \
            T *xr = x + (i / heads) * stride + (i % heads) * d;                             \
            ROW(xr, NULL, w, xr, d, eps);                                                   \
        }                                                                                   \
    }

/* Rotate-half RoPE in place on the first `heads` head_dim-wide slices of each
 * row (the query and key heads of a fused QKV row `stride` values long), by
 * row r's angles cos/sin[positions[r]] (tables [max_position, head_dim]). Returns
 * 1, rotating nothing, for a position outside the tables. */
#if defined(__AVX512F__)
/* 16 pairs at a time, each element as the scalar loop computes it */
#define ROPE_VECTOR(VLOAD, VSTORE, VROUND)                                                  \
    for (; i + 16 <= half; i += 16) {                                                       \
        __m512 a = VLOAD(x + i), b = VLOAD(x + i + half);                                   \
        __m512 lo = _mm512_add_ps(VROUND(_mm512_mul_ps(a, VLOAD(c + i))),                   \
                                  VROUND(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), b), \
                                                       VLOAD(s + i))));                     \
        __m512 hi = _mm512_add_ps(VROUND(_mm512_mul_ps(b, VLOAD(c + i + half))),            \
                                  VROUND(_mm512_mul_ps(a, VLOAD(s + i + half))));           \
        VSTORE(x + i, lo);                                                                  \
        VSTORE(x + i + half, hi);                                                           \
    }
#else
#define ROPE_VECTOR(VLOAD, VSTORE, VROUND)
#endif
#define DEFINE_ROPE(NAME, T, LOAD, STORE, ROUND, VLOAD, VSTORE, VROUND)                     \
    int NAME(T *qkv, int64_t rows, int64_t stride, int64_t heads, int64_t d,               \
             const T *cos_t, const T *sin_t, int64_t max_position, const int64_t *positions, \
             int threads) {                                                                 \
        for (int64_t r = 0; r < rows; r++)                                                  \
            if (positions[r] < 0 || positions[r] >= max_position) return 1;                 \
        int64_t half = d / 2;                                                               \
        _Pragma(PARALLEL_ROWS)                                                              \
        for (int64_t r = 0; r < rows; r++) {                                                \
            const T *c = cos_t + positions[r] * d, *s = sin_t + positions[r] * d;           \
            for (int64_t h = 0; h < heads; h++) {                                           \
                T *x = qkv + r * stride + h * d;                                            \
                int64_t i = 0;                                                              \
                ROPE_VECTOR(VLOAD, VSTORE, VROUND)                                          \
                for (; i < half; i++) {                                                     \
                    float a = LOAD(x[i]), b = LOAD(x[i + half]);                            \
                    float lo = ROUND(a * LOAD(c[i])) + ROUND(-b * LOAD(s[i]));              \
                    float hi = ROUND(b * LOAD(c[i + half])) + ROUND(a * LOAD(s[i + half])); \
                    x[i] = STORE(lo);                                                       \
                    x[i + half] = STORE(hi);                                                \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
        return 0;                                                                           \
    }

#if defined(__AVX512F__)
/* 16 outputs at a time, the row's last ones masked (every element through the vector
 * form, as gemm.c's fused GLU computes them; vsilu and vgelu_tanh: vector_math.h) */
#define GLU_VECTOR(VACT, VLOAD, VSTORE, VROUND)                                             \
    for (; i < width; i += 16) {                                                            \
        __mmask16 m = first_lanes(width - i);                                               \
        VSTORE##_mask(out + r * width + i, m,                                               \
                      _mm512_mul_ps(VROUND(VACT(VLOAD##_mask(g + i, m))),                   \
                                    VLOAD##_mask(u + i, m)));                               \
    }
#else
#define GLU_VECTOR(VACT, VLOAD, VSTORE, VROUND)
#endif

/* out[r, i] = round(round(act(g[r, i])) * u[r, i]) where row r of gate_up is
 * [g | u], each `width` long. */
#define DEFINE_GLU_MUL(NAME, ACT, VACT, T, LOAD, STORE, ROUND, VLOAD, VSTORE, VROUND)       \
    void NAME(const T *gate_up, T *out, int64_t rows, int64_t width, int threads) {         \
        _Pragma(PARALLEL_ROWS)                                                              \
        for (int64_t r = 0; r < rows; r++) {                                                \
            const T *g = gate_up + r * 2 * width, *u = g + width;                           \
            int64_t i = 0;                                                                  \
            GLU_VECTOR(VACT, VLOAD, VSTORE, VROUND)                                         \
            for (; i < width; i++)                                                          \
                out[r * width + i] = STORE(ROUND(ACT(LOAD(g[i]))) * LOAD(u[i]));            \
        }                                                                                   \
    }

DEFINE_NORM_ROW(norm_row_f32, float, load_f32, store_f32, round_f32, vload_f32, vstore_f32,
                vround_f32)
DEFINE_NORM_ROW(norm_row_bf16, uint16_t, bf16_to_f32, f32_to_bf16, round_bf16, vload_bf16,
                vstore_bf16, vround_bf16)
DEFINE_RMS_NORM(baton_rms_norm_f32, float, norm_row_f32)
DEFINE_RMS_NORM(baton_rms_norm_bf16, uint16_t, norm_row_bf16)
DEFINE_ADD_RMS_NORM(baton_add_rms_norm_f32, float, norm_row_f32)
DEFINE_ADD_RMS_NORM(baton_add_rms_norm_bf16, uint16_t, norm_row_bf16)
DEFINE_HEAD_RMS_NORM(baton_head_rms_norm_f32, float, norm_row_f32)
DEFINE_HEAD_RMS_NORM(baton_head_rms_norm_bf16, uint16_t, norm_row_bf16)
DEFINE_ROPE(baton_rope_f32, float, load_f32, store_f32, round_f32, vload_f32, vstore_f32,
            vround_f32)
DEFINE_ROPE(baton_rope_bf16, uint16_t, bf16_to_f32, f32_to_bf16, round_bf16, vload_bf16,
            vstore_bf16, vround_bf16)
DEFINE_GLU_MUL(baton_silu_mul_f32, silu, vsilu, float, load_f32, store_f32, round_f32, vload_f32,
               vstore_f32, vround_f32)
DEFINE_GLU_MUL(baton_silu_mul_bf16, silu, vsilu, uint16_t, bf16_to_f32, f32_to_bf16, round_bf16,
               vload_bf16, vstore_bf16, vround_bf16)
DEFINE_GLU_MUL(baton_gelu_tanh_mul_f32, gelu_tanh, vgelu_tanh, float, load_f32, store_f32,
               round_f32, vload_f32, vstore_f32, vround_f32)
DEFINE_GLU_MUL(baton_gelu_tanh_mul_bf16, gelu_tanh, vgelu_tanh, uint16_t, bf16_to_f32,
               f32_to_bf16, round_bf16, vload_bf16, vstore_bf16, vround_bf16)
