/* What the library tells its loader (native/library.py): the variant it was compiled
 * for, the constants Python's wrappers use, the signature of every HE_API function
 * (abi_signatures.h, which setup.py generates from kernels.h), and the CPU's features,
 * read by the baseline variant to pick among the others. */
#include "program.h"

HE_API const char he_isa[] = HE_ISA_NAME;

typedef struct {
    const char *name;
    long value;
} he_constant;

HE_API const he_constant he_constants[] = {
    {"NR", NR}, {"MR_LEFT", MR_LEFT}, {"MR_RIGHT", MR_RIGHT}, {"SEG", SEG},
    {"VW", VW}, {"KC", KC},
    {"ACT_NONE", ACT_NONE}, {"ACT_RELU", ACT_RELU}, {"ACT_CLIP", ACT_CLIP},
    {"ACT_HARD_SIGMOID", ACT_HARD_SIGMOID}, {"ACT_HARD_SWISH", ACT_HARD_SWISH},
    {"ACT_GELU", ACT_GELU}, {"ACT_GELU_TANH", ACT_GELU_TANH}, {"ACT_SILU", ACT_SILU},
    {"ACT_SIGMOID", ACT_SIGMOID}, {"ACT_TANH", ACT_TANH}, {"ACT_ERF", ACT_ERF},
    /* program.h: the record's layout and codes */
    {"HE_ND", HE_ND}, {"HE_NT", HE_NT}, {"HE_NP", HE_NP}, {"HE_NF", HE_NF},
    {"HE_OP_SIZE", sizeof(he_op)}, {"HE_TENSOR_SIZE", sizeof(he_tensor)},
    {"HE_OFF_OP", offsetof(he_op, op)}, {"HE_OFF_CODE", offsetof(he_op, code)},
    {"HE_OFF_NDIM", offsetof(he_op, ndim)}, {"HE_OFF_PARTS", offsetof(he_op, parts)},
    {"HE_OFF_DIMS", offsetof(he_op, dims)}, {"HE_OFF_T", offsetof(he_op, t)},
    {"HE_OFF_P", offsetof(he_op, p)}, {"HE_OFF_F", offsetof(he_op, f)},
    {"HE_OFF_T_BUF", offsetof(he_tensor, buf)}, {"HE_OFF_T_DTYPE", offsetof(he_tensor, dtype)},
    {"HE_OFF_T_OFF", offsetof(he_tensor, off)}, {"HE_OFF_T_ST", offsetof(he_tensor, st)},
    {"OP_COPY", OP_COPY}, {"OP_CAST", OP_CAST}, {"OP_UNARY", OP_UNARY},
    {"OP_BINARY", OP_BINARY}, {"OP_WHERE", OP_WHERE}, {"OP_REDUCE", OP_REDUCE},
    {"OP_MATMUL", OP_MATMUL}, {"OP_GEMM_PACKED", OP_GEMM_PACKED},
    {"OP_SOFTMAX", OP_SOFTMAX}, {"OP_ROW_NORM", OP_ROW_NORM}, {"OP_GATHER", OP_GATHER},
    {"OP_KV_APPEND", OP_KV_APPEND}, {"OP_GQA", OP_GQA}, {"OP_BIAS_ACT", OP_BIAS_ACT},
    {"OP_RANGE", OP_RANGE}, {"OP_ARGMAX", OP_ARGMAX},
    {"OP_ATTENTION", OP_ATTENTION},
    {"OP_NBITS", OP_NBITS}, {"OP_QGEMM", OP_QGEMM}, {"OP_DQL", OP_DQL},
    {"OP_GQA_PAST", OP_GQA_PAST},
    {"OP_QUANTIZE", OP_QUANTIZE}, {"OP_DEQUANTIZE", OP_DEQUANTIZE},
    {"U_NEG", U_NEG}, {"U_ABS", U_ABS}, {"U_SQRT", U_SQRT}, {"U_RECIP", U_RECIP},
    {"U_EXP", U_EXP}, {"U_LOG", U_LOG}, {"U_SIGMOID", U_SIGMOID}, {"U_TANH", U_TANH},
    {"U_COS", U_COS}, {"U_SIN", U_SIN}, {"U_ERF", U_ERF}, {"U_RELU", U_RELU},
    {"U_SILU", U_SILU}, {"U_GELU", U_GELU}, {"U_GELU_TANH", U_GELU_TANH},
    {"U_ISNAN", U_ISNAN}, {"U_NOT", U_NOT}, {"U_FLOOR", U_FLOOR}, {"U_CEIL", U_CEIL},
    {"U_SOFTPLUS", U_SOFTPLUS}, {"U_ISINF", U_ISINF}, {"U_NAN_TO_ZERO", U_NAN_TO_ZERO},
    {"B_ADD", B_ADD}, {"B_SUB", B_SUB}, {"B_MUL", B_MUL}, {"B_DIV", B_DIV},
    {"B_POW", B_POW}, {"B_MAX", B_MAX}, {"B_MIN", B_MIN}, {"B_EQ", B_EQ}, {"B_LT", B_LT},
    {"B_LE", B_LE}, {"B_GT", B_GT}, {"B_GE", B_GE}, {"B_AND", B_AND}, {"B_OR", B_OR},
    {"B_XOR", B_XOR},
    {"R_SUM", R_SUM}, {"R_MEAN", R_MEAN}, {"R_MAX", R_MAX}, {"R_MIN", R_MIN},
    {"R_PROD", R_PROD},
    {"E_OP", E_OP}, {"E_TYPE", E_TYPE}, {"E_INDEX", E_INDEX}, {"E_CAPACITY", E_CAPACITY},
    {"E_MEMORY", E_MEMORY},
    {0, 0},
};

typedef struct {
    const char *name;
    const char *result; /* v void, i int, l long, f float, d double, p pointer */
    const char *args;   /* one of those letters an argument */
} he_signature;

HE_API const he_signature he_signatures[] = {
#include "abi_signatures.h"
    {0, 0, 0},
};

/* bit 0 AVX2, 1 FMA, 2 AVX-512F (each with the OS's support for its registers, as
 * libgcc's cpu model checks it), 3 NEON (aarch64: always) */
int he_cpu_features(void)
{
    int f = 0;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2"))
        f |= 1;
    if (__builtin_cpu_supports("fma"))
        f |= 2;
    if (__builtin_cpu_supports("avx512f"))
        f |= 4;
#elif defined(__aarch64__)
    f |= 8;
#endif
    return f;
}
