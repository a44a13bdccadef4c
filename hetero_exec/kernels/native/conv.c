/* Convolution by indirection, on an input padded once: the cpu provider's ungrouped Conv
 * (FusedConv; see native/gemm.py). 2-D MaxPool, which padded its input here too,
 * is depthwise.c's now, a plane at a time. */
#include "kernels.h"

/* ----------------------------------------------- convolution by indirection (no im2col) */

/* A tile is gemm.c's (tile_rows): two runs of SEG output pixels, each stored through its
 * own pointer and lanes, compressed where a run crosses a row's end. */

/* Y_n (M x OH*OW) = act(conv(X_n, W) + bias + Z_n) for a 2-D conv on an input padded
 * already and laid out so that a run of output pixels reads a run of input for every
 * tap (column stride 1, or rows split into their column phases by the caller): X_n at
 * X + n * xs, input rows `pitch` apart, W packed by he_pack_left as (M, C*KH*KW), off[k]
 * the input offset of tap k from an output pixel's origin, sh the row stride.
 *
 * The output is cut into runs of 16 lanes, two runs a tile; work items t in [t0, t1)
 * are (image, tile) pairs. `flat` (row and column stride 1): runs over the padded grid
 * of OH rows of `pitch` pixels, contiguous in the input across rows; the pitch - OW
 * junk columns a row are computed and left out of the store (compress). Else runs of
 * at most 16 pixels within one output row. */
static inline int conv_runs(int flat, int OH, int OW, int pitch)
{
    return flat ? ((OH - 1) * pitch + OW + 15) / 16 : OH * ((OW + 15) / 16);
}

int he_conv_tiles(int flat, int OH, int OW, int pitch)
{
    return (conv_runs(flat, OH, OW, pitch) + 1) / 2;
}

static int he_conv_left(int M, int K, const float *Wp, const int *off, const float *X,
                        long xs, int pitch, int sh, int flat, int OH, int OW, float *Y, int t0,
                        int t1, int m_lo, int m_hi, const float *bias, const float *z, int act,
                        float lo, float hi)
{
    int runs_row = (OW + 15) / 16, runs = conv_runs(flat, OH, OW, pitch), tiles = (runs + 1) / 2;
    long L = (long)OH * OW, grid = (long)(OH - 1) * pitch + OW;
    /* rows of W per group: the group's packed weights (about 1 MB) stay in L2 while every
     * tile of this call passes them; a deep layer's whole weight would not (512 x 4608
     * floats is 9.4 MB, streamed again for every tile) */
    int mg = (int)((1L << 20) / ((long)K * sizeof(float)) / MR_LEFT * MR_LEFT);
    if (mg < MR_LEFT)
        mg = MR_LEFT;
    /* each tile's inputs copied into an aligned panel first: the tile's loads are then
     * aligned, where from the input most cross a cache line (16 floats at any offset) */
    float *panel = (float *)aligned_alloc(64, (size_t)K * NR * sizeof(float) + 64);
    if (!panel)
        return -1;
    for (int g0 = m_lo; g0 < m_hi; g0 += mg) {
        int g1 = g0 + mg < m_hi ? g0 + mg : m_hi;
        for (int t = t0; t < t1; t++) {
            int n = t / tiles, u = t % tiles;
            const float *in[2] = {0, 0};
            float *c[2] = {0, 0};
            const float *zz[2] = {0, 0};
            unsigned l[2] = {0, 0}, m[2] = {0, 0};
            for (int h = 0; h < 2; h++) {
                int run = 2 * u + h;
                long o;
                if (run >= runs) {  /* an odd last run: the second half stays masked off */
                    in[h] = in[0];
                    c[h] = c[0];
                    continue;
                }
                if (flat) {
                    long q0 = (long)run * 16, first = -1;
                    int len = grid - q0 < 16 ? (int)(grid - q0) : 16;
                    l[h] = (1u << len) - 1;
                    for (int i = 0; i < len; i++)
                        if ((q0 + i) % pitch < OW) {
                            m[h] |= 1u << i;
                            if (first < 0)
                                first = q0 + i;
                        }
                    in[h] = X + (long)n * xs + q0;
                    o = (long)n * M * L + (first < 0 ? 0 : first / pitch * OW + first % pitch);
                } else {
                    int oh = run / runs_row, ow0 = (run % runs_row) * 16;
                    int len = OW - ow0 < 16 ? OW - ow0 : 16;
                    l[h] = m[h] = (1u << len) - 1;
                    in[h] = X + (long)n * xs + (long)oh * sh * pitch + ow0;
                    o = (long)n * M * L + (long)oh * OW + ow0;
                }
                c[h] = Y + o;
                zz[h] = z ? z + o : 0;
            }
            for (int k = 0; k < K; k++)
#pragma GCC unroll 4
                for (int hh = 0; hh < 2; hh++)
#pragma GCC unroll 4
                    for (int v = 0; v < SEG / VW; v++)
                        vstore(panel + (long)k * NR + hh * SEG + v * VW,
                               vload_lanes((l[hh] >> (v * VW)) & VMASK, in[hh] + off[k] + v * VW));
            for (int k0 = 0; k0 < K; k0 += KC_CONV) {
                int kc = K - k0 < KC_CONV ? K - k0 : KC_CONV;
                store_t s = store_for(k0, kc, K, 0, act, lo, hi);
                s.ldz = L;
                for (int i0 = g0; i0 < g1; i0 += MR_LEFT) {
                    int mr = g1 - i0 < MR_LEFT ? g1 - i0 : MR_LEFT;
                    long ro = (long)i0 * L;
                    tile_out o = {{c[0] + ro, c[1] + ro},
                                  {zz[0] ? zz[0] + ro : 0, zz[1] ? zz[1] + ro : 0},
                                  {m[0], m[1]}};
                    s.rbias = bias ? bias + i0 : 0;
                    tile_rows(mr, kc, Wp + (long)i0 * K + (long)k0 * MR_LEFT, 1, MR_LEFT,
                              panel + (long)k0 * NR, NR, &o, L, &s, 1);
                }
            }
        }
    }
    free(panel);
    return 0;
}

