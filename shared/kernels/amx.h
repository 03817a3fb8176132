/* AMX tiles for the CPU kernels (gemm.c, attention_tile.h): the process's permission
 * to use them and the one tile configuration every kernel uses, eight tiles of
 * 16 rows x 64 bytes (16 x 16 fp32 sums, 16 x 32 bf16 values, or 16 rows of bf16
 * pairs). HAVE_AMX where the compiler targets AMX-BF16. */
#ifndef BATON_AMX_H
#define BATON_AMX_H
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX 1
#define AMX_ROWS 16 /* rows of a tile */
#define AMX_K 32    /* bf16 values in a tile row (64 bytes) */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* Linux lends AMX state to a process that asks (once; it holds for every thread). */
static int amx_permitted(void) {
    static int state = 0; /* 0: not asked yet, 1: granted, -1: refused */
    if (state == 0) state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                    18 /* XFEATURE_XTILEDATA */) == 0 ? 1 : -1;
    return state == 1;
}

/* This thread's tiles, all eight 16 x 64 bytes; _tile_release() when done. */
static inline void amx_configure(void) {
    TileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = AMX_ROWS;
        c.colsb[t] = 64;
    }
    _tile_loadconfig(&c);
}
#endif
#endif
