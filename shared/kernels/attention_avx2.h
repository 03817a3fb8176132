/* One fp32 attention kernel for decode and prefill alike on AVX2 hosts (FMA,
 * no AVX-512: AMD Zen 1-3, Intel client cores and servers before Skylake-SP).
 *
 * The rows of a tile share one KV head: decode's `group` query heads of one
 * token, or prefill's run of prompt tokens times those heads. Row r attends to
 * keys first_r .. len_r - 1 (causal; first_r > 0 only under a sliding window).
 * Keys are read transposed in groups of 8 ([key / 8][head_dim][8], each group
 * one contiguous run, so that a scores block streams through memory in order):
 * prefill transposes the KV head's context once per call for all its tiles,
 * decode 64 keys at a time into a buffer that stays in L1. Prefill also packs
 * the head's values once, 16 dims at a time ([head_dim / 16][key][16]), so that
 * each values pass streams them in order; decode reads them from the pool.
 *
 *   scores   (q * scale) . k as one FMA chain over head_dim in order per
 *            (row, key); blocks of 6 rows x 16 keys share every load;
 *   softmax  per row, exact max over its live keys, exp(s - max) (+0 for keys
 *            outside the row), summed in 8 lanes (lane l takes the keys at
 *            absolute positions = l mod 8, in order) and the lanes added in
 *            one fixed tree;
 *   values   one FMA chain over keys in order per (row, output dim), blocks of
 *            up to 6 rows x 16 dims sharing every V load, times 1 / sum.
 *
 * A tile's keys start at a multiple of avx2_align(block_size) (whole blocks, a
 * multiple of 8): decode's lone row and every prefill tile put a key in the
 * same lane. Every row runs the same operations on the same values whichever
 * tile, block or pass it is in: keys before a row's window or past its end
 * have probability +0, which leaves every sum and every FMA chain unchanged.
 * So a prompt token's row is bitwise the row decode computes for that token,
 * however the prompt is cut into chunks and on any thread count; rows never
 * depend on the batch.
 *
 * Included by paged_decode.c where the compiler targets AVX2 and FMA but not
 * AVX-512 (AVX-512 hosts keep their own paths). */
#ifndef BATON_ATTENTION_AVX2_H
#define BATON_ATTENTION_AVX2_H
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define HAVE_ATTENTION_AVX2 1
#include <immintrin.h>
#include <math.h>

#include "thread_scratch.h"

#define AVX2_TILE_ROWS 24  /* rows of a prefill tile (whole tokens of a group) */
#define AVX2_SCORE_ROWS 6  /* rows of a scores block */
#define AVX2_SCORE_VECS 2  /* 8-key groups of a scores block */
#define AVX2_VALUE_ROWS 6  /* rows of a values block */
#define AVX2_MAX_DIM 256
#define AVX2_CHUNK 64      /* decode: keys transposed at a time */
/* Keys between a row's prefetch and its load: pool blocks sit anywhere, so the
 * hardware prefetcher cannot follow a table (two blocks of 16 ahead: one block of
 * work is shorter than a DRAM miss). */
#define AVX2_KEYS_AHEAD 32

INLINE void avx2_prefetch(const float *row, int64_t floats) {
    for (int64_t off = 0; off < floats; off += 16) _mm_prefetch((const char *)(row + off), _MM_HINT_T0);
}

INLINE int avx2_supports(int64_t d) { return d % 16 == 0 && d <= AVX2_MAX_DIM; }

INLINE int64_t avx2_keys_padded(int64_t len) { return (len + 7) / 8 * 8; }

/* A tile's keys start at a multiple of this: whole blocks, and a multiple of 8
 * so that a key sits in the lane of its absolute position mod 8 in every tile. */
INLINE int64_t avx2_align(int64_t block_size) {
    int64_t a = 8, b = block_size;
    while (b) {
        int64_t r = a % b;
        a = b;
        b = r;
    }
    return 8 / a * block_size;
}

/* Floats of per-thread scratch for `rows` rows over `len` keys: scores then
 * probabilities in place, the scaled queries, 1 / sum per row. */
INLINE int64_t avx2_rows_scratch(int64_t rows, int64_t len, int64_t d) {
    return rows * (avx2_keys_padded(len) + d + 1);
}

