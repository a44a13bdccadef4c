/* Depthwise convolution (one input channel per group, multiplier 1) in float32 (simd.h):
 * the cpu provider's path for MobileNet's and ConvNeXt's depthwise layers (see
 * native/conv.py, `depthwise_2d`).
 *
 * Each plane is padded into a small scratch buffer (split into its column phases for a
 * column stride s > 1, as conv.c's input), where every tap of a run of VW
 * output pixels is one unmasked load at a fixed offset and one FMA. At strides 1 the runs
 * go over the padded grid across rows, and compress stores leave out the junk columns,
 * so that a 4x4 or 8x8 plane fills most lanes; otherwise runs lie within an output row.
 * Eight runs are summed at once, so that their FMA chains interleave (one run's nine
 * dependent FMAs wait on the FMA latency). Bias, the residual and Relu/Clip are applied as
 * a run is stored.
 *
 * The numba kernel this replaced (float64 now takes conv.py's numpy path) ran
 * 3-10x slower than onnxruntime on MobileNetV2's layers. A first version here, which read
 * the unpadded input under lane masks and one run at a time, waited on each run's chain
 * of dependent FMAs and ran 1.3-2x slower than this one. */
#include "kernels.h"

#define RUNS 8 /* runs summed at once: 8 accumulators */

typedef struct {
    const float *X, *W, *bias, *z;
    float *Y;
    int C, H, Wd, OH, OW, KH, KW, sw, pt, pl; /* (row stride and dilations: in the tables) */
    int Hp, Wq, runs;
    const int *off;   /* KH*KW tap offsets in the padded plane */
    const int *in0;   /* per run: its first pixel's offset in the padded plane */
    const int *out0;  /* per run: its first stored pixel's index in the output plane */
    const unsigned short *mask; /* per run: the lanes stored */
    const unsigned *perm;       /* per run: compress_perm(mask) (simd.h) */
    int act;
    float lo, hi;
    int pool;   /* MaxPool: the maximum over the taps, no weights (he_maxpool_plane_mt) */
    float fill; /* the padding: 0, or -inf for MaxPool */
    int failed;
    int flat; /* runs over the padded grid (strides 1): AVX2 stores them whole */
} dw_args;

/* one run's sum stored: act(v + z) under mask m, compressed when the lanes are not one
 * block from lane 0 (a run across a row's end). `wide`: a whole vector may be stored at
 * y (the lanes past m's land on pixels of later runs of this plane, which are stored
 * after it); then, but with AVX-512, whose masked and compress stores are fast, the
 * run is stored so, compressed in registers: AVX2's masked store (vmaskmovps) is slow on
 * AMD cores and it has no compress (a float at a time). */
ALWAYS_INLINE void store_run(vf v, float *y, const float *z, lanes_t m, unsigned perm, int wide,
                             int act, vf lo, vf hi)
{
    int compress = (m & (m + 1)) != 0;
    if (z)
        v = vadd(v, compress ? vexpand_load(m, z) : vload_lanes(m, z));
    /* max/min return their second operand when either is NaN: NaN stays NaN */
    if (act == ACT_RELU)
        v = vmax(vzero(), v);
    else if (act == ACT_CLIP)
        v = vmin(hi, vmax(lo, v));
#if !defined(HE_ISA_AVX512)
    if (wide && m) {
        vstoreu(y, compress ? vcompress(m, perm, v) : v);
        return;
    }
#else
    (void)perm, (void)wide;
#endif
    if (compress)
        vcompress_store(y, m, v);
    else
        vstore_lanes(y, m, v);
}

/* runs [u, u + nr) of one padded plane p: nr a constant where inlined; `wide`: stored as
 * whole vectors where store_run may (a constant: with the stores of runs within rows,
 * which seldom need it, the kernel ran 10-15% slower on 56 x 56 and 112 x 112 planes) */