typedef struct {
    int M, K;
    const float *Wp;
    const int *off;
    const float *X;
    long xs;
    int pitch, sh, flat, OH, OW;
    float *Y;
    const float *bias, *z;
    int act;
    float lo, hi;
    int items, by_rows, failed;
} conv_args;

static void conv_task(void *p, int i0, int i1)
{
    conv_args *a = (conv_args *)p;
    int t0 = i0, t1 = i1, m0 = 0, m1 = a->M;
    if (a->by_rows) { /* every (image, tile) pair, on this part's blocks of rows */
        t0 = 0, t1 = a->items;
        m0 = i0 * MR_LEFT, m1 = i1 * MR_LEFT < a->M ? i1 * MR_LEFT : a->M;
    }
    if (he_conv_left(a->M, a->K, a->Wp, a->off, a->X, a->xs, a->pitch, a->sh, a->flat, a->OH,
                     a->OW, a->Y, t0, t1, m0, m1, a->bias, a->z, a->act, a->lo, a->hi))
        __atomic_store_n(&a->failed, 1, __ATOMIC_RELAXED);
}

/* he_conv_left over `items` (image, tile) pairs in `parts` parts, cut by those pairs, or
 * with `by_rows` by blocks of the weight's rows (a small plane at batch 1: 7 tiles of a
 * 14 x 14 plane leave one of two parts a tile short; each part then copies the same
 * panels): 0, or -1 when a tile's panel could not be allocated */
int he_conv_left_mt(int M, int K, const float *Wp, const int *off, const float *X, long xs,
                     int pitch, int sh, int flat, int OH, int OW, float *Y, int items,
                     const float *bias, const float *z, int act, float lo, float hi,
                     int by_rows, int parts)
{
    conv_args a = {M, K, Wp, off, X, xs, pitch, sh, flat, OH, OW, Y, bias, z, act, lo, hi,
                   items, by_rows, 0};
    he_parallel(conv_task, &a, by_rows ? (M + MR_LEFT - 1) / MR_LEFT : items, parts);
    return a.failed ? -1 : 0;
}

/* ------------------------------------------------- a conv's input, padded and phased */

typedef struct {
    const float *X;
    float *out;
    int H, W, pt, pl, Hp, sw, Wq;
    float fill;
} pad_args;

static inline void fill_floats(float *o, long n, float v)
{
    for (long i = 0; i < n; i++)
        o[i] = v;
}

/* planes [p0, p1) of X (planes x H x W) padded with `fill` into out (planes x Hp x sw x
 * Wq): padded row hp, phase p, column q holds X[hp - pt][q * sw + p - pl] */
