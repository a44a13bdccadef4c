/* The vector operations the C kernels use, over one type `vf` of VW float lanes, for the
 * instruction set this copy of the library is compiled for (setup.py builds one library
 * per variant, native/library.py loads the one the CPU runs):
 *   HE_ISA_AVX512  16 lanes, AVX-512F intrinsics (masks, compress, gathers)
 *   HE_ISA_AVX2     8 lanes, AVX2 + FMA intrinsics
 *   HE_ISA_NEON     4 lanes, GCC vector extensions (aarch64: NEON, 32 registers)
 *   otherwise       4 lanes, GCC vector extensions (the baseline: SSE2 on x86-64)
 * The kernels are written once against these; only what an ISA has and the others lack
 * (AVX-512's permutes and gathers in the padding of depthwise.c) is under #if there.
 *
 * Lane masks are plain bit masks (`lanes_t`, bit i: lane i). max/min keep x86's rule:
 * the second operand when either is NaN (the kernels rely on it to keep NaN). */
#ifndef HE_SIMD_H
#define HE_SIMD_H

#include <stdint.h>
#include <string.h>

#define ALWAYS_INLINE static inline __attribute__((always_inline))

typedef unsigned lanes_t;

#if defined(HE_ISA_AVX512)
#include <immintrin.h>
#define VW 16
#define HE_ISA_NAME "avx512"
typedef __m512 vf;
typedef __mmask16 vb;
typedef __m512i vidx;
/* the micro-tile: rows at once, vectors a row (24 accumulators of 32 registers) */
#define TILE_ROWS 12
#define TILE_VECS 2
#elif defined(HE_ISA_AVX2)
#include <immintrin.h>
#define VW 8
#define HE_ISA_NAME "avx2"
typedef __m256 vf;
typedef __m256 vb;
typedef long vidx;
#define TILE_ROWS 6 /* 12 accumulators + 2 loads + 1 broadcast of 16 registers */
#define TILE_VECS 2
#else
#define VW 4
typedef float vf __attribute__((vector_size(16)));
typedef int32_t vi __attribute__((vector_size(16)));
typedef vi vb;
typedef long vidx;
#if defined(HE_ISA_NEON)
#define HE_ISA_NAME "neon"
#define TILE_ROWS 6 /* 24 accumulators of 32 registers */
#define TILE_VECS 4
#else
#define HE_ISA_NAME "baseline"
#define TILE_ROWS 6
#define TILE_VECS 2
#endif
#endif

#define VMASK ((lanes_t)((1u << VW) - 1))
#define TILE_COLS (VW * TILE_VECS)

/* the first n of VW lanes: all from VW on, none below 1 */
ALWAYS_INLINE lanes_t first_lanes(int n)
{
    return n >= VW ? VMASK : n <= 0 ? 0u : (lanes_t)((1u << n) - 1);
}

ALWAYS_INLINE void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

#if defined(HE_ISA_AVX512) /* ------------------------------------------------------ */

ALWAYS_INLINE vf vzero(void) { return _mm512_setzero_ps(); }
ALWAYS_INLINE vf vset1(float x) { return _mm512_set1_ps(x); }
ALWAYS_INLINE vf vload(const float *p) { return _mm512_load_ps(p); }
ALWAYS_INLINE vf vloadu(const float *p) { return _mm512_loadu_ps(p); }
ALWAYS_INLINE void vstore(float *p, vf v) { _mm512_store_ps(p, v); }
ALWAYS_INLINE void vstoreu(float *p, vf v) { _mm512_storeu_ps(p, v); }
ALWAYS_INLINE vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
ALWAYS_INLINE vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
ALWAYS_INLINE vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
ALWAYS_INLINE vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
ALWAYS_INLINE vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
ALWAYS_INLINE vf vfnma(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }
ALWAYS_INLINE vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
ALWAYS_INLINE vf vmin(vf a, vf b) { return _mm512_min_ps(a, b); }
ALWAYS_INLINE vf vsqrt(vf a) { return _mm512_sqrt_ps(a); }
ALWAYS_INLINE vf vabs(vf a) { return _mm512_abs_ps(a); }
ALWAYS_INLINE vf vload_lanes(lanes_t m, const float *p) { return _mm512_maskz_loadu_ps((__mmask16)m, p); }
ALWAYS_INLINE vf vload_lanes_or(vf fill, lanes_t m, const float *p)
{
    return _mm512_mask_loadu_ps(fill, (__mmask16)m, p);
}
ALWAYS_INLINE void vstore_lanes(float *p, lanes_t m, vf v) { _mm512_mask_storeu_ps(p, (__mmask16)m, v); }
/* The lanes of v set in m stored packed at p (and loaded so, spread to those lanes): in
 * registers, then one masked store or load of the first popcount(m) lanes. The memory
 * forms of vcompressps / vexpandps are microcoded on some CPUs (AMD Zen 4: over 100
 * cycles a store); here both forms measured the same. */
