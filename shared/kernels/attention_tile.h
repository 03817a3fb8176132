/* One bf16 attention kernel for decode and prefill alike (AVX512-BF16 hosts).
 *
 * The rows of a tile share one KV head: decode's `group` query heads of one
 * token, or prefill's run of prompt tokens times those heads. Row r attends
 * to keys 0 .. lens[r] - 1 (causal: a prompt token sees itself and what came
 * before). Keys are read transposed, 16 keys per vector as key pairs
 * ([head_dim / 2][keys] of bf16 pairs): prefill transposes the KV head's
 * context once per call for all its tiles, decode 64 keys at a time into a
 * buffer that stays in L1.
 *
 *   scores   key t's lane accumulates vdpbf16ps over head_dim pairs in order
 *            (from +0), times scale; blocks of 6 rows x 64 keys share every
 *            load;
 *   softmax  per row, exact: max over its keys, 2^(s log2(e) - max) rounded
 *            to bf16, the rounded values summed as bf16 pairs 32 keys a chunk
 *            (lane l takes keys 2l and 2l + 1 of each) and the lanes added in
 *            one fixed tree;
 *   values   per row, vdpbf16ps of key-pair probabilities with V rows
 *            interleaved in pairs, in key order, times 1 / sum, rounded to
 *            bf16 once.
 *
 * A sliding window (window > 0) gives keys before a row's window probability
 * +0, as keys past its end; a tile's keys then start at its first row's window
 * start, rounded down to tile_align(), so decode's lone row and a prefill tile
 * put each key in the same lane and pair.
 *
 * Every row runs the same instructions on the same values whichever tile,
 * block or pass it is in: a key past a row's end has probability +0 (and
 * adding +0 leaves any finite sum unchanged), keys at or past the context's
 * end are read as zeros. So a prompt token's row is bitwise the row decode
 * computes for that token, however the prompt is cut into chunks, and on any
 * thread count.
 *
 * On AMX hosts (head_dim a multiple of 64) the scores and the values are AMX
 * tile products instead (attention_amx.h), decode's and prefill's alike, keys in
 * groups of 32 from an aligned start: a different rounding from vdpbf16ps's, so
 * the choice depends on the machine and head_dim only, and the same promise holds.
 *
 * Included by paged_decode.c after its AVX-512 helpers. */
#ifndef BATON_ATTENTION_TILE_H
#define BATON_ATTENTION_TILE_H
#if defined(__AVX512BF16__)
#define HAVE_ATTENTION_TILE 1
#include "thread_scratch.h"

#define TILE_ROWS 32     /* rows of a prefill tile (whole tokens of a group) */
#define SCORE_ROWS 6     /* rows of a scores block */
#define SCORE_VECS 4     /* 16-key vectors of a scores block */
#define VALUE_ACC 24     /* fp32 accumulator registers of the values pass */
#define TILE_MAX_DIM 256
#define KEYS_AHEAD 48    /* keys between a row's prefetch and its load */

typedef int32_t __attribute__((may_alias, aligned(2))) bf16_pair;

INLINE int tile_supports(int64_t d, int64_t block_size) {
    return d % 32 == 0 && d <= TILE_MAX_DIM && block_size % 2 == 0; /* key pairs */
}

INLINE int64_t keys_padded(int64_t len) { return (len + 15) / 16 * 16; }

/* Windowed rows start their keys at a multiple of this (32 keys a softmax chunk and
 * an AMX tile product, whole blocks), so a key falls in the same lane and pair wherever a
 * tile starts. */
INLINE int64_t tile_align(int64_t block_size) {
    const int64_t unit = 32; /* row_softmax's chunks, an AMX tile product's keys */
    int64_t a = unit, b = block_size;
    while (b) {
        int64_t r = a % b;
        a = b;
        b = r;
    }
    return unit / a * block_size;
}

