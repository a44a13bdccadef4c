/* FusedAttention's float32 rows: y = softmax(where(cond, scale * q . K^T, fill) + mask) @ V,
 * one query row at a time, as kernels/attention.py defines it (the
 * MatMul-Mul-[Where]-[Add]-Softmax-MatMul chain).
 *
 * numpy computed every score of a (rows x keys) block and then the whole softmax; a
 * decoder's causal mask hides half of them in a prompt (and a decode step's unfilled
 * cache positions). Here each row reads its mask first: the keys before its first and
 * after its last visible one (mask <= -1e30, or cond false with fill <= -1e30: exp makes
 * those an exact 0 next to any visible score) are never computed. A row with no visible key is computed whole, so it
 * comes out as numpy's does (a uniform row, or NaN where the mask is -inf).
 *
 * Operands are strided views, (batch, head, row, column) in elements; K and V as (batch,
 * kv head, key, dim), query head h reading kv head h / (Hq / Hkv). The scores of a row
 * go across keys a vector at a time when K is given transposed (keys at unit stride),
 * else a dot per key along its dims. Rows are dealt to the parts in turn, so a causal
 * prompt's short and long rows spread evenly. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#define MASKED (-1e30f)

typedef struct {
    const attention_t *a;
    int parts;
    int failed;
} rows_args;

/* the widest head vdot_rows takes, in vectors (32 floats with AVX2, 64 with AVX-512) */
#define KEYS_BLOCK_VECS 4

/* scores[0, n) = q . each of K's n rows (key apart, D floats at unit stride): VW keys at
 * once where a head is whole vectors (one product chain a key, one tree for their sums),
 * then four (four chains), q's vectors loaded once for all */
void rows_scores(const float *q, const float *K, int64_t key, int64_t D, int64_t n, float *sc)
{
    int64_t j = 0;
    if (D % VW == 0 && D <= KEYS_BLOCK_VECS * VW) {
        vf x[KEYS_BLOCK_VECS];
        for (int c = 0; c < D / VW; c++)
            x[c] = vloadu(q + c * VW);
        switch (D / VW) {
#define T(c) case c: for (; j + VW <= n; j += VW) vdot_rows(x, K + j * key, key, sc + j, c); break;
            T(1) T(2) T(3) T(4)
#undef T
        }
    }
    for (; j + 4 <= n; j += 4)
        vdot4(q, K + j * key, key, D, sc + j);
    for (; j < n; j++)
        sc[j] = vdot(q, K + j * key, D);
}

/* scores[0, n) of keys lo.. of one row: q (D values, unit stride) against K */
static void scores_of(const attention_t *a, const float *q, const float *K, int64_t lo,
                      int64_t n, float *sc)
{
    const int64_t D = a->D, key = a->ks[2], dim = a->ks[3];
    if (dim == 1) {
        rows_scores(q, K + lo * key, key, D, n, sc);
    } else if (key == 1) { /* K^T: vectors of keys held in registers over the dims */
        const float *k0 = K + lo;
        int64_t j = 0;
        for (; j + 4 * VW <= n; j += 4 * VW) { /* four chains: the FMA's latency hidden */
            vf s0 = vzero(), s1 = vzero(), s2 = vzero(), s3 = vzero();
            for (int64_t d = 0; d < D; d++) {
                const vf qd = vset1(q[d]);
                const float *kd = k0 + d * dim + j;
                s0 = vfma(qd, vloadu(kd), s0);
                s1 = vfma(qd, vloadu(kd + VW), s1);
                s2 = vfma(qd, vloadu(kd + 2 * VW), s2);
                s3 = vfma(qd, vloadu(kd + 3 * VW), s3);
            }
            vstoreu(sc + j, s0);
            vstoreu(sc + j + VW, s1);
            vstoreu(sc + j + 2 * VW, s2);
            vstoreu(sc + j + 3 * VW, s3);
        }
        for (; j + 2 * VW <= n; j += 2 * VW) {
            vf s0 = vzero(), s1 = vzero();
            for (int64_t d = 0; d < D; d++) {
                const vf qd = vset1(q[d]);
                s0 = vfma(qd, vloadu(k0 + d * dim + j), s0);
                s1 = vfma(qd, vloadu(k0 + d * dim + j + VW), s1);
            }
            vstoreu(sc + j, s0);
            vstoreu(sc + j + VW, s1);
        }
        for (; j < n; j += VW) {
            lanes_t l = first_lanes((int)(n - j));
            vf s0 = vzero();
            for (int64_t d = 0; d < D; d++)
                s0 = vfma(vset1(q[d]), vload_lanes(l, k0 + d * dim + j), s0);
            vstore_lanes(sc + j, l, s0);
        }
    } else {
        for (int64_t j = 0; j < n; j++) {
            float s = 0.0f;
            for (int64_t d = 0; d < D; d++)
                s += q[d] * K[(lo + j) * key + d * dim];
            sc[j] = s;
        }
    }
}

