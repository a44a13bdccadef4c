/* Activations after a product, in float32 (simd.h): act(y + bias) over the last axis of
 * (rows, cols), in place; FusedMatMul's epilogue where the packed store cannot apply it
 * (GELU, SiLU... or a product OpenBLAS computed). Eigen's rationals for erf and tanh,
 * the logistic from simd.h's exp, a vector a step (16 lanes with AVX-512; the
 * numba loops these replaced got 8 from LLVM); the
 * activation codes are kernels.h's ACT_*. NaN stays NaN: max/min take the NaN operand second. */
#include "kernels.h"


ALWAYS_INLINE vf clamp(vf v, float lo, float hi)
{
    return vmin(vset1(hi), vmax(vset1(lo), v));
}

ALWAYS_INLINE vf tanh16(vf u)
{
    vf t = clamp(u, -7.90531110763549805f, 7.90531110763549805f);
    vf z = vmul(t, t);
    vf p = vset1(-2.76076847742355e-16f);
    p = vfma(p, z, vset1(2.00018790482477e-13f));
    p = vfma(p, z, vset1(-8.60467152213735e-11f));
    p = vfma(p, z, vset1(5.12229709037114e-08f));
    p = vfma(p, z, vset1(1.48572235717979e-05f));
    p = vfma(p, z, vset1(0.000637261928875436f));
    p = vfma(p, z, vset1(0.00489352455891786f));
    vf q = vset1(1.19825839466702e-06f);
    q = vfma(q, z, vset1(0.000118534705686654f));
    q = vfma(q, z, vset1(0.002268434632439f));
    q = vfma(q, z, vset1(0.00489352518554385f));
    /* from the clamp on, +-1 exactly (with the FMAs the rational ends 2 ulp short of it
     * there): GELU(-100) is then 0 and SiLU(-inf) NaN, as numpy's formulas give */
    vf r = vdiv(vmul(p, t), q);
    vb far = vge(vabs(u), vset1(7.90531110763549805f));
    return vselect(far, vselect(vlt(u, vzero()), vset1(-1.0f), vset1(1.0f)), r);
}

/* erf (kernels/erf_gelu.py's float32 rational, the numpy definition it is tested against) */
ALWAYS_INLINE vf erf16(vf x)
{
    vf t = clamp(x, -4.5f, 4.5f);
    vf z = vmul(t, t);
    vf p = vset1(0.00022905065861350646f);
    p = vfma(p, z, vset1(0.0034082910107109507f));
    p = vfma(p, z, vset1(0.05095569506238086f));
    p = vfma(p, z, vset1(0.18520832239976145f));
    p = vfma(p, z, vset1(1.128379143519084f));
    vf q = vset1(-1.1791602954361697e-07f);
    q = vfma(q, z, vset1(2.3547966471313183e-05f));
    q = vfma(q, z, vset1(0.0010179625278914884f));
    q = vfma(q, z, vset1(0.014070470171167667f));
    q = vfma(q, z, vset1(0.11098505178285362f));
    q = vfma(q, z, vset1(0.49746925110067536f));
    q = vfma(q, z, vset1(1.0f));
    return clamp(vdiv(vmul(t, p), q), -1.0f, 1.0f);
}

ALWAYS_INLINE vf gelu_erf16(vf x)
{
    vf e = erf16(vmul(x, vset1(0.7071067811865475f)));
    return vmul(vmul(vset1(0.5f), x), vadd(vset1(1.0f), e));
}

/* the logistic from e = exp(-|x|): 1 / (1 + e) above zero, e / (1 + e) below, so its
 * error stays relative far below zero (as 0.5 + 0.5 tanh(x / 2) did not: 1 + tanh
 * cancels there); NaN stays NaN */
ALWAYS_INLINE vf sigmoid16(vf x)
{
    const vf e = exp_nonpositive(vsub(vzero(), vabs(x)));
    const vf r = vdiv(vselect(vlt(x, vzero()), e, vset1(1.0f)), vadd(vset1(1.0f), e));
    return vselect(visnan(x), x, r);
}

ALWAYS_INLINE vf act16(vf v, int code, float p0, float p1)
{
    switch (code) {
    case ACT_RELU:
        return vmax(vzero(), v);
    case ACT_CLIP:
        return clamp(v, p0, p1);
    case ACT_HARD_SIGMOID:
        return clamp(vfma(v, vset1(p0), vset1(p1)), 0.0f, 1.0f);
    case ACT_HARD_SWISH:
        return vmul(v, clamp(vfma(v, vset1(p0), vset1(p1)), 0.0f, 1.0f));
    case ACT_GELU:
        return gelu_erf16(v);
    case ACT_GELU_TANH: {
        vf inner = vmul(vset1(0.7978845608028654f),
                                     vfma(vmul(vset1(0.044715f), v),
                                                     vmul(v, v), v));
        return vmul(vmul(vset1(0.5f), v),
                             vadd(vset1(1.0f), tanh16(inner)));
    }
    case ACT_SILU:
        return vmul(v, sigmoid16(v));
    case ACT_SIGMOID:
        return sigmoid16(v);
    case ACT_TANH:
        return tanh16(v);
    case ACT_ERF:
        return erf16(v);
    default:
        return v;
    }
}

