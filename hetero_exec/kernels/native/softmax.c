/* Softmax over the last axis of float32 rows, in place (simd.h): the Softmax kernel's
 * and FusedAttention's scores. numpy took five passes over the scores (max, subtract,
 * exp, sum, divide), each a new temporary or a full sweep; a row here is read three
 * times, and a 128-wide row stays in L1 between them. */
#include "kernels.h"

#include <float.h>
#include <math.h>

/* Each pass takes two whole vectors a step (two chains of max, of exp's polynomial and
 * of the sum: one a step bounded AVX2 at 1.2-1.35x AVX-512's time), then the tail under
 * its lanes. */
void softmax_row(float *x, int n)
{
    vf mx0 = vset1(-INFINITY), mx1 = mx0;
    vb nan = vb_none();
    int i = 0;
    for (; i + 2 * VW <= n; i += 2 * VW) {
        vf v0 = vloadu(x + i), v1 = vloadu(x + i + VW);
        nan = vb_or(nan, vb_or(visnan(v0), visnan(v1)));
        mx0 = vmax(mx0, v0);
        mx1 = vmax(mx1, v1);
    }
    for (; i < n; i += VW) {
        vf v = vload_lanes_or(vset1(-INFINITY), first_lanes(n - i), x + i);
        nan = vb_or(nan, visnan(v));
        mx0 = vmax(mx0, v);
    }
    float m = vreduce_max(vmax(mx0, mx1));
    if (vb_any(nan) || !isfinite(m)) {
        /* numpy's arithmetic: a NaN anywhere, or a maximum of +-inf (inf - inf), makes
         * every entry of the row NaN */
        for (int j = 0; j < n; j++)
            x[j] = NAN;
        return;
    }
    vf vm = vset1(m), sum0 = vzero(), sum1 = vzero();
    for (i = 0; i + 2 * VW <= n; i += 2 * VW) {
        vf e0 = exp_nonpositive(vsub(vloadu(x + i), vm));
        vf e1 = exp_nonpositive(vsub(vloadu(x + i + VW), vm));
        vstoreu(x + i, e0);
        vstoreu(x + i + VW, e1);
        sum0 = vadd(sum0, e0);
        sum1 = vadd(sum1, e1);
    }
    for (; i < n; i += VW) {
        lanes_t k = first_lanes(n - i);
        vf e = exp_nonpositive(vsub(vload_lanes(k, x + i), vm));
        e = vkeep(k, e);
        vstore_lanes(x + i, k, e);
        sum0 = vadd(sum0, e);
    }
    /* a quotient below float32's smallest normal (an exp near the floor over a sum above
     * 1) is stored as 0: no subnormal leaves here either */
    vf s = vset1(vreduce_add(vadd(sum0, sum1))), tiny = vset1(FLT_MIN);
    for (i = 0; i + VW <= n; i += VW) {
        vf y = vdiv(vloadu(x + i), s);
        vstoreu(x + i, vselect(vge(y, tiny), y, vzero()));
    }
    if (i < n) {
        lanes_t k = first_lanes(n - i);
        vf y = vdiv(vload_lanes(k, x + i), s);
        vstore_lanes(x + i, k, vselect(vge(y, tiny), y, vzero()));
    }
}

typedef struct {
    float *x;
    int n;
} softmax_args;

static void softmax_task(void *p, int r0, int r1)
{
    softmax_args *a = (softmax_args *)p;
    for (int r = r0; r < r1; r++)
        softmax_row(a->x + (long)r * a->n, a->n);
}

/* rows x n, C-contiguous, in place, the rows in `parts` parts over the workers */
void he_softmax_mt(float *x, int rows, int n, int parts)
{
    softmax_args a = {x, n};
    he_parallel(softmax_task, &a, rows, parts);
}
