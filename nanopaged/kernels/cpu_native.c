/* nanopaged's CPU kernels: for bfloat16 models, and for fp32 ones decode attention, the norms,
 * SiLU and the one-row GEMMs: one pass over each op's rows where torch runs several ops (and
 * the allocations between them). Compiled at first use by cpu_native.py with
 * the machine's C compiler; every function has a torch reference in nanopaged/kernels (the
 * tests' oracle, and the path taken when no compiler is found).
 *
 * bf16 values travel as uint16_t. Rounding to bf16 is round-to-nearest-even and NaN becomes
 * 0x7FC0, as torch rounds. Loops are written so that the compiler vectorizes them
 * (-O3 -march=native -fopenmp-simd): no calls but inline functions, selects instead of
 * branches. Single-threaded: these run on decode-sized rows, where waking threads costs more
 * than the work.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef uint16_t bf16;

static inline float f32(bf16 x) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)x << 16;
    return v.f;
}

static inline bf16 round_bf16(float f) {
    union { uint32_t u; float f; } v;
    v.f = f;
    uint32_t u = v.u;
    uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return (bf16)(((u & 0x7FFFFFFFu) > 0x7F800000u) ? 0x7FC0u : rounded);
}

/* Decode attention reads and writes bf16 (es == 2 bytes) or fp32 (es == 4) q, caches and
 * outputs through these; es is a constant at each exported entry point, and the functions taking
 * it are inlined there, so each dtype gets its own specialized loops. */
static inline float ld(const void *p, int64_t i, int es) {
    return es == 2 ? f32(((const bf16 *)p)[i]) : ((const float *)p)[i];
}

static inline void st(void *p, int64_t i, float v, int es) {
    if (es == 2)
        ((bf16 *)p)[i] = round_bf16(v);
    else
        ((float *)p)[i] = v;
}

static inline const void *at(const void *p, int64_t i, int es) {
    return (const char *)p + i * es;
}

/* v as it is, but opaque to the compiler: a product passed through here is rounded to fp32
 * before the sum it feeds (no fused multiply-add), as torch's separate ops round it. */
static inline float rounded(float v) {
    __asm__("" : "+m"(v));
    return v;
}

/* e^x in fp32 within ~2 ulp: x = n ln2 + r, |r| <= ln2 / 2, e^r by a degree-6 polynomial
 * (Cephes' coefficients), times 2^n built in the exponent bits. Overflow gives inf, deep
 * underflow 0. Used by decode attention's softmax. */
static inline float exp_f32(float x) {
    const float hi = 88.72283935546875f, lo = -87.33654022216797f;
    float xc = x > hi ? hi : (x < lo ? lo : x);
    const float magic = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    float t = xc * 1.44269504088896341f + magic;
    float n = t - magic;
    float r = xc - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    float y = p * (r * r) + r + 1.0f;
    union { uint32_t u; float f; } s;
    s.u = (uint32_t)((int32_t)n + 127) << 23;
    y = y * s.f;
    y = x > hi ? INFINITY : y;
    return x < -103.97f ? 0.0f : y;
}

/* out = rms_norm(x (+ residual)) * weight over rows of `hidden`, rms_norm_ref's arithmetic:
 * the sum (when residual) rounded to bf16 and written to new_residual, the norm in fp32,
 * rounded, times weight, rounded. Strides in elements between rows. */
void np_rms_norm(const bf16 *x, int64_t sx, const bf16 *residual, int64_t sr,
                 const bf16 *weight, bf16 *out, int64_t so, bf16 *new_residual, int64_t snr,
                 int64_t rows, int64_t hidden, float eps) {
    for (int64_t row = 0; row < rows; row++) {
        const bf16 *xr = x + row * sx;
        bf16 *o = out + row * so;
        if (residual) {
            const bf16 *rr = residual + row * sr;
            bf16 *nr = new_residual + row * snr;
#pragma omp simd
            for (int64_t i = 0; i < hidden; i++) nr[i] = round_bf16(f32(xr[i]) + f32(rr[i]));
            xr = nr;
        }
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < hidden; i++) {
            float v = f32(xr[i]);
            sum += v * v;
        }
        float inv = 1.0f / sqrtf(sum / (float)hidden + eps);
#pragma omp simd
        for (int64_t i = 0; i < hidden; i++)
            o[i] = round_bf16(f32(weight[i]) * f32(round_bf16(f32(xr[i]) * inv)));
    }
}

