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
 * bf16 on a CPU with AMX (and K a multiple of 32): every row, decode's and
 * prefill's alike, goes through AMX tiles instead (blocks of 32 or 16 rows x the
 * panel's three 16-column tiles, k in order in steps of 32). The packed panel is
 * already the B tiles' layout (k pairs, 192-byte rows). AMX rounds its sums
 * differently from AVX512-BF16, so the choice depends on K and the machine
 * only, never on the row count: a row's result still does not depend on its
 * batch (nor on the block it falls in: each row of a tile product is its own
 * chain), and a prompt computes 3-4x faster.
 *
 * fp32 on a CPU with AVX2 and FMA but no AVX-512: the same panels, in 8-float
 * vectors (its section below says how it tiles them).
 *
 * Built on first use by shared/kernels/build.py, called through ctypes.
 */
#include <stdint.h>
#include <string.h>

#include "vector_math.h"

#define PANEL 48   /* output columns per packed panel: three 16-float vectors */
#define HALF (PANEL / 2) /* a GLU panel: HALF gate columns, then the same HALF of up */
#define ROW_TILE 8 /* activation rows per register tile (24 accumulators) */
/* From this many rows a panel is long work, and panels are handed out one at a time
 * as threads come free (an engine thread that shares its core with other work then
 * delays the call by one panel, not by half of them); below it a thread takes a fixed
 * run of panels, so the panel it prefetches is the one it computes next. Which thread
 * computes a panel never changes its result. */
#define SHARED_ROWS 64

int baton_gemm_panel(void) { return PANEL; }
/* Bits per vector of the fp32 path the compiler targeted (0: none). */
int baton_gemm_vector_bits(void) {
#if defined(__AVX512F__)
    return 512;
#elif defined(__AVX2__) && defined(__FMA__)
    return 256;
#else
    return 0;
#endif
}

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

/* Rows ids[0..n) of the weight a pack above packed, each `steps` k steps long (a step:
 * one fp32 value or one bf16 pair, 4 bytes either way), into out [n, steps]: the
 * embedding lookup of a tied head. Returns 1, writing nothing, for an id outside
 * [0, rows). */
int baton_gemm_rows(const uint32_t *packed, int64_t steps, int64_t rows, const int64_t *ids,
                    int64_t n, uint32_t *out, int threads) {
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= rows) return 1;
    _Pragma("omp parallel for if (n >= 64) num_threads(threads) schedule(static)")
    for (int64_t i = 0; i < n; i++) {
        const uint32_t *col = packed + ids[i] / PANEL * steps * PANEL + ids[i] % PANEL;
        for (int64_t j = 0; j < steps; j++) out[i * steps + j] = col[j * PANEL];
    }
    return 0;
}

/* The part of the next panel a tile prefetches: lines [cursor, end). */
typedef struct {
    const char *cursor;
    const char *end;
} Prefetch;

#if defined(__AVX512F__)
#include <immintrin.h>

/* Prefetch lines per k step so that the next panel is requested while this one
 * is computed: one per step where there are three row tiles or more to spread
 * it over, two for one or two tiles. One or two rows read the weight at the
 * memory's pace already, and prefetches measured slower there. */
static int prefetch_per_k(int64_t m) {
    int64_t tiles = (m + ROW_TILE - 1) / ROW_TILE;
    if (m <= 2) return 0;
    return tiles >= 3 ? 1 : 2;
}

/* Rows of x a work item takes through one panel: all of them where x fits in
 * ROW_BLOCK_BYTES, else the fewest equal blocks (whole row tiles) that do. A block
 * then stays in L2 while the panels pass over it; streamed from L3 once per panel
 * instead, a 2,048-row x of K = 576 cost qkv and gate_up 5-9% on 2 threads. Which
 * block a row falls in never changes its result. */
#define ROW_BLOCK_BYTES (384 * 1024)
static int64_t row_block(int64_t m, int64_t row_bytes) {
    int64_t blocks = (m * row_bytes + ROW_BLOCK_BYTES - 1) / ROW_BLOCK_BYTES;
    if (blocks <= 1) return m;
    int64_t rows = (m + blocks - 1) / blocks;
    return (rows + ROW_TILE - 1) / ROW_TILE * ROW_TILE;
}

/* One dtype's kernel. T: storage type; PAIR: k values per step; BCAST(x): the
 * step's x value(s) of one row as a vector; MAC(acc, xv, b): acc += xv * b;
 * STORE(out, acc, cols): a row of cols results; GLU_TILE(acc, rows, out, ldo, cols,
 * act): a GLU tile's rows of act(gate) * up. rows and per_k are constants at every
 * tile call, so its loops unroll and the sums stay in registers. */