ALWAYS_INLINE void vcompress_store(float *p, lanes_t m, vf v)
{
    _mm512_mask_storeu_ps(p, (__mmask16)first_lanes(__builtin_popcount(m)),
                          _mm512_maskz_compress_ps((__mmask16)m, v));
}
ALWAYS_INLINE vf vexpand_load(lanes_t m, const float *p)
{
    return _mm512_maskz_expand_ps((__mmask16)m,
                                  _mm512_maskz_loadu_ps((__mmask16)first_lanes(__builtin_popcount(m)), p));
}
ALWAYS_INLINE vf vkeep(lanes_t m, vf v) { return _mm512_maskz_mov_ps((__mmask16)m, v); }
ALWAYS_INLINE vb vge(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_GE_OQ); }
ALWAYS_INLINE vb vlt(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
ALWAYS_INLINE vb visnan(vf a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q); }
ALWAYS_INLINE vb vb_none(void) { return 0; }
ALWAYS_INLINE vb vb_or(vb a, vb b) { return a | b; }
ALWAYS_INLINE int vb_any(vb a) { return a != 0; }
/* a where k, else b */
ALWAYS_INLINE vf vselect(vb k, vf a, vf b) { return _mm512_mask_blend_ps(k, b, a); }
ALWAYS_INLINE float vreduce_max(vf a) { return _mm512_reduce_max_ps(a); }
ALWAYS_INLINE float vreduce_add(vf a) { return _mm512_reduce_add_ps(a); }
ALWAYS_INLINE vf vround(vf a)
{
    return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
/* p * 2^n for integer-valued n (a normal result) */
ALWAYS_INLINE vf vscale2(vf p, vf n) { return _mm512_scalef_ps(p, n); }
/* lanes i < n of p[i * stride] (0 beyond), and the store back: the stride prepared once */
ALWAYS_INLINE vidx vidx_stride(long stride)
{
    return _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                              _mm512_set1_epi32((int)stride));
}
ALWAYS_INLINE vf vgather(const float *p, vidx idx, int n)
{
    return _mm512_mask_i32gather_ps(_mm512_setzero_ps(), (__mmask16)first_lanes(n), idx, p, 4);
}
ALWAYS_INLINE void vscatter(float *p, vidx idx, int n, vf v)
{
    _mm512_mask_i32scatter_ps(p, (__mmask16)first_lanes(n), idx, v, 4);
}

#elif defined(HE_ISA_AVX2) /* ---------------------------------------------------- */

