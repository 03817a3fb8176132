/* The AMX form of attention_tile.h's scores and values passes, and of a tile's body
 * after its query pairs (AMX-BF16 hosts, head_dim a multiple of 64).
 *
 * Included by attention_tile.h after its softmax and helpers. */
#ifndef BATON_ATTENTION_AMX_H
#define BATON_ATTENTION_AMX_H
#include "amx.h"
#if defined(HAVE_AMX)
/* On AMX hosts, for head_dim a multiple of 64, scores and values are tile products
 * instead, for decode and prefill alike (the choice depends on the machine and
 * head_dim only): a score is the chain of head_dim / 32 products of a 16-row query
 * tile with a 16-key tile of key pairs; a value is the chain of the products of a
 * 16-row tile of probabilities with the key-pair tiles of V, 32 keys each, from
 * key 0 (or the aligned window start) in key order. The softmax between them is
 * the one above. Rows are padded to 16 with zero queries whose results are never
 * read; each tile row is its own chain, so a row's result does not depend on the
 * rows beside it, and keys past a row's end add products of +0. */
INLINE int attention_amx(int64_t d) { return d % 64 == 0 && amx_permitted(); }

/* Tiles 0-3 += A tile 4 . the four B tiles at b, b + step, b + 2 step, b + 3 step
 * (elements), rows `stride` bytes apart. */
#define AMX_FOUR_PRODUCTS(b, step, stride)         \
    do {                                           \
        _tile_loadd(5, (b), (stride));             \
        _tile_dpbf16ps(0, 4, 5);                   \
        _tile_loadd(6, (b) + (step), (stride));    \
        _tile_dpbf16ps(1, 4, 6);                   \
        _tile_loadd(7, (b) + 2 * (step), (stride)); \
        _tile_dpbf16ps(2, 4, 7);                   \
        _tile_loadd(5, (b) + 3 * (step), (stride)); \
        _tile_dpbf16ps(3, 4, 5);                   \
    } while (0)

/* s[i][t] = q_i . k_t, unscaled (row_softmax scales them as it reads them: one pass
 * over the scores less), for rows [0, rows) in 16-row blocks (q: rows rounded up to
 * 16 of d bf16, the extra ones zero; s as many rows) and keys [0, nkeys), a multiple
 * of 16, from kt (rows `width` pairs long). */
static void scores_amx(const uint16_t *q, int64_t rows, const int32_t *kt, int64_t width,
                       int64_t nkeys, int64_t d, float *s, int64_t s_stride) {
    const int64_t kstride = width * 4, sstride = s_stride * 4;
    for (int64_t r0 = 0; r0 < rows; r0 += AMX_ROWS) {
        const uint16_t *qa = q + r0 * d;
        float *sr = s + r0 * s_stride;
        int64_t t = 0;
        for (; t + 64 <= nkeys; t += 64) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t j = 0; j < d / AMX_K; j++) {
                const int32_t *b = kt + 16 * j * width + t;
                _tile_loadd(4, qa + AMX_K * j, d * 2);
                AMX_FOUR_PRODUCTS(b, 16, kstride);
            }
            _tile_stored(0, sr + t, sstride);
            _tile_stored(1, sr + t + 16, sstride);
            _tile_stored(2, sr + t + 32, sstride);
            _tile_stored(3, sr + t + 48, sstride);
        }
        for (; t < nkeys; t += 16) { /* the same chains, 16 keys at a time */
            _tile_zero(0);
            for (int64_t j = 0; j < d / AMX_K; j++) {
                _tile_loadd(4, qa + AMX_K * j, d * 2);
                _tile_loadd(5, kt + 16 * j * width + t, kstride);
                _tile_dpbf16ps(0, 4, 5);
            }
            _tile_stored(0, sr + t, sstride);
        }
    }
}