#define DEFINE_GEMM(NAME, T, PAIR, BCAST, MAC, STORE, GLU_TILE)                              \
    INLINE void NAME##_tile(const int rows, const int per_k, const T *x, int64_t k_len,     \
                            const T *panel, T *out, int64_t ldo, int64_t cols, int act,     \
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
        if (act)                                                                            \
            GLU_TILE(acc, rows, out, ldo, cols, act);                                       \
        else                                                                                \
            for (int r = 0; r < rows; r++) STORE(out + r * ldo, acc[r], cols);              \
    }                                                                                       \
                                                                                            \
    static void NAME##_any_tile(int rows, int per_k, const T *x, int64_t k_len,             \
                                const T *panel, T *out, int64_t ldo, int64_t cols, int act, \
                                Prefetch *pf) {                                             \
        switch (per_k * 16 + rows) {                                                        \
            TILE_CASES(NAME, 0)                                                             \
            TILE_CASES(NAME, 1)                                                             \
            TILE_CASES(NAME, 2)                                                             \
        }                                                                                   \
    }                                                                                       \
                                                                                            \
    /* Panel p's columns of out: p's PANEL columns, or with a GLU act its HALF; panel     \
     * ahead (none where it is panels) is prefetched meanwhile. */                          \
    static void NAME##_panel(int64_t p, int64_t ahead, int64_t panels, int per_k,          \
                             const T *x, int64_t m, int64_t k_len, const T *packed,         \
                             int64_t n, T *out, int64_t ldo, int act) {                     \
        const T *panel = packed + p * k_len * PANEL;                                        \
        const char *next = (const char *)(packed + ahead * k_len * PANEL);                  \
        Prefetch pf = {next, ahead < panels ? next + k_len * PANEL * sizeof(T) : next};     \
        const int64_t wide = act ? HALF : PANEL;                                            \
        int64_t cols = n - p * wide < wide ? n - p * wide : wide;                           \
        for (int64_t r = 0; r < m; r += ROW_TILE) {                                         \
            int rows = m - r < ROW_TILE ? (int)(m - r) : ROW_TILE;                          \
            NAME##_any_tile(rows, per_k, x + r * k_len, k_len, panel,                      \
                            out + r * ldo + p * wide, ldo, cols, act, &pf);                 \
        }                                                                                   \
    }                                                                                       \
                                                                                            \
    /* Returns 0, or 1 for arguments it does not handle. x is [m, k_len]          \
     * contiguous, out is [m, n] with rows ldo elements apart (n: the GLU's width \
     * where act is one, the packed weight then a GLU weight, see gemm.py). */      \
    static int NAME(const T *x, int64_t m, int64_t k_len, const T *packed, int64_t n,       \
                    T *out, int64_t ldo, int act, int threads) {                            \
        if (m < 0 || k_len <= 0 || k_len % PAIR || n <= 0 || ldo < n) return 1;             \
        const int64_t wide = act ? HALF : PANEL, panels = (n + wide - 1) / wide;            \
        int per_k = prefetch_per_k(m);                                                      \
        if (m >= SHARED_ROWS) {                                                             \
            const int64_t block = row_block(m, k_len * (int64_t)sizeof(T));                 \
            const int64_t items = (m + block - 1) / block * panels;                         \
            _Pragma("omp parallel for num_threads(threads) schedule(dynamic, 1)")           \
            for (int64_t i = 0; i < items; i++) {                                           \
                const int64_t r0 = i / panels * block;                                      \
                const int64_t rows = m - r0 < block ? m - r0 : block;                       \
                /* the panel of the item this thread most likely takes next (threads      \
                 * take turns): its own next panel went to the other core's cache (1-2%) */ \
                const int64_t next = i + threads, ahead = next < items ? next % panels : panels; \
                NAME##_panel(i % panels, ahead, panels, prefetch_per_k(rows),               \
                             x + r0 * k_len, rows, k_len, packed, n, out + r0 * ldo, ldo,   \
                             act);                                                          \
            }                                                                               \
        } else {                                                                            \
            _Pragma("omp parallel for num_threads(threads) schedule(static)")               \
            for (int64_t p = 0; p < panels; p++)                                            \
                NAME##_panel(p, p + 1, panels, per_k, x, m, k_len, packed, n, out, ldo,    \
                             act);                                                          \
        }                                                                                   \
        return 0;                                                                           \
    }

#define TILE_CASE(NAME, P, R)                                                               \
    case P * 16 + R:                                                                        \
        NAME##_tile(R, P, x, k_len, panel, out, ldo, cols, act, pf);                        \
        return;
#define TILE_CASES(NAME, P)                                                                 \
    TILE_CASE(NAME, P, 1) TILE_CASE(NAME, P, 2) TILE_CASE(NAME, P, 3) TILE_CASE(NAME, P, 4) \
    TILE_CASE(NAME, P, 5) TILE_CASE(NAME, P, 6) TILE_CASE(NAME, P, 7) TILE_CASE(NAME, P, 8)

INLINE __m512 bcast_f32(const float *x) { return _mm512_set1_ps(*x); }
INLINE __m512 mac_f32(__m512 acc, __m512 x, __m512 b) { return _mm512_fmadd_ps(x, b, acc); }
/* out[j] = round(round(act(gate_j)) * up_j), j < cols, from a GLU panel's row of sums c
 * (gate in its first HALF columns, up in the next HALF), each sum first rounded as the
 * GEMM would round its output (IN): what gate/up's GEMM and then pointwise.c's GLU
 * store, bit for bit. */