ALWAYS_INLINE vf vzero(void) { return _mm256_setzero_ps(); }
ALWAYS_INLINE vf vset1(float x) { return _mm256_set1_ps(x); }
ALWAYS_INLINE vf vload(const float *p) { return _mm256_load_ps(p); }
ALWAYS_INLINE vf vloadu(const float *p) { return _mm256_loadu_ps(p); }
ALWAYS_INLINE void vstore(float *p, vf v) { _mm256_store_ps(p, v); }
ALWAYS_INLINE void vstoreu(float *p, vf v) { _mm256_storeu_ps(p, v); }
ALWAYS_INLINE vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
ALWAYS_INLINE vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
ALWAYS_INLINE vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
ALWAYS_INLINE vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
ALWAYS_INLINE vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
ALWAYS_INLINE vf vfnma(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
ALWAYS_INLINE vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
ALWAYS_INLINE vf vmin(vf a, vf b) { return _mm256_min_ps(a, b); }
ALWAYS_INLINE vf vsqrt(vf a) { return _mm256_sqrt_ps(a); }
ALWAYS_INLINE vf vabs(vf a) { return _mm256_and_ps(a, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff))); }
ALWAYS_INLINE __m256i lanes_vector(lanes_t m)
{
    const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)m), bit), bit);
}
/* (the full-vector case first: a masked store is slow on some AMD cores) */
ALWAYS_INLINE vf vload_lanes(lanes_t m, const float *p)
{
    return m == VMASK ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, lanes_vector(m));
}
ALWAYS_INLINE vf vload_lanes_or(vf fill, lanes_t m, const float *p)
{
    if (m == VMASK)
        return _mm256_loadu_ps(p);
    __m256i k = lanes_vector(m);
    return _mm256_blendv_ps(fill, _mm256_maskload_ps(p, k), _mm256_castsi256_ps(k));
}
ALWAYS_INLINE void vstore_lanes(float *p, lanes_t m, vf v)
{
    if (m == VMASK)
        _mm256_storeu_ps(p, v);
    else if (m)
        _mm256_maskstore_ps(p, lanes_vector(m), v);
}
ALWAYS_INLINE vf vkeep(lanes_t m, vf v) { return _mm256_and_ps(v, _mm256_castsi256_ps(lanes_vector(m))); }
ALWAYS_INLINE vb vge(vf a, vf b) { return _mm256_cmp_ps(a, b, _CMP_GE_OQ); }
ALWAYS_INLINE vb vlt(vf a, vf b) { return _mm256_cmp_ps(a, b, _CMP_LT_OQ); }
ALWAYS_INLINE vb visnan(vf a) { return _mm256_cmp_ps(a, a, _CMP_UNORD_Q); }
ALWAYS_INLINE vb vb_none(void) { return _mm256_setzero_ps(); }
ALWAYS_INLINE vb vb_or(vb a, vb b) { return _mm256_or_ps(a, b); }
ALWAYS_INLINE int vb_any(vb a) { return _mm256_movemask_ps(a) != 0; }
ALWAYS_INLINE vf vselect(vb k, vf a, vf b) { return _mm256_blendv_ps(b, a, k); }
ALWAYS_INLINE float vreduce_max(vf a)
{
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}
ALWAYS_INLINE float vreduce_add(vf a)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}
ALWAYS_INLINE vf vround(vf a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
/* the even lanes of lo then of hi (a stride-2 row's one phase): one shuffle within the
 * 128-bit halves, one permute across them */
ALWAYS_INLINE vf even_lanes(vf lo, vf hi)
{
    __m256 e = _mm256_shuffle_ps(lo, hi, _MM_SHUFFLE(2, 0, 2, 0)); /* l0 l2 h0 h2 l4 l6 h4 h6 */
    return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(e), _MM_SHUFFLE(3, 1, 2, 0)));
}
/* the odd lanes of lo then of hi (the other phase) */
ALWAYS_INLINE vf odd_lanes(vf lo, vf hi)
{
    __m256 e = _mm256_shuffle_ps(lo, hi, _MM_SHUFFLE(3, 1, 3, 1)); /* l1 l3 h1 h3 l5 l7 h5 h7 */
    return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(e), _MM_SHUFFLE(3, 1, 2, 0)));
}
ALWAYS_INLINE vf vscale2(vf p, vf n)
{
    return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p),
                                                _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23)));
}

#else /* ------------------------------------------ GCC vector extensions, 4 lanes */

