/* Scalar and AVX-512 helpers shared by the CPU kernels: bf16 conversions as
 * torch rounds, and exp for non-positive arguments (a max-subtracted softmax,
 * silu's e^-|x|). */
#ifndef BATON_VECTOR_MATH_H
#define BATON_VECTOR_MATH_H
#include <stdint.h>

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

/* The gated activations of a GLU MLP (pointwise.c's silu * up and gelu * up; gemm.c
 * fuses them into the gate/up GEMM with the same vector functions below, so the fused
 * form gives the same bits). */
enum { GLU_NONE = 0, GLU_SILU = 1, GLU_GELU_TANH = 2 };
#define GELU_K 0.7978845608028654f /* sqrt(2 / pi) */

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

/* The scalar gated activations (pointwise.c's GLU; gemm.c's fused AVX2 GLU): exp(x) for
 * any x that silu meets, from the non-positive kernel: silu(x) =
 * x / (1 + e^-x) for x >= 0 and x e^x / (1 + e^x) below. */
INLINE float silu(float x) {
    float e = exp_nonpositive(x >= 0.f ? -x : x);
    return x >= 0.f ? x / (1.f + e) : x * e / (1.f + e);
}

/* GELU, tanh approximation (torch's approximate="tanh"): 0.5 x (1 + tanh(y)),
 * y = sqrt(2 / pi) (x + 0.044715 x^3), computed as x * sigmoid(2y), which is
 * the same function without the cancellation 1 + tanh(y) suffers for y << 0
 * (so bf16 results can differ from torch's by one unit in the last place). */
INLINE float gelu_tanh(float x) {
    float y2 = 2.f * GELU_K * (x + 0.044715f * x * x * x);
    float e = exp_nonpositive(y2 >= 0.f ? -y2 : y2);
    return y2 >= 0.f ? x / (1.f + e) : x * e / (1.f + e);
}

#if defined(__AVX512F__)
#include <immintrin.h>
#include <math.h>

/* Vector form of exp_nonpositive, the same reduction and polynomial. */
INLINE __m512 vexp_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 y = _mm512_fmsub_ps(x, _mm512_set1_ps(1.44269504f), _mm512_set1_ps(0.5f));
    /* truncated as the scalar form's cast truncates; 2^n applied by vscalefps, exact
     * as the multiply by a built power of two was (n >= -126 after the clamp) */
    __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
    __m512 p = _mm512_set1_ps(1.f / 720.f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

INLINE __m512 vload_f32(const float *p) { return _mm512_loadu_ps(p); }
INLINE __m512 vload_bf16(const uint16_t *p) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

/* Vector form of f32_to_bf16: nearest even, NaN kept quiet. Where the CPU converts
 * (AVX512-BF16) one instruction does it (a sixth of the instructions of silu * up
 * went to two of these); it flushes fp32 denormals (below 1.2e-38) to zero, which
 * the scalar form keeps: each element always takes the same one of them (its place
 * in the row decides, never the batch), so rows still match across batches. */
INLINE __m256i vf32_to_bf16_scalar(__m512 x) { /* f32_to_bf16's bits exactly */
    __m512i u = _mm512_castps_si512(x);
    __m512i high = _mm512_srli_epi32(u, 16);
    __m512i lsb = _mm512_and_si512(high, _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
    r = _mm512_srli_epi32(r, 16);
    __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(high, _mm512_set1_epi32(0x40)));
    return _mm512_cvtepi32_epi16(r);
}
INLINE __m256i vf32_to_bf16(__m512 x) {
#if defined(__AVX512BF16__)
    return (__m256i)_mm512_cvtneps_pbh(x);
#else
    return vf32_to_bf16_scalar(x);
#endif
}
INLINE void vstore_f32(float *p, __m512 x) { _mm512_storeu_ps(p, x); }
INLINE void vstore_bf16(uint16_t *p, __m512 x) {
    _mm256_storeu_si256((__m256i *)p, vf32_to_bf16(x));
}
/* The lanes `m` of 16 values (the rest read as zero, written not at all). */
INLINE __m512 vload_f32_mask(const float *p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
INLINE __m512 vload_bf16_mask(const uint16_t *p, __mmask16 m) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
INLINE void vstore_f32_mask(float *p, __mmask16 m, __m512 x) { _mm512_mask_storeu_ps(p, m, x); }
INLINE void vstore_bf16_mask(uint16_t *p, __mmask16 m, __m512 x) {
    _mm256_mask_storeu_epi16(p, m, vf32_to_bf16(x));
}
/* The first `n` of 16 lanes (all for n >= 16). */
INLINE __mmask16 first_lanes(int64_t n) {
    return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u);
}
/* bf16 values widened to fp32 (exact) */
INLINE __m512 vwiden_bf16(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
/* x rounded to bf16 precision, kept as fp32 */
INLINE __m512 vround_f32(__m512 x) { return x; }
INLINE __m512 vround_bf16(__m512 x) { return vwiden_bf16(vf32_to_bf16(x)); }


/* silu(x) = x / (1 + e^-x) for x >= 0 and x e^x / (1 + e^x) below. */
INLINE __m512 vsilu(__m512 x) {
    __m512 e = vexp_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));
    __m512 den = _mm512_add_ps(_mm512_set1_ps(1.f), e);
    __mmask16 neg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
    return _mm512_div_ps(_mm512_mask_mul_ps(x, neg, x, e), den);
}
/* GELU's tanh approximation as x * sigmoid(2y), y = sqrt(2 / pi) (x + 0.044715 x^3)
 * (see pointwise.c) */
INLINE __m512 vgelu_tanh(__m512 x) {
    __m512 x3 = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
    __m512 y2 = _mm512_mul_ps(_mm512_set1_ps(2.f * GELU_K),
                              _mm512_fmadd_ps(_mm512_set1_ps(0.044715f), x3, x));
    __m512 e = vexp_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(y2)));
    __m512 den = _mm512_add_ps(_mm512_set1_ps(1.f), e);
    __mmask16 neg = _mm512_cmp_ps_mask(y2, _mm512_setzero_ps(), _CMP_LT_OQ);
    return _mm512_div_ps(_mm512_mask_mul_ps(x, neg, x, e), den);
}
/* The activation `act` (GLU_SILU or GLU_GELU_TANH) of gate values. */
INLINE __m512 vglu_act(int act, __m512 x) { return act == GLU_SILU ? vsilu(x) : vgelu_tanh(x); }

#endif
#endif