/* np_rms_norm on fp32 rows, rms_norm_ref's arithmetic: the sum (when residual) written to
 * new_residual, the norm in fp32, then times weight; only the squares add in another order
 * than torch's mean. */
void np_rms_norm_f32(const float *x, int64_t sx, const float *residual, int64_t sr,
                     const float *weight, float *out, int64_t so, float *new_residual,
                     int64_t snr, int64_t rows, int64_t hidden, float eps) {
    for (int64_t row = 0; row < rows; row++) {
        const float *xr = x + row * sx;
        float *o = out + row * so;
        if (residual) {
            const float *rr = residual + row * sr;
            float *nr = new_residual + row * snr;
#pragma omp simd
            for (int64_t i = 0; i < hidden; i++) nr[i] = xr[i] + rr[i];
            xr = nr;
        }
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < hidden; i++) sum += xr[i] * xr[i];
        float inv = 1.0f / sqrtf(sum / (float)hidden + eps);
        /* two products and no sum: nothing for -ffp-contract to fuse */
#pragma omp simd
        for (int64_t i = 0; i < hidden; i++) o[i] = weight[i] * (xr[i] * inv);
    }
}

/* silu(gate) * up over rows of [gate | up] (d each, stride sx between rows) into out (stride
 * so): silu as torch computes it in fp32, g / (1 + e^-g), then the product; e^x is exp_f32's
 * (within ~2 ulp of torch's). */
void np_silu_mul_f32(const float *x, int64_t sx, float *out, int64_t so, int64_t rows,
                     int64_t d) {
    for (int64_t row = 0; row < rows; row++) {
        const float *g = x + row * sx, *u = g + d;
        float *o = out + row * so;
#pragma omp simd
        for (int64_t i = 0; i < d; i++) o[i] = g[i] / (1.0f + exp_f32(-g[i])) * u[i];
    }
}

/* fp32 x W^T (+ bias) for one row: out[j] = x . w[j] (+ bias[j]), w's n rows of k elements
 * `sw` apart. At one row the GEMM is bound by reading w once: four rows at a time, each summed
 * in 8 lanes then across them (four independent sums keep loads in flight). The order of the
 * sums differs from a BLAS's (within fp32 rounding of the dot products). */
typedef float v8f __attribute__((vector_size(32)));