ALWAYS_INLINE vf vzero(void) { return (vf){0.0f, 0.0f, 0.0f, 0.0f}; }
ALWAYS_INLINE vf vset1(float x) { return (vf){x, x, x, x}; }
ALWAYS_INLINE vf vload(const float *p) { return *(const vf *)p; }
ALWAYS_INLINE vf vloadu(const float *p)
{
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}
ALWAYS_INLINE void vstore(float *p, vf v) { *(vf *)p = v; }
ALWAYS_INLINE void vstoreu(float *p, vf v) { memcpy(p, &v, sizeof v); }
ALWAYS_INLINE vf vadd(vf a, vf b) { return a + b; }
ALWAYS_INLINE vf vsub(vf a, vf b) { return a - b; }
ALWAYS_INLINE vf vmul(vf a, vf b) { return a * b; }
ALWAYS_INLINE vf vdiv(vf a, vf b) { return a / b; }
ALWAYS_INLINE vf vfma(vf a, vf b, vf c) { return a * b + c; }
ALWAYS_INLINE vf vfnma(vf a, vf b, vf c) { return c - a * b; }
ALWAYS_INLINE vf vselect(vb k, vf a, vf b) { return (vf)(((vi)a & k) | ((vi)b & ~k)); }
ALWAYS_INLINE vf vmax(vf a, vf b) { return vselect(a > b, a, b); }
ALWAYS_INLINE vf vmin(vf a, vf b) { return vselect(a < b, a, b); }
ALWAYS_INLINE vf vsqrt(vf a)
{
    for (int i = 0; i < VW; i++)
        a[i] = __builtin_sqrtf(a[i]);
    return a;
}
ALWAYS_INLINE vf vabs(vf a) { return (vf)((vi)a & 0x7fffffff); }
ALWAYS_INLINE vf vload_lanes_or(vf fill, lanes_t m, const float *p)
{
    if (m == VMASK)
        return vloadu(p);
    for (int i = 0; i < VW; i++)
        if (m >> i & 1)
            fill[i] = p[i];
    return fill;
}
ALWAYS_INLINE vf vload_lanes(lanes_t m, const float *p) { return vload_lanes_or(vzero(), m, p); }
ALWAYS_INLINE void vstore_lanes(float *p, lanes_t m, vf v)
{
    if (m == VMASK) {
        vstoreu(p, v);
        return;
    }
    for (int i = 0; i < VW; i++)
        if (m >> i & 1)
            p[i] = v[i];
}
ALWAYS_INLINE vf vkeep(lanes_t m, vf v)
{
    for (int i = 0; i < VW; i++)
        if (!(m >> i & 1))
            v[i] = 0.0f;
    return v;
}
ALWAYS_INLINE vb vge(vf a, vf b) { return a >= b; }
ALWAYS_INLINE vb vlt(vf a, vf b) { return a < b; }
ALWAYS_INLINE vb visnan(vf a) { return a != a; }
ALWAYS_INLINE vb vb_none(void) { return (vb){0, 0, 0, 0}; }
ALWAYS_INLINE vb vb_or(vb a, vb b) { return a | b; }
ALWAYS_INLINE int vb_any(vb a) { return (a[0] | a[1] | a[2] | a[3]) != 0; }
ALWAYS_INLINE float vreduce_max(vf a)
{
    float m = a[0];
    for (int i = 1; i < VW; i++)
        m = a[i] > m ? a[i] : m;
    return m;
}
ALWAYS_INLINE float vreduce_add(vf a) { return (a[0] + a[1]) + (a[2] + a[3]); }
/* round to nearest (|a| < 2^22: the kernels' arguments are within +-130) */
ALWAYS_INLINE vf vround(vf a) { return (a + 12582912.0f) - 12582912.0f; }
ALWAYS_INLINE vf vscale2(vf p, vf n) { return (vf)((vi)p + (__builtin_convertvector(n, vi) << 23)); }

#endif

/* v's lanes set in m packed from lane 0, the lanes after them any values, for a full
 * store where those lanes may be overwritten (depthwise.c); `perm` is compress_perm(m),
 * worked out once (AVX2's permute takes it as indices; AVX-512 has the compress). */