static void pad_task(void *args, int p0, int p1)
{
    const pad_args *a = (const pad_args *)args;
    long in_plane = (long)a->H * a->W, out_row = (long)a->sw * a->Wq;
    for (int pi = p0; pi < p1; pi++) {
        const float *x = a->X + pi * in_plane;
        float *o = a->out + pi * a->Hp * out_row;
        for (int hp = 0; hp < a->Hp; hp++, o += out_row) {
            int h = hp - a->pt;
            if (h < 0 || h >= a->H) {
                fill_floats(o, out_row, a->fill);
                continue;
            }
            const float *xr = x + (long)h * a->W;
            if (a->sw == 1) {
                int lead = a->pl < a->Wq ? a->pl : a->Wq;
                int body = a->Wq - lead < a->W ? a->Wq - lead : a->W;
                fill_floats(o, lead, a->fill);
                memcpy(o + lead, xr, body * sizeof(float));
                fill_floats(o + lead + body, a->Wq - lead - body, a->fill);
                continue;
            }
            for (int p = 0; p < a->sw; p++) {
                float *op = o + (long)p * a->Wq;
                /* the columns q of this phase that read X: col = q * sw + p - pl in [0, W) */
                int q_lo = (a->pl - p + a->sw - 1) / a->sw, q_hi = (a->W - 1 + a->pl - p) / a->sw + 1;
                if (a->pl - p < 0)
                    q_lo = 0;
                if (a->W - 1 + a->pl - p < 0) /* (C's division truncates toward zero) */
                    q_hi = 0;
                if (q_hi > a->Wq)
                    q_hi = a->Wq;
                if (q_lo > q_hi)
                    q_lo = q_hi;
                fill_floats(op, q_lo, a->fill);
                int q = q_lo;
#if defined(HE_ISA_AVX512)
                if (a->sw == 2) { /* 16 columns of a phase from 32 of the row: one permute */
                    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12,
                                                          10, 8, 6, 4, 2, 0);
                    for (; q + 16 <= q_hi; q += 16) {
                        long col = 2L * q + p - a->pl;
                        int left = a->W - (int)col; /* columns of X from col on */
                        __m512 lo = _mm512_maskz_loadu_ps((__mmask16)first_lanes(left), xr + col);
                        __m512 hi = _mm512_maskz_loadu_ps((__mmask16)first_lanes(left - 16),
                                                          xr + col + 16);
                        _mm512_storeu_ps(op + q, _mm512_permutex2var_ps(lo, even, hi));
                    }
                }
#elif defined(HE_ISA_AVX2)
                if (a->sw == 2) { /* 8 columns of a phase from 16 of the row */
                    for (; q + 8 <= q_hi; q += 8) {
                        long col = 2L * q + p - a->pl;
                        int left = a->W - (int)col;
                        vstoreu(op + q, even_lanes(vload_lanes(first_lanes(left), xr + col),
                                                   vload_lanes(first_lanes(left - 8), xr + col + 8)));
                    }
                }
#endif
                for (; q < q_hi; q++)
                    op[q] = xr[q * a->sw + p - a->pl];
                fill_floats(op + q_hi, a->Wq - q_hi, a->fill);
            }
        }
    }
}

/* X (planes x H x W) into out (planes x Hp x sw x Wq), padded by pt rows above and pl
 * columns before (and with `fill` beyond X), each row split into its sw column phases
 * of Wq columns; over `parts` parts */
void he_pad_mt(const float *X, float *out, int planes, int H, int W, int pt, int pl, int Hp,
               int sw, int Wq, float fill, int parts)
{
    pad_args a = {X, out, H, W, pt, pl, Hp, sw, Wq, fill};
    he_parallel(pad_task, &a, planes, parts);
}

/* ------------------------------------------- patches, pixel-major, for a right product */

typedef struct {
    const float *X;
    float *P;
    int C, H, W, KH, KW, sh, sw, dh, dw, pt, pl, OH, OW;
} patch_args;

/* rows r in [r0, r1) of (image, output row) pairs: for each output pixel, its patch
 * P[pixel][(c * KH + kh) * KW + kw] = X[n][c][oh * sh + kh * dh - pt][ow * sw + kw * dw - pl],
 * 0 beyond X (the padding) */
static void patch_task(void *p, int r0, int r1)
{
    const patch_args *a = (const patch_args *)p;
    long K = (long)a->C * a->KH * a->KW, plane = (long)a->H * a->W;
    for (int r = r0; r < r1; r++) {
        int n = r / a->OH, oh = r % a->OH;
        const float *xn = a->X + (long)n * a->C * plane;
        for (int ow = 0; ow < a->OW; ow++) {
            float *o = a->P + ((long)r * a->OW + ow) * K;
            int w0 = ow * a->sw - a->pl;
            int inside = w0 >= 0 && w0 + (a->KW - 1) * a->dw < a->W;
            for (int c = 0; c < a->C; c++) {
                const float *xc = xn + (long)c * plane;
                for (int kh = 0; kh < a->KH; kh++, o += a->KW) {
                    int h = oh * a->sh + kh * a->dh - a->pt;
                    if (h < 0 || h >= a->H) {
                        for (int kw = 0; kw < a->KW; kw++)
                            o[kw] = 0.0f;
                        continue;
                    }
                    const float *xr = xc + (long)h * a->W + w0;
                    if (inside) {
                        for (int kw = 0; kw < a->KW; kw++)
                            o[kw] = xr[kw * a->dw];
                    } else {
                        for (int kw = 0; kw < a->KW; kw++) {
                            int w = w0 + kw * a->dw;
                            o[kw] = w >= 0 && w < a->W ? xr[kw * a->dw] : 0.0f;
                        }
                    }
                }
            }
        }
    }
}

/* X (n, C, H, W) as P (n * OH * OW, C * KH * KW): each output pixel's patch a row, as a
 * right-hand product by the conv's weight (C * KH * KW, M) reads it; over `parts` parts */
void he_patches_mt(const float *X, float *P, int n, int C, int H, int W, int KH, int KW, int sh,
                   int sw, int dh, int dw, int pt, int pl, int OH, int OW, int parts)
{
    patch_args a = {X, P, C, H, W, KH, KW, sh, sw, dh, dw, pt, pl, OH, OW};
    he_parallel(patch_task, &a, n * OH, parts);
}