static inline v8f load_f32x8(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float lanes_sum(v8f v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

void np_gemv_f32(const float *x, const float *w, int64_t sw, const float *bias, float *out,
                 int64_t n, int64_t k) {
    int64_t kv = k & ~(int64_t)7, j = 0;
    for (; j + 4 <= n; j += 4) {
        const float *w0 = w + j * sw, *w1 = w0 + sw, *w2 = w1 + sw, *w3 = w2 + sw;
        v8f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        for (int64_t i = 0; i < kv; i += 8) {
            v8f xv = load_f32x8(x + i);
            a0 += xv * load_f32x8(w0 + i);
            a1 += xv * load_f32x8(w1 + i);
            a2 += xv * load_f32x8(w2 + i);
            a3 += xv * load_f32x8(w3 + i);
        }
        float s0 = lanes_sum(a0), s1 = lanes_sum(a1), s2 = lanes_sum(a2), s3 = lanes_sum(a3);
        for (int64_t i = kv; i < k; i++) {
            s0 += x[i] * w0[i];
            s1 += x[i] * w1[i];
            s2 += x[i] * w2[i];
            s3 += x[i] * w3[i];
        }
        out[j] = s0;
        out[j + 1] = s1;
        out[j + 2] = s2;
        out[j + 3] = s3;
    }
    for (; j < n; j++) {
        const float *w0 = w + j * sw;
        v8f a0 = {0};
        for (int64_t i = 0; i < kv; i += 8) a0 += load_f32x8(x + i) * load_f32x8(w0 + i);
        float s0 = lanes_sum(a0);
        for (int64_t i = kv; i < k; i++) s0 += x[i] * w0[i];
        out[j] = s0;
    }
    if (bias)
        for (j = 0; j < n; j++) out[j] += bias[j];
}

/* Rotate-half RoPE, rotate_ref's roundings: out = bf16(bf16(x * cos) + bf16(roll(x) * sin))
 * with sin's first half negated (rotary_tables_ref). x [tokens, heads, dim] with strides
 * (sxt, sxh, 1); cos, sin rows of `dim` per token (stride sct); out contiguous. */
void np_rotate(const bf16 *x, int64_t sxt, int64_t sxh, const bf16 *cos, const bf16 *sin,
               int64_t sct, bf16 *out, int64_t tokens, int64_t heads, int64_t dim) {
    int64_t half = dim / 2;
    for (int64_t t = 0; t < tokens; t++) {
        const bf16 *c = cos + t * sct, *s = sin + t * sct;
        for (int64_t h = 0; h < heads; h++) {
            const bf16 *xh = x + t * sxt + h * sxh;
            bf16 *o = out + (t * heads + h) * dim;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                float a = f32(round_bf16(f32(xh[i]) * f32(c[i])));
                float b = f32(round_bf16(f32(xh[i + half]) * f32(s[i])));
                o[i] = round_bf16(a + b);
            }
#pragma omp simd
            for (int64_t i = half; i < dim; i++) {
                float a = f32(round_bf16(f32(xh[i]) * f32(c[i])));
                float b = f32(round_bf16(f32(xh[i - half]) * f32(s[i])));
                o[i] = round_bf16(a + b);
            }
        }
    }
}

/* key/value rows of `row` contiguous elements (stride sk / sv between tokens) into the
 * caches' slots (num_slots of them); slot -1 skips the token. Returns 0, or -1 (nothing
 * written) when a slot is out of range. */
int np_store_kv(const bf16 *key, int64_t sk, const bf16 *value, int64_t sv, bf16 *k_cache,
                bf16 *v_cache, const int64_t *slots, int64_t tokens, int64_t row,
                int64_t num_slots) {
    for (int64_t t = 0; t < tokens; t++)
        if (slots[t] < -1 || slots[t] >= num_slots) return -1;
    for (int64_t t = 0; t < tokens; t++) {
        int64_t slot = slots[t];
        if (slot < 0) continue;
        memcpy(k_cache + slot * row, key + t * sk, (size_t)row * sizeof(bf16));
        memcpy(v_cache + slot * row, value + t * sv, (size_t)row * sizeof(bf16));
    }
    return 0;
}

/* Each of the `group` rows of `len` scores replaced by its softmax, in fp32. */
static inline void softmax_rows(float *scores, int64_t group, int64_t len) {
    for (int64_t g = 0; g < group; g++) {
        float *s = scores + g * len;
        float m = -INFINITY;
        for (int64_t t = 0; t < len; t++) m = s[t] > m ? s[t] : m;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < len; t++) {
            float e = exp_f32(s[t] - m);
            s[t] = e;
            sum += e;
        }
        float inv = 1.0f / sum;
#pragma omp simd
        for (int64_t t = 0; t < len; t++) s[t] *= inv;
    }
}

/* One sequence's KV head for np_paged_decode, any head size: scores of the head's `group`
 * queries (qf, fp32, pre-scaled) against the `len` cached tokens, softmax, then the weighted
 * sum of V into acc, rounded into o. */