ALWAYS_INLINE unsigned compress_perm(lanes_t m)
{
    unsigned perm = 0;
    for (int i = 0, k = 0; i < 8 && i < VW; i++)
        if (m >> i & 1)
            perm |= (unsigned)i << (4 * k++);
    return perm;
}
#if defined(HE_ISA_AVX512)
ALWAYS_INLINE vf vcompress(lanes_t m, unsigned perm, vf v)
{
    (void)perm;
    return _mm512_maskz_compress_ps((__mmask16)m, v);
}
#elif defined(HE_ISA_AVX2)
ALWAYS_INLINE vf vcompress(lanes_t m, unsigned perm, vf v)
{
    (void)m;
    __m256i idx = _mm256_srlv_epi32(_mm256_set1_epi32((int)perm),
                                    _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
    return _mm256_permutevar8x32_ps(v, idx);
}
#else
ALWAYS_INLINE vf vcompress(lanes_t m, unsigned perm, vf v)
{
    (void)perm;
    vf out = v;
    for (int i = 0, k = 0; i < VW; i++)
        if (m >> i & 1)
            out[k++] = v[i];
    return out;
}
#endif

#if !defined(HE_ISA_AVX512) /* ------------------------ what only AVX-512 has in one step */
ALWAYS_INLINE void vcompress_store(float *p, lanes_t m, vf v)
{
    float t[VW];
    vstoreu(t, v);
    for (int i = 0, k = 0; i < VW; i++)
        if (m >> i & 1)
            p[k++] = t[i];
}
ALWAYS_INLINE vf vexpand_load(lanes_t m, const float *p)
{
    float t[VW] = {0};
    for (int i = 0, k = 0; i < VW; i++)
        if (m >> i & 1)
            t[i] = p[k++];
    return vloadu(t);
}
ALWAYS_INLINE vidx vidx_stride(long stride) { return stride; }
ALWAYS_INLINE vf vgather(const float *p, vidx stride, int n)
{
    float t[VW] = {0};
    for (int i = 0; i < n && i < VW; i++)
        t[i] = p[i * stride];
    return vloadu(t);
}
ALWAYS_INLINE void vscatter(float *p, vidx stride, int n, vf v)
{
    float t[VW];
    vstoreu(t, v);
    for (int i = 0; i < n && i < VW; i++)
        p[i * stride] = t[i];
}
#endif

/* the sums of a0..a3's lanes into out[0..3] (four dot products' reductions at once: AVX's
 * horizontal adds take the four together in three steps, where one at a time is four
 * dependent steps each) */
ALWAYS_INLINE void vreduce_add4(vf a0, vf a1, vf a2, vf a3, float *out)
{
#if defined(HE_ISA_AVX512) || defined(HE_ISA_AVX2)
#if defined(HE_ISA_AVX512)
#define HALVES(v) _mm256_add_ps(_mm512_castps512_ps256(v), \
                                _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)))
    __m256 b0 = HALVES(a0), b1 = HALVES(a1), b2 = HALVES(a2), b3 = HALVES(a3);
#undef HALVES
#else
    __m256 b0 = a0, b1 = a1, b2 = a2, b3 = a3;
#endif
    __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(b0, b1), _mm256_hadd_ps(b2, b3));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
#else
    out[0] = vreduce_add(a0);
    out[1] = vreduce_add(a1);
    out[2] = vreduce_add(a2);
    out[3] = vreduce_add(a3);
#endif
}

/* exp(z) for z <= 0 (softmax.c: a score minus its row's maximum; act.c: the logistic's
 * exp(-|x|)), Cephes' expf: z = n ln2 + r,
 * |r| <= ln2 / 2, a degree-7 polynomial of r, scaled by 2^n; about 1 ulp. Below -87
 * (where exp(z) would soon be subnormal) the result is an exact 0, as in
 * reduce.exp_scores_inplace, so nothing after it runs on subnormals. */
ALWAYS_INLINE vf exp_nonpositive(vf z)
{
    const vf floor = vset1(-87.0f);
    vb live = vge(z, floor);
    vf x = vmax(z, floor);
    vf n = vround(vmul(x, vset1(1.44269504088896341f)));
    vf r = vfnma(n, vset1(0.693359375f), x);
    r = vfnma(n, vset1(-2.12194440e-4f), r);
    vf p = vset1(1.9875691500e-4f);
    p = vfma(p, r, vset1(1.3981999507e-3f));
    p = vfma(p, r, vset1(8.3334519073e-3f));
    p = vfma(p, r, vset1(4.1665795894e-2f));
    p = vfma(p, r, vset1(1.6666665459e-1f));
    p = vfma(p, r, vset1(5.0000001201e-1f));
    p = vfma(p, vmul(r, r), vadd(r, vset1(1.0f)));
    return vselect(live, vscale2(p, n), vzero());
}

/* the sums of VW vectors' lanes as one vector (lane i: the sum of a[i]'s lanes): a tree
 * of interleaves that halves the vectors at each level, log2(VW) levels of shuffles and
 * adds shared by all VW sums (VW - 1 adds in all), where a reduction per vector costs
 * log2(VW) shuffles and adds for each sum */
