/* Softmax over the last axis of float32 rows, in place (AVX-512F): the Softmax kernel's
 * and FusedAttention's scores. numpy took five passes over the scores (max, subtract,
 * exp, sum, divide), each a new temporary or a full sweep; a row here is read three
 * times, and a 128-wide row stays in L1 between them. */
#include "he.h"

#include <float.h>
#include <math.h>

/* exp(z) for z <= 0 (a score minus its row's maximum), Cephes' expf: z = n ln2 + r,
 * |r| <= ln2 / 2, a degree-7 polynomial of r, scaled by 2^n; about 1 ulp. Below -87
 * (where exp(z) would soon be subnormal) the result is an exact 0, as in
 * reduce.exp_scores_inplace, so nothing after it runs on subnormals. */
static inline __attribute__((always_inline)) __m512 exp_nonpositive(__m512 z)
{
    const __m512 floor = _mm512_set1_ps(-87.0f);
    __mmask16 live = _mm512_cmp_ps_mask(z, floor, _CMP_GE_OQ);
    __m512 x = _mm512_max_ps(z, floor);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_maskz_scalef_ps(live, p, n);
}

static void softmax_row(float *x, int n)
{
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    __mmask16 nan = 0;
    for (int i = 0; i < n; i += 16) {
        __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), first_lanes(n - i), x + i);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        vmax = _mm512_max_ps(vmax, v);
    }
    float m = _mm512_reduce_max_ps(vmax);
    if (nan || !isfinite(m)) {
        /* numpy's arithmetic: a NaN anywhere, or a maximum of +-inf (inf - inf), makes
         * every entry of the row NaN */
        for (int i = 0; i < n; i++)
            x[i] = NAN;
        return;
    }
    __m512 vm = _mm512_set1_ps(m), vsum = _mm512_setzero_ps();
    for (int i = 0; i < n; i += 16) {
        __mmask16 k = first_lanes(n - i);
        __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + i), vm));
        e = _mm512_maskz_mov_ps(k, e);
        _mm512_mask_storeu_ps(x + i, k, e);
        vsum = _mm512_add_ps(vsum, e);
    }
    /* a quotient below float32's smallest normal (an exp near the floor over a sum above
     * 1) is stored as 0: no subnormal leaves here either */
    __m512 s = _mm512_set1_ps(_mm512_reduce_add_ps(vsum)), tiny = _mm512_set1_ps(FLT_MIN);
    for (int i = 0; i < n; i += 16) {
        __mmask16 k = first_lanes(n - i);
        __m512 y = _mm512_div_ps(_mm512_maskz_loadu_ps(k, x + i), s);
        _mm512_mask_storeu_ps(x + i, k, _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(y, tiny, _CMP_GE_OQ), y));
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
