/* What the library tells its loader (native/library.py): the variant it was compiled
 * for, the constants Python's wrappers use, the signature of every HE_API function
 * (abi_signatures.h, which setup.py generates from kernels.h), and the CPU's features,
 * read by the baseline variant to pick among the others. */
#include "kernels.h"

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
    {"ACT_SIGMOID", ACT_SIGMOID}, {"ACT_TANH", ACT_TANH},
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