ALWAYS_INLINE void runs_block(const dw_args *a, const float *p, const float *w, vf b, float *y,
                              const float *z, int u, const int nr, const int wide)
{
    const int KT = a->KH * a->KW;
    const vf lo = vset1(a->lo), hi = vset1(a->hi);
    const float *base[RUNS];
    vf acc[RUNS];
#pragma GCC unroll 8
    for (int r = 0; r < nr; r++) {
        base[r] = p + a->in0[u + r];
        acc[r] = b;
    }
    for (int t = 0; t < KT; t++) {
        vf wv = vset1(w[t]);
        int o = a->off[t];
#pragma GCC unroll 8
        for (int r = 0; r < nr; r++)
            acc[r] = vfma(wv, vloadu(base[r] + o), acc[r]);
    }
    const int last = a->OH * a->OW - VW; /* the last pixel a whole vector may start at */
#pragma GCC unroll 8
    for (int r = 0; r < nr; r++) {
        int o = a->out0[u + r];
        store_run(acc[r], y + o, z ? z + o : 0, a->mask[u + r], a->perm[u + r],
                  wide && o <= last, a->act, lo, hi);
    }
}

/* MaxPool's runs [u, u + nr) of one plane padded with -inf: the maximum over the taps,
 * NaN where any tap is NaN (as numpy's maximum) */
ALWAYS_INLINE void pool_block(const dw_args *a, const float *p, float *y, int u, const int nr)
{
    const int KT = a->KH * a->KW;
    const vf nan = vset1(__builtin_nanf("")), none = vzero();
    const float *base[RUNS];
    vf acc[RUNS];
    vb isnan[RUNS];
#pragma GCC unroll 8
    for (int r = 0; r < nr; r++) {
        base[r] = p + a->in0[u + r];
        acc[r] = vset1(-__builtin_inff());
        isnan[r] = vb_none();
    }
    for (int t = 0; t < KT; t++) {
        int o = a->off[t];
#pragma GCC unroll 8
        for (int r = 0; r < nr; r++) {
            vf v = vloadu(base[r] + o);
            isnan[r] = vb_or(isnan[r], visnan(v));
            acc[r] = vmax(acc[r], v);
        }
    }
    const int last = a->OH * a->OW - VW;
#pragma GCC unroll 8
    for (int r = 0; r < nr; r++)
        store_run(vselect(isnan[r], nan, acc[r]), y + a->out0[u + r], 0, a->mask[u + r],
                  a->perm[u + r], a->out0[u + r] <= last, ACT_NONE, none, none);
}

/* the lanes k in [lo, hi) of 32 */
static inline unsigned range_mask(int lo, int hi)
{
    lo = lo < 0 ? 0 : lo > 32 ? 32 : lo;
    hi = hi < 0 ? 0 : hi > 32 ? 32 : hi;
    if (hi <= lo)
        return 0;
    unsigned below_hi = hi == 32 ? 0xFFFFFFFFu : (1u << hi) - 1;
    return below_hi & ~((1u << lo) - 1);
}

/* A padded row's chunks of VW columns, the same for every row of every plane (computed
 * once a task): chunk k of phase ph writes columns q0 .. q0 + VW - 1 of that phase from
 * x[col0 + 0, sw, 2 sw, ...] under `mask` (the lanes inside the row; for AVX-512 32
 * lanes for a stride of 2, whose even ones are kept). */
typedef struct {
    int dst, col0;
    unsigned mask;
} chunk_t;

static int pad_chunks(const dw_args *a, chunk_t *out)
{
    int n = 0;
    for (int ph = 0; ph < a->sw; ph++)
        for (int q0 = 0; q0 < a->Wq; q0 += VW) {
            int col0 = q0 * a->sw + ph - a->pl;
            chunk_t c = {ph * a->Wq + q0, col0, 0};
            if (a->sw <= 2) {
                c.mask = range_mask(-col0, a->Wd - col0);
                if (a->sw == 1)
                    c.mask &= VMASK;
            }
            out[n++] = c;
        }
    return n;
}