/* Lanes of the 16 keys from t on that are at or after `first`. */
INLINE __mmask16 keys_from(int64_t t, int64_t first) {
    if (first <= t) return (__mmask16)0xffff;
    if (first >= t + 16) return 0;
    return (__mmask16)(0xffffu << (first - t));
}

/* Prompt tokens per prefill tile for a KV head's `group` query heads: TILE_ROWS
 * rows' worth, or on AMX (16-row blocks) the fewest tokens past that whose rows fill
 * whole blocks, where that stays within 64 rows (3 heads a group: 16 tokens, 48 rows,
 * not 10 tokens padded from 30 rows to 32). A row's result never depends on its tile. */
INLINE int64_t tile_tokens(int64_t group, int amx) {
    if (group >= TILE_ROWS) return 1;
    if (amx) {
        int64_t t = 1;
        while ((t * group) % 16 != 0 || t * group < TILE_ROWS) t++;
        if (t * group <= 64) return t;
    }
    return TILE_ROWS / group;
}

/* Floats of per-thread scratch for `rows` rows over `len` keys: scores, then
 * bf16 probabilities (a row's width plus one key pair), then the query pairs; as
 * much as the AMX form needs (rows in 16s, probabilities in 32 keys). */
INLINE int64_t rows_scratch_floats(int64_t rows, int64_t len, int64_t d) {
    int64_t r = (rows + 15) / 16 * 16, keys = (len + 31) / 32 * 32;
    return r * keys + r * (keys + 2) / 2 + r * d / 2;
}

/* Row length (in pairs) of one KV head's transposed keys: 16 more than the
 * keys, so that the rows of a power-of-two context do not all fall in one
 * cache set (the transpose stores to every row at once). */
INLINE int64_t keys_width(int64_t len) { return keys_padded(len) + 16; }

/* Floats of one KV head's transposed keys. */
INLINE int64_t keys_scratch_floats(int64_t d, int64_t len) { return (d / 2) * keys_width(len); }

