/* Weight GEMM for CPU decode and prefill: out[M, N] = x[M, K] @ w[N, K]^T, fp32
 * or bf16 (fp32 sums, rounded once at the end as torch rounds).
 *
 * The weight is packed once into panels of PANEL (48) output columns: fp32 as
 * [ceil(N / 48), K, 48], bf16 as [ceil(N / 48), K / 2, 48, 2] (k pairs side by
 * side, the operand order of AVX512-BF16's dot product; K even). The inner
 * loop reads one panel row of three vectors per k step and broadcasts one x
 * value (one bf16 pair) per activation row: a tile of up to 8 rows x 48
 * columns keeps its 24 sums in registers for the whole K. Panels are the outer
 * loop: each is streamed from memory once per call and reused from L2 by
 * every row tile.
 *
 * Decode multiplies a few rows by a weight far larger than the caches, so the
 * first row tile of a panel would wait on DRAM. While a panel is computed the
 * next one is prefetched, spread over all its row tiles, so the stream
 * overlaps the arithmetic (one forward's fp32 weights at 32 rows, one thread:
 * 172 -> 214 GFLOPS).
 *
 * Every output is one chain of multiply-adds over k in order, whatever the
 * row count, the tile a row falls in or the thread count: a row's result does
 * not depend on the batch it is in.
 *
 * Built on first use by shared/kernels/build.py, called through ctypes.
 */
#include <stdint.h>
#include <string.h>

#include "vector_math.h"

#define PANEL 48   /* output columns per packed panel: three 16-float vectors */
#define ROW_TILE 8 /* activation rows per register tile (24 accumulators) */

int baton_gemm_panel(void) { return PANEL; }

/* w [n, k] row-major -> panels of PANEL columns, k in groups of PAIR; columns
 * past n are zero. */
#define DEFINE_PACK(NAME, T, PAIR)                                                          \
    void NAME(const T *w, int64_t n, int64_t k, T *packed) {                                \
        int64_t panels = (n + PANEL - 1) / PANEL;                                           \
        for (int64_t p = 0; p < panels; p++) {                                              \
            T *dst = packed + p * k * PANEL;                                                \
            for (int64_t j = 0; j < PANEL; j++) {                                           \
                int64_t col = p * PANEL + j;                                                \
                for (int64_t i = 0; i < k; i++)                                             \
                    dst[(i / PAIR) * PANEL * PAIR + j * PAIR + i % PAIR] =                  \
                        col < n ? w[col * k + i] : (T)0;                                    \
            }                                                                               \
        }                                                                                   \
    }

DEFINE_PACK(baton_gemm_pack_f32, float, 1)
DEFINE_PACK(baton_gemm_pack_bf16, uint16_t, 2)

#if defined(__AVX512F__)
#include <immintrin.h>

/* The part of the next panel a tile prefetches: lines [cursor, end). */
typedef struct {
    const char *cursor;
    const char *end;
} Prefetch;

/* Prefetch lines per k step so that the next panel is requested while this one
 * is computed: one per step where there are three row tiles or more to spread
 * it over, two for one or two tiles. One or two rows read the weight at the
 * memory's pace already, and prefetches measured slower there. */
static int prefetch_per_k(int64_t m) {
    int64_t tiles = (m + ROW_TILE - 1) / ROW_TILE;
    if (m <= 2) return 0;
    return tiles >= 3 ? 1 : 2;
}

/* One dtype's kernel. T: storage type; PAIR: k values per step; BCAST(x): the
 * step's x value(s) of one row as a vector; MAC(acc, xv, b): acc += xv * b;
 * STORE(out, acc, cols): a row of cols results. rows and per_k are constants at
 * every tile call, so its loops unroll and the sums stay in registers. */
