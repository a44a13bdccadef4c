/* The interpreter of bound plans (program.h): records run one after another, each over
 * buffers fixed when the plan was bound; only the buffer table changes from run to run.
 *
 * Element-wise records (copy, cast, unary, binary, where, reduce) walk up to HE_ND dims
 * with a stride per operand (0: broadcast), one row (the last dim) at a time; a row with
 * unit strides is a plain loop the compiler vectorises. Their rows are split over the
 * library's workers when the record says so (`parts`, chosen in Python from its size). */
#include <math.h>

#include "program.h"

static inline char *ptr_of(void *const *bufs, const he_tensor *t)
{
    return t->buf < 0 ? NULL : tensor_at(bufs, t);
}

/* ------------------------------------------------------------------ n-d rows */

typedef void (*row_fn)(const he_op *o, char **p, const int64_t *s, int64_t n);

typedef struct {
    const he_op *o;
    void *const *bufs;
    int nt;
    row_fn fn;
} nd_args;

static void nd_rows(void *arg, int r0, int r1)
{
    const nd_args *a = (const nd_args *)arg;
    const he_op *o = a->o;
    const int nd = o->ndim, nt = a->nt;
    int64_t bst[HE_NT][HE_ND] = {{0}}, idx[HE_ND] = {0}, inner[HE_NT];
    char *ptr[HE_NT];
    for (int t = 0; t < nt; t++) {
        const int es = dtype_size(o->t[t].dtype);
        for (int d = 0; d < nd; d++)
            bst[t][d] = o->t[t].st[d] * es;
        inner[t] = nd ? bst[t][nd - 1] : 0;
    }
    int64_t r = r0;
    for (int d = nd - 2; d >= 0; d--) {
        idx[d] = r % o->dims[d];
        r /= o->dims[d];
    }
    for (int t = 0; t < nt; t++) {
        ptr[t] = ptr_of(a->bufs, &o->t[t]);
        for (int d = 0; d < nd - 1; d++)
            ptr[t] += idx[d] * bst[t][d];
    }
    const int64_t n = nd ? o->dims[nd - 1] : 1;
    for (int64_t row = r0; row < r1; row++) {
        a->fn(o, ptr, inner, n);
        for (int d = nd - 2; d >= 0; d--) {
            idx[d]++;
            for (int t = 0; t < nt; t++)
                ptr[t] += bst[t][d];
            if (idx[d] < o->dims[d])
                break;
            for (int t = 0; t < nt; t++)
                ptr[t] -= bst[t][d] * o->dims[d];
            idx[d] = 0;
        }
    }
}

static int64_t nd_row_count(const he_op *o)
{
    int64_t rows = 1;
    for (int d = 0; d < o->ndim - 1; d++)
        rows *= o->dims[d];
    return rows;
}

static void nd_run(const he_op *o, void *const *bufs, int nt, row_fn fn)
{
    nd_args a = {o, bufs, nt, fn};
    const int64_t rows = nd_row_count(o);
    if (o->ndim && o->dims[o->ndim - 1] == 0)
        return;
    if (o->parts > 1)
        he_parallel(nd_rows, &a, (int)rows, o->parts);
    else
        nd_rows(&a, 0, (int)rows);
}

/* a copy whose last two dims are a transposed block (the source contiguous along the
 * inner one, the destination along the other): a tight double loop per block, not a
 * call per short row */
#define BLOCK_COPY(T)                                                                    \
    for (int64_t i = 0; i < n1; i++)                                                     \
        for (int64_t j = 0; j < n0; j++)                                                 \
            ((T *)dst)[i * d1 + j * d0] = ((const T *)src)[i * s1 + j * s0];

static void block_copy(const he_op *o, void *const *bufs)
{
    const int nd = o->ndim, es = dtype_size(o->t[0].dtype);
    const int64_t n1 = o->dims[nd - 2], n0 = o->dims[nd - 1];
    const int64_t d1 = o->t[0].st[nd - 2], d0 = o->t[0].st[nd - 1];
    const int64_t s1 = o->t[1].st[nd - 2], s0 = o->t[1].st[nd - 1];
    int64_t blocks = 1, idx[HE_ND] = {0};
    for (int d = 0; d < nd - 2; d++)
        blocks *= o->dims[d];
    char *base_d = ptr_of(bufs, &o->t[0]);
    const char *base_s = ptr_of(bufs, &o->t[1]);
    for (int64_t b = 0; b < blocks; b++) {
        char *dst = base_d;
        const char *src = base_s;
        for (int d = 0; d < nd - 2; d++) {
            dst += idx[d] * o->t[0].st[d] * es;
            src += idx[d] * o->t[1].st[d] * es;
        }
        switch (es) {
        case 1: BLOCK_COPY(uint8_t) break;
        case 2: BLOCK_COPY(uint16_t) break;
        case 4: BLOCK_COPY(uint32_t) break;
        default: BLOCK_COPY(uint64_t) break;
        }
        for (int d = nd - 3; d >= 0; d--) {
            if (++idx[d] < o->dims[d])
                break;
            idx[d] = 0;
        }
    }
}

/* ------------------------------------------------------------------ copy, where */

#define STRIDED_COPY(T)                                                                  \
    for (int64_t i = 0; i < n; i++)                                                      \
        *(T *)(p[0] + i * s[0]) = *(const T *)(p[1] + i * s[1]);

static void copy_row(const he_op *o, char **p, const int64_t *s, int64_t n)
{
    const int es = dtype_size(o->t[0].dtype);
    if (s[0] == es && s[1] == es) {
        memmove(p[0], p[1], (size_t)(n * es));
        return;
    }
    switch (es) {
    case 1: STRIDED_COPY(uint8_t) break;
    case 2: STRIDED_COPY(uint16_t) break;
    case 4: STRIDED_COPY(uint32_t) break;
    default: STRIDED_COPY(uint64_t) break;
    }
}

/* a dense row (output and condition at unit strides, each branch a row or one value,
 * as a decoder's mask makes them over its context) by loops the compiler vectorizes;
 * other strides element by element */