#define DEFINE_GLU_ROW(NAME, T, IN, ROUND, STORE_MASK)                                      \
    INLINE void NAME(const float *c, T *out, int64_t cols, int act) {                       \
        for (int64_t j = 0; j < cols; j += 16) {                                            \
            __mmask16 m = first_lanes(cols - j);                                            \
            __m512 g = IN(_mm512_maskz_loadu_ps(m, c + j));                                 \
            __m512 u = IN(_mm512_maskz_loadu_ps(m, c + HALF + j));                          \
            STORE_MASK(out + j, m, _mm512_mul_ps(ROUND(vglu_act(act, g)), u));              \
        }                                                                                   \
    }
/* A tile's GLU write-out, glu_row's arithmetic on its rows at once: the rows' gate
 * sums are gathered side by side (HALF a row), their up sums likewise, so the
 * activation runs on whole vectors (8 rows: 12 vectors, where a row at a time takes
 * 16, every second one half empty). Each element goes through the same instructions
 * whichever lane it lands in, so the bits are glu_row's. */
#define DEFINE_GLU_TILE(NAME, T, IN, ROUND, STORE_MASK)                                     \
    INLINE void NAME(__m512 acc[][3], int rows, T *out, int64_t ldo, int64_t cols, int act) { \
        float gate[ROW_TILE * HALF], up_lanes[8 + ROW_TILE * HALF];                         \
        float *up = up_lanes + 8; /* acc[r][1]'s upper 8 lanes start row r's up sums */     \
        T res[ROW_TILE * HALF];                                                             \
        for (int r = 0; r < rows; r++) {                                                    \
            _mm512_storeu_ps(gate + r * HALF, acc[r][0]);                                   \
            _mm512_mask_storeu_ps(gate + r * HALF + 16, 0x00ff, acc[r][1]);                 \
            _mm512_mask_storeu_ps(up + r * HALF - 8, 0xff00, acc[r][1]);                    \
            _mm512_storeu_ps(up + r * HALF + 8, acc[r][2]);                                 \
        }                                                                                   \
        const int64_t total = (int64_t)rows * HALF;                                         \
        for (int64_t j = 0; j < total; j += 16) {                                           \
            __mmask16 m = first_lanes(total - j);                                           \
            __m512 g = IN(_mm512_maskz_loadu_ps(m, gate + j));                              \
            __m512 u = IN(_mm512_maskz_loadu_ps(m, up + j));                                \
            STORE_MASK(res + j, m, _mm512_mul_ps(ROUND(vglu_act(act, g)), u));              \
        }                                                                                   \
        for (int r = 0; r < rows; r++)                                                      \
            memcpy(out + r * ldo, res + r * HALF, sizeof(T) * (size_t)cols);                \
    }
DEFINE_GLU_TILE(glu_tile_f32, float, vround_f32, vround_f32, vstore_f32_mask)

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

DEFINE_GEMM(native_gemm_f32, float, 1, bcast_f32, mac_f32, store_f32_row, glu_tile_f32)
int baton_gemm_available(void) { return 1; }
int baton_gemm_f32(const float *x, int64_t m, int64_t k_len, const float *packed, int64_t n,
                   float *out, int64_t ldo, int threads) {
    return native_gemm_f32(x, m, k_len, packed, n, out, ldo, GLU_NONE, threads);
}
/* The gate/up GEMM and its GLU activation `act` at once: out [m, n] = act(gate) * up,
 * where packed is the two weights packed as gemm.py's pack_glu lays them out. */
int baton_gemm_glu_f32(const float *x, int64_t m, int64_t k_len, const float *packed, int64_t n,
                       float *out, int64_t ldo, int act, int threads) {
    if (act != GLU_SILU && act != GLU_GELU_TANH) return 1;
    return native_gemm_f32(x, m, k_len, packed, n, out, ldo, act, threads);
}

#if defined(__AVX512BF16__)
INLINE __m512 bcast_bf16(const uint16_t *x) {
    uint32_t pair;
    memcpy(&pair, x, sizeof pair);
    return _mm512_castsi512_ps(_mm512_set1_epi32((int)pair));
}
INLINE __m512 mac_bf16(__m512 acc, __m512 x, __m512 b) {
    return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)b);
}
/* rounded as store_bf16_row rounds (denormals kept), widened back */
INLINE __m512 round_bf16_scalar(__m512 x) { return vwiden_bf16(vf32_to_bf16_scalar(x)); }
DEFINE_GLU_TILE(glu_tile_bf16, uint16_t, round_bf16_scalar, vround_bf16, vstore_bf16_mask)

INLINE void store_bf16_row(uint16_t *out, const __m512 acc[3], int64_t cols) {
    for (int v = 0; v < 3; v++) { /* f32_to_bf16's bits, a vector at a time */
        __mmask16 m = first_lanes(cols - 16 * v);
        if (cols > 16 * v) _mm256_mask_storeu_epi16(out + 16 * v, m, vf32_to_bf16_scalar(acc[v]));
    }
}

#include "amx.h"
#if defined(HAVE_AMX)
#include <stdlib.h>

/* A finished block's sums waiting to be rounded to bf16 and written out. The next
 * block's k loop does it a few rows per step, on the vector units that the tile
 * products leave idle, instead of after the products where nothing overlaps it. */