/* The 16 x 16 transpose of 32-bit elements: r[u][i] -> r[i][u]. */
INLINE void transpose16(__m512i r[16]) {
    __m512i a[16], b[16];
    for (int k = 0; k < 8; k++) {
        a[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
        a[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
    }
    for (int k = 0; k < 4; k++) {
        b[4 * k + 0] = _mm512_unpacklo_epi64(a[4 * k], a[4 * k + 2]);
        b[4 * k + 1] = _mm512_unpackhi_epi64(a[4 * k], a[4 * k + 2]);
        b[4 * k + 2] = _mm512_unpacklo_epi64(a[4 * k + 1], a[4 * k + 3]);
        b[4 * k + 3] = _mm512_unpackhi_epi64(a[4 * k + 1], a[4 * k + 3]);
    }
    for (int m = 0; m < 4; m++) {
        __m512i c0 = _mm512_shuffle_i32x4(b[m], b[4 + m], 0x44);
        __m512i c1 = _mm512_shuffle_i32x4(b[m], b[4 + m], 0xEE);
        __m512i c2 = _mm512_shuffle_i32x4(b[8 + m], b[12 + m], 0x44);
        __m512i c3 = _mm512_shuffle_i32x4(b[8 + m], b[12 + m], 0xEE);
        r[m] = _mm512_shuffle_i32x4(c0, c2, 0x88);
        r[4 + m] = _mm512_shuffle_i32x4(c0, c2, 0xDD);
        r[8 + m] = _mm512_shuffle_i32x4(c1, c3, 0x88);
        r[12 + m] = _mm512_shuffle_i32x4(c1, c3, 0xDD);
    }
}

/* kt[j][t - t0 + col] = pair j of key t for keys [t0, t1) (multiples of 16;
 * zeros at or past len), kt rows `width` pairs long. */
INLINE void transpose_keys(const uint16_t *k, const int64_t *table, int64_t len,
                           int64_t block_size, int64_t block_stride, int64_t tok_stride,
                           const int64_t d, int32_t *kt, int64_t width, int64_t t0, int64_t t1,
                           int64_t col) {
    const int whole_blocks = block_size % 16 == 0; /* a 16-key chunk never spans blocks */
    for (int64_t c = t0; c < t1; c += 16) {
        const uint16_t *rows[16];
        if (whole_blocks && c + 16 <= len) {
            const uint16_t *base = k + table[c / block_size] * block_stride + (c % block_size) * tok_stride;
            for (int u = 0; u < 16; u++) rows[u] = base + u * tok_stride;
            /* blocks sit anywhere in the pool, out of the hardware prefetcher's
             * sight: fetch the chunk KEYS_AHEAD keys on */
            int64_t ahead = c + KEYS_AHEAD;
            if (ahead + 16 <= len) {
                const uint16_t *next =
                    k + table[ahead / block_size] * block_stride + (ahead % block_size) * tok_stride;
                for (int u = 0; u < 16; u++)
                    prefetch_row(next + u * tok_stride, d * (int64_t)sizeof(uint16_t));
            }
        } else {
            for (int u = 0; u < 16; u++) {
                int64_t t = c + u;
                rows[u] = t < len ? k + table[t / block_size] * block_stride +
                                        (t % block_size) * tok_stride
                                  : NULL;
            }
        }
        for (int64_t jb = 0; jb < d / 32; jb++) {
            __m512i r[16];
            for (int u = 0; u < 16; u++)
                r[u] = rows[u] ? _mm512_loadu_si512(rows[u] + 32 * jb) : _mm512_setzero_si512();
            transpose16(r);
            for (int i = 0; i < 16; i++)
                _mm512_storeu_si512(kt + (16 * jb + i) * width + c - t0 + col, r[i]);
        }
    }
}

/* s[i][t] = scale * (q_i . k_t) for rows i < nr (q: [nr][d / 2] pairs) and the
 * 16-key vectors of keys [0, nkeys), nkeys a multiple of 16. */
#define DEFINE_TILE_SCORES(NAME, NR)                                                             \
    INLINE void NAME(const int32_t *q, const int32_t *kt, int64_t width, int64_t nkeys,     \
                     const int64_t d, float scale, float *s, int64_t s_stride) {            \
        const __m512 vscale = _mm512_set1_ps(scale);                                        \
        int64_t t = 0;                                                                      \
        for (; t + 16 * SCORE_VECS <= nkeys; t += 16 * SCORE_VECS) {                        \
            __m512 a[NR][SCORE_VECS];                                                       \
            for (int i = 0; i < NR; i++)                                                    \
                for (int m = 0; m < SCORE_VECS; m++) a[i][m] = _mm512_setzero_ps();         \
            for (int64_t j = 0; j < d / 2; j++) {                                           \
                __m512bh kv[SCORE_VECS];                                                    \
                for (int m = 0; m < SCORE_VECS; m++)                                        \
                    kv[m] = (__m512bh)_mm512_loadu_si512(kt + j * width + t + 16 * m);      \
                for (int i = 0; i < NR; i++) {                                              \
                    __m512bh qb = (__m512bh)_mm512_set1_epi32(q[i * (d / 2) + j]);          \
                    for (int m = 0; m < SCORE_VECS; m++)                                    \
                        a[i][m] = _mm512_dpbf16_ps(a[i][m], kv[m], qb);                     \
                }                                                                           \
            }                                                                               \
            for (int i = 0; i < NR; i++)                                                    \
                for (int m = 0; m < SCORE_VECS; m++)                                        \
                    _mm512_storeu_ps(s + i * s_stride + t + 16 * m,                         \
                                     _mm512_mul_ps(a[i][m], vscale));                       \
        }                                                                                   \
        for (; t < nkeys; t += 16) { /* the same sums, one vector of keys at a time */      \
            __m512 a[NR];                                                                   \
            for (int i = 0; i < NR; i++) a[i] = _mm512_setzero_ps();                        \
            for (int64_t j = 0; j < d / 2; j++) {                                           \
                __m512bh kv = (__m512bh)_mm512_loadu_si512(kt + j * width + t);             \
                for (int i = 0; i < NR; i++)                                                \
                    a[i] = _mm512_dpbf16_ps(a[i], kv,                                       \
                                            (__m512bh)_mm512_set1_epi32(q[i * (d / 2) + j])); \
            }                                                                               \
            for (int i = 0; i < NR; i++)                                                    \
                _mm512_storeu_ps(s + i * s_stride + t, _mm512_mul_ps(a[i], vscale));        \
        }                                                                                   \
    }
DEFINE_TILE_SCORES(scores_6, 6)
DEFINE_TILE_SCORES(scores_3, 3)
DEFINE_TILE_SCORES(scores_2, 2)
DEFINE_TILE_SCORES(scores_1, 1)

/* exp2(z) for z <= 0 (or a rounding above it): 2^n by vscalefps times a degree-4
 * polynomial in the fraction f = z - n, |f| <= 1/2 (fitted to 2^f, relative error
 * 2.7e-6, a thousandth of a bf16 probability's rounding step). z is clamped at
 * -126, where a probability is already below any bf16 sum's resolution. */
INLINE __m512 vexp2_probability(__m512 z) {
    z = _mm512_max_ps(z, _mm512_set1_ps(-126.f));
    __m512 n = _mm512_roundscale_ps(z, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(z, n); /* exact */
    __m512 p = _mm512_set1_ps(0.009560510516166687f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.05591703951358795f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24024981260299683f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931219696998596f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.9999991655349731f));
    return _mm512_scalef_ps(p, n);
}

/* Lanes of the 16 keys from t on that a row of `len` keys with its window from
 * `first` holds. */
INLINE __mmask16 keys_live(int64_t t, int64_t first, int64_t len) {
    __mmask16 in = len >= t + 16 ? (__mmask16)0xffff
                   : len <= t   ? (__mmask16)0
                                : (__mmask16)((1u << (len - t)) - 1u);
    return in & keys_from(t, first);
}

/* One row's scores (len of them, each times `scale` as it is read: 1 for scores
 * stored scaled) to bf16 probabilities p (+0 before `first`, the row's window, and
 * from len to `width` + 2, width a multiple of 32); returns 1 / the sum of the
 * rounded probabilities.
 *
 * The max is taken unscaled and then scaled: rounding is monotonic, so it is the
 * max of the scaled scores, bit for bit. A probability is exp2(s c - m) with c =
 * scale log2(e) and m = max c, the product fused; keys go 32 at a time from the
 * 32-key chunk holding `first` (keys before it are +0), the two halves rounded to
 * bf16 at once and summed as bf16 pairs (vdpbf16ps with ones: lane l takes keys
 * 2l and 2l + 1 of each chunk, in chunk order), the lanes then added in one fixed
 * tree. Chunks are counted from key 0 of the row, which callers put at a multiple
 * of 32 of the context (tile_align), so a key's lane and pair never depend on the
 * tile its row is in. */
INLINE float row_softmax(const float *s, int64_t first, int64_t len, uint16_t *p,
                         int64_t width, float scale) {
    __mmask16 tail = (__mmask16)((1u << (len % 16)) - 1u);
    int64_t full = len / 16 * 16;
    __m512 vmx = _mm512_set1_ps(-INFINITY);
    int64_t t = first / 16 * 16;
    if (first > t && t < full) {
        vmx = _mm512_mask_max_ps(vmx, keys_from(t, first), vmx, _mm512_loadu_ps(s + t));
        t += 16;
    }
    /* four running maxima (max is exact: any order gives the same bits), so the loop is
     * not held to one vmaxps latency per 16 keys */
    __m512 vmx1 = vmx, vmx2 = vmx, vmx3 = vmx;
    for (; t + 64 <= full; t += 64) {
        vmx = _mm512_max_ps(vmx, _mm512_loadu_ps(s + t));
        vmx1 = _mm512_max_ps(vmx1, _mm512_loadu_ps(s + t + 16));
        vmx2 = _mm512_max_ps(vmx2, _mm512_loadu_ps(s + t + 32));
        vmx3 = _mm512_max_ps(vmx3, _mm512_loadu_ps(s + t + 48));
    }
    vmx = _mm512_max_ps(_mm512_max_ps(vmx, vmx1), _mm512_max_ps(vmx2, vmx3));
    for (; t < full; t += 16) vmx = _mm512_max_ps(vmx, _mm512_loadu_ps(s + t));
    if (tail) {
        __mmask16 m = tail & keys_from(full, first);
        vmx = _mm512_mask_max_ps(vmx, m, vmx, _mm512_maskz_loadu_ps(m, s + full));
    }
    const float c = scale * 1.44269504088896341f;
    const __m512 vc = _mm512_set1_ps(c);
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(vmx) * c);
    const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3f80); /* bf16 1.0 */
    __m512 acc = _mm512_setzero_ps();
    const int64_t lead = first / 32 * 32;
    for (t = 0; t < lead; t += 32) _mm512_storeu_si512(p + t, _mm512_setzero_si512());
#define CHUNK_PROBS(LO, HI)                                                                     do {                                                                                            __m512bh pb = _mm512_cvtne2ps_pbh(HI, LO);                                                  _mm512_storeu_si512(p + t, (__m512i)pb);                                                    acc = _mm512_dpbf16_ps(acc, pb, ones);                                                  } while (0)
#define PROBS(x) vexp2_probability(_mm512_fmsub_ps(x, vc, m))
    for (t = lead; t < len; t += 32) {
        if (t >= first && t + 32 <= len) {
            CHUNK_PROBS(PROBS(_mm512_loadu_ps(s + t)), PROBS(_mm512_loadu_ps(s + t + 16)));
        } else { /* the window's first chunk, the row's last: lanes outside are +0 */
            __mmask16 lo = keys_live(t, first, len), hi = keys_live(t + 16, first, len);
            CHUNK_PROBS(_mm512_maskz_mov_ps(lo, PROBS(_mm512_maskz_loadu_ps(lo, s + t))),
                        _mm512_maskz_mov_ps(hi, PROBS(_mm512_maskz_loadu_ps(hi, s + t + 16))));
        }
    }
#undef PROBS
#undef CHUNK_PROBS
    for (; t < width + 2; t++) p[t] = 0;
    /* lanes added in a fixed tree: (l, l + 8), then (l, l + 4), (l, l + 2), (0, 1) */
    acc = _mm512_add_ps(acc, _mm512_shuffle_f32x4(acc, acc, 0x4E));
    acc = _mm512_add_ps(acc, _mm512_shuffle_f32x4(acc, acc, 0xB1));
    acc = _mm512_add_ps(acc, _mm512_permute_ps(acc, 0x4E));
    acc = _mm512_add_ps(acc, _mm512_permute_ps(acc, 0xB1));
    return 1.f / _mm512_cvtss_f32(acc);
}