#define WHERE_DENSE(T, XS, YS)                                                           \
    for (int64_t i = 0; i < n; i++)                                                      \
        y[i] = c[i] ? x[i * XS] : z[i * YS];
#define WHERE_ROW(T)                                                                     \
    if (s[0] == sizeof(T) && s[1] == 1 && (s[2] == 0 || s[2] == sizeof(T))             \
        && (s[3] == 0 || s[3] == sizeof(T))) {                                           \
        T *y = (T *)p[0];                                                                \
        const uint8_t *c = (const uint8_t *)p[1];                                        \
        const T *x = (const T *)p[2], *z = (const T *)p[3];                              \
        if (s[2] && s[3]) {                                                              \
            WHERE_DENSE(T, 1, 1)                                                         \
        } else if (s[2]) {                                                               \
            WHERE_DENSE(T, 1, 0)                                                         \
        } else if (s[3]) {                                                               \
            WHERE_DENSE(T, 0, 1)                                                         \
        } else {                                                                         \
            WHERE_DENSE(T, 0, 0)                                                         \
        }                                                                                \
    } else                                                                               \
        for (int64_t i = 0; i < n; i++)                                                  \
            *(T *)(p[0] + i * s[0]) = *(const uint8_t *)(p[1] + i * s[1])                \
                                          ? *(const T *)(p[2] + i * s[2])                \
                                          : *(const T *)(p[3] + i * s[3]);

static void where_row(const he_op *o, char **p, const int64_t *s, int64_t n)
{
    switch (dtype_size(o->t[0].dtype)) {
    case 1: WHERE_ROW(uint8_t) break;
    case 2: WHERE_ROW(uint16_t) break;
    case 4: WHERE_ROW(uint32_t) break;
    default: WHERE_ROW(uint64_t) break;
    }
}

/* ------------------------------------------------------------------ cast */

#define CAST_TO(TS, TD, EXPR)                                                            \
    if (s[0] == sizeof(TD) && s[1] == sizeof(TS)) { /* contiguous rows: a vector loop */  \
        TD *y = (TD *)p[0];                                                              \
        const TS *xs = (const TS *)p[1];                                                 \
        for (int64_t i = 0; i < n; i++) {                                                \
            TS x = xs[i];                                                                \
            y[i] = (TD)(EXPR);                                                           \
        }                                                                                \
    } else {                                                                             \
        for (int64_t i = 0; i < n; i++) {                                                \
            TS x = *(const TS *)(p[1] + i * s[1]);                                       \
            *(TD *)(p[0] + i * s[0]) = (TD)(EXPR);                                       \
        }                                                                                \
    }

#define CAST_FROM(TS)                                                                    \
    switch (o->t[0].dtype) {                                                             \
    case DT_FLOAT: CAST_TO(TS, float, x) break;                                          \
    case DT_DOUBLE: CAST_TO(TS, double, x) break;                                        \
    case DT_INT64: CAST_TO(TS, int64_t, x) break;                                        \
    case DT_INT32: CAST_TO(TS, int32_t, x) break;                                        \
    case DT_INT8: CAST_TO(TS, int8_t, x) break;                                          \
    case DT_UINT8: CAST_TO(TS, uint8_t, x) break;                                        \
    case DT_BOOL: CAST_TO(TS, uint8_t, x != 0) break;                                    \
    default: break;                                                                      \
    }

static void cast_row(const he_op *o, char **p, const int64_t *s, int64_t n)
{
    switch (o->t[1].dtype) {
    case DT_FLOAT: CAST_FROM(float) break;
    case DT_DOUBLE: CAST_FROM(double) break;
    case DT_INT64: CAST_FROM(int64_t) break;
    case DT_INT32: CAST_FROM(int32_t) break;
    case DT_INT8: CAST_FROM(int8_t) break;
    default: CAST_FROM(uint8_t) break; /* uint8, bool */
    }
}

/* ------------------------------------------------------------------ (de)quantize */

/* OP_QUANTIZE: t0 (uint8 or int8) = saturate(round_half_even(t1 / t2) + t3), t1 float32,
 * t2 the scale (float32) and t3 the zero point (t0's type), broadcast by their strides:
 * numpy's rint and onnxruntime's rounding. x / scale is held at +-2^22 first (past that
 * any 8-bit code saturates as it would anyway; simd.h's baseline vround wants it). The
 * clamps are simd.h's vector max/min: written as C compares, GCC under its default
 * trapping-math keeps them as branches and the loop scalar, a division per value. */
/* up to 64 values: t[j] = the code of x[j] / s (the zero point z[j], or zs) as a float */
static inline void quantize_block(float *t, const float *x, float s, const float *z, float zs,
                                  int m, float lo, float hi)
{
    const vf vlo = vset1(lo), vhi = vset1(hi), lim = vset1(4194304.0f), nlim = vset1(-4194304.0f);
    const vf vs = vset1(s);
    for (int j = 0; j < m; j += VW) {
        const lanes_t l = first_lanes(m - j < VW ? m - j : VW);
        vf q = vmin(vmax(vdiv(vload_lanes(l, x + j), vs), nlim), lim);
        q = vadd(vround(q), z ? vload_lanes(l, z + j) : vset1(zs));
        vstore_lanes(t + j, l, vmin(vmax(q, vlo), vhi));
    }
}

#if defined(HE_ISA_AVX512) || defined(HE_ISA_AVX2)
/* the per-tensor contiguous case in one pass: the rounding conversion to int32 (half to
 * even, the default rounding mode: vround's value), the zero point and the clamps in
 * integers, narrowed to bytes in registers (the values already in range) */