typedef struct {
    float *y;
    const float *b;
    int cols, code;
    float p0, p1;
} act_args;

/* one loop per activation (the switch hoisted out of it by the inlining). Two vectors a
 * step where they are whole: the activations' polynomials are long dependent chains (a
 * vector's GELU 40-50 cycles), and two in one step overlap; a vector a step bounded AVX2
 * at 1.2-1.5x AVX-512's time. Then the tail, a vector at a time under its lanes. */
#define PAIR(Y, X, B, CODE)                                                              \
    do {                                                                                  \
        vf v0 = vloadu(X), v1 = vloadu((X) + VW);                                         \
        if (B) {                                                                          \
            v0 = vadd(v0, vloadu(B));                                                     \
            v1 = vadd(v1, vloadu((B) + VW));                                              \
        }                                                                                 \
        v0 = act16(v0, CODE, a->p0, a->p1);                                               \
        v1 = act16(v1, CODE, a->p0, a->p1);                                               \
        vstoreu(Y, v0);                                                                   \
        vstoreu((Y) + VW, v1);                                                            \
    } while (0)

#define ROWS(CODE)                                                                      \
    for (int r = r0; r < r1; r++) {                                                      \
        float *y = a->y + (long)r * a->cols;                                              \
        int k = 0;                                                                        \
        for (; k + 2 * VW <= a->cols; k += 2 * VW)                                        \
            PAIR(y + k, y + k, a->b ? a->b + k : 0, CODE);                               \
        for (; k < a->cols; k += VW) {                                                   \
            lanes_t m = first_lanes(a->cols - k);                                         \
            vf v = vload_lanes(m, y + k);                                                 \
            if (a->b)                                                                     \
                v = vadd(v, vload_lanes(m, a->b + k));                                    \
            vstore_lanes(y + k, m, act16(v, CODE, a->p0, a->p1));                         \
        }                                                                                 \
    }

static void act_task(void *p, int r0, int r1)
{
    act_args *a = (act_args *)p;
    switch (a->code) {
    case ACT_NONE: ROWS(ACT_NONE) break;
    case ACT_RELU: ROWS(ACT_RELU) break;
    case ACT_CLIP: ROWS(ACT_CLIP) break;
    case ACT_HARD_SIGMOID: ROWS(ACT_HARD_SIGMOID) break;
    case ACT_HARD_SWISH: ROWS(ACT_HARD_SWISH) break;
    case ACT_GELU: ROWS(ACT_GELU) break;
    case ACT_GELU_TANH: ROWS(ACT_GELU_TANH) break;
    case ACT_SILU: ROWS(ACT_SILU) break;
    case ACT_SIGMOID: ROWS(ACT_SIGMOID) break;
    case ACT_ERF: ROWS(ACT_ERF) break;
    default: ROWS(ACT_TANH) break;
    }
}

/* y (rows x cols, C-contiguous) = act(y + b) in place, b (cols) or NULL */
void he_last_axis_mt(float *y, const float *b, int rows, int cols, int code, float p0,
                     float p1, int parts)
{
    act_args a = {y, b, cols, code, p0, p1};
    he_parallel(act_task, &a, rows, parts);
}

/* The channels epilogue of an NCHW product (n, M, L), in place: row r = i*M + m gets
 * act(y + b[m] + z), the residual z of y's shape or NULL, b (M) or NULL; a conv's bias,
 * residual and activation where the packed store cannot apply them (GELU, SiLU... or a
 * product numpy computed). The residual comes before the activation, as FusedConv's. */
typedef struct {
    float *y;
    const float *b, *z;
    int M, L, code;
    float p0, p1;
} channels_args;

