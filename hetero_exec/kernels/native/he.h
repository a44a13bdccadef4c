/* Shared by the cpu provider's C kernels (gemm.c, conv.c) and their worker threads
 * (workers.c), built into one library by native/packed_gemm.py. */
#ifndef HE_H
#define HE_H

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define NR 32
#define MR_LEFT 12 /* 24 accumulators + 2 loads + 1 broadcast of the 32 zmm registers */
#define MR_RIGHT 8
#define KC 256     /* a 32-column panel of KC rows is 32 KB: it stays in L1/L2 */
#define MC 96      /* rows of A per block (right): 96 KB at KC */
#define KC_CONV 1024 /* a conv tile's block of taps (fewer blocks store and reload the
                       output tile less often; measured no slower than 256 or 512) */

enum { ACT_NONE = 0, ACT_RELU = 1, ACT_CLIP = 2 };

typedef struct {
    const float *rbias; /* one value per row of the tile, or NULL */
    const float *cbias; /* one value per column, or NULL */
    const float *z;     /* a residual of the output's layout, or NULL */
    long ldz;
    int act;            /* ACT_*; applied only when last */
    float lo, hi;
    int accumulate;     /* add to what the output holds (a later K block) */
    int last;           /* the last K block: bias, residual and activation */
} store_t;


/* the first n of 16 lanes: all from 16 on, none below 1 (a row's tail) */
static inline __mmask16 first_lanes(int n)
{
    return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1);
}

/* the lanes of the first nr columns of a 32-column panel, in its two halves */
static inline void col_masks(int nr, __mmask16 *m0, __mmask16 *m1)
{
    *m0 = first_lanes(nr);
    *m1 = first_lanes(nr - 16);
}

static inline store_t store_for(int k0, int kc, int K, int accumulate, int act, float lo, float hi)
{
    store_t s = {0};
    s.act = act;
    s.lo = lo;
    s.hi = hi;
    s.accumulate = accumulate || k0 > 0;
    s.last = k0 + kc == K;
    return s;
}

/* The lanes of v set in m stored packed at c (and loaded so, spread to those lanes): in
 * registers, then one masked store or load of the first popcount(m) lanes. The memory
 * forms of vcompressps / vexpandps are microcoded on some CPUs (AMD Zen 4: over 100
 * cycles a store); here both forms measured the same. */
static inline __attribute__((always_inline)) void compress_store(float *c, __mmask16 m, __m512 v)
{
    _mm512_mask_storeu_ps(c, first_lanes(__builtin_popcount(m)), _mm512_maskz_compress_ps(m, v));
}

static inline __attribute__((always_inline)) __m512 expand_load(__mmask16 m, const float *c)
{
    return _mm512_maskz_expand_ps(m, _mm512_maskz_loadu_ps(first_lanes(__builtin_popcount(m)), c));
}

/* fn(args, i0, i1) over [0, n) in `parts` parts, the first on the calling thread and the
 * others on the workers (workers.c); returns when all are done */
typedef void (*task_fn)(void *args, int i0, int i1);
void he_parallel(task_fn fn, void *args, int n, int parts);

#endif