typedef struct {
    const float *c; /* the sums, PANEL floats a row */
    uint16_t *out;
    int64_t ldo, rows, cols, done; /* rows [done, rows) are still to write */
    int act;                       /* GLU_NONE, or the GLU the sums are gate and up of */
} Pending;

/* glu_tile_bf16's arithmetic a row at a time, on sums rounded as the write-out below
 * rounds them */
DEFINE_GLU_ROW(glu_row_amx, uint16_t, vround_bf16, vround_bf16, vstore_bf16_mask)

INLINE void pending_rows(Pending *w, int64_t count) {
    int64_t end = w->done + count < w->rows ? w->done + count : w->rows;
    if (w->act) {
        for (int64_t i = w->done; i < end; i++)
            glu_row_amx(w->c + i * PANEL, w->out + i * w->ldo, w->cols, w->act);
        w->done = end;
        return;
    }
    for (int64_t i = w->done; i < end; i++)
        for (int64_t j = 0; j < w->cols; j += 16) {
            __m256i v = vf32_to_bf16(_mm512_loadu_ps(w->c + i * PANEL + j));
            __mmask16 keep =
                w->cols - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (w->cols - j)) - 1);
            _mm256_mask_storeu_epi16(w->out + i * w->ldo + j, keep, v);
        }
    w->done = end;
}

/* Rows a k loop of k_len writes per step so that `rows` are done by its end. */
INLINE int64_t rows_per_step(int64_t rows, int64_t k_len) {
    int64_t steps = k_len / AMX_K;
    return (rows + steps - 1) / steps;
}

/* amx_block's tiles: 0-2 hold a block's 16 x 48 fp32 sums; 3 and 4 its rows' 32 k
 * values, for even and odd k steps; 5-7 the panel's three B tiles. Distinct source
 * tiles let a load start while the previous step's products still read the other
 * tiles. (amx_block2's are below it.)
 *
 * One k step: tiles 0-2 += the a tile `at` (already loaded) . the panel's pair rows at b. */
#define AMX_STEP(at, b)                 \
    do {                                \
        _tile_loadd(5, (b), PANEL * 4); \
        _tile_dpbf16ps(0, at, 5);       \
        _tile_loadd(6, (b) + 32, PANEL * 4); \
        _tile_dpbf16ps(1, at, 6);       \
        _tile_loadd(7, (b) + 64, PANEL * 4); \
        _tile_dpbf16ps(2, at, 7);       \
    } while (0)

/* c[16][PANEL] = a[16][k_len] . panel, k in order (a's rows lda elements apart); the
 * panel at `ahead` (NULL: none) is fetched into L2 meanwhile. */
static void amx_block(const uint16_t *a, int64_t lda, int64_t k_len, const uint16_t *panel,
                      float *c, Pending *w, const char *ahead) {
    int64_t per_step = rows_per_step(w->rows, k_len);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    for (int64_t k = 0; k < k_len; k += 2 * AMX_K) {
        _tile_loadd(3, a + k, lda * 2);
        AMX_STEP(3, panel + k * PANEL); /* k / 2 pair rows of PANEL x 2 values */
        pending_rows(w, per_step);
        if (ahead != NULL) /* the next panel's next two k steps, into L2 */
            for (int64_t at = k * PANEL * 2; at < (k + 2 * AMX_K) * PANEL * 2 &&
                                             at < k_len * PANEL * 2; at += 64)
                _mm_prefetch(ahead + at, _MM_HINT_T1);
        if (k + AMX_K < k_len) {
            _tile_loadd(4, a + k + AMX_K, lda * 2);
            AMX_STEP(4, panel + (k + AMX_K) * PANEL);
            pending_rows(w, per_step);
        }
    }
    _tile_stored(0, c, PANEL * 4);
    _tile_stored(1, c + 16, PANEL * 4);
    _tile_stored(2, c + 32, PANEL * 4);
}

/* c[32][PANEL] = the 32 rows at a (a1: the second 16) . panel: tiles 0-5 hold the six 16 x 16
 * sums, 6 an A tile and 7 a B tile. Each step loads its two A and three B tiles once from
 * wherever they are (an A tile twice, the second time from L1): 5 KB per 6 products where
 * amx_block moves 4 KB per 3. Every sum is the same chain as amx_block's; `ahead` as there. */
static void amx_block2(const uint16_t *a, const uint16_t *a1, int64_t lda, int64_t k_len,
                       const uint16_t *panel, float *c, Pending *w, const char *ahead) {
    int64_t per_step = rows_per_step(w->rows, k_len);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    _tile_zero(4);
    _tile_zero(5);
    for (int64_t k = 0; k < k_len; k += AMX_K) {
        const uint16_t *b = panel + k * PANEL;
        _tile_loadd(6, a + k, lda * 2);
        _tile_loadd(7, b, PANEL * 4);
        _tile_dpbf16ps(0, 6, 7);
        _tile_loadd(6, a1 + k, lda * 2);
        _tile_dpbf16ps(3, 6, 7);
        _tile_loadd(7, b + 32, PANEL * 4);
        _tile_dpbf16ps(4, 6, 7);
        _tile_loadd(6, a + k, lda * 2);
        _tile_dpbf16ps(1, 6, 7);
        _tile_loadd(7, b + 64, PANEL * 4);
        _tile_dpbf16ps(2, 6, 7);
        _tile_loadd(6, a1 + k, lda * 2);
        _tile_dpbf16ps(5, 6, 7);
        pending_rows(w, per_step);
        if (ahead != NULL) /* the next panel's same k step, into L2 */
            for (int64_t line = 0; line < AMX_K * PANEL * 2; line += 64)
                _mm_prefetch(ahead + k * PANEL * 2 + line, _MM_HINT_T1);
    }
    float *c1 = c + AMX_ROWS * PANEL;
    _tile_stored(0, c, PANEL * 4);
    _tile_stored(1, c + 16, PANEL * 4);
    _tile_stored(2, c + 32, PANEL * 4);
    _tile_stored(3, c1, PANEL * 4);
    _tile_stored(4, c1 + 16, PANEL * 4);
    _tile_stored(5, c1 + 32, PANEL * 4);
}