static inline __attribute__((always_inline)) void decode_head(
    const float *qf, const void *k_cache, const void *v_cache, const int32_t *table,
    int64_t len, int64_t block_size, int64_t row, int64_t kh, int64_t group, int64_t dim,
    float *scores, float *row_f, float *acc, void *o, int es) {
    for (int64_t start = 0, j = 0; start < len; start += block_size, j++) {
        int64_t n = len - start < block_size ? len - start : block_size;
        const void *kb = at(k_cache, (int64_t)table[j] * block_size * row + kh * dim, es);
        for (int64_t t = 0; t < n; t++) {
            const void *kr = at(kb, t * row, es);
#pragma omp simd
            for (int64_t i = 0; i < dim; i++) row_f[i] = ld(kr, i, es);
            for (int64_t g = 0; g < group; g++) {
                const float *qg = qf + g * dim;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t i = 0; i < dim; i++) dot += qg[i] * row_f[i];
                scores[g * len + start + t] = dot;
            }
        }
    }
    softmax_rows(scores, group, len);
    memset(acc, 0, (size_t)(group * dim) * sizeof(float));
    for (int64_t start = 0, j = 0; start < len; start += block_size, j++) {
        int64_t n = len - start < block_size ? len - start : block_size;
        const void *vb = at(v_cache, (int64_t)table[j] * block_size * row + kh * dim, es);
        for (int64_t t = 0; t < n; t++) {
            const void *vr = at(vb, t * row, es);
#pragma omp simd
            for (int64_t i = 0; i < dim; i++) row_f[i] = ld(vr, i, es);
            for (int64_t g = 0; g < group; g++) {
                float p = scores[g * len + start + t];
                float *a = acc + g * dim;
#pragma omp simd
                for (int64_t i = 0; i < dim; i++) a[i] += p * row_f[i];
            }
        }
    }
    for (int64_t g = 0; g < group; g++) {
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) st(o, g * dim + i, acc[g * dim + i], es);
    }
}

/* Head sizes that are multiples of 16 take whole 16-float vectors (GCC/Clang vector
 * extensions: one AVX-512 register, or two AVX2 ones). The dots of a chunk of up to 16 tokens
 * are left as 16 vectors of partial sums and added across lanes together by a shuffle tree
 * (sum16), 15 shuffle-adds for 16 tokens instead of a horizontal sum per dot. */
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u32 __attribute__((vector_size(64)));
typedef uint16_t v16u16 __attribute__((vector_size(32)));
#define CHUNK 16
#define MAX_DIM_VECS 16 /* head_dim up to 256 */

static inline v16f load_bf16x16(const bf16 *p) {
    v16u16 h;
    memcpy(&h, p, sizeof h);
    v16u32 w = __builtin_convertvector(h, v16u32) << 16;
    v16f f;
    memcpy(&f, &w, sizeof f);
    return f;
}

static inline v16f load_f32x16(const float *p) {
    v16f f;
    memcpy(&f, p, sizeof f);
    return f;
}

/* Lane l of the result: lanes 2l and 2l + 1 of the concatenation [a, b], added. */
static inline v16f pair_sums(v16f a, v16f b) {
    const v16i even = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    const v16i odd = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
    return __builtin_shuffle(a, b, even) + __builtin_shuffle(a, b, odd);
}

/* Lane t of the result: the sum of p[t]'s 16 lanes. */
static inline v16f sum16(const v16f *p) {
    v16f s8[8], s4[4], s2[2];
    for (int j = 0; j < 8; j++) s8[j] = pair_sums(p[2 * j], p[2 * j + 1]);
    for (int j = 0; j < 4; j++) s4[j] = pair_sums(s8[2 * j], s8[2 * j + 1]);
    for (int j = 0; j < 2; j++) s2[j] = pair_sums(s4[2 * j], s4[2 * j + 1]);
    return pair_sums(s2[0], s2[1]);
}