static int64_t quantize_tensor(const float *x, float s, int z, void *y, int64_t n, int i8)
{
    const int lo = i8 ? -128 : 0, hi = i8 ? 127 : 255;
    int64_t i = 0;
#if defined(HE_ISA_AVX512)
    const __m512 vs = _mm512_set1_ps(s), lim = _mm512_set1_ps(4194304.0f),
                 nlim = _mm512_set1_ps(-4194304.0f);
    const __m512i vz = _mm512_set1_epi32(z), vlo = _mm512_set1_epi32(lo),
                  vhi = _mm512_set1_epi32(hi);
    for (; i < n; i += 16) {
        const __mmask16 m = (__mmask16)first_lanes(n - i < 16 ? (int)(n - i) : 16);
        __m512 v = _mm512_div_ps(_mm512_maskz_loadu_ps(m, x + i), vs);
        v = _mm512_min_ps(_mm512_max_ps(v, nlim), lim);
        __m512i q = _mm512_add_epi32(_mm512_cvtps_epi32(v), vz);
        q = _mm512_min_epi32(_mm512_max_epi32(q, vlo), vhi);
        _mm512_mask_cvtepi32_storeu_epi8((char *)y + i, m, q);
    }
#else
    const __m256 vs = _mm256_set1_ps(s), lim = _mm256_set1_ps(4194304.0f),
                 nlim = _mm256_set1_ps(-4194304.0f);
    const __m256i vz = _mm256_set1_epi32(z), vlo = _mm256_set1_epi32(lo),
                  vhi = _mm256_set1_epi32(hi);
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_div_ps(_mm256_loadu_ps(x + i), vs);
        v = _mm256_min_ps(_mm256_max_ps(v, nlim), lim);
        __m256i q = _mm256_add_epi32(_mm256_cvtps_epi32(v), vz);
        q = _mm256_min_epi32(_mm256_max_epi32(q, vlo), vhi);
        __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
        w = i8 ? _mm_packs_epi16(w, w) : _mm_packus_epi16(w, w);
        _mm_storel_epi64((__m128i *)((char *)y + i), w);
    }
#endif
    return i; /* the values done (the rest: the portable path) */
}
#endif

static void quantize_values(const float *x, int64_t sx, const float *sc, int64_t ss,
                            const void *zp, int64_t sz, void *y, int64_t sy, int64_t n, int i8)
{
    float t[64] __attribute__((aligned(64))), z[64];
    const float lo = i8 ? -128.0f : 0.0f, hi = i8 ? 127.0f : 255.0f;
    const int tensor = sx == 1 && ss == 0 && sz == 0 && sy == 1; /* the QDQ activations' case */
    const float s0 = *sc, z0 = i8 ? (float)*(const int8_t *)zp : (float)*(const uint8_t *)zp;
    int64_t done = 0;
#if defined(HE_ISA_AVX512) || defined(HE_ISA_AVX2)
    if (tensor)
        done = quantize_tensor(x, s0, (int)z0, y, n, i8);
#endif
    for (int64_t i0 = done; i0 < n; i0 += 64) {
        const int m = n - i0 < 64 ? (int)(n - i0) : 64;
        if (tensor) {
            quantize_block(t, x + i0, s0, NULL, z0, m, lo, hi);
        } else {
            for (int j = 0; j < m; j++) { /* the operands gathered by their strides */
                t[j] = x[(i0 + j) * sx] / sc[(i0 + j) * ss];
                z[j] = i8 ? (float)((const int8_t *)zp)[(i0 + j) * sz]
                          : (float)((const uint8_t *)zp)[(i0 + j) * sz];
            }
            quantize_block(t, t, 1.0f, z, 0.0f, m, lo, hi); /* (divided: x / 1 is x) */
        }
        if (tensor && i8) /* (unit strides spelled out: the loops vectorise) */
            for (int j = 0; j < m; j++)
                ((int8_t *)y)[i0 + j] = (int8_t)(int)t[j];
        else if (tensor)
            for (int j = 0; j < m; j++)
                ((uint8_t *)y)[i0 + j] = (uint8_t)(int)t[j];
        else if (i8)
            for (int j = 0; j < m; j++)
                ((int8_t *)y)[(i0 + j) * sy] = (int8_t)(int)t[j];
        else
            for (int j = 0; j < m; j++)
                ((uint8_t *)y)[(i0 + j) * sy] = (uint8_t)(int)t[j];
    }
}

static void quantize_row(const he_op *o, char **p, const int64_t *s, int64_t n)
{
    const int i8 = o->t[0].dtype == DT_INT8;
    quantize_values((const float *)p[1], s[1] / 4, (const float *)p[2], s[2] / 4, p[3], s[3],
                    p[0], s[0], n, i8);
}

/* OP_DEQUANTIZE: t0 float32 = ((float)t1 - (float)t3) * t2, t1 and the zero point t3
 * uint8, int8 or int32, t2 the scale (float32), broadcast by their strides (numpy's
 * order of operations, so the same float32 values) */
#define DEQUANTIZE_ROW(T)                                                                \
    if (s[0] == 4 && s[1] == sizeof(T) && s[2] == 0 && s[3] == 0) {                      \
        const T *x = (const T *)p[1];                                                    \
        const float sc = *(const float *)p[2], z = (float)*(const T *)p[3];              \
        float *y = (float *)p[0];                                                        \
        for (int64_t i = 0; i < n; i++)                                                  \
            y[i] = ((float)x[i] - z) * sc;                                               \
    } else {                                                                             \
        for (int64_t i = 0; i < n; i++)                                                  \
            *(float *)(p[0] + i * s[0]) = ((float)*(const T *)(p[1] + i * s[1])         \
                                           - (float)*(const T *)(p[3] + i * s[3]))      \
                                          * *(const float *)(p[2] + i * s[2]);           \
    }

static void dequantize_row(const he_op *o, char **p, const int64_t *s, int64_t n)
{
    switch (o->t[1].dtype) {
    case DT_INT8: DEQUANTIZE_ROW(int8_t) break;
    case DT_INT32: DEQUANTIZE_ROW(int32_t) break;
    default: DEQUANTIZE_ROW(uint8_t) break;
    }
}

/* ------------------------------------------------------------------ unary */

static inline float sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }

#define UNARY_LOOP(TI, TO, EXPR)                                                         \
    if (s[0] == sizeof(TO) && s[1] == sizeof(TI)) {                                      \
        TO *y = (TO *)p[0];                                                              \
        const TI *xs = (const TI *)p[1];                                                 \
        for (int64_t i = 0; i < n; i++) {                                                \
            TI x = xs[i];                                                                \
            y[i] = (EXPR);                                                               \
        }                                                                                \
    } else {                                                                             \
        for (int64_t i = 0; i < n; i++) {                                                \
            TI x = *(const TI *)(p[1] + i * s[1]);                                       \
            *(TO *)(p[0] + i * s[0]) = (EXPR);                                           \
        }                                                                                \
    }