/* a padding row of a padded plane: whole vectors of the fill (the plane's pitch is
 * padded to them) */
static inline void fill_row(float *orow, long pitch, vf fill)
{
    for (long q = 0; q < pitch; q += VW)
        vstoreu(orow + q, fill);
}

/* one plane padded with a->fill into o (Hp x sw x Wq), a chunk a masked load and a
 * store, no call per row (a 4x4 plane's taps are only a few dozen FMAs) */
static inline void pad_plane(const dw_args *a, const chunk_t *chunks, int n, const float *x,
                             float *o)
{
    const int sw = a->sw, W = a->Wd;
    const long pitch = (long)sw * a->Wq;
    const vf fill = vset1(a->fill);
#if defined(HE_ISA_AVX512)
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4,
                                          2, 0);
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
#endif
    for (int hp = 0; hp < a->Hp; hp++) {
        int h = hp - a->pt;
        float *orow = o + hp * pitch;
        /* (a chunk's last lanes spill into the next phase or row: written again there) */
        if (h < 0 || h >= a->H) {
            fill_row(orow, pitch, fill);
            continue;
        }
        const float *xr = x + (long)h * W;
        for (int k = 0; k < n; k++) {
            const chunk_t c = chunks[k];
            vf v;
            if (sw == 1) {
                v = vload_lanes_or(fill, c.mask, xr + c.col0);
            }
#if defined(HE_ISA_AVX512)
            else if (sw == 2) {
                __m512 lo = _mm512_mask_loadu_ps(fill, (__mmask16)(c.mask & 0xFFFF), xr + c.col0);
                __m512 hi = _mm512_mask_loadu_ps(fill, (__mmask16)(c.mask >> 16), xr + c.col0 + 16);
                v = _mm512_permutex2var_ps(lo, even, hi);
            } else {
                __m512i col = _mm512_add_epi32(_mm512_set1_epi32(c.col0),
                                               _mm512_mullo_epi32(lane, _mm512_set1_epi32(sw)));
                __mmask16 m = _mm512_cmpge_epi32_mask(col, _mm512_setzero_si512()) &
                              _mm512_cmplt_epi32_mask(col, _mm512_set1_epi32(W));
                v = _mm512_mask_i32gather_ps(fill, m, col, xr, 4);
            }
#else
#if defined(HE_ISA_AVX2)
            else if (sw == 2)
                v = even_lanes(vload_lanes_or(fill, c.mask & 0xFF, xr + c.col0),
                               vload_lanes_or(fill, (c.mask >> 8) & 0xFF, xr + c.col0 + 8));
#endif
            else {
                float t[VW];
                for (int i = 0; i < VW; i++) {
                    int col = c.col0 + i * sw;
                    t[i] = col >= 0 && col < W ? xr[col] : a->fill;
                }
                v = vloadu(t);
            }
#endif
            vstoreu(orow + c.dst, v);
        }
    }
}

#if defined(HE_ISA_AVX2)
/* pad_plane at a column stride of 2 for AVX2: both phases from one pair of loads (a
 * phase-0 chunk's 16 columns hold the phase-1 chunk's in their odd lanes), where
 * pad_plane loads each phase's own; the last chunk first, since its phase-0 lanes spill
 * into phase 1's first columns */
static void pad_plane_s2(const dw_args *a, const chunk_t *chunks, int n, const float *x,
                         float *o)
{
    const long pitch = 2L * a->Wq;
    const vf fill = vset1(a->fill);
    const int half = n / 2;
    for (int hp = 0; hp < a->Hp; hp++) {
        int h = hp - a->pt;
        float *orow = o + hp * pitch;
        if (h < 0 || h >= a->H) {
            fill_row(orow, pitch, fill);
            continue;
        }
        const float *xr = x + (long)h * a->Wd;
        for (int i = 0; i < half; i++) {
            const chunk_t c = chunks[i == 0 ? half - 1 : i - 1];
            vf lo = vload_lanes_or(fill, c.mask & 0xFF, xr + c.col0);
            vf hi = vload_lanes_or(fill, (c.mask >> 8) & 0xFF, xr + c.col0 + 8);
            vstoreu(orow + c.dst, even_lanes(lo, hi));
            vstoreu(orow + a->Wq + c.dst, odd_lanes(lo, hi));
        }
    }
}
#endif