/* Rows [start, start + n) of one KV head of a sequence's cache (K or V) as fp32 vectors, n
 * <= CHUNK tokens within one block; returns n. */
static inline __attribute__((always_inline)) int64_t load_chunk(
    const void *cache, const int32_t *table, int64_t start, int64_t len, int64_t block_size,
    int64_t row, int64_t kh, int64_t nv, v16f rows[CHUNK][MAX_DIM_VECS], int es) {
    int64_t in_block = start % block_size;
    int64_t n = block_size - in_block;
    n = n < CHUNK ? n : CHUNK;
    n = n < len - start ? n : len - start;
    const void *base = at(
        cache, ((int64_t)table[start / block_size] * block_size + in_block) * row + kh * nv * 16,
        es);
    for (int64_t t = 0; t < n; t++)
        for (int64_t c = 0; c < nv; c++) {
            const void *p = at(base, t * row + c * 16, es);
            rows[t][c] = es == 2 ? load_bf16x16(p) : load_f32x16(p);
        }
    return n;
}

/* decode_head for dim a multiple of 16 (nv = dim / 16 vectors), chunks of <= 16 tokens. */
static inline __attribute__((always_inline)) void decode_head_vec(
    const float *qf, const void *k_cache, const void *v_cache, const int32_t *table,
    int64_t len, int64_t block_size, int64_t row, int64_t kh, int64_t group, int64_t nv,
    float *scores, float *acc, void *o, int es) {
    int64_t dim = nv * 16;
    v16f rows[CHUNK][MAX_DIM_VECS];
    v16f part[CHUNK];
    for (int64_t start = 0; start < len;) {
        int64_t n = load_chunk(k_cache, table, start, len, block_size, row, kh, nv, rows, es);
        for (int64_t g = 0; g < group; g++) {
            const float *qg = qf + g * dim;
            for (int64_t t = 0; t < CHUNK; t++) {
                v16f p = {0};
                if (t < n)
                    for (int64_t c = 0; c < nv; c++) p += load_f32x16(qg + c * 16) * rows[t][c];
                part[t] = p;
            }
            v16f sums = sum16(part);
            float out[CHUNK];
            memcpy(out, &sums, sizeof out);
            for (int64_t t = 0; t < n; t++) scores[g * len + start + t] = out[t];
        }
        start += n;
    }
    softmax_rows(scores, group, len);
    memset(acc, 0, (size_t)(group * dim) * sizeof(float));
    for (int64_t start = 0; start < len;) {
        int64_t n = load_chunk(v_cache, table, start, len, block_size, row, kh, nv, rows, es);
        for (int64_t g = 0; g < group; g++) {
            v16f a[MAX_DIM_VECS];
            for (int64_t c = 0; c < nv; c++) a[c] = load_f32x16(acc + g * dim + c * 16);
            for (int64_t t = 0; t < n; t++) {
                float p = scores[g * len + start + t];
                for (int64_t c = 0; c < nv; c++) a[c] += p * rows[t][c];
            }
            memcpy(acc + g * dim, a, (size_t)nv * sizeof(v16f));
        }
        start += n;
    }
    for (int64_t g = 0; g < group; g++) {
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) st(o, g * dim + i, acc[g * dim + i], es);
    }
}

/* Checks np_paged_decode's and np_rotary_decode's tables: 0, or -2 when a context needs
 * more table entries than there are or a block id it reads is out of range; *max_len gets
 * the longest context. */
static int check_tables(const int32_t *block_tables, int64_t sbt, int64_t width,
                        const int32_t *context_lens, int64_t batch, int64_t block_size,
                        int64_t num_blocks, int64_t *max_len) {
    *max_len = 0;
    for (int64_t b = 0; b < batch; b++) {
        int64_t len = context_lens[b], used = (len + block_size - 1) / block_size;
        if (used > width) return -2;
        for (int64_t j = 0; j < used; j++)
            if (block_tables[b * sbt + j] < 0 || block_tables[b * sbt + j] >= num_blocks)
                return -2;
        if (len > *max_len) *max_len = len;
    }
    return 0;
}

