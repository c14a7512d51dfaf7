/* One decode step of ChatTTS's GPT (a Llama body) for up to MAX_ROWS rows, with 4-bit weights:
   engines/q4step.py builds this file with the host's C compiler and calls it through ctypes.

   Weights come from engines/weightonly.py's Int4WeightLinear: w = (q - 8) * scale + zero per group of 32
   input features, scale and zero bfloat16. q is packed for 256-bit registers: a block of 64 inputs (two
   groups) is 16 words of four nibbles, nibble r of word j holding input r*8 + j of the block's first group
   (j < 8) or 32 + r*8 + (j-8) of its second (j >= 8). The input is quantized to int16 per group of 32
   (a scale each), so a block's 64 products are four multiply-adds of 16-bit lanes; the int16 input keeps
   seven more bits than the bfloat16 of torch's int4 kernel. Every row's products read each weight
   once. Norms, rotation, attention and the KV cache are float32. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if !defined(__AVX2__) || !defined(__FMA__)
#error "q4step needs AVX2 and FMA"
#endif

#define MAX_ROWS 8

typedef struct {
    const uint16_t *words; /* rows x cols/4 */
    const uint16_t *scale; /* rows x cols/32, bfloat16 */
    const uint16_t *zero;  /* rows x cols/32, bfloat16 */
    int rows, cols;
} Q4;

typedef struct {
    const float *input_norm, *post_norm;
    Q4 qkv, o, gate_up, down;
} Layer;

typedef struct {
    int layers, hidden, heads, head_dim, inter;
    float eps, scaling;
    const float *inv_freq; /* head_dim / 2 */
    const float *norm;
    const Layer *layer;
} Model;

static inline float bf16(uint16_t v) {
    uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline float hsum(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    return _mm_cvtss_f32(_mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1)));
}

/* e^x for 8 floats: x = n ln2 + r, e^r by a degree-6 polynomial (about 1 ulp), 2^n in the exponent bits. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), _mm256_set1_ps(-87.3365447505531f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* e^x over n floats in place, each by exp8 whatever its place (a row's numbers never depend on its padding). */
static void exp_all(float *x, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, exp8(_mm256_loadu_ps(x + i)));
    if (i < n) {
        float last[8] = {0};
        memcpy(last, x + i, (n - i) * sizeof(float));
        _mm256_storeu_ps(last, exp8(_mm256_loadu_ps(last)));
        memcpy(x + i, last, (n - i) * sizeof(float));
    }
}

/* The dot product of n floats, summed in an order that depends on n alone (never on the addresses). */
static inline float dot(const float *a, const float *b, int n) {
    __m256 acc = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float sum = hsum(acc);
    for (; i < n; i++) sum += a[i] * b[i];
    return sum;
}

/* The input of a product: per row, int16 per group of 32 in the packed words' order, each group's scale and
   sum; row r's values start at q + r * cols and scale, sum + r * cols / 32. */
typedef struct {
    int16_t *q;
    float *scale, *sum;
} Input;

static void prepare_row(int cols, const float *x, int16_t *q, float *scales, float *sums) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    for (int g = 0; g < cols / 32; g++) {
        const float *xg = x + g * 32;
        __m256 v[4], top = _mm256_setzero_ps(), sum = _mm256_setzero_ps();
        for (int r = 0; r < 4; r++) {
            v[r] = _mm256_loadu_ps(xg + r * 8);
            top = _mm256_max_ps(top, _mm256_andnot_ps(sign, v[r]));
            sum = _mm256_add_ps(sum, v[r]);
        }
        __m128 t = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
        t = _mm_max_ps(t, _mm_movehl_ps(t, t));
        float most = _mm_cvtss_f32(_mm_max_ss(t, _mm_shuffle_ps(t, t, 1)));
        float scale = most > 0.f ? most / 32767.f : 1.f;
        scales[g] = scale;
        sums[g] = hsum(sum);
        __m256 inverse = _mm256_set1_ps(1.f / scale);
        /* Eight inputs r*8..r*8+7 of the group go to lanes (g % 2) * 8.. of the block's vector r. */
        int16_t *block = q + (g / 2) * 64 + (g % 2) * 8;
        for (int r = 0; r < 4; r++) {
            __m256i n = _mm256_cvtps_epi32(_mm256_mul_ps(v[r], inverse));
            __m128i packed = _mm_packs_epi32(_mm256_castsi256_si128(n), _mm256_extracti128_si256(n, 1));
            _mm_storeu_si128((__m128i *)(block + r * 16), packed);
        }
    }
}