static void dw_task(void *args, int p0, int p1)
{
    dw_args *a = (dw_args *)args;
    long padded = (long)a->Hp * a->sw * a->Wq;
    /* the padded plane, with slack for the last runs' reads past its end (zeros at first:
     * they only reach lanes that are not stored, but must not be denormals) */
    float *p = (float *)calloc((size_t)padded + 64, sizeof(float));
    chunk_t *chunks = (chunk_t *)malloc((size_t)a->sw * ((a->Wq + VW - 1) / VW) * sizeof(chunk_t));
    if (!p || !chunks) {
        free(p);
        free(chunks);
        __atomic_store_n(&a->failed, 1, __ATOMIC_RELAXED);
        return;
    }
    if (a->fill != 0.0f)
        for (long i = 0; i < padded + 64; i++)
            p[i] = a->fill;
    int n = pad_chunks(a, chunks);
    long in_plane = (long)a->H * a->Wd, out_plane = (long)a->OH * a->OW;
    for (int pi = p0; pi < p1; pi++) {
#if defined(HE_ISA_AVX2)
        if (a->sw == 2)
            pad_plane_s2(a, chunks, n, a->X + (long)pi * in_plane, p);
        else
#endif
            pad_plane(a, chunks, n, a->X + (long)pi * in_plane, p);
        if (a->pool) {
            float *y = a->Y + (long)pi * out_plane;
            int u = 0;
            for (; u + RUNS <= a->runs; u += RUNS)
                pool_block(a, p, y, u, RUNS);
            switch (a->runs - u) {
#define T(n) case n: pool_block(a, p, y, u, n); break;
                T(1) T(2) T(3) T(4) T(5) T(6) T(7)
#undef T
                default: break;
            }
            continue;
        }
        int c = pi % a->C;
        const float *w = a->W + (long)c * a->KH * a->KW;
        const vf b = vset1(a->bias ? a->bias[c] : 0.0f);
        float *y = a->Y + (long)pi * out_plane;
        const float *z = a->z ? a->z + (long)pi * out_plane : 0;
        int u = 0;
        if (a->flat)
            for (; u + RUNS <= a->runs; u += RUNS)
                runs_block(a, p, w, b, y, z, u, RUNS, 1);
        else
            for (; u + RUNS <= a->runs; u += RUNS)
                runs_block(a, p, w, b, y, z, u, RUNS, 0);
        switch (a->runs - u) {
#define T(n) case n: runs_block(a, p, w, b, y, z, u, n, 0); break;
            T(1) T(2) T(3) T(4) T(5) T(6) T(7)
#undef T
            default: break;
        }
    }
    free(p);
    free(chunks);
}

/* Y (planes x OH x OW) = act(depthwise(X) + bias + Z) for X (planes x H x W), planes =
 * images x C, W (C x KH x KW), bias (C) or NULL, Z of Y's layout or NULL; pt, pl the top
 * and left pads (the bottom and right ones follow from OH and OW); over `parts` parts:
 * 0, or -1 when a buffer could not be allocated */