/* exp_nonpositive's reduction and polynomial, 8 lanes at a time. */
INLINE __m256 avx2_exp_nonpositive(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 y = _mm256_fmsub_ps(x, _mm256_set1_ps(1.44269504f), _mm256_set1_ps(0.5f));
    __m256 n = _mm256_round_ps(y, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
    __m256 p = _mm256_set1_ps(1.f / 720.f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e)); /* n >= -126 after the clamp */
}

/* Lanes of the 8 keys from t on that lie in [first, len), as an all-ones mask. */
INLINE __m256 avx2_keys_live(int64_t t, int64_t first, int64_t len) {
    __m256i idx = _mm256_add_epi32(_mm256_set1_epi32((int32_t)t), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    __m256i after = _mm256_cmpgt_epi32(idx, _mm256_set1_epi32((int32_t)(first - 1)));
    __m256i before = _mm256_cmpgt_epi32(_mm256_set1_epi32((int32_t)len), idx);
    return _mm256_castsi256_ps(_mm256_and_si256(after, before));
}

/* The 8 x 8 transpose: r[u][i] -> r[i][u]. */
INLINE void avx2_transpose8(__m256 r[8]) {
    __m256 t[8], u[8];
    for (int k = 0; k < 4; k++) {
        t[2 * k] = _mm256_unpacklo_ps(r[2 * k], r[2 * k + 1]);
        t[2 * k + 1] = _mm256_unpackhi_ps(r[2 * k], r[2 * k + 1]);
    }
    for (int k = 0; k < 2; k++) {
        u[4 * k + 0] = _mm256_shuffle_ps(t[4 * k], t[4 * k + 2], 0x44);
        u[4 * k + 1] = _mm256_shuffle_ps(t[4 * k], t[4 * k + 2], 0xEE);
        u[4 * k + 2] = _mm256_shuffle_ps(t[4 * k + 1], t[4 * k + 3], 0x44);
        u[4 * k + 3] = _mm256_shuffle_ps(t[4 * k + 1], t[4 * k + 3], 0xEE);
    }
    for (int m = 0; m < 4; m++) {
        r[m] = _mm256_permute2f128_ps(u[m], u[4 + m], 0x20);
        r[4 + m] = _mm256_permute2f128_ps(u[m], u[4 + m], 0x31);
    }
}

/* kt[(t - t0) * d + i * 8 + t % 8] = dim i of key t for keys [t0, t1) (multiples
 * of 8: groups of 8 keys, each [d][8]), zeros at or past len. */
INLINE void avx2_transpose_keys(const float *k, const int64_t *table, int64_t len,
                                int64_t block_size, int64_t block_stride, int64_t tok_stride,
                                int64_t d, float *kt, int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; t += 8) {
        const float *rows[8];
        for (int u = 0; u < 8; u++) {
            int64_t at = t + u, ahead = at + AVX2_KEYS_AHEAD;
            rows[u] = at < len ? k + table[at / block_size] * block_stride +
                                     (at % block_size) * tok_stride
                               : NULL;
            if (ahead < len)
                avx2_prefetch(k + table[ahead / block_size] * block_stride +
                                  (ahead % block_size) * tok_stride, d);
        }
        float *dst = kt + (t - t0) * d;
        for (int64_t i = 0; i < d; i += 8) {
            __m256 r[8];
            for (int u = 0; u < 8; u++)
                r[u] = rows[u] != NULL ? _mm256_loadu_ps(rows[u] + i) : _mm256_setzero_ps();
            avx2_transpose8(r);
            for (int u = 0; u < 8; u++) _mm256_storeu_ps(dst + (i + u) * 8, r[u]);
        }
    }
}

/* s[r][8 j ..] = the scores of rows r < nr (scaled queries qs, d apart) over the
 * 8-key groups j < nv of kt. */