static void unary_f32(int code, char **p, const int64_t *s, int64_t n)
{
    const float k = 0.7978845608028654f; /* sqrt(2 / pi) */
    switch (code) {
    case U_NEG: UNARY_LOOP(float, float, -x) break;
    case U_ABS: UNARY_LOOP(float, float, fabsf(x)) break;
    case U_SQRT: UNARY_LOOP(float, float, sqrtf(x)) break;
    case U_RECIP: UNARY_LOOP(float, float, 1.0f / x) break;
    case U_EXP: UNARY_LOOP(float, float, expf(x)) break;
    case U_LOG: UNARY_LOOP(float, float, logf(x)) break;
    case U_SIGMOID: UNARY_LOOP(float, float, sigmoidf(x)) break;
    case U_TANH: UNARY_LOOP(float, float, tanhf(x)) break;
    case U_COS: UNARY_LOOP(float, float, cosf(x)) break;
    case U_SIN: UNARY_LOOP(float, float, sinf(x)) break;
    case U_ERF: UNARY_LOOP(float, float, erff(x)) break;
    case U_RELU: UNARY_LOOP(float, float, x > 0.0f ? x : (x != x ? x : 0.0f)) break;
    case U_SILU: UNARY_LOOP(float, float, x / (1.0f + expf(-x))) break;
    case U_GELU: UNARY_LOOP(float, float, 0.5f * x * (1.0f + erff(x * 0.7071067811865476f))) break;
    case U_GELU_TANH:
        UNARY_LOOP(float, float, 0.5f * x * (1.0f + tanhf(k * (x + 0.044715f * x * x * x))))
        break;
    case U_FLOOR: UNARY_LOOP(float, float, floorf(x)) break;
    case U_CEIL: UNARY_LOOP(float, float, ceilf(x)) break;
    case U_SOFTPLUS: UNARY_LOOP(float, float, log1pf(expf(x))) break;
    case U_ISNAN: UNARY_LOOP(float, uint8_t, x != x) break;
    case U_ISINF: UNARY_LOOP(float, uint8_t, isinf(x) != 0) break;
    case U_NAN_TO_ZERO: UNARY_LOOP(float, float, x != x ? 0.0f : x) break;
    default: break;
    }
}

#define UNARY_INT(T)                                                                     \
    switch (code) {                                                                      \
    case U_NEG: UNARY_LOOP(T, T, -x) break;                                              \
    case U_ABS: UNARY_LOOP(T, T, x < 0 ? -x : x) break;                                  \
    default: break;                                                                      \
    }

static void unary_row(const he_op *o, char **p, const int64_t *s, int64_t n)
{
    const int code = o->code;
    switch (o->t[1].dtype) {
    case DT_FLOAT: unary_f32(code, p, s, n); break;
    case DT_INT64: UNARY_INT(int64_t) break;
    case DT_INT32: UNARY_INT(int32_t) break;
    case DT_BOOL: UNARY_LOOP(uint8_t, uint8_t, !x) break;
    default: break;
    }
}

/* ------------------------------------------------------------------ binary */

/* numpy's maximum and minimum: NaN when either is NaN */
#define FMAX(a, b) (((a) >= (b) || (a) != (a)) ? (a) : (b))
#define FMIN(a, b) (((a) <= (b) || (a) != (a)) ? (a) : (b))

#define BINARY_LOOP(T, TO, EXPR)                                                         \
    if (s[0] == sizeof(TO) && s[1] == sizeof(T) && s[2] == sizeof(T)) {                  \
        TO *c = (TO *)p[0];                                                              \
        const T *xa = (const T *)p[1], *xb = (const T *)p[2];                            \
        for (int64_t i = 0; i < n; i++) {                                                \
            T a = xa[i], b = xb[i];                                                      \
            c[i] = (EXPR);                                                               \
        }                                                                                \
    } else if (s[0] == sizeof(TO) && s[1] == sizeof(T) && s[2] == 0) {                   \
        TO *c = (TO *)p[0];                                                              \
        const T *xa = (const T *)p[1], b = *(const T *)p[2];                             \
        for (int64_t i = 0; i < n; i++) {                                                \
            T a = xa[i];                                                                 \
            c[i] = (EXPR);                                                               \
        }                                                                                \
    } else if (s[0] == sizeof(TO) && s[1] == 0 && s[2] == sizeof(T)) {                   \
        TO *c = (TO *)p[0];                                                              \
        const T a = *(const T *)p[1], *xb = (const T *)p[2];                             \
        for (int64_t i = 0; i < n; i++) {                                                \
            T b = xb[i];                                                                 \
            c[i] = (EXPR);                                                               \
        }                                                                                \
    } else {                                                                             \
        for (int64_t i = 0; i < n; i++) {                                                \
            T a = *(const T *)(p[1] + i * s[1]), b = *(const T *)(p[2] + i * s[2]);      \
            *(TO *)(p[0] + i * s[0]) = (EXPR);                                           \
        }                                                                                \
    }

#define BINARY_COMPARE(T)                                                                \
    case B_EQ: BINARY_LOOP(T, uint8_t, a == b) break;                                    \
    case B_LT: BINARY_LOOP(T, uint8_t, a < b) break;                                     \
    case B_LE: BINARY_LOOP(T, uint8_t, a <= b) break;                                    \
    case B_GT: BINARY_LOOP(T, uint8_t, a > b) break;                                     \
    case B_GE: BINARY_LOOP(T, uint8_t, a >= b) break;