/* Output dims of the values pass come as 4-dim runs alternating between the
 * two halves of a key pair's unpack; these restore the order. */
INLINE __m512 dims_low(__m512 lo, __m512 hi) {
    const __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    return _mm512_permutex2var_ps(lo, idx, hi);
}
INLINE __m512 dims_high(__m512 lo, __m512 hi) {
    const __m512i idx =
        _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    return _mm512_permutex2var_ps(lo, idx, hi);
}

/* out_i = inv[i] * sum over key pairs (t, t + 1), t < len, of vdpbf16ps(p_i
 * pair, v pair) for rows i < nr (p rows p_stride values apart), rounded to
 * bf16. A key at len (an odd len's last pair) reads as zero. */
INLINE void values_pass(const uint16_t *p, int64_t p_stride, const uint16_t *v,
                        const int64_t *table, int64_t len, int64_t block_size,
                        int64_t block_stride, int64_t tok_stride, const int64_t d,
                        const int64_t nr, const float *inv, uint16_t *const *outs) {
    const int64_t c = d / 16, w = d / 32; /* accumulators per row, 32-value row pieces */
    __m512 acc[VALUE_ACC];
    for (int64_t i = 0; i < nr * c; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t start = 0, bi = 0; start < len; start += block_size, bi++) {
        int64_t n = len - start < block_size ? len - start : block_size;
        const uint16_t *vb = v + table[bi] * block_stride;
        const uint16_t *vn = v + block_ahead(table, bi, start, len, block_size) * block_stride;
        for (int64_t at = 0; at < n; at += 2) {
            prefetch_row(vn + at * tok_stride, d * (int64_t)sizeof(uint16_t));
            prefetch_row(vn + (at + 1) * tok_stride, d * (int64_t)sizeof(uint16_t));
            __mmask32 second = at + 1 < n ? (__mmask32)~0u : 0;
            __m512i vp[TILE_MAX_DIM / 16];
            for (int64_t j = 0; j < w; j++) {
                __m512i a = _mm512_loadu_si512(vb + at * tok_stride + 32 * j);
                __m512i b = _mm512_maskz_loadu_epi16(second, vb + (at + 1) * tok_stride + 32 * j);
                vp[2 * j] = _mm512_unpacklo_epi16(a, b);
                vp[2 * j + 1] = _mm512_unpackhi_epi16(a, b);
            }
            const uint16_t *pt = p + start + at;
            for (int64_t i = 0; i < nr; i++) {
                int32_t pair;
                memcpy(&pair, pt + i * p_stride, sizeof pair);
                __m512bh pb = (__m512bh)_mm512_set1_epi32(pair);
                for (int64_t j = 0; j < c; j++)
                    acc[i * c + j] = _mm512_dpbf16_ps(acc[i * c + j], (__m512bh)vp[j], pb);
            }
        }
    }
    /* unrolled whole, so that no accumulator is indexed at run time (GCC would
     * then keep the array in memory and store it on every key pair) */
#pragma GCC unroll 16
    for (int64_t i = 0; i < nr; i++) {
        __m512 scale = _mm512_set1_ps(inv[i]);
#pragma GCC unroll 8
        for (int64_t j = 0; j < w; j++) {
            __m512 lo = acc[i * c + 2 * j], hi = acc[i * c + 2 * j + 1];
            vstore_bf16(outs[i] + 32 * j, _mm512_mul_ps(dims_low(lo, hi), scale));
            vstore_bf16(outs[i] + 32 * j + 16, _mm512_mul_ps(dims_high(lo, hi), scale));
        }
    }
}