/* Attention of sequence b's query heads qb (head stride sqh) over its cached tokens, into
 * out [heads, dim]: each KV head's group through decode_head(_vec). */
static inline __attribute__((always_inline)) void attend(
    const void *qb, int64_t sqh, const void *k_cache, const void *v_cache, const int32_t *table,
    int64_t len, int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size, float scale,
    float *scratch, int64_t max_len, void *out, int es) {
    int64_t group = heads / kv_heads, row = kv_heads * dim;
    float *scores = scratch;               /* [group, len] */
    float *qf = scratch + group * max_len; /* [group, dim] */
    float *acc = qf + group * dim;         /* [group, dim] */
    float *row_f = acc + group * dim;      /* [dim] */
    for (int64_t kh = 0; kh < kv_heads; kh++) {
        void *o = (char *)out + kh * group * dim * es;
        if (len <= 0) {
            memset(o, 0, (size_t)(group * dim * es));
            continue;
        }
        for (int64_t g = 0; g < group; g++) {
            const void *qh = at(qb, (kh * group + g) * sqh, es);
#pragma omp simd
            for (int64_t i = 0; i < dim; i++) qf[g * dim + i] = ld(qh, i, es) * scale;
        }
        if (dim == 64)
            decode_head_vec(qf, k_cache, v_cache, table, len, block_size, row, kh, group, 4,
                            scores, acc, o, es);
        else if (dim == 128)
            decode_head_vec(qf, k_cache, v_cache, table, len, block_size, row, kh, group, 8,
                            scores, acc, o, es);
        else if (dim % 16 == 0 && dim <= 16 * MAX_DIM_VECS)
            decode_head_vec(qf, k_cache, v_cache, table, len, block_size, row, kh, group,
                            dim / 16, scores, acc, o, es);
        else
            decode_head(qf, k_cache, v_cache, table, len, block_size, row, kh, group, dim,
                        scores, row_f, acc, o, es);
    }
}

/* Decode attention over the paged cache, paged_decode_ref's result in fp32 arithmetic:
 * for each sequence and KV head, the scores of its query group against every cached token
 * (the fp32 dot, times scale), softmax in fp32, the probabilities times V summed in fp32,
 * rounded once to bf16 (a bf16 cache). q [batch, heads, dim] with strides (sqb, sqh, 1);
 * caches [blocks, block_size, kv_heads, dim] contiguous; block_tables [batch, *] (stride sbt);
 * `width` entries of num_blocks ids each; out contiguous [batch, heads, dim]; scratch:
 * scratch_len floats, at least group * (longest context + 2 * dim) + dim. An empty context
 * writes zeros, as the kernel does. Returns 0; nothing is written and -1 is returned when the
 * scratch is too small, -2 when a context needs more table entries than there are or a block
 * id it reads is out of range. */
static inline __attribute__((always_inline)) int paged_decode(
    const void *q, int64_t sqb, int64_t sqh, const void *k_cache, const void *v_cache,
    int64_t num_blocks, const int32_t *block_tables, int64_t sbt, int64_t width,
    const int32_t *context_lens, int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim,
    int64_t block_size, float scale, float *scratch, int64_t scratch_len, void *out, int es) {
    int64_t max_len;
    if (check_tables(block_tables, sbt, width, context_lens, batch, block_size, num_blocks,
                     &max_len))
        return -2;
    if ((heads / kv_heads) * (max_len + 2 * dim) + dim > scratch_len) return -1;
    for (int64_t b = 0; b < batch; b++)
        attend(at(q, b * sqb, es), sqh, k_cache, v_cache, block_tables + b * sbt,
               context_lens[b], heads, kv_heads, dim, block_size, scale, scratch, max_len,
               (char *)out + b * heads * dim * es, es);
    return 0;
}