INLINE void avx2_scores_block(const int nr, const int nv, const float *qs, int64_t d,
                              const float *kt, float *s, int64_t s_stride) {
    __m256 acc[AVX2_SCORE_ROWS][AVX2_SCORE_VECS];
#pragma GCC unroll 6
    for (int r = 0; r < nr; r++)
#pragma GCC unroll 2
        for (int j = 0; j < nv; j++) acc[r][j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i++) {
        __m256 kv[AVX2_SCORE_VECS];
#pragma GCC unroll 3
        for (int j = 0; j < nv; j++) kv[j] = _mm256_loadu_ps(kt + (j * d + i) * 8);
#pragma GCC unroll 6
        for (int r = 0; r < nr; r++) {
            __m256 qv = _mm256_broadcast_ss(qs + r * d + i);
#pragma GCC unroll 3
            for (int j = 0; j < nv; j++) acc[r][j] = _mm256_fmadd_ps(qv, kv[j], acc[r][j]);
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < nr; r++)
#pragma GCC unroll 2
        for (int j = 0; j < nv; j++) _mm256_storeu_ps(s + r * s_stride + 8 * j, acc[r][j]);
}

#define AVX2_SCORES_CASE(R, V)                                                              \
    case R * 4 + V: avx2_scores_block(R, V, qs, d, kt, s, s_stride); return;
/* noinline, noclone: one compiled copy of every block shape for decode and prefill */
__attribute__((noinline, noclone)) static void avx2_scores(int nr, int nv, const float *qs,
                                                           int64_t d, const float *kt, float *s,
                                                           int64_t s_stride) {
    switch (nr * 4 + nv) {
        AVX2_SCORES_CASE(1, 1) AVX2_SCORES_CASE(2, 1) AVX2_SCORES_CASE(3, 1)
        AVX2_SCORES_CASE(4, 1) AVX2_SCORES_CASE(5, 1) AVX2_SCORES_CASE(6, 1)
        AVX2_SCORES_CASE(1, 2) AVX2_SCORES_CASE(2, 2) AVX2_SCORES_CASE(3, 2)
        AVX2_SCORES_CASE(4, 2) AVX2_SCORES_CASE(5, 2) AVX2_SCORES_CASE(6, 2)
    }
}
#undef AVX2_SCORES_CASE

/* Scores of `rows` rows over keys [0, nkeys) of kt (a multiple of 8). */
INLINE void avx2_scores_rows(const float *qs, int64_t rows, int64_t d, const float *kt,
                             int64_t nkeys, float *s, int64_t s_stride) {
    const int64_t step = 8 * AVX2_SCORE_VECS;
    for (int64_t c = 0; c < nkeys; c += step) { /* keys outer: kt's slice stays in L1 */
        int nv = (int)((nkeys - c < step ? nkeys - c : step) / 8);
        for (int64_t r0 = 0; r0 < rows; r0 += AVX2_SCORE_ROWS) {
            int nr = (int)(rows - r0 < AVX2_SCORE_ROWS ? rows - r0 : AVX2_SCORE_ROWS);
            avx2_scores(nr, nv, qs + r0 * d, d, kt + c * d, s + r0 * s_stride + c, s_stride);
        }
    }
}

/* Turns a row's scores (keys [0, pad)) into probabilities in place: exp(s - max)
 * for keys in [first, len), +0 elsewhere. Returns 1 / their sum. */
INLINE float avx2_row_softmax(float *s, int64_t first, int64_t len, int64_t pad) {
    __m256 vmx = _mm256_set1_ps(-INFINITY);
    for (int64_t t = first / 8 * 8; t < len; t += 8) {
        __m256 x = _mm256_loadu_ps(s + t);
        if (t < first || t + 8 > len)
            x = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), x, avx2_keys_live(t, first, len));
        vmx = _mm256_max_ps(vmx, x);
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(vmx), _mm256_extractf128_ps(vmx, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const __m256 mx = _mm256_set1_ps(_mm_cvtss_f32(h));
    __m256 sum = _mm256_setzero_ps();
    for (int64_t t = 0; t < pad; t += 8) {
        if (t + 8 <= first || t >= len) { /* no live key: +0, and nothing to add */
            _mm256_storeu_ps(s + t, _mm256_setzero_ps());
            continue;
        }
        __m256 e = avx2_exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + t), mx));
        if (t < first || t + 8 > len) e = _mm256_and_ps(e, avx2_keys_live(t, first, len));
        _mm256_storeu_ps(s + t, e);
        sum = _mm256_add_ps(sum, e);
    }
    /* lanes added in a fixed tree: (l, l + 4), then (l, l + 2), then (0, 1) */
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_movehdup_ps(q));
    return 1.f / _mm_cvtss_f32(q);
}

