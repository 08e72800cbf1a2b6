/* nanopaged's CPU kernels for bfloat16 models: one pass over each op's rows where torch runs
 * several ops (and the allocations between them). Compiled at first use by cpu_native.py with
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
    const float *qf, const bf16 *k_cache, const bf16 *v_cache, const int32_t *table,
    int64_t len, int64_t block_size, int64_t row, int64_t kh, int64_t group, int64_t dim,
    float *scores, float *row_f, float *acc, bf16 *o) {
    for (int64_t start = 0, j = 0; start < len; start += block_size, j++) {
        int64_t n = len - start < block_size ? len - start : block_size;
        const bf16 *kb = k_cache + (int64_t)table[j] * block_size * row + kh * dim;
        for (int64_t t = 0; t < n; t++) {
            const bf16 *kr = kb + t * row;
#pragma omp simd
            for (int64_t i = 0; i < dim; i++) row_f[i] = f32(kr[i]);
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
        const bf16 *vb = v_cache + (int64_t)table[j] * block_size * row + kh * dim;
        for (int64_t t = 0; t < n; t++) {
            const bf16 *vr = vb + t * row;
#pragma omp simd
            for (int64_t i = 0; i < dim; i++) row_f[i] = f32(vr[i]);
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
        for (int64_t i = 0; i < dim; i++) o[g * dim + i] = round_bf16(acc[g * dim + i]);
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
    const bf16 *cache, const int32_t *table, int64_t start, int64_t len, int64_t block_size,
    int64_t row, int64_t kh, int64_t nv, v16f rows[CHUNK][MAX_DIM_VECS]) {
    int64_t in_block = start % block_size;
    int64_t n = block_size - in_block;
    n = n < CHUNK ? n : CHUNK;
    n = n < len - start ? n : len - start;
    const bf16 *base =
        cache + ((int64_t)table[start / block_size] * block_size + in_block) * row + kh * nv * 16;
    for (int64_t t = 0; t < n; t++)
        for (int64_t c = 0; c < nv; c++) rows[t][c] = load_bf16x16(base + t * row + c * 16);
    return n;
}

/* decode_head for dim a multiple of 16 (nv = dim / 16 vectors), chunks of <= 16 tokens. */
static inline __attribute__((always_inline)) void decode_head_vec(
    const float *qf, const bf16 *k_cache, const bf16 *v_cache, const int32_t *table,
    int64_t len, int64_t block_size, int64_t row, int64_t kh, int64_t group, int64_t nv,
    float *scores, float *acc, bf16 *o) {
    int64_t dim = nv * 16;
    v16f rows[CHUNK][MAX_DIM_VECS];
    v16f part[CHUNK];
    for (int64_t start = 0; start < len;) {
        int64_t n = load_chunk(k_cache, table, start, len, block_size, row, kh, nv, rows);
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
        int64_t n = load_chunk(v_cache, table, start, len, block_size, row, kh, nv, rows);
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
        for (int64_t i = 0; i < dim; i++) o[g * dim + i] = round_bf16(acc[g * dim + i]);
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

/* Attention of sequence b's query heads qb (bf16, head stride sqh) over its cached tokens,
 * into out [heads, dim]: each KV head's group through decode_head(_vec). */
static void attend(const bf16 *qb, int64_t sqh, const bf16 *k_cache, const bf16 *v_cache,
                   const int32_t *table, int64_t len, int64_t heads, int64_t kv_heads,
                   int64_t dim, int64_t block_size, float scale, float *scratch,
                   int64_t max_len, bf16 *out) {
    int64_t group = heads / kv_heads, row = kv_heads * dim;
    float *scores = scratch;               /* [group, len] */
    float *qf = scratch + group * max_len; /* [group, dim] */
    float *acc = qf + group * dim;         /* [group, dim] */
    float *row_f = acc + group * dim;      /* [dim] */
    for (int64_t kh = 0; kh < kv_heads; kh++) {
        bf16 *o = out + kh * group * dim;
        if (len <= 0) {
            memset(o, 0, (size_t)(group * dim) * sizeof(bf16));
            continue;
        }
        for (int64_t g = 0; g < group; g++) {
            const bf16 *qh = qb + (kh * group + g) * sqh;
#pragma omp simd
            for (int64_t i = 0; i < dim; i++) qf[g * dim + i] = f32(qh[i]) * scale;
        }
        if (dim == 64)
            decode_head_vec(qf, k_cache, v_cache, table, len, block_size, row, kh, group, 4,
                            scores, acc, o);
        else if (dim == 128)
            decode_head_vec(qf, k_cache, v_cache, table, len, block_size, row, kh, group, 8,
                            scores, acc, o);
        else if (dim % 16 == 0 && dim <= 16 * MAX_DIM_VECS)
            decode_head_vec(qf, k_cache, v_cache, table, len, block_size, row, kh, group,
                            dim / 16, scores, acc, o);
        else
            decode_head(qf, k_cache, v_cache, table, len, block_size, row, kh, group, dim,
                        scores, row_f, acc, o);
    }
}

/* Decode attention over the paged cache, paged_decode_ref's result in fp32 arithmetic:
 * for each sequence and KV head, the scores of its query group against every cached token
 * (the fp32 dot of bf16 values, times scale), softmax in fp32, the probabilities times V
 * summed in fp32, rounded once. q [batch, heads, dim] with strides (sqb, sqh, 1); caches
 * [blocks, block_size, kv_heads, dim] contiguous; block_tables [batch, *] (stride sbt);
 * `width` entries of num_blocks ids each; out contiguous [batch, heads, dim]; scratch:
 * scratch_len floats, at least group * (longest context + 2 * dim) + dim. An empty context
 * writes zeros, as the kernel does. Returns 0; nothing is written and -1 is returned when the
 * scratch is too small, -2 when a context needs more table entries than there are or a block
 * id it reads is out of range. */
int np_paged_decode(const bf16 *q, int64_t sqb, int64_t sqh, const bf16 *k_cache,
                    const bf16 *v_cache, int64_t num_blocks, const int32_t *block_tables,
                    int64_t sbt, int64_t width, const int32_t *context_lens, int64_t batch,
                    int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size,
                    float scale, float *scratch, int64_t scratch_len, bf16 *out) {
    int64_t max_len;
    if (check_tables(block_tables, sbt, width, context_lens, batch, block_size, num_blocks,
                     &max_len))
        return -2;
    if ((heads / kv_heads) * (max_len + 2 * dim) + dim > scratch_len) return -1;
    for (int64_t b = 0; b < batch; b++)
        attend(q + b * sqb, sqh, k_cache, v_cache, block_tables + b * sbt, context_lens[b],
               heads, kv_heads, dim, block_size, scale, scratch, max_len, out + b * heads * dim);
    return 0;
}

/* A decode step's attention block after the qkv projection, in one call: rotary on q and k
 * at each sequence's position (np_rotate's arithmetic, the fp32 tables cos/sin [*, dim]
 * rounded to bf16 as rotary_tables_ref does), k and v stored at the sequence's slot (-1
 * skips), then np_paged_decode over the cache with the rotated q. q [batch, heads, dim],
 * k and v [batch, kv_heads, dim], each head's row contiguous, strides (s*t, s*h). Checks as
 * np_paged_decode's, plus -3 when a position is outside [0, max_position) or a slot outside
 * [-1, num_blocks * block_size); the scratch also holds heads * dim more floats. */
int np_rotary_decode(const bf16 *q, int64_t sqt, int64_t sqh, const bf16 *k, int64_t skt,
                     int64_t skh, const bf16 *v, int64_t svt, int64_t svh,
                     const int64_t *positions, const float *cos, const float *sin,
                     int64_t max_position, const int64_t *slots, bf16 *k_cache,
                     bf16 *v_cache, int64_t num_blocks, const int32_t *block_tables,
                     int64_t sbt, int64_t width, const int32_t *context_lens, int64_t batch,
                     int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size,
                     float scale, float *scratch, int64_t scratch_len, bf16 *out) {
    int64_t max_len, half = dim / 2, row = kv_heads * dim;
    if (check_tables(block_tables, sbt, width, context_lens, batch, block_size, num_blocks,
                     &max_len))
        return -2;
    for (int64_t b = 0; b < batch; b++)
        if (positions[b] < 0 || positions[b] >= max_position || slots[b] < -1 ||
            slots[b] >= num_blocks * block_size)
            return -3;
    int64_t attend_len = (heads / kv_heads) * (max_len + 2 * dim) + dim;
    if (attend_len + (heads + 1) * dim > scratch_len) return -1;
    /* rotated q heads of one sequence (bf16) and this position's table rows, after attend's */
    bf16 *q_rot = (bf16 *)(scratch + attend_len);
    bf16 *tables = q_rot + heads * dim; /* cos [dim], then sin with its first half negated */
    bf16 *k_row = tables + 2 * dim;     /* [dim] */
    for (int64_t b = 0; b < batch; b++) {
        const float *c32 = cos + positions[b] * dim, *s32 = sin + positions[b] * dim;
        bf16 *c = tables, *sn = tables + dim;
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) {
            c[i] = round_bf16(c32[i]);
            sn[i] = round_bf16(s32[i]);
        }
        for (int64_t i = 0; i < half; i++) sn[i] ^= 0x8000; /* -x, exactly */
        np_rotate(q + b * sqt, 0, sqh, c, sn, 0, q_rot, 1, heads, dim);
        if (slots[b] >= 0) {
            for (int64_t h = 0; h < kv_heads; h++) {
                np_rotate(k + b * skt + h * skh, 0, 0, c, sn, 0, k_row, 1, 1, dim);
                memcpy(k_cache + slots[b] * row + h * dim, k_row, (size_t)dim * sizeof(bf16));
                memcpy(v_cache + slots[b] * row + h * dim, v + b * svt + h * svh,
                       (size_t)dim * sizeof(bf16));
            }
        }
        attend(q_rot, dim, k_cache, v_cache, block_tables + b * sbt, context_lens[b], heads,
               kv_heads, dim, block_size, scale, scratch, max_len, out + b * heads * dim);
    }
    return 0;
}
