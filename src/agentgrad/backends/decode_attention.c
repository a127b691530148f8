/* One decode step's attention for a layer of a Llama-family model, fused: rotary embedding of this token's
 * query and key, the key/value written into the slot cache, softmax attention of each query head over its row's
 * own keys. Built at first use by agentgrad/backends/native.py (cc -O3 -march=native) and called through ctypes.
 *
 * Why: on CPU a decode step of the tiny model runs ~30 small torch ops per layer, and its attention is a batched
 * matmul of (B x kv_heads) tiny matrices whose per-matrix overhead costs more than the arithmetic. Here a row's
 * keys and values are streamed once for all query heads of a kv head, and a row attends over its own length
 * only, so its floats do not depend on which rows share the step or on how long they are.
 *
 * Numerics: fp32 throughout; exp is Cephes' single-precision polynomial (max relative error ~2e-7 on the range
 * used: scores minus their maximum, <= 0). Portable C with GCC/Clang vector extensions, no intrinsics. */

#include <math.h>
#include <stdint.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));
typedef int32_t i8 __attribute__((vector_size(32)));

static inline v8 load8(const float *p) { v8 a; memcpy(&a, p, sizeof a); return a; }
static inline void store8(float *p, v8 a) { memcpy(p, &a, sizeof a); }
static inline v8 splat(float x) { v8 a = {x, x, x, x, x, x, x, x}; return a; }

static inline v8 select8(i8 mask, v8 a, v8 b) {
    i8 ia, ib, r;
    v8 out;
    memcpy(&ia, &a, sizeof ia);
    memcpy(&ib, &b, sizeof ib);
    r = (ia & mask) | (ib & ~mask);
    memcpy(&out, &r, sizeof out);
    return out;
}

static inline float hsum8(v8 a) { return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7])); }

/* exp(x) for x <= 0; 0 below -87.3 (where expf underflows to denormals anyway). */
static inline v8 exp8(v8 x) {
    const v8 lo = splat(-87.3f);
    i8 under = x < lo;
    x = select8(under, lo, x);
    v8 fx = x * 1.44269504088896341f + 0.5f;
    i8 n = __builtin_convertvector(fx, i8);
    v8 fn = __builtin_convertvector(n, v8);
    fn = select8(fn > fx, fn - 1.0f, fn); /* floor: the conversion truncates toward zero */
    n = __builtin_convertvector(fn, i8);
    x = x - fn * 0.693359375f - fn * -2.12194440e-4f; /* x - n ln2, ln2 split in two for precision */
    v8 z = x * x;
    v8 y = splat(1.9875691500E-4f);
    y = y * x + 1.3981999507E-3f;
    y = y * x + 8.3334519073E-3f;
    y = y * x + 4.1665795894E-2f;
    y = y * x + 1.6666665459E-1f;
    y = y * x + 5.0000001201E-1f;
    y = y * z + x + 1.0f;
    i8 bits = (n + 127) << 23;
    v8 scale;
    memcpy(&scale, &bits, sizeof scale);
    return select8(under, splat(0.0f), y * scale);
}

/* out[i] = x[i] cos[i] + rotate_half(x)[i] sin[i], rotate_half(x) = (-x[h:], x[:h]) (HF's rotate-half RoPE). */
static inline void rope(const float *x, const float *cos, const float *sin, int64_t d, float *out) {
    int64_t half = d / 2;
    for (int64_t i = 0; i < half; i++) out[i] = x[i] * cos[i] - x[i + half] * sin[i];
    for (int64_t i = half; i < d; i++) out[i] = x[i] * cos[i] + x[i - half] * sin[i];
}

enum { MAX_GROUP = 16, MAX_HEAD_DIM = 256 };

#if defined(__clang__)
#define SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUF(a, b, ...) __builtin_shuffle(a, b, (i8){__VA_ARGS__})
#endif

/* Pairwise sums of neighbours, a's and b's interleaved per 128-bit half (x86's hadd). */
static inline v8 hadd8(v8 a, v8 b) {
    return SHUF(a, b, 0, 2, 8, 10, 4, 6, 12, 14) + SHUF(a, b, 1, 3, 9, 11, 5, 7, 13, 15);
}

/* The lane sums of r[0..7], as one vector: out[p] = sum of r[p]'s lanes. */
static inline v8 reduce8x8(const v8 *r) {
    v8 u0 = hadd8(hadd8(r[0], r[1]), hadd8(r[2], r[3]));
    v8 u1 = hadd8(hadd8(r[4], r[5]), hadd8(r[6], r[7]));
    return SHUF(u0, u1, 0, 1, 2, 3, 8, 9, 10, 11) + SHUF(u0, u1, 4, 5, 6, 7, 12, 13, 14, 15);
}

/* One (row, kv head): the queries q (G, D8*8), RoPE already applied, over L keys/values, positions below `sh` read
 * from Ks, Vs (the same numbers, in another slot: see decode_attention) and the rest from K, V (each (C, D8*8)).
 * G and D8 are compile-time constants in the common cases (`attend` below) so that q stays in registers. */