static void binary_f32(int code, char **p, const int64_t *s, int64_t n)
{
    switch (code) {
    case B_ADD: BINARY_LOOP(float, float, a + b) break;
    case B_SUB: BINARY_LOOP(float, float, a - b) break;
    case B_MUL: BINARY_LOOP(float, float, a * b) break;
    case B_DIV: BINARY_LOOP(float, float, a / b) break;
    case B_POW: BINARY_LOOP(float, float, b == 2.0f ? a * a : powf(a, b)) break;
    case B_MAX: BINARY_LOOP(float, float, FMAX(a, b)) break;
    case B_MIN: BINARY_LOOP(float, float, FMIN(a, b)) break;
    BINARY_COMPARE(float)
    default: break;
    }
}

#define BINARY_INT(T)                                                                    \
    switch (code) {                                                                      \
    case B_ADD: BINARY_LOOP(T, T, a + b) break;                                          \
    case B_SUB: BINARY_LOOP(T, T, a - b) break;                                          \
    case B_MUL: BINARY_LOOP(T, T, a * b) break;                                          \
    case B_MAX: BINARY_LOOP(T, T, a > b ? a : b) break;                                  \
    case B_MIN: BINARY_LOOP(T, T, a < b ? a : b) break;                                  \
    BINARY_COMPARE(T)                                                                    \
    default: break;                                                                      \
    }

static void binary_row(const he_op *o, char **p, const int64_t *s, int64_t n)
{
    const int code = o->code;
    switch (o->t[1].dtype) {
    case DT_FLOAT: binary_f32(code, p, s, n); break;
    case DT_INT64: BINARY_INT(int64_t) break;
    case DT_INT32: BINARY_INT(int32_t) break;
    case DT_BOOL:
        switch (code) {
        case B_AND: BINARY_LOOP(uint8_t, uint8_t, a && b) break;
        case B_OR: BINARY_LOOP(uint8_t, uint8_t, a || b) break;
        case B_XOR: BINARY_LOOP(uint8_t, uint8_t, (a != 0) != (b != 0)) break;
        case B_EQ: BINARY_LOOP(uint8_t, uint8_t, a == b) break;
        default: break;
        }
        break;
    default: break;
    }
}

/* ------------------------------------------------------------------ reduce */

/* t0 holds p[0] values (stride 0 along the reduced dims of the iteration over t1) */
#define REDUCE_ROW(T, ACC, INIT, STEP)                                                   \
    if (s[0] == 0) { /* the row is reduced whole: combined locally, then with the output */ \
        ACC row = INIT;                                                                  \
        for (int64_t i = 0; i < n; i++) {                                                \
            ACC acc = row, x = *(const T *)(p[1] + i * s[1]);                            \
            row = STEP;                                                                  \
        }                                                                                \
        ACC acc = *(T *)p[0], x = row;                                                   \
        *(T *)p[0] = (T)(STEP);                                                          \
    } else {                                                                             \
        for (int64_t i = 0; i < n; i++) {                                                \
            T *out = (T *)(p[0] + i * s[0]);                                             \
            ACC acc = *out, x = *(const T *)(p[1] + i * s[1]);                           \
            *out = (T)(STEP);                                                            \
        }                                                                                \
    }

static void reduce_row(const he_op *o, char **p, const int64_t *s, int64_t n)
{
    const int code = o->code;
    switch (o->t[1].dtype) {
    case DT_FLOAT:
        switch (code) {
        case R_SUM: case R_MEAN: REDUCE_ROW(float, double, 0.0, acc + x) break;
        case R_PROD: REDUCE_ROW(float, double, 1.0, acc * x) break;
        case R_MAX: REDUCE_ROW(float, float, -INFINITY, FMAX(x, acc)) break;
        case R_MIN: REDUCE_ROW(float, float, INFINITY, FMIN(x, acc)) break;
        default: break;
        }
        break;
    case DT_INT64:
        switch (code) {
        case R_SUM: case R_MEAN: REDUCE_ROW(int64_t, int64_t, 0, acc + x) break;
        case R_PROD: REDUCE_ROW(int64_t, int64_t, 1, acc * x) break;
        case R_MAX: REDUCE_ROW(int64_t, int64_t, INT64_MIN, x > acc ? x : acc) break;
        case R_MIN: REDUCE_ROW(int64_t, int64_t, INT64_MAX, x < acc ? x : acc) break;
        default: break;
        }
        break;
    case DT_INT32:
        switch (code) {
        case R_SUM: case R_MEAN: REDUCE_ROW(int32_t, int64_t, 0, acc + x) break;
        case R_MAX: REDUCE_ROW(int32_t, int32_t, INT32_MIN, x > acc ? x : acc) break;
        case R_MIN: REDUCE_ROW(int32_t, int32_t, INT32_MAX, x < acc ? x : acc) break;
        default: break;
        }
        break;
    default: break;
    }
}

static int reduce_run(const he_op *o, void *const *bufs)
{
    char *out = ptr_of(bufs, &o->t[0]);
    const int64_t count = o->p[0];
    const int dt = o->t[0].dtype;
    for (int64_t i = 0; i < count; i++) {
        if (dt == DT_FLOAT) {
            float v = o->code == R_MAX ? -INFINITY : o->code == R_MIN ? INFINITY
                    : o->code == R_PROD ? 1.0f : 0.0f;
            ((float *)out)[i] = v;
        } else if (dt == DT_INT64) {
            ((int64_t *)out)[i] = o->code == R_MAX ? INT64_MIN : o->code == R_MIN ? INT64_MAX
                                : o->code == R_PROD ? 1 : 0;
        } else if (dt == DT_INT32) {
            ((int32_t *)out)[i] = o->code == R_MAX ? INT32_MIN : o->code == R_MIN ? INT32_MAX
                                : o->code == R_PROD ? 1 : 0;
        } else {
            return E_TYPE;
        }
    }
    he_op serial = *o;
    serial.parts = 1; /* rows of the iteration may add into one output */
    nd_run(&serial, bufs, 2, reduce_row);
    if (o->code == R_MEAN && dt == DT_FLOAT) {
        const float k = (float)o->f[0];
        for (int64_t i = 0; i < count; i++)
            ((float *)out)[i] *= k;
    }
    return E_NONE;
}

/* ------------------------------------------------------------------ products */