/* vectors of a row's output at once: 64 floats (8 with AVX2, 4 with AVX-512), at most 8 */
#define WV_VECS (64 / VW > 8 ? 8 : 64 / VW)

/* out[0, nv) = p[0, n) @ the nv vectors of V's rows from v (rows key apart), the last
 * vector's lanes `last`: nv FMA chains, over 2 or 4 keys at a time where they fit the
 * registers (the chains' latency, not the loads, bounds a loop over one key at a time: a
 * 16-wide head's row was 2 cycles a key with AVX-512 over two chains) */
ALWAYS_INLINE void values_block(const float *p, const float *v, int64_t key, int64_t n,
                                lanes_t last, vf *out, const int nv)
{
    const int ways = 4 * nv <= WV_VECS ? 4 : 2 * nv <= WV_VECS ? 2 : 1;
    vf s[4][WV_VECS];
#pragma GCC unroll 4
    for (int w = 0; w < 4; w++)
#pragma GCC unroll 8
        for (int i = 0; i < nv; i++)
            s[w][i] = vzero();
    int64_t j = 0;
    if (ways > 1)
        for (; j + ways <= n; j += ways, v += ways * key) {
#pragma GCC unroll 4
            for (int w = 0; w < ways; w++) {
                const vf pw = vset1(p[j + w]);
#pragma GCC unroll 8
                for (int i = 0; i < nv; i++)
                    s[w][i] = vfma(pw, vload_lanes(i == nv - 1 ? last : VMASK, v + w * key + i * VW),
                                   s[w][i]);
            }
        }
    for (; j < n; j++, v += key) {
        const vf p0 = vset1(p[j]);
#pragma GCC unroll 8
        for (int i = 0; i < nv; i++)
            s[0][i] = vfma(p0, vload_lanes(i == nv - 1 ? last : VMASK, v + i * VW), s[0][i]);
    }
#pragma GCC unroll 8
    for (int i = 0; i < nv; i++)
        out[i] = ways == 4 ? vadd(vadd(s[0][i], s[1][i]), vadd(s[2][i], s[3][i]))
                 : ways == 2 ? vadd(s[0][i], s[1][i]) : s[0][i];
}

/* y (D values at stride ys) = p[0, n) @ V's n rows (key apart, D floats at unit
 * stride), WV_VECS vectors of dims at a time */
void rows_values(const float *p, const float *V, int64_t key, int64_t D, int64_t n, float *y,
                 int64_t ys)
{
    for (int64_t d = 0; d < D; d += WV_VECS * VW) {
        int rest = (int)(D - d), nv = (rest + VW - 1) / VW;
        nv = nv < WV_VECS ? nv : WV_VECS;
        lanes_t last = first_lanes(rest - (nv - 1) * VW);
        const float *v = V + d;
        vf sum[WV_VECS];
        if (last == VMASK) {
            switch (nv) {
#define T(c) case c: values_block(p, v, key, n, VMASK, sum, c); break;
                T(1) T(2) T(3) T(4)
#if WV_VECS > 4
                T(5) T(6) T(7) T(8)
#endif
#undef T
            }
        } else {
            switch (nv) {
#define T(c) case c: values_block(p, v, key, n, last, sum, c); break;
                T(1) T(2) T(3) T(4)
#if WV_VECS > 4
                T(5) T(6) T(7) T(8)
#endif
#undef T
            }
        }
        for (int i = 0; i < nv; i++) {
            lanes_t l = i == nv - 1 ? last : VMASK;
            if (ys == 1)
                vstore_lanes(y + d + i * VW, l, sum[i]);
            else {
                float tmp[VW];
                vstoreu(tmp, sum[i]);
                for (int64_t k = 0; k < VW && d + i * VW + k < D; k++)
                    y[(d + i * VW + k) * ys] = tmp[k];
            }
        }
    }
}

/* y (D values at stride ys) = p[0, n) @ V's rows lo.. */
static void weighted_values(const attention_t *a, const float *p, const float *V, int64_t lo,
                            int64_t n, float *y, int64_t ys)
{
    const int64_t D = a->D, key = a->vs[2], dim = a->vs[3];
    if (dim == 1) {
        rows_values(p, V + lo * key, key, D, n, y, ys);
        return;
    }
    for (int64_t d = 0; d < D; d++) {
        float s = 0.0f;
        for (int64_t j = 0; j < n; j++)
            s += p[j] * V[(lo + j) * key + d * dim];
        y[d * ys] = s;
    }
}

