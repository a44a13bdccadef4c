/* The cpu provider's C kernels: what their files share, and the library's ABI.
 *
 * Every function Python calls is declared below on one line starting `HE_API`, with
 * int, long, float, double or pointer arguments: setup.py reads these lines and
 * generates the table of signatures the library exports (abi.c: `he_signatures`), from
 * which native/library.py sets the ctypes signatures. A prototype is thus written once,
 * here, and the compiler checks each definition against it. The constants Python needs
 * (the tile, the activation codes) are exported the same way (`he_constants`). */
#ifndef HE_KERNELS_H
#define HE_KERNELS_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#define HE_API __attribute__((visibility("default")))

/* the packed weights' layout, the same in every variant (a tile is NR columns: two
 * segments of 16, each with its own output pointer and lane mask in a conv) */
#define NR 32
#define MR_LEFT 12
#define MR_RIGHT 8
#define SEG 16     /* a conv run: output pixels of one of a tile's two segments */
#define KC 256     /* a 32-column panel of KC rows is 32 KB: it stays in L1/L2 */
/* a product's K up to this in one block (gemm.c's kc_for): AVX2's tile is stored in four
 * 6 x 16 parts, each a store, and a reload at the next block, per KC rows of the panel;
 * one block for K <= 1024 ran the products of 768 and 1024 rows 5-10% faster there
 * (larger K: blocks of KC, as before). The other variants keep KC. */
#if defined(HE_ISA_AVX2)
#define KC_WHOLE 1024
#else
#define KC_WHOLE KC
#endif
#define MC 96      /* rows of A per block (right): 96 KB at KC */
#define KC_CONV 1024 /* a conv tile's block of taps (fewer blocks store and reload the
                       output tile less often; measured no slower than 256 or 512) */

/* the store's activations (gemm.c, conv.c, depthwise*.c); act.c has the others */
enum { ACT_NONE = 0, ACT_RELU = 1, ACT_CLIP = 2, ACT_HARD_SIGMOID = 3, ACT_HARD_SWISH = 4,
       ACT_GELU = 8, ACT_GELU_TANH = 9, ACT_SILU = 10, ACT_SIGMOID = 11, ACT_TANH = 12,
       ACT_ERF = 13 };

typedef struct {
    const float *rbias; /* one value per row of the tile, or NULL */
    const float *cbias; /* one value per column, or NULL */
    long ldz;           /* rows of the residual (the tile's destinations hold it) */
    int act;            /* ACT_NONE, ACT_RELU or ACT_CLIP; applied only when last */
    float lo, hi;
    int accumulate;     /* add to what the output holds (a later K block) */
    int last;           /* the last K block: bias, residual and activation */
} store_t;

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

/* where a tile's NR columns go: two segments of SEG columns, each an output pointer (and
 * the residual's), and its lanes (bit i: column i of the segment). `compress`: a
 * segment's lanes are consecutive pixels with junk columns between them, stored packed
 * from c on (a conv run over the padded grid across a row's end). */
typedef struct {
    float *c[2];
    const float *z[2];
    unsigned m[2];
} tile_out;

/* gemm.c: act(A @ B + bias + z) for mr <= MR_LEFT rows of a tile, over K; A's row r, k
 * at a[r * ars + k * aks], B's row k at b + k * bks (NR columns) */
void tile_rows(int mr, int K, const float *a, long ars, long aks, const float *b, long bks,
               const tile_out *o, long ldc, const store_t *s, int compress);

/* softmax.c: softmax of one row of n floats, in place (NaN rows as numpy makes them) */
void softmax_row(float *x, int n);

/* attention.c: FusedAttention's float32 rows, softmax(where(c, scale * q . K^T, fill) +
 * m) @ V, the keys a row hides (m <= -1e30, or c false with fill <= -1e30) at either end
 * skipped; strides in elements, as (batch, head, row, column), K and V as (batch, kv
 * head, key, dim); m and c (bool) may be NULL; returns nonzero when a part found no
 * memory for its scores */
typedef struct {
    const float *q, *k, *v, *m;
    const uint8_t *c;
    float *y;
    int64_t B, Hq, Hkv, L, S, D;
    int64_t qs[4], ks[4], vs[4], ms[4], cs[4], ys[4];
    float scale, fill;
    int nan_to_zero;
} attention_t;
int attention_run(const attention_t *a, int parts);
/* attention.c's dense rows, also GroupQueryAttention's (gqa.c): sc[0, n) = q . K's n rows,
 * y (at stride ys) = p[0, n) @ V's n rows; rows `key` floats apart, D floats at unit stride */
void rows_scores(const float *q, const float *K, int64_t key, int64_t D, int64_t n, float *sc);
void rows_values(const float *p, const float *V, int64_t key, int64_t D, int64_t n, float *y,
                 int64_t ys);

