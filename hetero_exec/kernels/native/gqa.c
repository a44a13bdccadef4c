/* onnxruntime's GroupQueryAttention (com.microsoft) in a bound program, for a past and
 * present that are one buffer (a generator's cache: kv_cache.share_buffer), as
 * kernels/contrib/attention.py defines it: batch b's keys are its first seqlens_k[b] + 1
 * positions; a first prompt (S equal to total_sequence_length) starts at position 0,
 * later calls append their S tokens at seqlens_k[b] + 1 - S. The new keys (rotated when
 * do_rotary) and values are written into the buffers in place; each query row attends to
 * the keys it may see (causal, within the local window), never to the masked positions
 * past them, so a decode step costs the context it has, not the buffer's capacity.
 *
 * Record: t0 output (B, S, N*H), t1 query (B, S, N*H, or packed (N + 2 Nkv) * H), t2 key
 * and t3 value (B, S, Nkv*H; buf -1 when packed), t4/t5 the key/value buffers
 * (B, Nkv, cap, H), t6 seqlens_k (int32, B); p0 B, p1 S, p2 N, p3 Nkv, p4 H, p5 cap,
 * p6 total, p7 packed, p8 do_rotary, p9 interleaved, p10/p11 and p12/p13 the cos and sin
 * caches' buffer and byte offset ((max_pos, rd / 2)), p14 max_pos, p15 local window
 * (<= 0: none), p16 rotary dim; f0 scale, f1 softcap (<= 0: none).
 *
 * Distinct past and present buffers (onnxruntime's own layout, a past fed each step) take
 * one OP_GQA_PAST record per buffer first: present gets each row's first past-length
 * positions of the past and zeros after its new ones, as onnxruntime writes them; OP_GQA
 * then runs over the present in place.
 *
 * OP_GQA_PAST record: t0 present (B, Nkv, cap, H), t1 past (B, Nkv, P, H; buf -1: none),
 * t2 seqlens_k (int32, B); p0 B, p1 S, p2 Nkv, p3 H, p4 cap, p5 P, p6 total. */
#include <math.h>

#include "program.h"

typedef struct {
    const he_op *o;
    void *const *bufs;
    const float *q, *cosc, *sinc;
    float *out;
    const float *kbuf, *vbuf;
    const int64_t *past;
    long q_row;
    int failed; /* a part found no memory for its scores */
} gqa_args;

/* x (rd values of a head) rotated at position pos into y (y may be x) */
static void rotate(const float *x, float *y, int64_t H, int64_t rd, int interleaved,
                   const float *cosc, const float *sinc, int64_t pos)
{
    const int64_t half = rd / 2;
    const float *c = cosc + pos * half, *s = sinc + pos * half;
    if (interleaved) {
        for (int64_t i = 0; i < half; i++) {
            float a = x[2 * i], b = x[2 * i + 1];
            y[2 * i] = a * c[i] - b * s[i];
            y[2 * i + 1] = a * s[i] + b * c[i];
        }
    } else {
        for (int64_t i = 0; i < half; i++) {
            float a = x[i], b = x[i + half];
            y[i] = a * c[i] - b * s[i];
            y[i + half] = a * s[i] + b * c[i];
        }
    }
    if (y != x)
        for (int64_t i = rd; i < H; i++)
            y[i] = x[i];
}

/* query rows of (b, h) pairs [i0, i1): scores, softmax, the weighted values */
static void attend_task(void *arg, int i0, int i1)
{
    const gqa_args *a = (const gqa_args *)arg;
    const he_op *o = a->o;
    const int64_t S = o->p[1], N = o->p[2], Nkv = o->p[3], H = o->p[4], cap = o->p[5];
    const int64_t total = o->p[6], window = o->p[15], rd = o->p[16];
    const float alpha = (float)o->f[0], softcap = (float)o->f[1];
    float qr[H > 0 ? H : 1];
    float local[1024], *scores = total <= 1024 ? local : (float *)malloc((size_t)total * sizeof(float));
    if (!scores) {
        ((gqa_args *)arg)->failed = 1;
        return;
    }
    for (int bh = i0; bh < i1; bh++) {
        const int64_t b = bh / N, h = bh % N, kvh = h / (N / Nkv);
        const float *K = a->kbuf + ((b * Nkv + kvh) * cap) * H;
        const float *V = a->vbuf + ((b * Nkv + kvh) * cap) * H;
        for (int64_t i = 0; i < S; i++) {
            const int64_t at = a->past[b] + i;
            const float *q = a->q + (b * S + i) * a->q_row + h * H;
            if (o->p[8]) {
                int64_t pos = at;
                if (S == total && at >= a->past[o->p[0] + b]) /* a first prompt's padding */
                    pos = 1;
                rotate(q, qr, H, rd, (int)o->p[9], a->cosc, a->sinc, pos);
                q = qr;
            }
            int64_t lo = window > 0 ? at - window + 1 : 0, hi = at < total - 1 ? at : total - 1;
            if (lo < 0)
                lo = 0;
            const int n = (int)(hi - lo + 1);
            rows_scores(q, K + lo * H, H, H, n, scores);
            for (int j = 0; j < n; j++) {
                float sc = scores[j] * alpha;
                if (softcap > 0.0f)
                    sc = tanhf(sc / softcap) * softcap;
                scores[j] = sc;
            }
            softmax_row(scores, n);
            rows_values(scores, V + lo * H, H, H, n, a->out + ((b * S + i) * N + h) * H, 1);
        }
    }
    if (scores != local)
        free(scores);
}

