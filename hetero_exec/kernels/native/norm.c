/* LayerNorm over the channels of (n, C, L) in float32 (simd.h): ConvNeXt's
 * channels-first LayerNorm, as exporters write it (ReduceMean over axis 1 and the rest
 * of the chain, fused into FusedLayerNorm). numpy took six passes over the whole tensor,
 * each a strided reduction or a temporary; here a run of VW pixels is read for its
 * means over the channels, again for the variances (two passes: no sum of squares minus
 * the squared mean, which cancels), and once for the output, while its C x VW floats
 * stay in L1. The row norms over the last axis (he_row_norm_mt) are float32's; float64
 * takes norm.py's numpy path. */
#include "kernels.h"

typedef struct {
    const float *x, *g, *b;
    float *y;
    int C, L, runs;
    float eps;
    int nhwc; /* write y as (n, L, C): a LayerNorm over the last axis of a permuted view */
    int failed;
} norm_args;

/* items t = (image, run of VW pixels): LayerNorm of each pixel over the C channels, VW
 * pixels a vector, the channels L floats apart */
static void channels_task(void *p, int t0, int t1)
{
    norm_args *a = (norm_args *)p;
    const int C = a->C, L = a->L;
    const vf one = vset1(1.0f), eps = vset1(a->eps), inv_c = vset1(1.0f / C);
    const vidx byvw = vidx_stride(VW);
    /* nhwc: a run's outputs (C x VW) kept here, then written a pixel (C floats) at a time */
    float *block = a->nhwc ? (float *)aligned_alloc(64, ((size_t)C * VW * sizeof(float) + 63) / 64 * 64) : 0;
    if (a->nhwc && !block) {
        __atomic_store_n(&a->failed, 1, __ATOMIC_RELAXED);
        return;
    }
    for (int t = t0; t < t1; t++) {
        int n = t / a->runs, l0 = (t % a->runs) * VW;
        lanes_t k = first_lanes(L - l0);
        const float *x = a->x + (long)n * C * L + l0;
        float *y = a->y + (long)n * C * L + l0;
        vf s = vzero();
        for (int c = 0; c < C; c++)
            s = vadd(s, vload_lanes(k, x + (long)c * L));
        vf m = vmul(s, inv_c), v = vzero();
        for (int c = 0; c < C; c++) {
            vf d = vsub(vload_lanes(k, x + (long)c * L), m);
            v = vfma(d, d, v);
        }
        vf iv = vdiv(one, vsqrt(vfma(v, inv_c, eps)));
        for (int c = 0; c < C; c++) {
            vf o = vmul(vsub(vload_lanes(k, x + (long)c * L), m), iv);
            if (a->g)
                o = vmul(o, vset1(a->g[c]));
            if (a->b)
                o = vadd(o, vset1(a->b[c]));
            if (block)
                vstore(block + (long)c * VW, o);
            else
                vstore_lanes(y + (long)c * L, k, o);
        }
        if (block) {
            int nk = L - l0 < VW ? L - l0 : VW;
            for (int q = 0; q < nk; q++) {
                float *out = a->y + ((long)n * L + l0 + q) * C;
                for (int c0 = 0; c0 < C; c0 += VW)
                    vstore_lanes(out + c0, first_lanes(C - c0),
                                 vgather(block + (long)c0 * VW + q, byvw, C - c0));
            }
        }
    }
    free(block);
}

/* y = LayerNorm over axis 1 of x (n, C, L), g and b (C) or NULL; y (n, C, L), or with
 * nhwc (n, L, C): 0, or -1 when a task's buffer could not be allocated */
int he_layer_norm_channels_mt(const float *x, const float *g, const float *b, float eps,
                              float *y, int n, int C, int L, int nhwc, int parts)
{
    norm_args a = {x, g, b, y, C, L, (L + VW - 1) / VW, eps, nhwc, 0};
    he_parallel(channels_task, &a, n * a.runs, parts);
    return a.failed ? -1 : 0;
}