/* C (M x N, rows ldc apart) = A @ B: A's element (m, k) at a[m * am + k * ak], B's (k, n)
 * at b[k * bk + n * bn] */
static void small_matmul(int64_t M, int64_t N, int64_t K, const float *a, int64_t am, int64_t ak,
                         const float *b, int64_t bk, int64_t bn, float *c, int64_t ldc)
{
    if (bn == 1) { /* rows of B: c[m, n0:n0+4VW] += a[m, k] * b[k, n0:...], in registers */
        for (int64_t m = 0; m < M; m++) {
            float *cr = c + m * ldc;
            const float *ar = a + m * am;
            for (int64_t n0 = 0; n0 < N; n0 += 4 * VW) {
                const int64_t w = N - n0 < 4 * VW ? N - n0 : 4 * VW;
                lanes_t l[4];
                for (int v = 0; v < 4; v++)
                    l[v] = w > v * VW ? first_lanes((int)(w - v * VW)) : 0;
                vf s0 = vzero(), s1 = vzero(), s2 = vzero(), s3 = vzero();
                const float *br = b + n0;
                for (int64_t k = 0; k < K; k++, br += bk) {
                    const vf x = vset1(ar[k * ak]);
                    s0 = vfma(x, vload_lanes(l[0], br), s0);
                    if (w > VW)
                        s1 = vfma(x, vload_lanes(l[1], br + VW), s1);
                    if (w > 2 * VW) {
                        s2 = vfma(x, vload_lanes(l[2], br + 2 * VW), s2);
                        s3 = vfma(x, vload_lanes(l[3], br + 3 * VW), s3);
                    }
                }
                vstore_lanes(cr + n0, l[0], s0);
                if (w > VW)
                    vstore_lanes(cr + n0 + VW, l[1], s1);
                if (w > 2 * VW) {
                    vstore_lanes(cr + n0 + 2 * VW, l[2], s2);
                    if (l[3])
                        vstore_lanes(cr + n0 + 3 * VW, l[3], s3);
                }
            }
        }
        return;
    }
    if (ak == 1 && bk == 1) { /* dot products of rows, four columns of C at a time */
        for (int64_t m = 0; m < M; m++) {
            const float *ar = a + m * am;
            int64_t n = 0;
            for (; n + 4 <= N; n += 4) {
                const float *b0 = b + n * bn, *b1 = b0 + bn, *b2 = b1 + bn, *b3 = b2 + bn;
                vf s0 = vzero(), s1 = vzero(), s2 = vzero(), s3 = vzero();
                int64_t k = 0;
                for (; k + VW <= K; k += VW) {
                    const vf x = vloadu(ar + k);
                    s0 = vfma(x, vloadu(b0 + k), s0);
                    s1 = vfma(x, vloadu(b1 + k), s1);
                    s2 = vfma(x, vloadu(b2 + k), s2);
                    s3 = vfma(x, vloadu(b3 + k), s3);
                }
                if (k < K) {
                    lanes_t l = first_lanes((int)(K - k));
                    const vf x = vload_lanes(l, ar + k);
                    s0 = vfma(x, vload_lanes(l, b0 + k), s0);
                    s1 = vfma(x, vload_lanes(l, b1 + k), s1);
                    s2 = vfma(x, vload_lanes(l, b2 + k), s2);
                    s3 = vfma(x, vload_lanes(l, b3 + k), s3);
                }
                vreduce_add4(s0, s1, s2, s3, c + m * ldc + n);
            }
            for (; n < N; n++) {
                const float *bc = b + n * bn;
                vf acc = vzero();
                int64_t k = 0;
                for (; k + VW <= K; k += VW)
                    acc = vfma(vloadu(ar + k), vloadu(bc + k), acc);
                if (k < K) {
                    lanes_t l = first_lanes((int)(K - k));
                    acc = vfma(vload_lanes(l, ar + k), vload_lanes(l, bc + k), acc);
                }
                c[m * ldc + n] = vreduce_add(acc);
            }
        }
        return;
    }
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) {
            float acc = 0.0f;
            for (int64_t k = 0; k < K; k++)
                acc += a[m * am + k * ak] * b[k * bk + n * bn];
            c[m * ldc + n] = acc;
        }
}

/* p: M, N, K, batch dims (p3 of them, sizes p4..p7); t1 A, t2 B, t0 C with strides
 * [batch dims..., row, column]; p11: one BLAS call over p16 matrices (see below) */
static int matmul_run(const he_op *o, void *const *bufs)
{
    const int64_t M = o->p[0], N = o->p[1], K = o->p[2], nb = o->p[3];
    const float *A = (const float *)ptr_of(bufs, &o->t[1]);
    const float *B = (const float *)ptr_of(bufs, &o->t[2]);
    float *C = (float *)ptr_of(bufs, &o->t[0]);
    if (o->p[11]) {
        he_blas_gemm_mt((void *)o->p[8], (void *)o->p[9], (int)o->p[10], 0, (int)o->p[12],
                        (int)o->p[14], o->p[16], M, N, K, A, o->p[13], o->p[17], B, o->p[15],
                        o->p[18], C, N, o->p[19], (int)o->p[20], o->parts);
        return E_NONE;
    }
    int64_t count = 1, idx[4] = {0};
    for (int d = 0; d < nb; d++)
        count *= o->p[4 + d];
    const he_tensor *ta = &o->t[1], *tb = &o->t[2], *tc = &o->t[0];
    for (int64_t i = 0; i < count; i++) {
        int64_t oa = 0, ob = 0, oc = 0;
        for (int d = 0; d < nb; d++) {
            oa += idx[d] * ta->st[d];
            ob += idx[d] * tb->st[d];
            oc += idx[d] * tc->st[d];
        }
        small_matmul(M, N, K, A + oa, ta->st[4], ta->st[5], B + ob, tb->st[4], tb->st[5],
                     C + oc, tc->st[4]);
        for (int d = (int)nb - 1; d >= 0; d--) {
            if (++idx[d] < o->p[4 + d])
                break;
            idx[d] = 0;
        }
    }
    return E_NONE;
}

/* ------------------------------------------------------------------ rows */