/* V's key pairs as tiles: for key pairs [kk0, kk0 + pairs) (keys 2 kk0 on), vt[kk][tile]
 * [32 bf16] with d / 16 tiles a pair, tile 2j + h holding unpack-h (lo, hi) of the
 * two keys' dims [32 j, 32 j + 32), for the dims [c_lo, c_hi) only (multiples of
 * 32); a key at or past end, or before skip, as zero. */
INLINE void value_pairs(const uint16_t *v, const int64_t *table, int64_t skip, int64_t end,
                        int64_t block_size, int64_t block_stride, int64_t tok_stride, int64_t d,
                        int64_t c_lo, int64_t c_hi, int64_t kk0, int64_t pairs, uint16_t *vt) {
    for (int64_t kk = kk0; kk < kk0 + pairs; kk++) {
        int64_t t = 2 * kk;
        const uint16_t *ra = t >= skip && t < end
                                 ? v + table[t / block_size] * block_stride + (t % block_size) * tok_stride
                                 : NULL;
        const uint16_t *rb = t + 1 >= skip && t + 1 < end
                                 ? v + table[(t + 1) / block_size] * block_stride +
                                       ((t + 1) % block_size) * tok_stride
                                 : NULL;
        uint16_t *row = vt + (kk - kk0) * 2 * d;
        for (int64_t j = c_lo / 32; j < c_hi / 32; j++) {
            __m512i a = ra ? _mm512_loadu_si512(ra + 32 * j) : _mm512_setzero_si512();
            __m512i b = rb ? _mm512_loadu_si512(rb + 32 * j) : _mm512_setzero_si512();
            _mm512_storeu_si512(row + 64 * j, _mm512_unpacklo_epi16(a, b));
            _mm512_storeu_si512(row + 64 * j + 32, _mm512_unpackhi_epi16(a, b));
        }
    }
}

/* out_i = inv[i] * sum over keys t < end of p_i[t] v_t, rounded to bf16 once, for
 * the nr rows of one 16-row block (p rows p_stride apart, +0 from each row's end up
 * to end rounded up to 32; rows past nr are read, never written). Keys in groups of
 * 32: V's key-pair tiles from vt (prefill's value_pairs of the call's keys, made once
 * per call, zero before its first row's window) or, where vt is NULL (decode), made
 * here 32 keys and 64 dims at a time, a key at or past end or before `skip` (where
 * every row's window starts after it: its block may be gone) as zero; a key the
 * block's rows give +0 adds nothing either way. The
 * 16 output dims of a tile are those of one unpack of two V rows, as values_pass's
 * accumulators, restored to order at the end. d a multiple of 64. */
static void values_amx(const uint16_t *p, int64_t p_stride, int64_t nr, const uint16_t *v,
                       const int64_t *table, const uint16_t *vt, int64_t skip, int64_t end,
                       int64_t block_size, int64_t block_stride, int64_t tok_stride, int64_t d,
                       const float *inv, uint16_t *const *outs) {
    uint16_t vb[16 * 2 * TILE_MAX_DIM] __attribute__((aligned(64))); /* 16 key pairs */
    float c[AMX_ROWS * 64] __attribute__((aligned(64)));
    const int64_t vstride = 4 * d; /* bytes a key pair's row */
    for (int64_t c0 = 0; c0 < d; c0 += 64) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t g = 0; g < end; g += 32) {
            const uint16_t *b;
            if (vt != NULL) {
                b = vt + g * d + c0 * 2;
            } else {
                value_pairs(v, table, skip, end, block_size, block_stride, tok_stride, d, c0,
                            c0 + 64, g / 2, 16, vb);
                b = vb + c0 * 2;
            }
            _tile_loadd(4, p + g, p_stride * 2);
            AMX_FOUR_PRODUCTS(b, 32, vstride);
        }
        _tile_stored(0, c, 256);
        _tile_stored(1, c + 16, 256);
        _tile_stored(2, c + 32, 256);
        _tile_stored(3, c + 48, 256);
        for (int64_t i = 0; i < nr; i++) {
            __m512 scale = _mm512_set1_ps(inv[i]);
            for (int64_t j = 0; j < 2; j++) {
                __m512 lo = _mm512_load_ps(c + i * 64 + 32 * j);
                __m512 hi = _mm512_load_ps(c + i * 64 + 32 * j + 16);
                vstore_bf16(outs[i] + c0 + 32 * j, _mm512_mul_ps(dims_low(lo, hi), scale));
                vstore_bf16(outs[i] + c0 + 32 * j + 16, _mm512_mul_ps(dims_high(lo, hi), scale));
            }
        }
    }
}
#else
INLINE int attention_amx(int64_t d) {
    (void)d;
    return 0;
}
#endif