static void row(const attention_t *a, int64_t r, float *sc, float *qv)
{
    const int64_t BH = a->B * a->Hq, l = r / BH, bh = r % BH, b = bh / a->Hq, h = bh % a->Hq;
    const int64_t kvh = h / (a->Hq / a->Hkv), S = a->S;
    const float *q = a->q + b * a->qs[0] + h * a->qs[1] + l * a->qs[2];
    for (int64_t d = 0; d < a->D; d++)
        qv[d] = q[d * a->qs[3]];
    const float *m = a->m ? a->m + b * a->ms[0] + h * a->ms[1] + l * a->ms[2] : NULL;
    const uint8_t *c = a->c ? a->c + b * a->cs[0] + h * a->cs[1] + l * a->cs[2] : NULL;
    const int64_t mk = a->ms[3], ck = a->cs[3];
    const int fill_hides = c && a->fill <= MASKED;
#define HIDDEN(j) ((m && m[(j) * mk] <= MASKED) || (fill_hides && !c[(j) * ck]))
    int64_t lo = 0, hi = S - 1;
    if (m || fill_hides) {
        while (lo < S && HIDDEN(lo))
            lo++;
        if (lo == S)
            lo = 0; /* no visible key: the whole row, as numpy computes it */
        else {
            if (m && mk == 1 && !fill_hides) /* a decode step's unfilled positions */
                while (hi - VW >= lo && !vb_any(vlt(vset1(MASKED), vloadu(m + hi - VW + 1))))
                    hi -= VW;
            while (hi > lo && HIDDEN(hi))
                hi--;
        }
    }
#undef HIDDEN
    const int64_t n = hi - lo + 1;
    scores_of(a, qv, a->k + b * a->ks[0] + kvh * a->ks[1], lo, n, sc);
    if (!c && (!m || mk == 1)) { /* sc * scale + mask, a vector at a time */
        const vf scale = vset1(a->scale);
        for (int64_t j = 0; j < n; j += VW) {
            const lanes_t l = first_lanes((int)(n - j));
            const vf add = m ? vload_lanes(l, m + lo + j) : vzero();
            vstore_lanes(sc + j, l, vadd(vmul(vload_lanes(l, sc + j), scale), add));
        }
    } else
        for (int64_t j = 0; j < n; j++) {
            float s = sc[j] * a->scale;
            if (c && !c[(lo + j) * ck])
                s = a->fill;
            sc[j] = s + (m ? m[(lo + j) * mk] : 0.0f);
        }
    softmax_row(sc, (int)n);
    if (a->nan_to_zero)
        for (int64_t j = 0; j < n; j += VW) {
            const lanes_t l = first_lanes((int)(n - j));
            const vf p = vload_lanes(l, sc + j);
            vstore_lanes(sc + j, l, vselect(visnan(p), vzero(), p));
        }
    weighted_values(a, sc, a->v + b * a->vs[0] + kvh * a->vs[1], lo, n,
                    a->y + b * a->ys[0] + h * a->ys[1] + l * a->ys[2], a->ys[3]);
}

static void rows_task(void *arg, int i0, int i1)
{
    rows_args *ra = (rows_args *)arg;
    const attention_t *a = ra->a;
    const int64_t total = a->B * a->Hq * a->L;
    float local[2048], qlocal[256];
    float *sc = a->S <= 2048 ? local : (float *)malloc((size_t)a->S * sizeof(float));
    float *qv = a->D <= 256 ? qlocal : (float *)malloc((size_t)a->D * sizeof(float));
    if (!sc || !qv) {
        ra->failed = 1;
    } else {
        for (int part = i0; part < i1; part++)
            for (int64_t r = part; r < total; r += ra->parts)
                row(a, r, sc, qv);
    }
    if (sc && sc != local)
        free(sc);
    if (qv && qv != qlocal)
        free(qv);
}

int attention_run(const attention_t *a, int parts)
{
    const int64_t total = a->B * a->Hq * a->L;
    if (total <= 0 || a->S <= 0)
        return 0;
    if (parts < 1)
        parts = 1;
    if (parts > total)
        parts = (int)total;
    rows_args ra = {a, parts, 0};
    if (parts > 1)
        he_parallel(rows_task, &ra, parts, parts);
    else
        rows_task(&ra, 0, 1);
    return ra.failed;
}

HE_API int he_attention_mt(const float *q, const float *k, const float *v, const float *m,
                           const void *c, float *y, const long *dims, const long *strides,
                           float scale, float fill, int nan_to_zero, int parts)
{
    attention_t a = {q, k, v, m, (const uint8_t *)c, y, dims[0], dims[1], dims[2], dims[3],
                     dims[4], dims[5], {0}, {0}, {0}, {0}, {0}, {0}, scale, fill, nan_to_zero};
    for (int i = 0; i < 4; i++) {
        a.qs[i] = strides[i];
        a.ks[i] = strides[4 + i];
        a.vs[i] = strides[8 + i];
        a.ms[i] = strides[12 + i];
        a.cs[i] = strides[16 + i];
        a.ys[i] = strides[20 + i];
    }
    return attention_run(&a, parts);
}
