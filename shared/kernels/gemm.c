/* fp32 weight GEMM for CPU decode and prefill: out[M, N] = x[M, K] @ w[N, K]^T.
 *
 * The weight is packed once into panels of PANEL (48) output columns,
 * [ceil(N / 48), K, 48] (baton_gemm_pack_f32), so the inner loop reads one
 * panel row of three 16-float vectors per k and broadcasts one x value per
 * activation row: a tile of up to 8 rows x 48 columns keeps its 24 sums in
 * registers for the whole K. Panels are the outer loop: each one is streamed
 * from memory once per call and reused from L2 by every row tile.
 *
 * Decode multiplies a few rows by a weight far larger than the caches, so the
 * first row tile of a panel would wait on DRAM. While a panel is computed, the
 * next panel is prefetched, spread over all its row tiles, so the stream
 * overlaps the arithmetic (measured: 172 -> 214 GFLOPS over a forward's
 * weights at 32 rows, one thread).
 *
 * Every output is one fp32 FMA chain over k = 0..K-1 in order, whatever the
 * row count, the tile a row falls in or the thread count: a row's result does
 * not depend on the batch it is in.
 *
 * Built on first use by shared/kernels/build.py, called through ctypes.
 */
#include <stdint.h>
#include <string.h>

#define PANEL 48    /* output columns per packed panel: three 16-float vectors */
#define ROW_TILE 8  /* activation rows per register tile (24 accumulators) */

int baton_gemm_panel(void) { return PANEL; }

/* w [N, K] row-major -> packed [ceil(N / PANEL), K, PANEL]; columns past N are zero. */
void baton_gemm_pack_f32(const float *w, int64_t n, int64_t k, float *packed) {
    int64_t panels = (n + PANEL - 1) / PANEL;
    for (int64_t p = 0; p < panels; p++) {
        float *dst = packed + p * k * PANEL;
        for (int64_t j = 0; j < PANEL; j++) {
            int64_t col = p * PANEL + j;
            if (col >= n) {
                for (int64_t i = 0; i < k; i++) dst[i * PANEL + j] = 0.f;
                continue;
            }
            const float *src = w + col * k;
            for (int64_t i = 0; i < k; i++) dst[i * PANEL + j] = src[i];
        }
    }
}

#if defined(__AVX512F__)
#include <immintrin.h>

#define INLINE static inline __attribute__((always_inline))

/* The part of the next panel a tile prefetches: lines [*cursor, end), `per_k`
 * lines per k step. */
typedef struct {
    const char *cursor;
    const char *end;
} Prefetch;

/* rows x PANEL outputs of one panel; rows and per_k are compile-time constants
 * at every call, so the loops unroll and the sums stay in registers. */