/* Keys a tile's probabilities are padded to (row_softmax writes them 32 at a time,
 * as AMX reads them), and rows it holds (AMX reads 16 at a time). */
INLINE int64_t probs_padded(int64_t len) { return (len + 31) / 32 * 32; }
INLINE int64_t rows_padded(int64_t rows, int amx) { return amx ? (rows + 15) / 16 * 16 : rows; }

#if defined(HAVE_AMX)
/* tile_body's AMX form, from its query pairs on: scores (through kt, or for decode
 * 64 keys at a time transposed into L1), then per 16-row block the softmax of each
 * row and the block's values. */
static void tile_body_amx(const int32_t *qs, int64_t rows, int64_t group, const int32_t *kt,
                          int64_t width, const uint16_t *k, const uint16_t *v,
                          const uint16_t *vt, uint16_t *out,
                          int64_t out_tok_stride, const int64_t *table, int64_t len0, int64_t len,
                          int64_t window, int64_t block_size, int64_t block_stride,
                          int64_t tok_stride, int64_t d, float scale, float *s, int64_t pad,
                          uint16_t *p, int64_t p_stride) {
    const uint16_t *qv = (const uint16_t *)qs;
    if (kt != NULL) {
        scores_amx(qv, rows, kt, width, pad, d, s, pad);
    } else {
        enum { CHUNK = 64 };
        int32_t chunk[(TILE_MAX_DIM / 2) * CHUNK] __attribute__((aligned(64)));
        for (int64_t c = 0; c < pad; c += CHUNK) {
            int64_t nk = pad - c < CHUNK ? pad - c : CHUNK;
            transpose_keys(k, table, len, block_size, block_stride, tok_stride, d, chunk, CHUNK,
                           c, c + nk, 0);
            scores_amx(qv, rows, chunk, CHUNK, nk, d, s + c, pad);
        }
    }
    for (int64_t r0 = 0; r0 < rows; r0 += AMX_ROWS) {
        int64_t nr = rows - r0 < AMX_ROWS ? rows - r0 : AMX_ROWS;
        float inv[AMX_ROWS];
        uint16_t *outs[AMX_ROWS];
        for (int64_t i = 0; i < nr; i++) {
            int64_t r = r0 + i, len_r = len0 + r / group;
            inv[i] = row_softmax(s + r * pad, window_start(len_r, window), len_r, p + r * p_stride,
                                 p_stride - 2, scale);
            outs[i] = out + (r / group) * out_tok_stride + (r % group) * d;
        }
        int64_t end = len0 + (r0 + nr - 1) / group; /* the block's longest row */
        int64_t skip = window_start(len0 + r0 / group, window); /* its earliest window */
        values_amx(p + r0 * p_stride, p_stride, nr, v, table, vt, skip, end, block_size,
                   block_stride, tok_stride, d, inv, outs);
    }
}

/* This thread's tiles around a kernel's loop, where it uses them. */
INLINE void tiles_begin(int amx) {
    if (amx) amx_configure();
}
INLINE void tiles_end(int amx) {
    if (amx) _tile_release();
}
#else
INLINE void tiles_begin(int amx) { (void)amx; }
INLINE void tiles_end(int amx) { (void)amx; }
#endif

#endif