static void prepare(int rows, int cols, const float *x, Input in) {
    for (int r = 0; r < rows; r++)
        prepare_row(cols, x + (size_t)r * cols, in.q + (size_t)r * cols, in.scale + r * cols / 32,
                    in.sum + r * cols / 32);
}

/* The 64 products of a block's nibbles (n: q's nibble r in vector r) with a row's int16 input, in 8 lanes: lanes
   0-3 the block's first group, 4-7 its second. */
static inline __m256i block_dot(const __m256i *n, const int16_t *x) {
    const __m256i *v = (const __m256i *)x;
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    /* Multiply-add-accumulate in one instruction. */
    __m256i a = _mm256_madd_epi16(n[0], _mm256_loadu_si256(v));
    __m256i c = _mm256_madd_epi16(n[2], _mm256_loadu_si256(v + 2));
    a = _mm256_dpwssd_epi32(a, n[1], _mm256_loadu_si256(v + 1));
    c = _mm256_dpwssd_epi32(c, n[3], _mm256_loadu_si256(v + 3));
    return _mm256_add_epi32(a, c);
#else
    __m256i a = _mm256_madd_epi16(n[0], _mm256_loadu_si256(v));
    __m256i b = _mm256_madd_epi16(n[1], _mm256_loadu_si256(v + 1));
    __m256i c = _mm256_madd_epi16(n[2], _mm256_loadu_si256(v + 2));
    __m256i d = _mm256_madd_epi16(n[3], _mm256_loadu_si256(v + 3));
    return _mm256_add_epi32(_mm256_add_epi32(a, b), _mm256_add_epi32(c, d));
#endif
}

static inline void nibbles(const uint16_t *words, __m256i *n) {
    const __m256i m = _mm256_set1_epi16(0x000f);
    __m256i v = _mm256_loadu_si256((const __m256i *)words);
    n[0] = _mm256_and_si256(v, m);
    n[1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m);
    n[2] = _mm256_and_si256(_mm256_srli_epi16(v, 8), m);
    n[3] = _mm256_srli_epi16(v, 12);
}

static inline __m256 bf16x8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* Row n of W times each of R prepared inputs, to y[r * w->rows + n]. A group's term is its weights' scale times
   the input's scale times the integer dot, plus (zero - 8 scale) times the input's sum. Inlined with R constant. */
static inline __attribute__((always_inline)) void product_row(const Q4 *w, Input in, int n, const int R, float *y) {
    const __m256i lanes[4] = {_mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3),
                              _mm256_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5), _mm256_setr_epi32(6, 6, 6, 6, 7, 7, 7, 7)};
    int cols = w->cols, groups = cols / 32;
    const uint16_t *words = w->words + (size_t)n * (cols / 4);
    const uint16_t *scale = w->scale + (size_t)n * groups, *zero = w->zero + (size_t)n * groups;
    __m256 acc[MAX_ROWS], offset[MAX_ROWS], m[MAX_ROWS];
    float tail[MAX_ROWS];
    __m256i q[4];
    for (int r = 0; r < R; r++) acc[r] = offset[r] = _mm256_setzero_ps(), tail[r] = 0.f;
    int g = 0;
    for (; g + 8 <= groups; g += 8) {
        __m256 s = bf16x8(scale + g), z = _mm256_fnmadd_ps(_mm256_set1_ps(8.f), s, bf16x8(zero + g));
        for (int r = 0; r < R; r++) {
            offset[r] = _mm256_fmadd_ps(z, _mm256_loadu_ps(in.sum + r * groups + g), offset[r]);
            m[r] = _mm256_mul_ps(s, _mm256_loadu_ps(in.scale + r * groups + g));
        }
        for (int pair = 0; pair < 4; pair++) {
            int b = g / 2 + pair;
            nibbles(words + b * 16, q);
            for (int r = 0; r < R; r++) {
                __m256i dot = block_dot(q, in.q + (size_t)r * cols + b * 64);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_permutevar8x32_ps(m[r], lanes[pair]), acc[r]);
            }
        }
    }
    for (; g < groups; g += 2) {
        float s0 = bf16(scale[g]), s1 = bf16(scale[g + 1]);
        float z0 = bf16(zero[g]) - 8.f * s0, z1 = bf16(zero[g + 1]) - 8.f * s1;
        nibbles(words + g / 2 * 16, q);
        for (int r = 0; r < R; r++) {
            const float *is = in.scale + r * groups + g, *sum = in.sum + r * groups + g;
            __m256i dot = block_dot(q, in.q + (size_t)r * cols + g / 2 * 64);
            __m256 mr = _mm256_setr_m128(_mm_set1_ps(s0 * is[0]), _mm_set1_ps(s1 * is[1]));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), mr, acc[r]);
            tail[r] += z0 * sum[0] + z1 * sum[1];
        }
    }
    for (int r = 0; r < R; r++) y[(size_t)r * w->rows + n] = hsum(_mm256_add_ps(acc[r], offset[r])) + tail[r];
}