#define CHANNEL_ROWS(CODE)                                                              \
    for (int r = r0; r < r1; r++) {                                                      \
        float *y = a->y + (long)r * a->L;                                                 \
        const float *z = a->z ? a->z + (long)r * a->L : NULL;                             \
        vf bias = vset1(a->b ? a->b[r % a->M] : 0.0f);                                    \
        int k = 0;                                                                        \
        for (; k + 2 * VW <= a->L; k += 2 * VW) {                                         \
            vf v0 = vloadu(y + k), v1 = vloadu(y + k + VW);                               \
            if (z) {                                                                      \
                v0 = vadd(v0, vloadu(z + k));                                             \
                v1 = vadd(v1, vloadu(z + k + VW));                                        \
            }                                                                             \
            v0 = act16(vadd(v0, bias), CODE, a->p0, a->p1);                               \
            v1 = act16(vadd(v1, bias), CODE, a->p0, a->p1);                               \
            vstoreu(y + k, v0);                                                           \
            vstoreu(y + k + VW, v1);                                                      \
        }                                                                                 \
        for (; k < a->L; k += VW) {                                                      \
            lanes_t m = first_lanes(a->L - k);                                            \
            vf v = vload_lanes(m, y + k);                                                 \
            if (z)                                                                        \
                v = vadd(v, vload_lanes(m, z + k));                                       \
            vstore_lanes(y + k, m, act16(vadd(v, bias), CODE, a->p0, a->p1));             \
        }                                                                                 \
    }

static void channels_task(void *p, int r0, int r1)
{
    channels_args *a = (channels_args *)p;
    switch (a->code) {
    case ACT_NONE: CHANNEL_ROWS(ACT_NONE) break;
    case ACT_RELU: CHANNEL_ROWS(ACT_RELU) break;
    case ACT_CLIP: CHANNEL_ROWS(ACT_CLIP) break;
    case ACT_HARD_SIGMOID: CHANNEL_ROWS(ACT_HARD_SIGMOID) break;
    case ACT_HARD_SWISH: CHANNEL_ROWS(ACT_HARD_SWISH) break;
    case ACT_GELU: CHANNEL_ROWS(ACT_GELU) break;
    case ACT_GELU_TANH: CHANNEL_ROWS(ACT_GELU_TANH) break;
    case ACT_SILU: CHANNEL_ROWS(ACT_SILU) break;
    case ACT_SIGMOID: CHANNEL_ROWS(ACT_SIGMOID) break;
    case ACT_ERF: CHANNEL_ROWS(ACT_ERF) break;
    default: CHANNEL_ROWS(ACT_TANH) break;
    }
}

void he_channels_mt(float *y, const float *b, const float *z, int n, int M, int L, int code,
                    float p0, float p1, int parts)
{
    channels_args a = {y, b, z, M, L, code, p0, p1};
    he_parallel(channels_task, &a, n * M, parts);
}

/* y = act(x) over n values (x and y may be the same array): Gelu, Sigmoid... as single
 * ops, in runs of ACT_RUN values split over the workers */
#define ACT_RUN 4096

typedef struct {
    const float *x;
    float *y;
    long n;
    int code;
    float p0, p1;
} unary_args;

#define UNARY_RUNS(CODE)                                                                \
    for (int r = r0; r < r1; r++) {                                                      \
        long end = (long)(r + 1) * ACT_RUN < a->n ? (long)(r + 1) * ACT_RUN : a->n;       \
        long k = (long)r * ACT_RUN;                                                       \
        for (; k + 2 * VW <= end; k += 2 * VW)                                            \
            PAIR(a->y + k, a->x + k, (const float *)0, CODE);                             \
        for (; k < end; k += VW) {                                                       \
            lanes_t m = first_lanes((int)(end - k < VW ? end - k : VW));                  \
            vstore_lanes(a->y + k, m, act16(vload_lanes(m, a->x + k), CODE, a->p0, a->p1)); \
        }                                                                                 \
    }

static void unary_task(void *p, int r0, int r1)
{
    unary_args *a = (unary_args *)p;
    switch (a->code) {
    case ACT_NONE: UNARY_RUNS(ACT_NONE) break;
    case ACT_RELU: UNARY_RUNS(ACT_RELU) break;
    case ACT_CLIP: UNARY_RUNS(ACT_CLIP) break;
    case ACT_HARD_SIGMOID: UNARY_RUNS(ACT_HARD_SIGMOID) break;
    case ACT_HARD_SWISH: UNARY_RUNS(ACT_HARD_SWISH) break;
    case ACT_GELU: UNARY_RUNS(ACT_GELU) break;
    case ACT_GELU_TANH: UNARY_RUNS(ACT_GELU_TANH) break;
    case ACT_SILU: UNARY_RUNS(ACT_SILU) break;
    case ACT_SIGMOID: UNARY_RUNS(ACT_SIGMOID) break;
    case ACT_ERF: UNARY_RUNS(ACT_ERF) break;
    default: UNARY_RUNS(ACT_TANH) break;
    }
}

void he_unary_mt(const float *x, float *y, long n, int code, float p0, float p1, int parts)
{
    unary_args a = {x, y, n, code, p0, p1};
    he_parallel(unary_task, &a, (int)((n + ACT_RUN - 1) / ACT_RUN), parts);
}