static int depthwise_or_pool(const float *X, const float *W, const float *bias, const float *z,
                             float *Y, int planes, int C, int H, int Wd, int OH, int OW, int KH,
                             int KW, int sh, int sw, int dh, int dw, int pt, int pl, int act,
                             float lo, float hi, int pool, int parts)
{
    /* the padded plane: rows and (phased) columns enough for every tap of every pixel,
     * and for the input itself */
    int Hp = (OH - 1) * sh + (KH - 1) * dh + 1, Wp = (OW - 1) * sw + (KW - 1) * dw + 1;
    if (Hp < pt + H)
        Hp = pt + H;
    if (Wp < pl + Wd)
        Wp = pl + Wd;
    int Wq = (Wp + sw - 1) / sw, pitch = sw * Wq;
    /* at strides 1, runs over the padded grid (a row's junk columns computed and not
     * stored) when they take fewer lanes than runs within each row */
    int row_runs = (OW + VW - 1) / VW;
    int flat = sh == 1 && sw == 1 && pitch <= VW * row_runs;
    int runs = flat ? ((OH - 1) * pitch + OW + VW - 1) / VW : OH * row_runs;
    int KT = KH * KW;
    int *off = (int *)malloc((size_t)KT * sizeof(int));
    int *in0 = (int *)malloc((size_t)runs * sizeof(int));
    int *out0 = (int *)malloc((size_t)runs * sizeof(int));
    unsigned short *mask = (unsigned short *)malloc((size_t)runs * sizeof(unsigned short));
    unsigned *perm = (unsigned *)malloc((size_t)runs * sizeof(unsigned));
    int rc = -1;
    if (!off || !in0 || !out0 || !mask || !perm)
        goto done;
    for (int i = 0; i < KH; i++)
        for (int j = 0; j < KW; j++) {
            int col = j * dw;
            off[i * KW + j] = i * dh * pitch + (col % sw) * Wq + col / sw;
        }
    for (int u = 0; u < runs; u++) {
        unsigned m = 0;
        if (flat) {
            long q0 = (long)u * VW, grid = (long)(OH - 1) * pitch + OW, first = -1;
            for (int k = 0; k < VW && q0 + k < grid; k++)
                if ((q0 + k) % pitch < OW) {
                    m |= 1u << k;
                    if (first < 0)
                        first = q0 + k;
                }
            in0[u] = (int)q0;
            out0[u] = first < 0 ? 0 : (int)(first / pitch * OW + first % pitch);
        } else {
            int oh = u / row_runs, ow0 = (u % row_runs) * VW;
            int len = OW - ow0 < VW ? OW - ow0 : VW;
            m = (1u << len) - 1;
            in0[u] = oh * sh * pitch + ow0;
            out0[u] = oh * OW + ow0;
        }
        mask[u] = (unsigned short)m;
        perm[u] = compress_perm(m);
    }
    dw_args a = {X, W, bias, z, Y, C, H, Wd, OH, OW, KH, KW, sw, pt, pl, Hp, Wq, runs, off, in0,
                 out0, mask, perm, act, lo, hi, pool, pool ? -__builtin_inff() : 0.0f, 0, flat};
    he_parallel(dw_task, &a, planes, parts);
    rc = a.failed ? -1 : 0;
done:
    free(off);
    free(in0);
    free(out0);
    free(mask);
    free(perm);
    return rc;
}

int he_depthwise_mt(const float *X, const float *W, const float *bias, const float *z,
                    float *Y, int planes, int C, int H, int Wd, int OH, int OW, int KH, int KW,
                    int sh, int sw, int dh, int dw, int pt, int pl, int act, float lo, float hi,
                    int parts)
{
    return depthwise_or_pool(X, W, bias, z, Y, planes, C, H, Wd, OH, OW, KH, KW, sh, sw, dh,
                             dw, pt, pl, act, lo, hi, 0, parts);
}

/* MaxPool (no indices) of X (planes x H x W) into Y (planes x OH x OW): each plane padded
 * with -inf into the worker's buffer and pooled from there, by the depthwise conv's runs;
 * 0, or -1 when a buffer could not be allocated */
int he_maxpool_plane_mt(const float *X, float *Y, int planes, int H, int Wd, int OH, int OW,
                        int KH, int KW, int sh, int sw, int dh, int dw, int pt, int pl, int parts)
{
    return depthwise_or_pool(X, 0, 0, 0, Y, planes, 1, H, Wd, OH, OW, KH, KW, sh, sw, dh, dw,
                             pt, pl, ACT_NONE, 0.0f, 0.0f, 1, parts);
}