static inline __attribute__((always_inline)) void attend_head(const float *q, const float *K, const float *V,
                                                              const float *Ks, const float *Vs, int64_t sh,
                                                              int64_t L, int64_t C, float *scratch, float *o,
                                                              const int64_t G, const int64_t D8) {
    const int64_t d = D8 * 8;
    float m[MAX_GROUP], inv[MAX_GROUP];
    for (int64_t j = 0; j < G; j++) {
        const float *qq = q + j * d;
        float *sc = scratch + j * C;
        v8 mx = splat(-INFINITY);
        int64_t l = 0;
        for (; l + 8 <= L; l += 8) {
            v8 r[8];
            for (int64_t p = 0; p < 8; p++) {
                const float *kk = (l + p < sh ? Ks : K) + (l + p) * d;
                v8 a = load8(qq) * load8(kk);
                for (int64_t i = 1; i < D8; i++) a += load8(qq + 8 * i) * load8(kk + 8 * i);
                r[p] = a;
            }
            v8 sv = reduce8x8(r);
            store8(sc + l, sv);
            mx = select8(sv > mx, sv, mx);
        }
        float mj = -INFINITY;
        for (int64_t i = 0; i < 8; i++) mj = mx[i] > mj ? mx[i] : mj;
        for (; l < L; l++) {
            const float *kk = (l < sh ? Ks : K) + l * d;
            v8 a = load8(qq) * load8(kk);
            for (int64_t i = 1; i < D8; i++) a += load8(qq + 8 * i) * load8(kk + 8 * i);
            sc[l] = hsum8(a);
            mj = sc[l] > mj ? sc[l] : mj;
        }
        m[j] = mj;
    }
    for (int64_t j = 0; j < G; j++) {
        float *e = scratch + j * C;
        v8 mj = splat(m[j]), sum8 = splat(0.0f);
        int64_t l = 0;
        for (; l + 8 <= L; l += 8) {
            v8 x = exp8(load8(e + l) - mj);
            store8(e + l, x);
            sum8 += x;
        }
        float sum = hsum8(sum8);
        if (l < L) {
            float tail[8], got[8];
            for (int64_t i = 0; i < 8; i++) tail[i] = l + i < L ? e[l + i] - m[j] : -INFINITY;
            store8(got, exp8(load8(tail)));
            for (int64_t i = 0; l + i < L; i++) {
                e[l + i] = got[i];
                sum += got[i];
            }
        }
        inv[j] = 1.0f / sum;
    }
    v8 acc[MAX_GROUP * MAX_HEAD_DIM / 8];
    for (int64_t x = 0; x < G * D8; x++) acc[x] = splat(0.0f);
    for (int64_t l = 0; l < L; l++) {
        const float *vv = (l < sh ? Vs : V) + l * d;
        for (int64_t i = 0; i < D8; i++) {
            v8 b = load8(vv + 8 * i);
            for (int64_t j = 0; j < G; j++) acc[j * D8 + i] += scratch[j * C + l] * b;
        }
    }
    for (int64_t j = 0; j < G; j++)
        for (int64_t i = 0; i < D8; i++) store8(o + j * d + 8 * i, acc[j * D8 + i] * inv[j]);
}

#define CASE(g_, d8_) \
    if (G == g_ && D8 == d8_) { attend_head(q, K, V, Ks, Vs, sh, L, C, scratch, o, g_, d8_); return; }

static void attend(const float *q, const float *K, const float *V, const float *Ks, const float *Vs, int64_t sh,
                   int64_t L, int64_t C, float *scratch, float *o, int64_t G, int64_t D8) {
    CASE(1, 4) CASE(2, 4) CASE(4, 4) CASE(1, 8) CASE(2, 8) CASE(4, 8) CASE(7, 8) CASE(8, 8)
    CASE(1, 16) CASE(2, 16) CASE(4, 16) CASE(7, 16) CASE(8, 16)
    attend_head(q, K, V, Ks, Vs, sh, L, C, scratch, o, G, D8);
}

/* Returns 0, or -1 when a shape is outside what this kernel handles (the caller checks `supported` first).
 *
 * qkv      (N, (nh + 2 kvh) d)  this step's projections, queries first (the attention scale folded into them),
 *                               then keys, then values
 * cos, sin (P, d)               RoPE tables; row p is position p
 * slots    (N,)                 each row's slot in the cache
 * pos      (N,)                 each row's position: its key/value goes there and it attends to 0..pos
 * src, shared (N,)              positions below shared[n] are read from slot src[n] instead: a slot that holds
 *                               the same keys/values there (GRPO's samples of one prompt), so a group's prompt is
 *                               streamed from memory once and from cache by the rest (src = slot, shared = 0: none)
 * k, v     (S, kvh, C, d)       the layer's slot cache, contiguous
 * out      (N, nh d)
 * scratch  (nh / kvh, C)        per-call workspace */
int decode_attention(const float *qkv, const float *cos, const float *sin, const int64_t *slots,
                     const int64_t *pos, const int64_t *src, const int64_t *shared, float *k, float *v, float *out,
                     int64_t N, int64_t nh, int64_t kvh, int64_t d, int64_t C, float *scratch) {
    int64_t g = nh / kvh, width = (nh + 2 * kvh) * d;
    if (g > MAX_GROUP || d > MAX_HEAD_DIM || d % 8 != 0 || nh % kvh != 0) return -1;
    float q[MAX_GROUP * MAX_HEAD_DIM];
    for (int64_t n = 0; n < N; n++) {
        int64_t p = pos[n];
        const float *row = qkv + n * width, *c = cos + p * d, *s = sin + p * d;
        for (int64_t h = 0; h < kvh; h++) {
            float *K = k + (slots[n] * kvh + h) * C * d, *V = v + (slots[n] * kvh + h) * C * d;
            const float *Ks = k + (src[n] * kvh + h) * C * d, *Vs = v + (src[n] * kvh + h) * C * d;
            rope(row + (nh + h) * d, c, s, d, K + p * d);
            memcpy(V + p * d, row + (nh + kvh + h) * d, d * sizeof(float));
            for (int64_t j = 0; j < g; j++) rope(row + (h * g + j) * d, c, s, d, q + j * d);
            attend(q, K, V, Ks, Vs, shared[n], p + 1, C, scratch, out + n * nh * d + h * g * d, g, d / 8);
        }
    }
    return 0;
}