INLINE void tile(const int rows, const int per_k, const float *x, int64_t k_len,
                 const float *panel, float *out, int64_t ldo, int64_t cols, Prefetch *pf) {
    __m512 acc[ROW_TILE][3];
#pragma GCC unroll 8
    for (int r = 0; r < rows; r++)
        acc[r][0] = acc[r][1] = acc[r][2] = _mm512_setzero_ps();
    const char *cursor = pf->cursor;
    for (int64_t k = 0; k < k_len; k++) {
#pragma GCC unroll 3
        for (int i = 0; i < per_k; i++)
            if (cursor < pf->end) {
                _mm_prefetch(cursor, _MM_HINT_T0);
                cursor += 64;
            }
        const float *b = panel + k * PANEL;
        __m512 b0 = _mm512_loadu_ps(b), b1 = _mm512_loadu_ps(b + 16), b2 = _mm512_loadu_ps(b + 32);
#pragma GCC unroll 8
        for (int r = 0; r < rows; r++) {
            __m512 xr = _mm512_set1_ps(x[r * k_len + k]);
            acc[r][0] = _mm512_fmadd_ps(xr, b0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(xr, b1, acc[r][1]);
            acc[r][2] = _mm512_fmadd_ps(xr, b2, acc[r][2]);
        }
    }
    pf->cursor = cursor;
    if (cols == PANEL) {
#pragma GCC unroll 8
        for (int r = 0; r < rows; r++) {
            _mm512_storeu_ps(out + r * ldo, acc[r][0]);
            _mm512_storeu_ps(out + r * ldo + 16, acc[r][1]);
            _mm512_storeu_ps(out + r * ldo + 32, acc[r][2]);
        }
        return;
    }
    for (int r = 0; r < rows; r++) { /* the last panel of an N that is not a multiple */
        float row[PANEL];
        _mm512_storeu_ps(row, acc[r][0]);
        _mm512_storeu_ps(row + 16, acc[r][1]);
        _mm512_storeu_ps(row + 32, acc[r][2]);
        memcpy(out + r * ldo, row, sizeof(float) * (size_t)cols);
    }
}

#define TILE(R, P) tile(R, P, x, k_len, panel, out, ldo, cols, pf)
#define TILE_CASES(P)                                                                      \
    switch (rows) {                                                                        \
    case 8: TILE(8, P); return;                                                            \
    case 7: TILE(7, P); return;                                                            \
    case 6: TILE(6, P); return;                                                            \
    case 5: TILE(5, P); return;                                                            \
    case 4: TILE(4, P); return;                                                            \
    case 3: TILE(3, P); return;                                                            \
    case 2: TILE(2, P); return;                                                            \
    default: TILE(1, P); return;                                                           \
    }

static void any_tile(int rows, int per_k, const float *x, int64_t k_len, const float *panel,
                     float *out, int64_t ldo, int64_t cols, Prefetch *pf) {
    switch (per_k) {
    case 0: TILE_CASES(0)
    case 1: TILE_CASES(1)
    case 2: TILE_CASES(2)
    default: TILE_CASES(3)
    }
}

/* Prefetch lines per k step so that the next panel (3 lines per k) is requested
 * while this one is computed: spread over the row tiles where there are several,
 * two per step for one or two tiles. One or two rows read the weight at the
 * memory's pace already, and prefetches measured slower there. */
static int prefetch_per_k(int64_t m) {
    int64_t tiles = (m + ROW_TILE - 1) / ROW_TILE;
    if (m <= 2) return 0;
    return tiles >= 3 ? 1 : 2;
}

int baton_gemm_available(void) { return 1; }

/* Returns 0, or 1 for arguments it does not handle. x is [m, k] contiguous,
 * out is [m, n] with rows ldo floats apart. */
int baton_gemm_f32(const float *x, int64_t m, int64_t k_len, const float *packed, int64_t n,
                   float *out, int64_t ldo, int threads) {
    if (m < 0 || k_len <= 0 || n <= 0 || ldo < n) return 1;
    int64_t panels = (n + PANEL - 1) / PANEL;
    int per_k = prefetch_per_k(m);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        const float *panel = packed + p * k_len * PANEL;
        const char *next = (const char *)(panel + k_len * PANEL);
        Prefetch pf = {next, p + 1 < panels ? next + k_len * PANEL * sizeof(float) : next};
        int64_t cols = n - p * PANEL < PANEL ? n - p * PANEL : PANEL;
        for (int64_t r = 0; r < m; r += ROW_TILE) {
            int rows = m - r < ROW_TILE ? (int)(m - r) : ROW_TILE;
            any_tile(rows, per_k, x + r * k_len, k_len, panel, out + r * ldo + p * PANEL, ldo,
                     cols, &pf);
        }
    }
    return 0;
}

#else
int baton_gemm_available(void) { return 0; }
int baton_gemm_f32(const float *x, int64_t m, int64_t k_len, const float *packed, int64_t n,
                   float *out, int64_t ldo, int threads) {
    (void)x, (void)m, (void)k_len, (void)packed, (void)n, (void)out, (void)ldo, (void)threads;
    return 1;
}
#endif