/* fn(args, i0, i1) over [0, n) in `parts` parts, the first on the calling thread and the
 * others on the workers (workers.c); returns when all are done */
typedef void (*task_fn)(void *args, int i0, int i1);
void he_parallel(task_fn fn, void *args, int n, int parts);

/* ------------------------------------------------------------------ the library's ABI */
HE_API long he_pack_right_size(int K, int N);
HE_API void he_pack_right(int K, int N, const float *B, long rs, long cs, float *out);
HE_API long he_pack_left_size(int M, int K);
HE_API void he_pack_left(int M, int K, const float *W, long rs, long cs, float *out);
HE_API void he_gemm_right_mt(int M, int N, int K, const float *A, long lda, const float *Bp, float *Y, long ldy, const float *bias, const float *z, long ldz, int act, float lo, float hi, int parts);
HE_API int he_gemm_left_mt(int M, int K, int L, const float *Wp, const float *X, long ldx, long xs, float *Y, long ys, int items, const float *bias, const float *z, int act, float lo, float hi, int by_rows, int parts);
HE_API int he_conv_tiles(int flat, int OH, int OW, int pitch);
HE_API int he_conv_left_mt(int M, int K, const float *Wp, const int *off, const float *X, long xs, int pitch, int sh, int flat, int OH, int OW, float *Y, int items, const float *bias, const float *z, int act, float lo, float hi, int by_rows, int parts);
HE_API void he_pad_mt(const float *X, float *out, int planes, int H, int W, int pt, int pl, int Hp, int sw, int Wq, float fill, int parts);
HE_API void he_patches_mt(const float *X, float *P, int n, int C, int H, int W, int KH, int KW, int sh, int sw, int dh, int dw, int pt, int pl, int OH, int OW, int parts);
HE_API int he_depthwise_mt(const float *X, const float *W, const float *bias, const float *z, float *Y, int planes, int C, int H, int Wd, int OH, int OW, int KH, int KW, int sh, int sw, int dh, int dw, int pt, int pl, int act, float lo, float hi, int parts);
HE_API int he_maxpool_plane_mt(const float *X, float *Y, int planes, int H, int Wd, int OH, int OW, int KH, int KW, int sh, int sw, int dh, int dw, int pt, int pl, int parts);
HE_API int he_depthwise_cl_mt(const float *X, const float *W, const float *bias, const float *z, float *Y, int n, int C, int H, int Wd, int OH, int OW, int KH, int KW, int sh, int sw, int dh, int dw, int pt, int pl, int act, float lo, float hi, int parts);
HE_API void he_softmax_mt(float *x, int rows, int n, int parts);
HE_API int he_layer_norm_channels_mt(const float *x, const float *g, const float *b, float eps, float *y, int n, int C, int L, int nhwc, int parts);
HE_API void he_row_norm_mt(const float *x, const float *g, const float *b, float eps, float *y, float *mean, float *inv, int rows, int cols, int rms, int parts);
HE_API void he_last_axis_mt(float *y, const float *b, int rows, int cols, int code, float p0, float p1, int parts);
HE_API void he_channels_mt(float *y, const float *b, const float *z, int n, int M, int L, int code, float p0, float p1, int parts);
HE_API void he_unary_mt(const float *x, float *y, long n, int code, float p0, float p1, int parts);
HE_API void he_blas_gemm_mt(void *fn, void *gemv, int ilp64, int dbl, int ta, int tb, long batch, long M, long N, long K, const void *A, long lda, long sa, const void *B, long ldb, long sb, void *C, long ldc, long sc, int unit, int parts);
HE_API int he_pool_start(int n, long spin_ns);
HE_API int he_pool_hot(void);
HE_API void he_half_to_float(const uint16_t *src, float *dst, long n);
HE_API void he_float_to_half(const float *src, uint16_t *dst, long n);
HE_API int he_cpu_features(void);
HE_API int he_attention_mt(const float *q, const float *k, const float *v, const float *m, const void *c, float *y, const long *dims, const long *strides, float scale, float fill, int nan_to_zero, int parts);
HE_API long he_qgemm_pack_size(int K, int N);
HE_API void he_qgemm_pack(int K, int N, const void *B, long rs, long cs, int b_signed, void *out);
HE_API int he_qgemm_mt(int M, int N, int K, const void *A, long lda, int a_signed, const void *Bp, const int *a_zp, const int *b_zp, int *Yi, float *Yf, long ldy, const float *scale, const float *bias, int parts);
HE_API void he_dynamic_quantize(const float *x, long n, void *y, float *scale, void *zp);
HE_API int he_nbits_mt(int M, int N, int K, const float *A, long lda, const void *B, const float *scales, const void *zp, const float *zpf, int bits, int block_size, const float *bias, float *Y, long ldy, int parts);
HE_API int he_program_run(const void *ops, int first, int count, void *const *bufs, int *err);

#endif