/* Zero rows to pad a last partial block: one buffer per calling thread, grown as
 * needed and zero again after each call (tiles always load 16 rows; a row's sums
 * never see another's). */
static _Thread_local uint16_t *pad_rows;
static _Thread_local int64_t pad_cap;

static uint16_t *padded_rows(const uint16_t *x, int64_t rows, int64_t k_len) {
    if (pad_cap < AMX_ROWS * k_len) {
        free(pad_rows);
        pad_rows = calloc((size_t)(AMX_ROWS * k_len), sizeof(uint16_t));
        pad_cap = pad_rows == NULL ? 0 : AMX_ROWS * k_len;
        if (pad_rows == NULL) return NULL;
    }
    memcpy(pad_rows, x, sizeof(uint16_t) * (size_t)(rows * k_len));
    return pad_rows;
}

/* Work items are (a run of rows, a group of panels): the group's panels (about
 * AMX_GROUP_BYTES) stay in L2 while each 32-row block of the run goes across them,
 * so a row's A tiles are read once per group and the output is written a block of
 * rows at a time. A thread takes a run's groups one after another, the run's rows
 * (about AMX_CHUNK_BYTES of A, with a group well inside a 2 MB L2) staying in its
 * L2 meanwhile: the weight streams from memory once per run, so runs are as long
 * as that allows (a 2,048-row prompt's 3.5 MB gate/up weight is read 3 times, not
 * 8 as with 256-row runs: 1.26 -> 1.1x oneDNN's time). Groups shrink where there
 * would be fewer than four items a thread. Which item a block falls in never
 * changes its sums. */
#define AMX_CHUNK_BYTES (1024 * 1024)
#define AMX_GROUP_BYTES (256 * 1024)
#define PREFETCH_ROWS 128 /* from this many rows, a run fetches its next panel ahead */

static int64_t amx_group(int64_t panels, int64_t chunks, int64_t k_len, int threads) {
    int64_t group = AMX_GROUP_BYTES / (k_len * PANEL * 2);
    int64_t spread = panels * chunks / (4 * (int64_t)(threads > 1 ? threads : 1));
    if (group > spread) group = spread;
    return group < 1 ? 1 : group;
}

/* The AMX form of native_gemm_bf16 (act and n as there). */
static int amx_gemm(const uint16_t *x, int64_t m, int64_t k_len, const uint16_t *packed,
                    int64_t n, uint16_t *out, int64_t ldo, int act, int threads) {
    const int64_t wide = act ? HALF : PANEL, panels = (n + wide - 1) / wide;
    int64_t full = m / AMX_ROWS * AMX_ROWS;
    const uint16_t *rest = NULL;
    if (m > full && (rest = padded_rows(x + full * k_len, m - full, k_len)) == NULL) return 2;
    int64_t chunk_rows = AMX_CHUNK_BYTES / (k_len * 2) / (2 * AMX_ROWS) * (2 * AMX_ROWS);
    if (chunk_rows < 2 * AMX_ROWS) chunk_rows = 2 * AMX_ROWS; /* whole 32-row blocks */
    int64_t chunks = (m + chunk_rows - 1) / chunk_rows;
    int64_t group = amx_group(panels, chunks, k_len, threads);
    int64_t groups = (panels + group - 1) / group;
    _Pragma("omp parallel num_threads(threads)") {
        float c[2][2 * AMX_ROWS * PANEL]; /* a block's sums, and the previous block's */
        int cur = 0;
        Pending w = {.rows = 0, .done = 0, .act = act};
        amx_configure();
        _Pragma("omp for schedule(dynamic, 1)") for (int64_t item = 0; item < chunks * groups;
                                                     item++) {
            int64_t first = item % groups * group, last = first + group;
            int64_t r_end = (item / groups + 1) * chunk_rows;
            if (last > panels) last = panels;
            if (r_end > m) r_end = m;
            for (int64_t r = item / groups * chunk_rows; r < r_end;) {
                /* two blocks at once where both exist, the second maybe padded */
                int64_t rows = r_end - r < 2 * AMX_ROWS ? r_end - r : 2 * AMX_ROWS;
                const uint16_t *a = r < full ? x + r * k_len : rest;
                const uint16_t *a1 = r + AMX_ROWS < full ? a + AMX_ROWS * k_len : rest;
                for (int64_t p = first; p < last; p++) {
                    int64_t cols = n - p * wide < wide ? n - p * wide : wide;
                    const uint16_t *panel = packed + p * k_len * PANEL;
                    /* the item's first block meets each panel first: the next one is
                     * fetched while this one is computed, where the run is long enough
                     * for the fetch to hide behind it (decode's few rows read the
                     * weight at memory speed already: 8% slower with it at 1-8 rows) */
                    const char *ahead = m >= PREFETCH_ROWS && r == item / groups * chunk_rows &&
                                                p + 1 < last
                                            ? (const char *)(panel + k_len * PANEL)
                                            : NULL;
                    if (rows > AMX_ROWS)
                        amx_block2(a, a1, k_len, k_len, panel, c[cur], &w, ahead);
                    else
                        amx_block(a, k_len, k_len, panel, c[cur], &w, ahead);
                    pending_rows(&w, w.rows); /* whatever the loop left */
                    w = (Pending){c[cur], out + r * ldo + p * wide, ldo, rows, cols, 0, act};
                    cur ^= 1;
                }
                r += rows;
            }
        }
        pending_rows(&w, w.rows);
        _tile_release();
    }
    if (rest != NULL) memset(pad_rows, 0, sizeof(uint16_t) * (size_t)((m - full) * k_len));
    return 0;
}
#endif