/* The values pass for the common shapes, each compiled alone (inlined into the
 * tile, GCC stored the accumulators to memory on every key pair). */
#define VALUES_PARAMS                                                                       \
    const uint16_t *p, int64_t p_stride, const uint16_t *v, const int64_t *table,          \
        int64_t len, int64_t block_size, int64_t block_stride, int64_t tok_stride,         \
        const float *inv, uint16_t *const *outs
#define VALUES_ARGS pp, p_stride, vc, vtable, end, block_size, block_stride, tok_stride, iv, outs
#define DEFINE_VALUES_SHAPE(NAME, D, NP)                                                    \
    __attribute__((noinline)) static void NAME(VALUES_PARAMS) {                              \
        values_pass(p, p_stride, v, table, len, block_size, block_stride, tok_stride, D, NP, \
                    inv, outs);                                                             \
    }
DEFINE_VALUES_SHAPE(values_64_6, 64, 6)
DEFINE_VALUES_SHAPE(values_64_3, 64, 3)
DEFINE_VALUES_SHAPE(values_128_3, 128, 3)
__attribute__((noinline)) static void values_any(const uint16_t *p, int64_t p_stride,
                                                 const uint16_t *v, const int64_t *table,
                                                 int64_t len, int64_t block_size,
                                                 int64_t block_stride, int64_t tok_stride,
                                                 int64_t d, int64_t np, const float *inv,
                                                 uint16_t *const *outs) {
    values_pass(p, p_stride, v, table, len, block_size, block_stride, tok_stride, d, np, inv,
                outs);
}