/* outs[r][8 j ..] = inv[r] * sum over keys t < len of p[r][t] * v_t[8 j ..] for rows
 * r < nr and 8-dim vectors j < nv (v offset to the pass's first dim). */
INLINE void avx2_values_block(const int nr, const int nv, const float *p, int64_t p_stride,
                              const float *v, const int64_t *table, int64_t len,
                              int64_t block_size, int64_t block_stride, int64_t tok_stride,
                              const float *inv, float *const *outs) {
    __m256 acc[AVX2_VALUE_ROWS][4];
#pragma GCC unroll 6
    for (int r = 0; r < nr; r++)
#pragma GCC unroll 4
        for (int j = 0; j < nv; j++) acc[r][j] = _mm256_setzero_ps();
    for (int64_t start = 0, bi = 0; start < len; start += block_size, bi++) {
        int64_t n = len - start < block_size ? len - start : block_size;
        const float *vb = v + table[bi] * block_stride;
        /* the same rows of the block AVX2_KEYS_AHEAD keys on (none for packed values:
         * one block, read in order) */
        int64_t skip = AVX2_KEYS_AHEAD / block_size;
        const float *vn = skip > 0 && start + skip * block_size < len
                              ? v + table[bi + skip] * block_stride
                              : NULL;
        for (int64_t t = 0; t < n; t++) {
            if (vn != NULL) avx2_prefetch(vn + t * tok_stride, 8 * nv);
            __m256 vr[4];
#pragma GCC unroll 4
            for (int j = 0; j < nv; j++) vr[j] = _mm256_loadu_ps(vb + t * tok_stride + 8 * j);
#pragma GCC unroll 6
            for (int r = 0; r < nr; r++) {
                __m256 pr = _mm256_broadcast_ss(p + r * p_stride + start + t);
#pragma GCC unroll 4
                for (int j = 0; j < nv; j++) acc[r][j] = _mm256_fmadd_ps(pr, vr[j], acc[r][j]);
            }
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < nr; r++)
#pragma GCC unroll 4
        for (int j = 0; j < nv; j++)
            _mm256_storeu_ps(outs[r] + 8 * j, _mm256_mul_ps(acc[r][j], _mm256_set1_ps(inv[r])));
}

#define AVX2_VALUES_CASE(R, V)                                                              \
    case R * 8 + V:                                                                         \
        avx2_values_block(R, V, p, p_stride, v, table, len, block_size, block_stride,       \
                          tok_stride, inv, outs);                                           \
        return;
__attribute__((noinline, noclone)) static void avx2_values(int nr, int nv, const float *p,
                                                  int64_t p_stride, const float *v,
                                                  const int64_t *table, int64_t len,
                                                  int64_t block_size, int64_t block_stride,
                                                  int64_t tok_stride, const float *inv,
                                                  float *const *outs) {
    switch (nr * 8 + nv) {
        AVX2_VALUES_CASE(1, 2) AVX2_VALUES_CASE(2, 2) AVX2_VALUES_CASE(3, 2)
        AVX2_VALUES_CASE(4, 2) AVX2_VALUES_CASE(5, 2) AVX2_VALUES_CASE(6, 2)
        AVX2_VALUES_CASE(1, 4) AVX2_VALUES_CASE(2, 4) AVX2_VALUES_CASE(3, 4)
    }
}
#undef AVX2_VALUES_CASE

/* vp[(i / 16) * keys + t][i % 16] = dim i of key t for keys [t0, t1): a KV head's
 * values packed for prefill's values passes (16 dims a pass, `keys` keys a pass). */
INLINE void avx2_pack_values(const float *v, const int64_t *table, int64_t block_size,
                             int64_t block_stride, int64_t tok_stride, int64_t d, float *vp,
                             int64_t keys, int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; t++) {
        const float *row = v + table[t / block_size] * block_stride + (t % block_size) * tok_stride;
        for (int64_t c = 0; c < d; c += 16) {
            _mm256_storeu_ps(vp + ((c / 16) * keys + t) * 16, _mm256_loadu_ps(row + c));
            _mm256_storeu_ps(vp + ((c / 16) * keys + t) * 16 + 8, _mm256_loadu_ps(row + c + 8));
        }
    }
}