DEFINE_GEMM(native_gemm_bf16, uint16_t, 2, bcast_bf16, mac_bf16, store_bf16_row, glu_tile_bf16)

/* Which arithmetic bf16 uses is a property of the machine and K, never of m. */
static int gemm_bf16(const uint16_t *x, int64_t m, int64_t k_len, const uint16_t *packed,
                     int64_t n, uint16_t *out, int64_t ldo, int act, int threads) {
#if defined(HAVE_AMX)
    if (k_len > 0 && k_len % AMX_K == 0 && n > 0 && ldo >= n && m >= 0 && amx_permitted())
        return m == 0 ? 0 : amx_gemm(x, m, k_len, packed, n, out, ldo, act, threads);
#endif
    return native_gemm_bf16(x, m, k_len, packed, n, out, ldo, act, threads);
}
int baton_gemm_bf16(const uint16_t *x, int64_t m, int64_t k_len, const uint16_t *packed,
                    int64_t n, uint16_t *out, int64_t ldo, int threads) {
    return gemm_bf16(x, m, k_len, packed, n, out, ldo, GLU_NONE, threads);
}
/* baton_gemm_glu_f32's bf16 form. */
int baton_gemm_glu_bf16(const uint16_t *x, int64_t m, int64_t k_len, const uint16_t *packed,
                        int64_t n, uint16_t *out, int64_t ldo, int act, int threads) {
    if (act != GLU_SILU && act != GLU_GELU_TANH) return 1;
    return gemm_bf16(x, m, k_len, packed, n, out, ldo, act, threads);
}
int baton_gemm_available_bf16(void) { return 1; }
#endif
#elif defined(__AVX2__) && defined(__FMA__)
/* fp32 on CPUs with AVX2 and FMA but no AVX-512 (16 ymm registers), on the same
 * packed panels. Below SHARED_ROWS rows (decode) a register tile is one or two rows
 * x the whole panel (12 sums for two rows, six 8-float vectors each), so a tile
 * reads its panel in order while the next panel is prefetched. A prompt's tile is
 * 4 rows x half a panel (12 sums; each weight vector is loaded once into a
 * register for the 4 rows: 7 loads per 12 multiply-adds where the pair tile needs
 * 8, the load ports' limit here). A work item is a block of up to M_BLOCK rows x
 * one panel, run K_BLOCK k steps at a time: the panel's 24 KB of those k rows stay
 * in L1 while every tile of the block passes over them, a prompt tile's two halves
 * one after the other, so its 4 rows of x come from L2 once, not once a half (the
 * sums wait in memory between k blocks, exactly). Every output is still one chain of fused
 * multiply-adds over k in order from zero, whatever the tile: a row's result does
 * not depend on its batch, tile or thread. */
#include <immintrin.h>
#define HAVE_GEMM_AVX2 1
#define PAIR_ROWS 2 /* activation rows per register tile over a whole panel */
#define QUAD_ROWS 4 /* activation rows per register tile over half a panel */
#define K_BLOCK 128 /* k steps a tile runs before the block's next tile */
#define M_BLOCK 128 /* rows a work item takes through one panel */

/* Prefetch lines per k step that spread the next panel (three lines a k step) over
 * this one's tiles: none for one or two rows, which read the weight at the
 * memory's pace already. */
static int prefetch_per_k(int64_t m) {
    int64_t tiles = (m + PAIR_ROWS - 1) / PAIR_ROWS;
    if (m <= 2) return 0;
    return (int)((3 + tiles - 1) / tiles);
}

/* c[r][0..PANEL) (+)= rows r < rows of x (rows ldx apart) times the panel rows at b
 * over k < k_len; `first`: c starts from zero. */
