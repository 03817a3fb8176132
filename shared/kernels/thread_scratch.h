/* Per-thread scratch the attention kernels keep between calls.
 *
 * Shared by the AVX512-BF16 tile (attention_tile.h) and the AVX2 fp32 tile
 * (attention_avx2.h). Included by paged_decode.c only. */
#ifndef BATON_THREAD_SCRATCH_H
#define BATON_THREAD_SCRATCH_H
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>

/* This thread's scratch of at least n floats in one of its slots (rows, keys,
 * values), kept for its next call: a fresh allocation of this size is mapped
 * anew each time, and decode would pay its page faults on every layer of
 * every step. Freed when the thread ends; NULL when memory is short. */
enum { ROWS_SLOT, KEYS_SLOT, VALUES_SLOT, SLOTS };
typedef struct {
    float *buf[SLOTS];
    int64_t cap[SLOTS];
} ThreadScratch;

static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;

static void scratch_free(void *p) {
    ThreadScratch *ts = p;
    for (int i = 0; i < SLOTS; i++) free(ts->buf[i]);
    free(ts);
}
static void scratch_key_make(void) { pthread_key_create(&scratch_key, scratch_free); }

static float *thread_scratch(int slot, int64_t n) {
    pthread_once(&scratch_once, scratch_key_make);
    ThreadScratch *ts = pthread_getspecific(scratch_key);
    if (ts == NULL) {
        ts = calloc(1, sizeof *ts);
        if (ts == NULL || pthread_setspecific(scratch_key, ts) != 0) {
            free(ts);
            return NULL;
        }
    }
    if (n > ts->cap[slot]) {
        free(ts->buf[slot]);
        ts->cap[slot] = (n + 1023) / 1024 * 1024;
        ts->buf[slot] = aligned_alloc(64, sizeof(float) * (size_t)ts->cap[slot]);
        if (ts->buf[slot] == NULL) ts->cap[slot] = 0;
    }
    return ts->buf[slot];
}

#endif