/* paged_decode on bf16 tensors. */
int np_paged_decode(const bf16 *q, int64_t sqb, int64_t sqh, const bf16 *k_cache,
                    const bf16 *v_cache, int64_t num_blocks, const int32_t *block_tables,
                    int64_t sbt, int64_t width, const int32_t *context_lens, int64_t batch,
                    int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size,
                    float scale, float *scratch, int64_t scratch_len, bf16 *out) {
    return paged_decode(q, sqb, sqh, k_cache, v_cache, num_blocks, block_tables, sbt, width,
                        context_lens, batch, heads, kv_heads, dim, block_size, scale, scratch,
                        scratch_len, out, 2);
}

/* paged_decode on fp32 tensors. */
int np_paged_decode_f32(const float *q, int64_t sqb, int64_t sqh, const float *k_cache,
                        const float *v_cache, int64_t num_blocks, const int32_t *block_tables,
                        int64_t sbt, int64_t width, const int32_t *context_lens, int64_t batch,
                        int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size,
                        float scale, float *scratch, int64_t scratch_len, float *out) {
    return paged_decode(q, sqb, sqh, k_cache, v_cache, num_blocks, block_tables, sbt, width,
                        context_lens, batch, heads, kv_heads, dim, block_size, scale, scratch,
                        scratch_len, out, 4);
}

/* One head's row x rotated into out (both `dim` elements), rotate_ref's roundings: bf16 rounds
 * each product and the sum (np_rotate's arithmetic); fp32 rounds them too, as torch's separate
 * multiply and add do (no fused multiply-add). c and s: the table rows as fp32 values (s's first
 * half negated). */
static inline __attribute__((always_inline)) void rotate_row(const void *x, const float *c,
                                                             const float *s, void *out,
                                                             int64_t dim, int es) {
    int64_t half = dim / 2;
    for (int64_t i = 0; i < dim; i++) {
        float xi = ld(x, i, es), xr = ld(x, i < half ? i + half : i - half, es);
        if (es == 2)
            st(out, i, f32(round_bf16(xi * c[i])) + f32(round_bf16(xr * s[i])), es);
        else
            ((float *)out)[i] = rounded(xi * c[i]) + rounded(xr * s[i]);
    }
}

/* A decode step's attention block after the qkv projection, in one call: rotary on q and k
 * at each sequence's position (rotate_ref's arithmetic with rotary_tables_ref's tables, the
 * fp32 cos/sin [*, dim] rounded to bf16 for a bf16 model), k and v stored at the sequence's
 * slot (-1 skips), then paged_decode over the cache with the rotated q. q [batch, heads, dim],
 * k and v [batch, kv_heads, dim], each head's row contiguous, strides (s*t, s*h). Checks as
 * paged_decode's, plus -3 when a position is outside [0, max_position) or a slot outside
 * [-1, num_blocks * block_size); the scratch also holds (heads + 3) * dim more floats. */