typedef struct {
    const he_op *o;
    char *present;
    const char *past;
    const int64_t *past_len;
} past_args;

/* (b, kv head) pairs [i0, i1): the past's valid rows, zeros past the new ones */
static void past_task(void *arg, int i0, int i1)
{
    const past_args *a = (const past_args *)arg;
    const he_op *o = a->o;
    const int64_t S = o->p[1], Nkv = o->p[2], cap = o->p[4], P = o->p[5];
    const size_t row = (size_t)o->p[3] * (size_t)dtype_size(o->t[0].dtype);
    for (int i = i0; i < i1; i++) {
        const int64_t n = a->past_len[i / Nkv];
        char *dst = a->present + (size_t)i * (size_t)cap * row;
        if (n)
            memcpy(dst, a->past + (size_t)i * (size_t)P * row, (size_t)n * row);
        memset(dst + (size_t)(n + S) * row, 0, (size_t)(cap - n - S) * row);
    }
}

int gqa_past_run(const he_op *o, void *const *bufs)
{
    const int64_t B = o->p[0], S = o->p[1], Nkv = o->p[2], cap = o->p[4], P = o->p[5];
    const int32_t *seqlens = (const int32_t *)tensor_at(bufs, &o->t[2]);
    int64_t past_len[B > 0 ? B : 1];
    for (int64_t b = 0; b < B; b++) { /* as gqa_run reads the lengths */
        past_len[b] = S == o->p[6] ? 0 : (int64_t)seqlens[b] + 1 - S;
        if (past_len[b] < 0 || past_len[b] > P || past_len[b] + S > cap)
            return E_CAPACITY;
    }
    past_args a = {o, (char *)tensor_at(bufs, &o->t[0]),
                   o->t[1].buf < 0 ? NULL : tensor_at(bufs, &o->t[1]), past_len};
    if (o->parts > 1)
        he_parallel(past_task, &a, (int)(B * Nkv), o->parts);
    else
        past_task(&a, 0, (int)(B * Nkv));
    return E_NONE;
}

int gqa_run(const he_op *o, void *const *bufs)
{
    const int64_t B = o->p[0], S = o->p[1], N = o->p[2], Nkv = o->p[3], H = o->p[4];
    const int64_t cap = o->p[5], total = o->p[6], packed = o->p[7], rd = o->p[16];
    const int32_t *seqlens = (const int32_t *)tensor_at(bufs, &o->t[6]);
    const float *query = (const float *)tensor_at(bufs, &o->t[1]);
    const float *cosc = NULL, *sinc = NULL;
    if (o->p[8]) {
        cosc = (const float *)((char *)bufs[o->p[10]] + o->p[11]);
        sinc = (const float *)((char *)bufs[o->p[12]] + o->p[13]);
    }
    float *kbuf = (float *)tensor_at(bufs, &o->t[4]), *vbuf = (float *)tensor_at(bufs, &o->t[5]);
    const long q_row = packed ? (N + 2 * Nkv) * H : N * H;
    const float *key = packed ? query + N * H : (const float *)tensor_at(bufs, &o->t[2]);
    const float *val = packed ? query + (N + Nkv) * H : (const float *)tensor_at(bufs, &o->t[3]);
    const long kv_row = packed ? q_row : Nkv * H;
    int64_t past[2 * B > 0 ? 2 * B : 1]; /* each row's past length, then its length */
    const int first = S == total;
    for (int64_t b = 0; b < B; b++) {
        const int64_t len = (int64_t)seqlens[b] + 1;
        past[b] = first ? 0 : len - S;
        past[B + b] = len;
        if (past[b] < 0 || past[b] + S > cap || past[b] + S > total)
            return E_CAPACITY;
        if (o->p[8] && (first ? S : past[b] + S) > o->p[14])
            return E_INDEX;
    }
    /* the new keys (rotated) and values into the buffers at each row's past length */
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = 0; i < S; i++) {
            int64_t at = past[b] + i, pos = at;
            if (first && at >= past[B + b])
                pos = 1;
            for (int64_t h = 0; h < Nkv; h++) {
                const float *k = key + (b * S + i) * kv_row + h * H;
                const float *v = val + (b * S + i) * kv_row + h * H;
                float *kd = kbuf + ((b * Nkv + h) * cap + at) * H;
                float *vd = vbuf + ((b * Nkv + h) * cap + at) * H;
                if (o->p[8])
                    rotate(k, kd, H, rd, (int)o->p[9], cosc, sinc, pos);
                else
                    memcpy(kd, k, (size_t)H * sizeof(float));
                memcpy(vd, v, (size_t)H * sizeof(float));
            }
        }
    gqa_args a = {o, bufs, query, cosc, sinc, (float *)tensor_at(bufs, &o->t[0]), kbuf, vbuf,
                  past, q_row, 0};
    if (o->parts > 1)
        he_parallel(attend_task, &a, (int)(B * N), o->parts);
    else
        attend_task(&a, 0, (int)(B * N));
    return a.failed ? E_MEMORY : E_NONE;
}
