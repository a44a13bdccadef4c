/* float16 <-> float32 conversion (round to nearest even: the same bits as numpy's
 * astype), for the float16 models whose nodes compute in float32 (exec/half.py):
 * numpy's own conversion loop is scalar, 5 ns a value here against ~0.2 ns with
 * AVX-512F's vcvtph2ps / vcvtps2ph. AVX2 machines use F16C's 8-lane forms; the
 * baseline converts through the compiler's _Float16. */
#include "kernels.h"

#if defined(HE_ISA_AVX512) || defined(HE_ISA_AVX2)
#include <immintrin.h>
#endif

void he_half_to_float(const uint16_t *src, float *dst, long n)
{
    long i = 0;
#if defined(HE_ISA_AVX512)
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + i))));
#elif defined(HE_ISA_AVX2)
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
#endif
    for (; i < n; i++) {
        _Float16 h;
        memcpy(&h, src + i, sizeof h);
        dst[i] = (float)h;
    }
}

void he_float_to_half(const float *src, uint16_t *dst, long n)
{
    long i = 0;
#if defined(HE_ISA_AVX512)
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(dst + i),
                            _mm512_cvtps_ph(_mm512_loadu_ps(src + i),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#elif defined(HE_ISA_AVX2)
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
    for (; i < n; i++) {
        _Float16 h = (_Float16)src[i];
        memcpy(dst + i, &h, sizeof h);
    }
}