static inline __attribute__((always_inline)) int rotary_decode(
    const void *q, int64_t sqt, int64_t sqh, const void *k, int64_t skt, int64_t skh,
    const void *v, int64_t svt, int64_t svh, const int64_t *positions, const float *cos,
    const float *sin, int64_t max_position, const int64_t *slots, void *k_cache, void *v_cache,
    int64_t num_blocks, const int32_t *block_tables, int64_t sbt, int64_t width,
    const int32_t *context_lens, int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim,
    int64_t block_size, float scale, float *scratch, int64_t scratch_len, void *out, int es) {
    int64_t max_len, half = dim / 2, row = kv_heads * dim;
    if (check_tables(block_tables, sbt, width, context_lens, batch, block_size, num_blocks,
                     &max_len))
        return -2;
    for (int64_t b = 0; b < batch; b++)
        if (positions[b] < 0 || positions[b] >= max_position || slots[b] < -1 ||
            slots[b] >= num_blocks * block_size)
            return -3;
    int64_t attend_len = (heads / kv_heads) * (max_len + 2 * dim) + dim;
    if (attend_len + (heads + 3) * dim > scratch_len) return -1;
    /* after attend's scratch: this position's table rows (cos [dim], then sin with its first
     * half negated), the rotated q heads of one sequence and one rotated k head */
    float *c = scratch + attend_len, *sn = c + dim;
    void *q_rot = sn + dim;
    void *k_row = (char *)q_rot + heads * dim * es;
    for (int64_t b = 0; b < batch; b++) {
        const float *c32 = cos + positions[b] * dim, *s32 = sin + positions[b] * dim;
        for (int64_t i = 0; i < dim; i++) {
            c[i] = es == 2 ? f32(round_bf16(c32[i])) : c32[i];
            sn[i] = es == 2 ? f32(round_bf16(s32[i])) : s32[i];
            sn[i] = i < half ? -sn[i] : sn[i]; /* -x, exactly */
        }
        for (int64_t h = 0; h < heads; h++)
            rotate_row(at(q, b * sqt + h * sqh, es), c, sn, (char *)q_rot + h * dim * es, dim,
                       es);
        if (slots[b] >= 0) {
            for (int64_t h = 0; h < kv_heads; h++) {
                rotate_row(at(k, b * skt + h * skh, es), c, sn, k_row, dim, es);
                memcpy((char *)k_cache + (slots[b] * row + h * dim) * es, k_row,
                       (size_t)(dim * es));
                memcpy((char *)v_cache + (slots[b] * row + h * dim) * es,
                       at(v, b * svt + h * svh, es), (size_t)(dim * es));
            }
        }
        attend(q_rot, dim, k_cache, v_cache, block_tables + b * sbt, context_lens[b], heads,
               kv_heads, dim, block_size, scale, scratch, max_len,
               (char *)out + b * heads * dim * es, es);
    }
    return 0;
}

/* rotary_decode on bf16 tensors. */
int np_rotary_decode(const bf16 *q, int64_t sqt, int64_t sqh, const bf16 *k, int64_t skt,
                     int64_t skh, const bf16 *v, int64_t svt, int64_t svh,
                     const int64_t *positions, const float *cos, const float *sin,
                     int64_t max_position, const int64_t *slots, bf16 *k_cache,
                     bf16 *v_cache, int64_t num_blocks, const int32_t *block_tables,
                     int64_t sbt, int64_t width, const int32_t *context_lens, int64_t batch,
                     int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size,
                     float scale, float *scratch, int64_t scratch_len, bf16 *out) {
    return rotary_decode(q, sqt, sqh, k, skt, skh, v, svt, svh, positions, cos, sin,
                         max_position, slots, k_cache, v_cache, num_blocks, block_tables, sbt,
                         width, context_lens, batch, heads, kv_heads, dim, block_size, scale,
                         scratch, scratch_len, out, 2);
}

/* rotary_decode on fp32 tensors. */
int np_rotary_decode_f32(const float *q, int64_t sqt, int64_t sqh, const float *k,
                         int64_t skt, int64_t skh, const float *v, int64_t svt, int64_t svh,
                         const int64_t *positions, const float *cos, const float *sin,
                         int64_t max_position, const int64_t *slots, float *k_cache,
                         float *v_cache, int64_t num_blocks, const int32_t *block_tables,
                         int64_t sbt, int64_t width, const int32_t *context_lens,
                         int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim,
                         int64_t block_size, float scale, float *scratch, int64_t scratch_len,
                         float *out) {
    return rotary_decode(q, sqt, sqh, k, skt, skh, v, svt, svh, positions, cos, sin,
                         max_position, slots, k_cache, v_cache, num_blocks, block_tables, sbt,
                         width, context_lens, batch, heads, kv_heads, dim, block_size, scale,
                         scratch, scratch_len, out, 4);
}