static int gather_run(const he_op *o, void *const *bufs)
{
    char *out = ptr_of(bufs, &o->t[0]);
    const char *data = ptr_of(bufs, &o->t[1]);
    const char *idx = ptr_of(bufs, &o->t[2]);
    const int64_t outer = o->p[0], len = o->p[1], nidx = o->p[2], inner = o->p[3];
    const int i64 = o->t[2].dtype == DT_INT64;
    for (int64_t j = 0; j < nidx; j++) {
        int64_t at = i64 ? ((const int64_t *)idx)[j] : ((const int32_t *)idx)[j];
        if (at < 0)
            at += len;
        if (at < 0 || at >= len)
            return E_INDEX;
    }
/* a copy of a size known here compiles to one move: a decoder's mask Gather picks single
 * bytes, where a memcpy call each cost a decode step a microsecond over 576 positions
 * (memcpy, not a typed load: a row of two floats is 8 bytes at 4-byte alignment) */
#define GATHER_ROWS(SIZE)                                                                \
    for (int64_t r = 0; r < outer; r++)                                                  \
        for (int64_t j = 0; j < nidx; j++) {                                             \
            int64_t at = i64 ? ((const int64_t *)idx)[j] : ((const int32_t *)idx)[j];   \
            if (at < 0)                                                                  \
                at += len;                                                               \
            memcpy(out + (r * nidx + j) * inner, data + (r * len + at) * inner, (SIZE));  \
        }
    switch (inner) {
    case 1: GATHER_ROWS(1) break;
    case 2: GATHER_ROWS(2) break;
    case 4: GATHER_ROWS(4) break;
    case 8: GATHER_ROWS(8) break;
    default: GATHER_ROWS((size_t)inner) break;
    }
#undef GATHER_ROWS
    return E_NONE;
}

/* the new entries (t1, over dims) into the cache t0 at the position t2 holds (int64):
 * p0 bytes a position, p1 new positions, p2 the capacity */
static int kv_append_run(const he_op *o, void *const *bufs)
{
    const int64_t at = *(const int64_t *)ptr_of(bufs, &o->t[2]);
    if (at < 0 || at + o->p[1] > o->p[2])
        return E_CAPACITY;
    he_op copy = *o;
    copy.t[0].off += at * o->p[0];
    nd_run(&copy, bufs, 2, copy_row);
    return E_NONE;
}

static int range_run(const he_op *o, void *const *bufs)
{
    char *out = ptr_of(bufs, &o->t[0]);
    const char *start = ptr_of(bufs, &o->t[1]), *delta = ptr_of(bufs, &o->t[2]);
    const int64_t n = o->dims[0];
    switch (o->t[0].dtype) {
    case DT_FLOAT: {
        float s = *(const float *)start, d = *(const float *)delta;
        for (int64_t i = 0; i < n; i++)
            ((float *)out)[i] = s + (float)i * d;
        break;
    }
    case DT_INT64: {
        int64_t s = *(const int64_t *)start, d = *(const int64_t *)delta;
        for (int64_t i = 0; i < n; i++)
            ((int64_t *)out)[i] = s + i * d;
        break;
    }
    case DT_INT32: {
        int32_t s = *(const int32_t *)start, d = *(const int32_t *)delta;
        for (int64_t i = 0; i < n; i++)
            ((int32_t *)out)[i] = s + (int32_t)i * d;
        break;
    }
    default:
        return E_TYPE;
    }
    return E_NONE;
}

static int argmax_run(const he_op *o, void *const *bufs)
{
    int64_t *out = (int64_t *)ptr_of(bufs, &o->t[0]);
    const float *x = (const float *)ptr_of(bufs, &o->t[1]);
    const int64_t rows = o->p[0], n = o->p[1], ld = o->p[2];
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * ld;
        int64_t best = 0;
        float m = row[0];
        for (int64_t i = 0; i < n && m == m; i++) /* numpy: the first NaN wins */
            if (row[i] > m || row[i] != row[i]) {
                m = row[i];
                best = i;
            }
        out[r] = best;
    }
    return E_NONE;
}

/* ------------------------------------------------------------------ the interpreter */

/* OP_ATTENTION: t0 out, t1 Q, t2 K and t3 V (as batch, kv head, key, dim), t4 the mask,
 * t5 the condition (bool) and t6 its fill (one float) (buf -1: none), each 4-d strides;
 * p0..p5 B, Hq, Hkv, L, S, D, p6 nan_to_zero; f0 the scale */
static int attention_record(const he_op *o, void *const *bufs)
{
    const float *fill = (const float *)ptr_of(bufs, &o->t[6]);
    attention_t a = {(const float *)ptr_of(bufs, &o->t[1]), (const float *)ptr_of(bufs, &o->t[2]),
                     (const float *)ptr_of(bufs, &o->t[3]), (const float *)ptr_of(bufs, &o->t[4]),
                     (const uint8_t *)ptr_of(bufs, &o->t[5]), (float *)ptr_of(bufs, &o->t[0]),
                     o->p[0], o->p[1], o->p[2], o->p[3], o->p[4], o->p[5],
                     {0}, {0}, {0}, {0}, {0}, {0}, (float)o->f[0], fill ? *fill : 0.0f,
                     (int)o->p[6]};
    for (int i = 0; i < 4; i++) {
        a.qs[i] = o->t[1].st[i];
        a.ks[i] = o->t[2].st[i];
        a.vs[i] = o->t[3].st[i];
        a.ms[i] = o->t[4].st[i];
        a.cs[i] = o->t[5].st[i];
        a.ys[i] = o->t[0].st[i];
    }
    return attention_run(&a, o->parts) ? E_MEMORY : E_NONE;
}