/* ------------------------------------------------ LayerNorm and RMSNorm over the rows */

typedef struct {
    const float *x, *g, *b;
    float *y, *mean, *inv;
    int cols, rms;
    float eps;
} rows_args;

/* the lanes' partial sums of x[0, n) (d = 0), or of (x - m)^2 (d = 1): four chains, where
 * one chain's add or FMA latency bounded the loop (AVX2 at 1.4-1.6x AVX-512's time) */
ALWAYS_INLINE vf row_sum(const float *x, int n, vf m, const int d)
{
    vf s0 = vzero(), s1 = vzero(), s2 = vzero(), s3 = vzero();
    int k = 0;
#define TERM(acc, v) acc = d ? vfma(vsub(v, m), vsub(v, m), acc) : vadd(acc, v)
    for (; k + 4 * VW <= n; k += 4 * VW) {
        TERM(s0, vloadu(x + k));
        TERM(s1, vloadu(x + k + VW));
        TERM(s2, vloadu(x + k + 2 * VW));
        TERM(s3, vloadu(x + k + 3 * VW));
    }
    for (; k + VW <= n; k += VW)
        TERM(s0, vloadu(x + k));
#undef TERM
    if (k < n) {
        lanes_t l = first_lanes(n - k);
        vf v = vload_lanes(l, x + k);
        s1 = d ? vfma(vkeep(l, vsub(v, m)), vkeep(l, vsub(v, m)), s1) : vadd(s1, v);
    }
    return vadd(vadd(s0, s1), vadd(s2, s3));
}

/* rows [r0, r1) of (rows, cols): a row read for its mean, again for its variance (two
 * passes: no sum of squares minus the squared mean, which cancels), once for the
 * output; the lanes' partial sums added in double */
static void rows_task(void *p, int r0, int r1)
{
    const rows_args *a = (const rows_args *)p;
    const int n = a->cols;
    for (int r = r0; r < r1; r++) {
        const float *x = a->x + (long)r * n;
        float *y = a->y + (long)r * n;
        double m = 0.0;
        if (!a->rms)
            m = (double)vreduce_add(row_sum(x, n, vzero(), 0)) / n;
        vf vm = vset1((float)m);
        double iv = 1.0 / __builtin_sqrt((double)vreduce_add(row_sum(x, n, vm, 1)) / n + a->eps);
        if (a->mean)
            a->mean[r] = (float)m;
        if (a->inv)
            a->inv[r] = (float)iv;
        vf vi = vset1((float)iv);
        int k = 0;
        for (; k + VW <= n; k += VW) {
            vf o = vmul(vsub(vloadu(x + k), vm), vi);
            if (a->g)
                o = vmul(o, vloadu(a->g + k));
            if (a->b)
                o = vadd(o, vloadu(a->b + k));
            vstoreu(y + k, o);
        }
        if (k < n) {
            lanes_t l = first_lanes(n - k);
            vf o = vmul(vsub(vload_lanes(l, x + k), vm), vi);
            if (a->g)
                o = vmul(o, vload_lanes(l, a->g + k));
            if (a->b)
                o = vadd(o, vload_lanes(l, a->b + k));
            vstore_lanes(y + k, l, o);
        }
    }
}

/* y = LayerNorm (or with rms RMSNorm: x / sqrt(mean(x^2) + eps)) of each row of x (rows,
 * cols), times g and plus b (cols) where not NULL; mean and inv (rows), 1 / sqrt(var +
 * eps), kept where not NULL */
void he_row_norm_mt(const float *x, const float *g, const float *b, float eps, float *y,
                    float *mean, float *inv, int rows, int cols, int rms, int parts)
{
    rows_args a = {x, g, b, y, mean, inv, cols, rms, eps};
    he_parallel(rows_task, &a, rows, parts);
}