/* y (R x w->rows) = W x for R prepared inputs; W's rows split over the team's threads. */
static void product(const Q4 *w, Input in, int R, float *y, int threads) {
#define ROWS(k)                                                                                                       \
    case k:                                                                                                           \
        _Pragma("omp parallel for num_threads(threads) schedule(static)") for (int n = 0; n < w->rows; n++)         \
            product_row(w, in, n, k, y);                                                                              \
        break;
    switch (R) {
        ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8)
    }
#undef ROWS
}

static void rms(int n, const float *x, const float *weight, float eps, float *out) {
    float r = 1.f / sqrtf(dot(x, x, n) / n + eps);
    for (int i = 0; i < n; i++) out[i] = weight[i] * (x[i] * r);
}

static void rotate(float *x, int heads, int dim, const float *cos_, const float *sin_) {
    int half = dim / 2;
    for (int h = 0; h < heads; h++) {
        float *v = x + h * dim;
        for (int i = 0; i < half; i++) {
            float a = v[i], b = v[i + half];
            v[i] = a * cos_[i] - b * sin_[i];
            v[i + half] = b * cos_[i] + a * sin_[i];
        }
    }
}

/* Attention of every row's and head's query (rows x heads x dim in q, rows x 3 x hidden apart) over columns
   0..width of its keys and values (row r, head h at ((r * heads + h) * room) * dim), the columns where `mask`
   (rows x (width + 1)) is nonzero or, without one, all of them; out is rows x heads x dim. */
static void attend(const Model *m, int rows, const float *q, const float *keys, const float *values,
                   const unsigned char *mask, int width, int room, float *out, float *scores, int threads) {
    int dim = m->head_dim, columns = width + 1, heads = m->heads;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int rh = 0; rh < rows * heads; rh++) {
        int r = rh / heads, h = rh % heads;
        const float *qh = q + (size_t)r * 3 * m->hidden + h * dim;
        const float *k = keys + (size_t)rh * room * dim, *v = values + (size_t)rh * room * dim;
        const unsigned char *seen = mask ? mask + (size_t)r * columns : NULL;
        float *s = scores + (size_t)rh * columns, top = -INFINITY, total = 0.f;
        for (int t = 0; t < columns; t++) {
            s[t] = dot(qh, k + (size_t)t * dim, dim) * m->scaling;
            if (!seen || seen[t]) top = fmaxf(top, s[t]);
        }
        for (int t = 0; t < columns; t++) s[t] -= top;
        exp_all(s, columns);
        for (int t = 0; t < columns; t++) {
            if (seen && !seen[t]) s[t] = 0.f;
            total += s[t];
        }
        float *o = out + (size_t)rh * dim;
        for (int i = 0; i < dim; i++) o[i] = 0.f;
        for (int t = 0; t < columns; t++) {
            if (s[t] == 0.f) continue;
            float p = s[t] / total;
#pragma omp simd
            for (int i = 0; i < dim; i++) o[i] += p * v[(size_t)t * dim + i];
        }
    }
}