static int run_one(const he_op *o, void *const *bufs)
{
    switch (o->op) {
    case OP_COPY:
        if (o->ndim >= 2 && o->t[1].st[o->ndim - 1] == 1 && o->t[0].st[o->ndim - 2] == 1
            && o->t[0].st[o->ndim - 1] != 1)
            block_copy(o, bufs);
        else
            nd_run(o, bufs, 2, copy_row);
        return E_NONE;
    case OP_CAST: nd_run(o, bufs, 2, cast_row); return E_NONE;
    case OP_QUANTIZE: nd_run(o, bufs, 4, quantize_row); return E_NONE;
    case OP_DEQUANTIZE: nd_run(o, bufs, 4, dequantize_row); return E_NONE;
    case OP_UNARY: nd_run(o, bufs, 2, unary_row); return E_NONE;
    case OP_BINARY: nd_run(o, bufs, 3, binary_row); return E_NONE;
    case OP_WHERE: nd_run(o, bufs, 4, where_row); return E_NONE;
    case OP_REDUCE: return reduce_run(o, bufs);
    case OP_MATMUL: return matmul_run(o, bufs);
    case OP_GEMM_PACKED:
        he_gemm_right_mt((int)o->p[0], (int)o->p[1], (int)o->p[2],
                         (const float *)ptr_of(bufs, &o->t[1]), o->p[3],
                         (const float *)ptr_of(bufs, &o->t[2]), (float *)ptr_of(bufs, &o->t[0]),
                         o->p[4], (const float *)ptr_of(bufs, &o->t[3]),
                         (const float *)ptr_of(bufs, &o->t[4]), o->p[6], (int)o->p[5],
                         (float)o->f[0], (float)o->f[1], o->parts);
        return E_NONE;
    case OP_SOFTMAX: {
        float *y = (float *)ptr_of(bufs, &o->t[0]);
        const float *x = (const float *)ptr_of(bufs, &o->t[1]);
        if (x != y)
            memcpy(y, x, (size_t)(o->p[0] * o->p[1]) * sizeof(float));
        he_softmax_mt(y, (int)o->p[0], (int)o->p[1], o->parts);
        return E_NONE;
    }
    case OP_ROW_NORM:
        he_row_norm_mt((const float *)ptr_of(bufs, &o->t[1]), (const float *)ptr_of(bufs, &o->t[2]),
                       (const float *)ptr_of(bufs, &o->t[3]), (float)o->f[0],
                       (float *)ptr_of(bufs, &o->t[0]), (float *)ptr_of(bufs, &o->t[4]),
                       (float *)ptr_of(bufs, &o->t[5]), (int)o->p[0], (int)o->p[1], (int)o->p[2],
                       o->parts);
        return E_NONE;
    case OP_GATHER: return gather_run(o, bufs);
    case OP_KV_APPEND: return kv_append_run(o, bufs);
    case OP_GQA: return gqa_run(o, bufs);
    case OP_GQA_PAST: return gqa_past_run(o, bufs);
    case OP_NBITS: {
        int rc = he_nbits_mt((int)o->p[0], (int)o->p[1], (int)o->p[2],
                           (const float *)ptr_of(bufs, &o->t[1]), o->p[2], ptr_of(bufs, &o->t[2]),
                           (const float *)ptr_of(bufs, &o->t[3]), ptr_of(bufs, &o->t[4]),
                           (const float *)ptr_of(bufs, &o->t[5]), (int)o->p[3], (int)o->p[4],
                           (const float *)ptr_of(bufs, &o->t[6]), (float *)ptr_of(bufs, &o->t[0]),
                           o->p[1], o->parts);
        return rc == -1 ? E_MEMORY : rc ? E_OP : E_NONE;
    }
    case OP_QGEMM: {
        int M = (int)o->p[0], z = 0;
        const he_tensor *tz = &o->t[3];
        if (tz->buf >= 0) {
            const char *zp = ptr_of(bufs, tz);
            z = tz->dtype == DT_INT8 ? *(const int8_t *)zp : *(const uint8_t *)zp;
        }
        int *az = malloc(sizeof(int) * (size_t)(M > 0 ? M : 1));
        if (!az)
            return E_MEMORY;
        for (int m = 0; m < M; m++)
            az[m] = z;
        /* a float32 output: Y * scale[n] (t5) + bias[n] (t6, optional) from the tile */
        const int to_float = o->t[0].dtype == DT_FLOAT;
        void *y = ptr_of(bufs, &o->t[0]);
        int rc = he_qgemm_mt(M, (int)o->p[1], (int)o->p[2], ptr_of(bufs, &o->t[1]), o->p[2],
                             o->t[1].dtype == DT_INT8, ptr_of(bufs, &o->t[2]), az,
                             (const int *)ptr_of(bufs, &o->t[4]), to_float ? NULL : (int *)y,
                             to_float ? (float *)y : NULL, o->p[1],
                             to_float ? (const float *)ptr_of(bufs, &o->t[5]) : NULL,
                             to_float ? (const float *)ptr_of(bufs, &o->t[6]) : NULL, o->parts);
        free(az);
        return rc == -1 ? E_MEMORY : rc ? E_OP : E_NONE;
    }
    case OP_DQL:
        he_dynamic_quantize((const float *)ptr_of(bufs, &o->t[3]), o->p[0], ptr_of(bufs, &o->t[0]),
                            (float *)ptr_of(bufs, &o->t[1]), ptr_of(bufs, &o->t[2]));
        return E_NONE;
    case OP_BIAS_ACT:
        he_last_axis_mt((float *)ptr_of(bufs, &o->t[0]), (const float *)ptr_of(bufs, &o->t[1]),
                        (int)o->p[0], (int)o->p[1], (int)o->p[2], (float)o->f[0], (float)o->f[1],
                        o->parts);
        return E_NONE;
    case OP_RANGE: return range_run(o, bufs);
    case OP_ARGMAX: return argmax_run(o, bufs);
    case OP_ATTENTION: return attention_record(o, bufs);
    default: return E_OP;
    }
}

/* records [first, first + count) of `ops`; 0, or the failing record's index + 1 with its
 * E_* code in *err */
int he_program_run(const void *ops, int first, int count, void *const *bufs, int *err)
{
    const he_op *o = (const he_op *)ops;
    for (int i = first; i < first + count; i++) {
        int e = run_one(o + i, bufs);
        if (e != E_NONE) {
            *err = e;
            return i + 1;
        }
    }
    *err = E_NONE;
    return 0;
}