ALWAYS_INLINE vf vreduce_add_lanes(const vf *a)
{
#if defined(HE_ISA_AVX512)
    /* per 128-bit chunk: (x0+x2, y0+y2, x1+x3, y1+y3) of rows x, y */
    __m512 b[8], c[4], d[2];
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++)
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                             _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    /* per chunk: rows 4i..4i+3, each a quarter of its sum */
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
        __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
        c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    /* chunks (rows 8i..8i+3 halves, rows 8i+4..8i+7 halves) */
#pragma GCC unroll 2
    for (int i = 0; i < 2; i++)
        d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], 0x88),
                         _mm512_shuffle_f32x4(d[0], d[1], 0xDD));
#elif defined(HE_ISA_AVX2)
    __m256 b[4], c[2];
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++)
        b[i] = _mm256_add_ps(_mm256_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                             _mm256_unpackhi_ps(a[2 * i], a[2 * i + 1]));
#pragma GCC unroll 2
    for (int i = 0; i < 2; i++) {
        __m256d x = _mm256_castps_pd(b[2 * i]), y = _mm256_castps_pd(b[2 * i + 1]);
        c[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)),
                             _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
    }
    return _mm256_add_ps(_mm256_permute2f128_ps(c[0], c[1], 0x20),
                         _mm256_permute2f128_ps(c[0], c[1], 0x31));
#else
    float t[VW];
    vreduce_add4(a[0], a[1], a[2], a[3], t);
    return vloadu(t);
#endif
}

/* a . b over n floats (unit strides), a vector at a time, the tail by a lane mask */
ALWAYS_INLINE float vdot(const float *a, const float *b, int64_t n)
{
    vf acc = vzero();
    int64_t k = 0;
    for (; k + VW <= n; k += VW)
        acc = vfma(vloadu(a + k), vloadu(b + k), acc);
    if (k < n) {
        lanes_t l = first_lanes((int)(n - k));
        acc = vfma(vload_lanes(l, a + k), vload_lanes(l, b + k), acc);
    }
    return vreduce_add(acc);
}

/* a . b_i for the four rows b_i = b + i * ld (n floats each, unit strides) into out[0..3]:
 * a's vector loaded once for the four, four FMA chains where vdot has one */
ALWAYS_INLINE void vdot4(const float *a, const float *b, int64_t ld, int64_t n, float *out)
{
    vf s0 = vzero(), s1 = vzero(), s2 = vzero(), s3 = vzero();
    int64_t k = 0;
    for (; k + VW <= n; k += VW) {
        vf x = vloadu(a + k);
        s0 = vfma(x, vloadu(b + k), s0);
        s1 = vfma(x, vloadu(b + ld + k), s1);
        s2 = vfma(x, vloadu(b + 2 * ld + k), s2);
        s3 = vfma(x, vloadu(b + 3 * ld + k), s3);
    }
    if (k < n) {
        lanes_t l = first_lanes((int)(n - k));
        vf x = vload_lanes(l, a + k);
        s0 = vfma(x, vload_lanes(l, b + k), s0);
        s1 = vfma(x, vload_lanes(l, b + ld + k), s1);
        s2 = vfma(x, vload_lanes(l, b + 2 * ld + k), s2);
        s3 = vfma(x, vload_lanes(l, b + 3 * ld + k), s3);
    }
    vreduce_add4(s0, s1, s2, s3, out);
}

/* x . b_i for the VW rows b_i = b + i * ld into out[0..VW), x the `vecs` vectors of a row
 * of vecs * VW floats (b's rows as long, unit strides), loaded once by the caller for all
 * its rows: a product chain per row, and one tree for the VW reductions (the short rows of
 * attention heads, where vdot4's reductions outweighed its products) */
ALWAYS_INLINE void vdot_rows(const vf *x, const float *b, int64_t ld, float *out, const int vecs)
{
    vf s[VW];
#pragma GCC unroll 16
    for (int i = 0; i < VW; i++, b += ld) {
        vf acc = vmul(x[0], vloadu(b));
#pragma GCC unroll 8
        for (int c = 1; c < vecs; c++)
            acc = vfma(x[c], vloadu(b + c * VW), acc);
        s[i] = acc;
    }
    vstoreu(out, vreduce_add_lanes(s));
}

#endif