INLINE void pair_tile(const int rows, const int per_k, const float *x, int64_t ldx,
                      int64_t k_len, const float *b, float *c, int first, Prefetch *pf) {
    __m256 acc[PAIR_ROWS][6];
#pragma GCC unroll 2
    for (int r = 0; r < rows; r++)
#pragma GCC unroll 6
        for (int v = 0; v < 6; v++)
            acc[r][v] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(c + r * PANEL + 8 * v);
    const char *cursor = pf->cursor;
    for (int64_t k = 0; k < k_len; k++) {
#pragma GCC unroll 2
        for (int i = 0; i < per_k; i++)
            if (cursor < pf->end) {
                _mm_prefetch(cursor, _MM_HINT_T0);
                cursor += 64;
            }
        __m256 x0 = _mm256_broadcast_ss(x + k);
        __m256 x1 = rows > 1 ? _mm256_broadcast_ss(x + ldx + k) : x0;
#pragma GCC unroll 6
        for (int v = 0; v < 6; v++) {
            __m256 bv = _mm256_loadu_ps(b + k * PANEL + 8 * v);
            __asm__("" : "+x"(bv)); /* one load for both rows, not a memory operand each */
            acc[0][v] = _mm256_fmadd_ps(x0, bv, acc[0][v]);
            if (rows > 1) acc[1][v] = _mm256_fmadd_ps(x1, bv, acc[1][v]);
        }
    }
    pf->cursor = cursor;
#pragma GCC unroll 2
    for (int r = 0; r < rows; r++)
#pragma GCC unroll 6
        for (int v = 0; v < 6; v++) _mm256_storeu_ps(c + r * PANEL + 8 * v, acc[r][v]);
}

/* c[r][0..HALF) (+)= rows r < rows of x times a half panel at b over k < k_len (prompts:
 * 7 loads per 12 multiply-adds, where a pair of rows over the whole panel needs 8). */