#define DEFINE_GEMM(NAME, T, PAIR, BCAST, MAC, STORE)                                        \
    INLINE void NAME##_tile(const int rows, const int per_k, const T *x, int64_t k_len,     \
                            const T *panel, T *out, int64_t ldo, int64_t cols,              \
                            Prefetch *pf) {                                                 \
        __m512 acc[ROW_TILE][3];                                                            \
        _Pragma("GCC unroll 8") for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] =      \
            acc[r][2] = _mm512_setzero_ps();                                                \
        const char *cursor = pf->cursor;                                                    \
        for (int64_t k = 0; k < k_len; k += PAIR) {                                         \
            _Pragma("GCC unroll 3") for (int i = 0; i < per_k; i++) if (cursor < pf->end) { \
                _mm_prefetch(cursor, _MM_HINT_T0);                                          \
                cursor += 64;                                                               \
            }                                                                               \
            const float *b = (const float *)(panel + k * PANEL);                            \
            __m512 b0 = _mm512_loadu_ps(b), b1 = _mm512_loadu_ps(b + 16);                   \
            __m512 b2 = _mm512_loadu_ps(b + 32);                                            \
            _Pragma("GCC unroll 8") for (int r = 0; r < rows; r++) {                        \
                __m512 xr = BCAST(x + r * k_len + k);                                       \
                acc[r][0] = MAC(acc[r][0], xr, b0);                                         \
                acc[r][1] = MAC(acc[r][1], xr, b1);                                         \
                acc[r][2] = MAC(acc[r][2], xr, b2);                                         \
            }                                                                               \
        }                                                                                   \
        pf->cursor = cursor;                                                                \
        for (int r = 0; r < rows; r++) STORE(out + r * ldo, acc[r], cols);                  \
    }                                                                                       \
                                                                                            \
    static void NAME##_any_tile(int rows, int per_k, const T *x, int64_t k_len,             \
                                const T *panel, T *out, int64_t ldo, int64_t cols,          \
                                Prefetch *pf) {                                             \
        switch (per_k * 16 + rows) {                                                        \
            TILE_CASES(NAME, 0)                                                             \
            TILE_CASES(NAME, 1)                                                             \
            TILE_CASES(NAME, 2)                                                             \
        }                                                                                   \
    }                                                                                       \
                                                                                            \
    /* Returns 0, or 1 for arguments it does not handle. x is [m, k_len]          \
     * contiguous, out is [m, n] with rows ldo elements apart. */                          \
    int NAME(const T *x, int64_t m, int64_t k_len, const T *packed, int64_t n, T *out,      \
             int64_t ldo, int threads) {                                                    \
        if (m < 0 || k_len <= 0 || k_len % PAIR || n <= 0 || ldo < n) return 1;             \
        int64_t panels = (n + PANEL - 1) / PANEL;                                           \
        int per_k = prefetch_per_k(m);                                                      \
        _Pragma("omp parallel for num_threads(threads) schedule(static)")                   \
        for (int64_t p = 0; p < panels; p++) {                                              \
            const T *panel = packed + p * k_len * PANEL;                                    \
            const char *next = (const char *)(panel + k_len * PANEL);                       \
            Prefetch pf = {next, p + 1 < panels ? next + k_len * PANEL * sizeof(T) : next}; \
            int64_t cols = n - p * PANEL < PANEL ? n - p * PANEL : PANEL;                   \
            for (int64_t r = 0; r < m; r += ROW_TILE) {                                     \
                int rows = m - r < ROW_TILE ? (int)(m - r) : ROW_TILE;                      \
                NAME##_any_tile(rows, per_k, x + r * k_len, k_len, panel,                  \
                                out + r * ldo + p * PANEL, ldo, cols, &pf);                 \
            }                                                                               \
        }                                                                                   \
        return 0;                                                                           \
    }

#define TILE_CASE(NAME, P, R)                                                               \
    case P * 16 + R:                                                                        \
        NAME##_tile(R, P, x, k_len, panel, out, ldo, cols, pf);                             \
        return;
#define TILE_CASES(NAME, P)                                                                 \
    TILE_CASE(NAME, P, 1) TILE_CASE(NAME, P, 2) TILE_CASE(NAME, P, 3) TILE_CASE(NAME, P, 4) \
    TILE_CASE(NAME, P, 5) TILE_CASE(NAME, P, 6) TILE_CASE(NAME, P, 7) TILE_CASE(NAME, P, 8)

INLINE __m512 bcast_f32(const float *x) { return _mm512_set1_ps(*x); }
INLINE __m512 mac_f32(__m512 acc, __m512 x, __m512 b) { return _mm512_fmadd_ps(x, b, acc); }
INLINE void store_f32_row(float *out, const __m512 acc[3], int64_t cols) {
    if (cols == PANEL) {
        _mm512_storeu_ps(out, acc[0]);
        _mm512_storeu_ps(out + 16, acc[1]);
        _mm512_storeu_ps(out + 32, acc[2]);
        return;
    }
    float row[PANEL]; /* the last panel of an n that is not a multiple */
    for (int v = 0; v < 3; v++) _mm512_storeu_ps(row + 16 * v, acc[v]);
    memcpy(out, row, sizeof(float) * (size_t)cols);
}

DEFINE_GEMM(baton_gemm_f32, float, 1, bcast_f32, mac_f32, store_f32_row)
int baton_gemm_available(void) { return 1; }

#if defined(__AVX512BF16__)
INLINE __m512 bcast_bf16(const uint16_t *x) {
    uint32_t pair;
    memcpy(&pair, x, sizeof pair);
    return _mm512_castsi512_ps(_mm512_set1_epi32((int)pair));
}
INLINE __m512 mac_bf16(__m512 acc, __m512 x, __m512 b) {
    return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)b);
}
INLINE void store_bf16_row(uint16_t *out, const __m512 acc[3], int64_t cols) {
    float row[PANEL];
    for (int v = 0; v < 3; v++) _mm512_storeu_ps(row + 16 * v, acc[v]);
    for (int64_t j = 0; j < cols; j++) out[j] = f32_to_bf16(row[j]);
}

DEFINE_GEMM(baton_gemm_bf16, uint16_t, 2, bcast_bf16, mac_bf16, store_bf16_row)
int baton_gemm_available_bf16(void) { return 1; }
#endif
#else
int baton_gemm_available(void) { return 0; }
#endif

/* Stubs where the compiler did not target the instructions a dtype needs. */
#if !defined(__AVX512F__)
int baton_gemm_f32(const float *x, int64_t m, int64_t k_len, const float *packed, int64_t n,
                   float *out, int64_t ldo, int threads) {
    (void)x, (void)m, (void)k_len, (void)packed, (void)n, (void)out, (void)ldo, (void)threads;
    return 1;
}
#endif
#if !defined(__AVX512F__) || !defined(__AVX512BF16__)
int baton_gemm_available_bf16(void) { return 0; }
int baton_gemm_bf16(const uint16_t *x, int64_t m, int64_t k_len, const uint16_t *packed,
                    int64_t n, uint16_t *out, int64_t ldo, int threads) {
    (void)x, (void)m, (void)k_len, (void)packed, (void)n, (void)out, (void)ldo, (void)threads;
    return 1;
}
#endif
