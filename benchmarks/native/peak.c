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

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
/* rounds * 12 vfmadd231ps ymm: 16 fp32 FLOP each (the unit of CPUs without AVX-512).
 * 12 chains: with the two operands they fill the 16 ymm registers, no spills. */
float baton_peak_fma32_ymm(int64_t rounds) {
    const __m256 x = _mm256_set1_ps(1e-9f), y = _mm256_set1_ps(1.f);
    __m256 a[12];
    for (int i = 0; i < 12; i++) a[i] = _mm256_setzero_ps();
    for (int64_t n = 0; n < rounds; n++) {
        _Pragma("GCC unroll 12") for (int i = 0; i < 12; i++) a[i] = _mm256_fmadd_ps(a[i], y, x);
    }
    for (int i = 1; i < 12; i++) a[0] = _mm256_add_ps(a[0], a[i]);
    float lanes[8];
    _mm256_storeu_ps(lanes, a[0]);
    return lanes[0] + lanes[7];
}
int baton_peak_has_fma32_ymm(void) { return 1; }
#else
float baton_peak_fma32_ymm(int64_t rounds) { return (float)rounds; }
int baton_peak_has_fma32_ymm(void) { return 0; }
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

#include "../../shared/kernels/amx.h"
#if defined(HAVE_AMX)
/* rounds * 6 tdpbf16ps, each a 16 x 16 tile of sums over 32 bf16 products: 16,384
 * FLOP. Six accumulator tiles (0-5) share the operands in tiles 6 and 7, more
 * chains than the instruction's latency over its issue interval. 0 where Linux
 * refuses the process AMX state. */
float baton_peak_amx(int64_t rounds) {
    if (!amx_permitted()) return 0.f;
    amx_configure();
    static uint16_t operand[AMX_ROWS * AMX_K];
    float sums[AMX_ROWS * AMX_ROWS];
    for (int i = 0; i < AMX_ROWS * AMX_K; i++) operand[i] = 0x3000; /* bf16 ~4.7e-10 */
    _tile_loadd(6, operand, 64);
    _tile_loadd(7, operand, 64);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    _tile_zero(4);
    _tile_zero(5);
    for (int64_t n = 0; n < rounds; n++) {
        _tile_dpbf16ps(0, 6, 7);
        _tile_dpbf16ps(1, 6, 7);
        _tile_dpbf16ps(2, 6, 7);
        _tile_dpbf16ps(3, 6, 7);
        _tile_dpbf16ps(4, 6, 7);
        _tile_dpbf16ps(5, 6, 7);
    }
    float total = 0.f;
    _tile_stored(0, sums, 64);
    total += sums[0];
    _tile_stored(5, sums, 64);
    total += sums[AMX_ROWS * AMX_ROWS - 1];
    _tile_release();
    return total;
}
int baton_peak_has_amx(void) { return amx_permitted(); }
#else
float baton_peak_amx(int64_t rounds) { return (float)rounds; }
int baton_peak_has_amx(void) { return 0; }
#endif