INLINE void quad_tile(const int rows, const float *x, int64_t ldx, int64_t k_len,
                      const float *b, float *c, int first) {
    __m256 acc[QUAD_ROWS][3];
#pragma GCC unroll 4
    for (int r = 0; r < rows; r++)
#pragma GCC unroll 3
        for (int v = 0; v < 3; v++)
            acc[r][v] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(c + r * PANEL + 8 * v);
    for (int64_t k = 0; k < k_len; k++) {
        __m256 b0 = _mm256_loadu_ps(b + k * PANEL), b1 = _mm256_loadu_ps(b + k * PANEL + 8);
        __m256 b2 = _mm256_loadu_ps(b + k * PANEL + 16);
        __asm__("" : "+x"(b0), "+x"(b1), "+x"(b2)); /* loaded once for every row */
#pragma GCC unroll 4
        for (int r = 0; r < rows; r++) {
            __m256 xr = _mm256_broadcast_ss(x + r * ldx + k);
            acc[r][0] = _mm256_fmadd_ps(xr, b0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(xr, b1, acc[r][1]);
            acc[r][2] = _mm256_fmadd_ps(xr, b2, acc[r][2]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < rows; r++)
#pragma GCC unroll 3
        for (int v = 0; v < 3; v++) _mm256_storeu_ps(c + r * PANEL + 8 * v, acc[r][v]);
}

static void any_quad_tile(int rows, const float *x, int64_t ldx, int64_t k_len, const float *b,
                          float *c, int first) {
    switch (rows) {
    case 1: quad_tile(1, x, ldx, k_len, b, c, first); return;
    case 2: quad_tile(2, x, ldx, k_len, b, c, first); return;
    case 3: quad_tile(3, x, ldx, k_len, b, c, first); return;
    case 4: quad_tile(4, x, ldx, k_len, b, c, first); return;
    }
}

#define PAIR_CASE(P, R)                                                                     \
    case P * 4 + R: pair_tile(R, P, x, ldx, k_len, b, c, first, pf); return;
static void any_pair_tile(int rows, int per_k, const float *x, int64_t ldx, int64_t k_len,
                          const float *b, float *c, int first, Prefetch *pf) {
    switch (per_k * 4 + rows) {
        PAIR_CASE(0, 1) PAIR_CASE(0, 2) PAIR_CASE(1, 1) PAIR_CASE(1, 2)
        PAIR_CASE(2, 1) PAIR_CASE(2, 2) PAIR_CASE(3, 1) PAIR_CASE(3, 2)
    }
}
#undef PAIR_CASE

/* Panel p's columns of out (its PANEL columns, or with a GLU act its HALF) for rows
 * [r0, r1), at most M_BLOCK of them, in 4-row tiles for a prompt. */
static void avx2_panel(int64_t p, int64_t panels, int64_t r0, int64_t r1, int prompt,
                       int per_k, const float *x, int64_t k_len, const float *packed, int64_t n,
                       float *out, int64_t ldo, int act) {
    const float *panel = packed + p * k_len * PANEL;
    const char *next = (const char *)(panel + k_len * PANEL);
    Prefetch pf = {next, p + 1 < panels ? next + k_len * PANEL * sizeof(float) : next};
    const int64_t wide = act ? HALF : PANEL;
    int64_t cols = n - p * wide < wide ? n - p * wide : wide;
    float sums[M_BLOCK * PANEL];
    for (int64_t k0 = 0; k0 < k_len; k0 += K_BLOCK) {
        int64_t kn = k_len - k0 < K_BLOCK ? k_len - k0 : K_BLOCK;
        if (prompt)
            for (int64_t r = r0; r < r1; r += QUAD_ROWS)
                for (int h = 0; h < 2; h++)
                    any_quad_tile(r1 - r < QUAD_ROWS ? (int)(r1 - r) : QUAD_ROWS,
                                  x + r * k_len + k0, k_len, kn, panel + k0 * PANEL + h * HALF,
                                  sums + (r - r0) * PANEL + h * HALF, k0 == 0);
        else
            for (int64_t r = r0; r < r1; r += PAIR_ROWS) {
                int rows = r1 - r < PAIR_ROWS ? (int)(r1 - r) : PAIR_ROWS;
                any_pair_tile(rows, per_k, x + r * k_len + k0, k_len, kn, panel + k0 * PANEL,
                              sums + (r - r0) * PANEL, k0 == 0, &pf);
            }
    }
    for (int64_t i = 0; i < r1 - r0; i++) {
        const float *c = sums + i * PANEL;
        float *o = out + (r0 + i) * ldo + p * wide;
        if (act == GLU_SILU)
            for (int64_t j = 0; j < cols; j++) o[j] = silu(c[j]) * c[HALF + j];
        else if (act == GLU_GELU_TANH)
            for (int64_t j = 0; j < cols; j++) o[j] = gelu_tanh(c[j]) * c[HALF + j];
        else
            memcpy(o, c, sizeof(float) * (size_t)cols);
    }
}

/* From SHARED_ROWS rows, work items are (row block, panel), row blocks outer and
 * handed out as threads come free: a block's rows stay in L2 while it meets every
 * panel (panels outer, each kept in L2 while x streams from L3, measured no better).
 * Below, a thread takes a fixed run of panels, so the panel it prefetches is the one
 * it computes next. */
static int avx2_gemm(const float *x, int64_t m, int64_t k_len, const float *packed, int64_t n,
                     float *out, int64_t ldo, int act, int threads) {
    if (m < 0 || k_len <= 0 || n <= 0 || ldo < n) return 1;
    const int64_t wide = act ? HALF : PANEL, panels = (n + wide - 1) / wide;
    const int64_t blocks = (m + M_BLOCK - 1) / M_BLOCK;
    const int prompt = m >= SHARED_ROWS, per_k = prompt ? 0 : prefetch_per_k(m);
    if (m >= SHARED_ROWS) {
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
        for (int64_t item = 0; item < blocks * panels; item++) {
            int64_t b = item / panels, r0 = b * M_BLOCK, r1 = r0 + M_BLOCK < m ? r0 + M_BLOCK : m;
            avx2_panel(item % panels, panels, r0, r1, prompt, per_k, x, k_len, packed, n, out,
                       ldo, act);
        }
    } else {
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t p = 0; p < panels; p++)
            avx2_panel(p, panels, 0, m, prompt, per_k, x, k_len, packed, n, out, ldo, act);
    }
    return 0;
}

int baton_gemm_available(void) { return 1; }
int baton_gemm_f32(const float *x, int64_t m, int64_t k_len, const float *packed, int64_t n,
                   float *out, int64_t ldo, int threads) {
    return avx2_gemm(x, m, k_len, packed, n, out, ldo, GLU_NONE, threads);
}
int baton_gemm_glu_f32(const float *x, int64_t m, int64_t k_len, const float *packed, int64_t n,
                       float *out, int64_t ldo, int act, int threads) {
    if (act != GLU_SILU && act != GLU_GELU_TANH) return 1;
    return avx2_gemm(x, m, k_len, packed, n, out, ldo, act, threads);
}
#else
int baton_gemm_available(void) { return 0; }
#endif

/* Stubs where the compiler did not target the instructions a dtype needs. */
#if !defined(__AVX512F__) && !defined(HAVE_GEMM_AVX2)
int baton_gemm_f32(const float *x, int64_t m, int64_t k_len, const float *packed, int64_t n,
                   float *out, int64_t ldo, int threads) {
    (void)x, (void)m, (void)k_len, (void)packed, (void)n, (void)out, (void)ldo, (void)threads;
    return 1;
}
int baton_gemm_glu_f32(const float *x, int64_t m, int64_t k_len, const float *packed, int64_t n,
                       float *out, int64_t ldo, int act, int threads) {
    (void)act;
    return baton_gemm_f32(x, m, k_len, packed, n, out, ldo, threads); /* 1: refused */
}
#endif
#if !defined(__AVX512F__) || !defined(__AVX512BF16__)
int baton_gemm_available_bf16(void) { return 0; }
int baton_gemm_bf16(const uint16_t *x, int64_t m, int64_t k_len, const uint16_t *packed,
                    int64_t n, uint16_t *out, int64_t ldo, int threads) {
    (void)x, (void)m, (void)k_len, (void)packed, (void)n, (void)out, (void)ldo, (void)threads;
    return 1;
}
int baton_gemm_glu_bf16(const uint16_t *x, int64_t m, int64_t k_len, const uint16_t *packed,
                        int64_t n, uint16_t *out, int64_t ldo, int act, int threads) {
    (void)act;
    return baton_gemm_bf16(x, m, k_len, packed, n, out, ldo, threads); /* 1: refused */
}
#endif
