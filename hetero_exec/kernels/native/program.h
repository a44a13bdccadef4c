/* A bound plan as a program: the records the interpreter (program.c) runs, one after
 * another, in one call from Python.
 *
 * A plan bound to its input shapes (exec/bound.py) computes the same shapes on every run,
 * so every value can live in a buffer allocated once, and every step becomes a record
 * holding its operands' places (buffer, byte offset, strides in elements) and its
 * parameters. A run writes the feeds' addresses into the buffer table and calls
 * `he_program_run`: the CPU counterpart of a captured device graph, with nothing per
 * node left in Python (exec/program/ builds the records).
 *
 * Python reads this layout from `he_constants` (HE_OP_SIZE, HE_OFF_*), never from a copy. */
#ifndef HE_PROGRAM_H
#define HE_PROGRAM_H

#include <stddef.h>

#include "kernels.h"

#define HE_ND 6 /* dims of an element-wise iteration (Python merges what it can) */
#define HE_NT 8 /* tensor operands of a record */
#define HE_NP 24
#define HE_NF 8

/* element types, by ONNX's TensorProto codes */
enum { DT_FLOAT = 1, DT_UINT8 = 2, DT_INT8 = 3, DT_INT32 = 6, DT_INT64 = 7, DT_BOOL = 9,
       DT_FLOAT16 = 10, DT_DOUBLE = 11 };

/* an operand: buffer table index, element type, byte offset, a stride per dim (elements) */
typedef struct {
    int32_t buf;
    int32_t dtype;
    int64_t off;
    int64_t st[HE_ND];
} he_tensor;

typedef struct {
    int32_t op, code, ndim, parts;
    int64_t dims[HE_ND];
    he_tensor t[HE_NT];
    int64_t p[HE_NP];
    double f[HE_NF];
} he_op;

/* the records' kinds (t[0] is the output unless said otherwise) */
enum {
    OP_COPY = 1,     /* t0 = t1 over dims (any element type, same on both) */
    OP_CAST,         /* t0 = (t0's type) t1 */
    OP_UNARY,        /* t0 = code(t1) */
    OP_BINARY,       /* t0 = t1 code t2 (comparisons and logic write bool) */
    OP_WHERE,        /* t0 = t1 ? t2 : t3 */
    OP_REDUCE,       /* t0 (p0 values, stride 0 on reduced dims) = code over t1 */
    OP_MATMUL,       /* t0 (contiguous) = t1 @ t2 over p: batch dims, M, N, K */
    OP_GEMM_PACKED,  /* t0 = act(t1 @ packed t2 + t3 bias) via gemm.c */
    OP_SOFTMAX,      /* t0 = softmax of t1's rows (last axis) */
    OP_ROW_NORM,     /* t0 = (rms) norm of t1's rows * t2 + t3 */
    OP_GATHER,       /* t0 = t1 gathered along an axis at t2's indices */
    OP_KV_APPEND,    /* t0 (a cache, at a position read from t2) = t1 */
    OP_GQA,          /* onnxruntime's GroupQueryAttention (gqa.c) */
    OP_BIAS_ACT,     /* t0 = act(t0 + t1) along the last axis, in place (act.c) */
    OP_RANGE,        /* t0[i] = t1 + i * t2 */
    OP_ARGMAX,       /* t0 (int64, rows) = argmax of t1's rows (first on ties) */
    OP_ATTENTION,    /* t0 = softmax(where(t5, f0 * t1 . t2, t6) + t4) @ t3 (attention.c) */
    OP_NBITS,        /* t0 = t1 @ dequantize(t2 codes, t3 scales, t4/t5 zero points).T + t6
                        (MatMulNBits, nbits.c) */
    OP_QGEMM,        /* t0 int32 = (t1 - t3 scalar) @ (packed t2 - t4 int32 [N]) (qgemm.c) */
    OP_DQL,          /* t0, t1, t2 = DynamicQuantizeLinear(t3) (qgemm.c) */
    OP_GQA_PAST,     /* t0 present = t1 past's valid rows, zeros after (gqa.c) */
    OP_QUANTIZE,     /* t0 8-bit = saturate(round_half_even(t1 / t2) + t3) */
    OP_DEQUANTIZE,   /* t0 float = (t1 - t3) * t2 */
};

enum { U_NEG = 1, U_ABS, U_SQRT, U_RECIP, U_EXP, U_LOG, U_SIGMOID, U_TANH, U_COS, U_SIN,
       U_ERF, U_RELU, U_SILU, U_GELU, U_GELU_TANH, U_ISNAN, U_NOT, U_FLOOR, U_CEIL,
       U_SOFTPLUS, U_ISINF, U_NAN_TO_ZERO };

enum { B_ADD = 1, B_SUB, B_MUL, B_DIV, B_POW, B_MAX, B_MIN, B_EQ, B_LT, B_LE, B_GT, B_GE,
       B_AND, B_OR, B_XOR };

enum { R_SUM = 1, R_MEAN, R_MAX, R_MIN, R_PROD };

/* what a failed record reports (he_program_run's *err) */
enum { E_NONE = 0, E_OP = 1, E_TYPE, E_INDEX, E_CAPACITY, E_MEMORY };

static inline char *tensor_at(void *const *bufs, const he_tensor *t)
{
    return (char *)bufs[t->buf] + t->off;
}

static inline int dtype_size(int dt)
{
    switch (dt) {
    case DT_FLOAT: case DT_INT32: return 4;
    case DT_INT64: case DT_DOUBLE: return 8;
    case DT_FLOAT16: return 2;
    default: return 1;
    }
}

/* gqa.c */
int gqa_run(const he_op *o, void *const *bufs);
int gqa_past_run(const he_op *o, void *const *bufs);

#endif