/* A tile: `ntok` tokens (q rows q_tok_stride apart, out rows out_tok_stride apart)
 * times `group` query heads (d apart). Keys are numbered from the absolute position
 * ks (a multiple of avx2_align()); token tt's rows attend to keys first .. len0 + tt - 1,
 * read through kt (transposed groups from ks's on) or, where kt is NULL (decode),
 * transposed here AVX2_CHUNK keys at a time; values through vp (packed from absolute
 * key 0, vp_keys keys a pass) or, where vp is NULL, v via the table (from ks's block).
 * noinline, noclone: decode and prefill run this one compiled copy. */
__attribute__((noinline, noclone)) static void avx2_tile(
    const float *q, int64_t q_tok_stride, int64_t out_tok_stride, int64_t ntok, int64_t group,
    const float *kt, const float *vp, int64_t vp_keys, const float *k, const float *v,
    float *out, const int64_t *table, int64_t ks, int64_t len0, int64_t window,
    int64_t block_size, int64_t block_stride, int64_t tok_stride, int64_t d, float scale,
    float *scratch) {
    static const int64_t one_block = 0; /* the table of packed values: one block */
    const int64_t rows = ntok * group, len = len0 + ntok - 1, pad = avx2_keys_padded(len);
    float *s = scratch;           /* [rows][pad] scores, then probabilities */
    float *qs = s + rows * pad;   /* [rows][d] queries times scale */
    float *inv = qs + rows * d;   /* [rows] */
    for (int64_t r = 0; r < rows; r++) {
        const float *qr = q + (r / group) * q_tok_stride + (r % group) * d;
        for (int64_t i = 0; i < d; i++) qs[r * d + i] = qr[i] * scale;
    }
    if (kt != NULL) {
        avx2_scores_rows(qs, rows, d, kt, pad, s, pad);
    } else {
        float chunk[d * AVX2_CHUNK] __attribute__((aligned(32))); /* stays in L1 */
        for (int64_t c = 0; c < pad; c += AVX2_CHUNK) {
            int64_t nk = pad - c < AVX2_CHUNK ? pad - c : AVX2_CHUNK;
            avx2_transpose_keys(k, table, len, block_size, block_stride, tok_stride, d, chunk,
                                c, c + nk);
            avx2_scores_rows(qs, rows, d, chunk, nk, s + c, pad);
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        int64_t len_r = len0 + r / group;
        int64_t first = window_start(ks + len_r, window) - ks;
        inv[r] = avx2_row_softmax(s + r * pad, first, len_r, pad);
    }
    /* 8-dim vectors a pass: decode's few rows take 32 dims at once from the pool (a
     * row's sums do not depend on the blocking) */
    const int64_t nv = vp == NULL && rows <= 3 && d % 32 == 0 ? 4 : 2;
    const int64_t per_block = nv == 4 ? 3 : AVX2_VALUE_ROWS;
    for (int64_t r0 = 0; r0 < rows; r0 += per_block) {
        int64_t nr = rows - r0 < per_block ? rows - r0 : per_block;
        /* whole blocks before the block's earliest window are skipped: their
         * probabilities are +0 and their V may be gone */
        int64_t skip = (window_start(ks + len0 + r0 / group, window) - ks) / block_size * block_size;
        int64_t end = len0 + (r0 + nr - 1) / group; /* the block's longest row */
        for (int64_t c0 = 0; c0 < d; c0 += 8 * nv) {
            float *outs[AVX2_VALUE_ROWS];
            for (int64_t i = 0; i < nr; i++) {
                int64_t r = r0 + i;
                outs[i] = out + (r / group) * out_tok_stride + (r % group) * d + c0;
            }
            if (vp != NULL)
                avx2_values((int)nr, 2, s + r0 * pad + skip, pad,
                            vp + ((c0 / 16) * vp_keys + ks + skip) * 16, &one_block, end - skip,
                            end - skip, 0, 16, inv + r0, outs);
            else
                avx2_values((int)nr, (int)nv, s + r0 * pad + skip, pad, v + c0,
                            table + skip / block_size, end - skip, block_size, block_stride,
                            tok_stride, inv + r0, outs);
        }
    }
}

#endif
#endif
