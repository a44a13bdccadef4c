/* Activations after a product, in float32 (AVX-512F): act(y + bias) over the last axis of
 * (rows, cols), in place; FusedMatMul's epilogue where the packed store cannot apply it
 * (GELU, SiLU... or a product OpenBLAS computed). The same rationals as numba's float32
 * epilogue (native/epilogue.py: Eigen's erf and tanh, the logistic as 0.5 + 0.5 tanh(x/2)),
 * 16 lanes a step where LLVM gave numba's loops 8; the activation codes are
 * kernels/native.ACT_CODES. NaN stays NaN: max/min take the NaN operand second. */
#include "he.h"

enum { A_NONE = 0, A_RELU = 1, A_CLIP = 2, A_HARD_SIGMOID = 3, A_HARD_SWISH = 4, A_GELU = 8,
       A_GELU_TANH = 9, A_SILU = 10, A_SIGMOID = 11, A_TANH = 12 };

static inline __attribute__((always_inline)) __m512 clamp(__m512 v, float lo, float hi)
{
    return _mm512_min_ps(_mm512_set1_ps(hi), _mm512_max_ps(_mm512_set1_ps(lo), v));
}

static inline __attribute__((always_inline)) __m512 tanh16(__m512 u)
{
    __m512 t = clamp(u, -7.90531110763549805f, 7.90531110763549805f);
    __m512 z = _mm512_mul_ps(t, t);
    __m512 p = _mm512_set1_ps(-2.76076847742355e-16f);
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(2.00018790482477e-13f));
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(-8.60467152213735e-11f));
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(5.12229709037114e-08f));
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(1.48572235717979e-05f));
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(0.000637261928875436f));
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(0.00489352455891786f));
    __m512 q = _mm512_set1_ps(1.19825839466702e-06f);
    q = _mm512_fmadd_ps(q, z, _mm512_set1_ps(0.000118534705686654f));
    q = _mm512_fmadd_ps(q, z, _mm512_set1_ps(0.002268434632439f));
    q = _mm512_fmadd_ps(q, z, _mm512_set1_ps(0.00489352518554385f));
    /* from the clamp on, +-1 exactly (with the FMAs the rational ends 2 ulp short of it
     * there): GELU(-100) is then 0 and SiLU(-inf) NaN, as in numba's float32 loop */
    __m512 r = _mm512_div_ps(_mm512_mul_ps(p, t), q);
    __mmask16 far = _mm512_cmp_ps_mask(_mm512_abs_ps(u), _mm512_set1_ps(7.90531110763549805f), _CMP_GE_OQ);
    return _mm512_mask_blend_ps(far, r, _mm512_mask_blend_ps(_mm512_cmp_ps_mask(u, _mm512_setzero_ps(), _CMP_LT_OQ),
                                                             _mm512_set1_ps(1.0f), _mm512_set1_ps(-1.0f)));
}

static inline __attribute__((always_inline)) __m512 gelu_erf16(__m512 x)
{
    __m512 t = clamp(_mm512_mul_ps(x, _mm512_set1_ps(0.7071067811865475f)), -4.5f, 4.5f);
    __m512 z = _mm512_mul_ps(t, t);
    __m512 p = _mm512_set1_ps(0.00022905065861350646f);
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(0.0034082910107109507f));
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(0.05095569506238086f));
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(0.18520832239976145f));
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(1.128379143519084f));
    __m512 q = _mm512_set1_ps(-1.1791602954361697e-07f);
    q = _mm512_fmadd_ps(q, z, _mm512_set1_ps(2.3547966471313183e-05f));
    q = _mm512_fmadd_ps(q, z, _mm512_set1_ps(0.0010179625278914884f));
    q = _mm512_fmadd_ps(q, z, _mm512_set1_ps(0.014070470171167667f));
    q = _mm512_fmadd_ps(q, z, _mm512_set1_ps(0.11098505178285362f));
    q = _mm512_fmadd_ps(q, z, _mm512_set1_ps(0.49746925110067536f));
    q = _mm512_fmadd_ps(q, z, _mm512_set1_ps(1.0f));
    __m512 e = clamp(_mm512_div_ps(_mm512_mul_ps(t, p), q), -1.0f, 1.0f);
    return _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), x), _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}

static inline __attribute__((always_inline)) __m512 sigmoid16(__m512 x)
{
    __m512 h = _mm512_set1_ps(0.5f);
    return _mm512_fmadd_ps(h, tanh16(_mm512_mul_ps(h, x)), h);
}

static inline __attribute__((always_inline)) __m512 act16(__m512 v, int code, float p0, float p1)
{
    switch (code) {
    case A_RELU:
        return _mm512_max_ps(_mm512_setzero_ps(), v);
    case A_CLIP:
        return clamp(v, p0, p1);
    case A_HARD_SIGMOID:
        return clamp(_mm512_fmadd_ps(v, _mm512_set1_ps(p0), _mm512_set1_ps(p1)), 0.0f, 1.0f);
    case A_HARD_SWISH:
        return _mm512_mul_ps(v, clamp(_mm512_fmadd_ps(v, _mm512_set1_ps(p0), _mm512_set1_ps(p1)), 0.0f, 1.0f));
    case A_GELU:
        return gelu_erf16(v);
    case A_GELU_TANH: {
        __m512 inner = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f),
                                     _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(0.044715f), v),
                                                     _mm512_mul_ps(v, v), v));
        return _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), v),
                             _mm512_add_ps(_mm512_set1_ps(1.0f), tanh16(inner)));
    }
    case A_SILU:
        return _mm512_mul_ps(v, sigmoid16(v));
    case A_SIGMOID:
        return sigmoid16(v);
    case A_TANH:
        return tanh16(v);
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

/* one loop per activation (the switch hoisted out of it by the inlining) */
#define ROWS(CODE)                                                                      \
    for (int r = r0; r < r1; r++) {                                                      \
        float *y = a->y + (long)r * a->cols;                                              \
        for (int k = 0; k < a->cols; k += 16) {                                           \
            __mmask16 m = first_lanes(a->cols - k);                                      \
            __m512 v = _mm512_maskz_loadu_ps(m, y + k);                                    \
            if (a->b)                                                                     \
                v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, a->b + k));                   \
            _mm512_mask_storeu_ps(y + k, m, act16(v, CODE, a->p0, a->p1));                  \
        }                                                                                 \
    }

static void act_task(void *p, int r0, int r1)
{
    act_args *a = (act_args *)p;
    switch (a->code) {
    case A_NONE: ROWS(A_NONE) break;
    case A_RELU: ROWS(A_RELU) break;
    case A_CLIP: ROWS(A_CLIP) break;
    case A_HARD_SIGMOID: ROWS(A_HARD_SIGMOID) break;
    case A_HARD_SWISH: ROWS(A_HARD_SWISH) break;
    case A_GELU: ROWS(A_GELU) break;
    case A_GELU_TANH: ROWS(A_GELU_TANH) break;
    case A_SILU: ROWS(A_SILU) break;
    case A_SIGMOID: ROWS(A_SIGMOID) break;
    default: ROWS(A_TANH) break;
    }
}

/* y (rows x cols, C-contiguous) = act(y + b) in place, b (cols) or NULL */
void he_last_axis_mt(float *y, const float *b, int rows, int cols, int code, float p0,
                     float p1, int parts)
{
    act_args a = {y, b, cols, code, p0, p1};
    he_parallel(act_task, &a, rows, parts);
}