/* `rows` (1..MAX_ROWS) new positions through every layer: row r's input x_in[r] (rows x hidden) at positions[r]
   appends column `width` of each layer's keys and values (keys[l], values[l]: rows x heads x rooms[l] x head_dim)
   and attends to the columns 0..width where `mask` (rows x (width + 1)) is nonzero, or to all of them where mask
   is NULL; the final norm of each row's result goes to out (rows x hidden). 0; -1 when out of memory; -2 for a
   row count outside 1..MAX_ROWS. */
int q4_step(const Model *m, int rows, const float *x_in, const long *positions, const unsigned char *mask,
            float *const *keys, float *const *values, int width, const int *rooms, int threads, float *out) {
    if (rows < 1 || rows > MAX_ROWS) return -2;
    int d = m->hidden, inter = m->inter, dim = m->head_dim, half = dim / 2, heads = m->heads;
    int widest = d > inter ? d : inter;
    size_t per_row = (size_t)7 * d + 3 * inter + (size_t)heads * (width + 1) + 2 * dim + widest / 16;
    float *work = malloc(rows * per_row * sizeof(float));
    int16_t *quantized = malloc((size_t)rows * widest * sizeof(int16_t));
    if (!work || !quantized) {
        free(work);
        free(quantized);
        return -1;
    }
    float *x = work, *h = x + rows * d, *att = h + rows * d, *tmp = att + rows * d, *qkv = tmp + rows * d;
    float *gu = qkv + (size_t)rows * 3 * d, *act = gu + (size_t)rows * 2 * inter, *scores = act + (size_t)rows * inter;
    float *cos_ = scores + (size_t)rows * heads * (width + 1), *sin_ = cos_ + rows * dim;
    Input in = {quantized, sin_ + rows * dim, sin_ + rows * dim + rows * widest / 32};
    memcpy(x, x_in, (size_t)rows * d * sizeof(float));
    for (int r = 0; r < rows; r++)
        for (int i = 0; i < half; i++) {
            float f = m->inv_freq[i] * (float)positions[r];
            cos_[r * dim + i] = cos_[r * dim + i + half] = cosf(f);
            sin_[r * dim + i] = sin_[r * dim + i + half] = sinf(f);
        }
    for (int l = 0; l < m->layers; l++) {
        const Layer *layer = m->layer + l;
        for (int r = 0; r < rows; r++) rms(d, x + r * d, layer->input_norm, m->eps, h + r * d);
        prepare(rows, d, h, in);
        product(&layer->qkv, in, rows, qkv, threads);
        for (int r = 0; r < rows; r++) {
            float *row = qkv + (size_t)r * 3 * d;
            rotate(row, 2 * heads, dim, cos_ + r * dim, sin_ + r * dim);
            for (int head = 0; head < heads; head++) {
                size_t at = (((size_t)r * heads + head) * rooms[l] + width) * dim;
                memcpy(keys[l] + at, row + d + head * dim, dim * sizeof(float));
                memcpy(values[l] + at, row + 2 * d + head * dim, dim * sizeof(float));
            }
        }
        attend(m, rows, qkv, keys[l], values[l], mask, width, rooms[l], att, scores, threads);
        prepare(rows, d, att, in);
        product(&layer->o, in, rows, tmp, threads);
        for (int i = 0; i < rows * d; i++) x[i] += tmp[i];
        for (int r = 0; r < rows; r++) rms(d, x + r * d, layer->post_norm, m->eps, h + r * d);
        prepare(rows, d, h, in);
        product(&layer->gate_up, in, rows, gu, threads);
        for (int r = 0; r < rows; r++) {
            const float *gate = gu + (size_t)r * 2 * inter, *up = gate + inter;
            float *a = act + (size_t)r * inter;
            for (int i = 0; i < inter; i++) a[i] = -gate[i];
            exp_all(a, inter);
            for (int i = 0; i < inter; i++) a[i] = gate[i] / (1.f + a[i]) * up[i];
        }
        prepare(rows, inter, act, in);
        product(&layer->down, in, rows, tmp, threads);
        for (int i = 0; i < rows * d; i++) x[i] += tmp[i];
    }
    for (int r = 0; r < rows; r++) rms(d, x + r * d, m->norm, m->eps, out + r * d);
    free(work);
    free(quantized);
    return 0;
}