/* Scores of rows r0 .. r0 + nr (q: their pairs) over 16-key vectors [0, nkeys). */
INLINE void scores_rows(const int32_t *q, int64_t nr, const int32_t *kt, int64_t width,
                        int64_t nkeys, const int64_t d, float scale, float *s, int64_t s_stride) {
    switch (nr) {
    case 6: scores_6(q, kt, width, nkeys, d, scale, s, s_stride); break;
    case 3: scores_3(q, kt, width, nkeys, d, scale, s, s_stride); break;
    case 2: scores_2(q, kt, width, nkeys, d, scale, s, s_stride); break;
    default:
        for (int64_t i = 0; i < nr; i++)
            scores_1(q + i * (d / 2), kt, width, nkeys, d, scale, s + i * s_stride, s_stride);
    }
}

#include "attention_amx.h" /* the AMX forms of the scores and values */

/* A tile: `ntok` tokens (q rows q_tok_stride apart, out rows out_tok_stride apart)
 * times `group` query heads (d apart); token tt's rows attend to keys 0 .. len0 + tt - 1, read through
 * kt (transposed keys, rows `width` pairs long) or, where kt is NULL (decode),
 * transposed here 64 keys at a time into a buffer that stays in L1; v via the
 * table. */
INLINE void tile_body(const uint16_t *q, int64_t q_tok_stride, int64_t out_tok_stride,
                      int64_t ntok, int64_t group, const int32_t *kt, int64_t width, const uint16_t *k, const uint16_t *v,
                      const uint16_t *vt, uint16_t *out, const int64_t *table, int64_t len0, int64_t window,
                      int64_t block_size, int64_t block_stride, int64_t tok_stride,
                      const int64_t d, float scale, float *scratch, int amx) {
    const int64_t rows = ntok * group, len = len0 + ntok - 1, pad = keys_padded(len);
    const int64_t held = rows_padded(rows, amx), p_pad = probs_padded(len);
    float *s = scratch;                               /* [held][pad] scores */
    uint16_t *p = (uint16_t *)(s + held * pad);       /* [held][p_pad + 2] probabilities */
    const int64_t p_stride = p_pad + 2;
    int32_t *qs = (int32_t *)(p + held * p_stride);   /* [held][d / 2] query pairs */
    for (int64_t r = 0; r < rows; r++) {
        const bf16_pair *qr = (const bf16_pair *)(q + (r / group) * q_tok_stride + (r % group) * d);
        for (int64_t j = 0; j < d / 2; j++) qs[r * (d / 2) + j] = qr[j];
    }
    memset(qs + rows * (d / 2), 0, sizeof(int32_t) * (size_t)((held - rows) * (d / 2)));
#if defined(HAVE_AMX)
    if (amx) {
        tile_body_amx(qs, rows, group, kt, width, k, v, vt, out, out_tok_stride, table, len0, len,
                      window, block_size, block_stride, tok_stride, d, scale, s, pad, p,
                      p_stride);
        return;
    }
#else
    (void)vt;
#endif
    if (kt != NULL) {
        for (int64_t r0 = 0; r0 < rows; r0 += SCORE_ROWS) {
            int64_t nr = rows - r0 < SCORE_ROWS ? rows - r0 : SCORE_ROWS;
            scores_rows(qs + r0 * (d / 2), nr, kt, width, pad, d, scale, s + r0 * pad, pad);
        }
    } else {
        /* a scores block's keys at a time: its independent sums hide vdpbf16ps's latency */
        enum { CHUNK = 16 * SCORE_VECS };
        int32_t chunk[(TILE_MAX_DIM / 2) * CHUNK] __attribute__((aligned(64)));
        for (int64_t c = 0; c < pad; c += CHUNK) {
            int64_t nk = pad - c < CHUNK ? pad - c : CHUNK;
            transpose_keys(k, table, len, block_size, block_stride, tok_stride, d, chunk, CHUNK,
                           c, c + nk, 0);
            for (int64_t r0 = 0; r0 < rows; r0 += SCORE_ROWS) {
                int64_t nr = rows - r0 < SCORE_ROWS ? rows - r0 : SCORE_ROWS;
                scores_rows(qs + r0 * (d / 2), nr, chunk, CHUNK, nk, d, scale, s + r0 * pad + c,
                            pad);
            }
        }
    }
    for (int64_t r0 = 0; r0 < rows; r0 += SCORE_ROWS) {
        int64_t nr = rows - r0 < SCORE_ROWS ? rows - r0 : SCORE_ROWS;
        float *sr = s + r0 * pad;
        float inv[SCORE_ROWS];
        for (int64_t i = 0; i < nr; i++) {
            int64_t r = r0 + i;
            int64_t len_r = len0 + r / group;
            inv[i] = row_softmax(sr + i * pad, window_start(len_r, window), len_r,
                                 p + r * p_stride, p_stride - 2, 1.f);
        }
        /* values for this block's rows, in passes of what the registers hold; wide
         * heads (head_dim 256) in 128-column slices, so that a pass serves 3 rows
         * instead of 1 (each output column sums its keys in the same order either way) */
        const int64_t dv = d > 128 && d % 128 == 0 ? 128 : d;
        const int64_t per_pass = VALUE_ACC / (dv / 16);
        for (int64_t a = 0; a < nr; a += per_pass) {
            int64_t np = nr - a < per_pass ? nr - a : per_pass, first = r0 + a;
            /* whole blocks before the pass's earliest window (there since the keys
             * start at a tile_align() multiple) are skipped: their probabilities are
             * +0, their V may be gone, and a sum of +0 products from +0 is +0 */
            int64_t skip = window_start(len0 + first / group, window) / block_size * block_size;
            int64_t end = len0 + (first + np - 1) / group - skip; /* the pass's longest row */
            const uint16_t *pp = p + first * p_stride + skip;
            const int64_t *vtable = table + skip / block_size;
            const float *iv = inv + a;
            for (int64_t c0 = 0; c0 < d; c0 += dv) {
                uint16_t *outs[SCORE_ROWS];
                for (int64_t i = 0; i < np; i++) {
                    int64_t r = first + i;
                    outs[i] = out + (r / group) * out_tok_stride + (r % group) * d + c0;
                }
                const uint16_t *vc = v + c0;
                if (dv == 64 && np == 6) values_64_6(VALUES_ARGS);
                else if (dv == 64 && np == 3) values_64_3(VALUES_ARGS);
                else if (dv == 128 && np == 3) values_128_3(VALUES_ARGS);
                else values_any(pp, p_stride, vc, vtable, end, block_size, block_stride,
                                tok_stride, dv, np, iv, outs);
            }
        }
    }
}

/* noinline: decode and prefill run this one compiled copy. */
__attribute__((noinline)) static void tile_bf16(const uint16_t *q, int64_t q_tok_stride,
                                                int64_t out_tok_stride,
                                                int64_t ntok, int64_t group, const int32_t *kt,
                                                int64_t width, const uint16_t *k,
                                                const uint16_t *v, const uint16_t *vt,
                                                uint16_t *out,
                                                const int64_t *table, int64_t len0,
                                                int64_t window, int64_t block_size,
                                                int64_t block_stride, int64_t tok_stride,
                                                int64_t d, float scale, float *scratch,
                                                int amx) {
#define BODY(D)                                                                             \
    tile_body(q, q_tok_stride, out_tok_stride, ntok, group, kt, width, k, v, vt, out, table, \
              len0, window, block_size, block_stride, tok_stride, D, scale, scratch, amx)
    if (d == 64) BODY(64);
    else if (d == 128) BODY(128);
    else BODY(d);
#undef BODY
}

#endif
#endif
