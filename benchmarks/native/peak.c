/* This core's arithmetic peak, measured: independent chains of one vector
 * instruction (16 accumulators, more than its latency times its throughput),
 * so the loop runs at the instruction's issue rate. Returns a value that
 * depends on every accumulator, so nothing is optimized away; the caller
 * times the call. Benchmarks only (share of peak in their reports). */
#include <stdint.h>
#if defined(__AVX512F__)
#include <immintrin.h>

#define CHAINS 16
#define PEAK_LOOP(ACC_T, ZERO, STEP, SUM)                                                   \
    ACC_T a[CHAINS];                                                                        \
    for (int i = 0; i < CHAINS; i++) a[i] = ZERO;                                           \
    for (int64_t n = 0; n < rounds; n++) {                                                  \
        _Pragma("GCC unroll 16") for (int i = 0; i < CHAINS; i++) a[i] = STEP;              \
    }                                                                                       \
    for (int i = 1; i < CHAINS; i++) a[0] = SUM;                                            \
    return _mm512_reduce_add_ps(a[0]);

/* rounds * 16 vfmadd231ps zmm: 32 fp32 FLOP each */
float baton_peak_fma32(int64_t rounds) {
    const __m512 x = _mm512_set1_ps(1e-9f), y = _mm512_set1_ps(1.f);
    PEAK_LOOP(__m512, _mm512_setzero_ps(), _mm512_fmadd_ps(a[i], y, x), _mm512_add_ps(a[0], a[i]))
}
int baton_peak_has_fma32(void) { return 1; }
#else
float baton_peak_fma32(int64_t rounds) { return (float)rounds; }
int baton_peak_has_fma32(void) { return 0; }
#endif

#if defined(__AVX512BF16__)
/* rounds * 16 vdpbf16ps zmm: 64 bf16 FLOP each (32 products, 32 sums) */
float baton_peak_dpbf16(int64_t rounds) {
    const __m512bh x = (__m512bh)_mm512_set1_epi32(0x3f803f80);
    PEAK_LOOP(__m512, _mm512_setzero_ps(), _mm512_dpbf16_ps(a[i], x, x), _mm512_add_ps(a[0], a[i]))
}
int baton_peak_has_dpbf16(void) { return 1; }
#else
float baton_peak_dpbf16(int64_t rounds) { return (float)rounds; }
int baton_peak_has_dpbf16(void) { return 0; }
#endif
