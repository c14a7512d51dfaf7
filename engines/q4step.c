/* One decode step of ChatTTS's GPT (a Llama body) for up to MAX_ROWS rows, with 4-bit weights, and the 4-bit
   product alone for any number of rows: engines/q4build.py builds this file with the host's C compiler,
   engines/q4step.py calls it through ctypes and engines/q4harness.c from a process of its own.

   Weights come from engines/weightonly.py's Int4WeightLinear: w = (q - 8) * scale + zero per group of 32
   input features, scale and zero bfloat16. q is packed in blocks of 64 inputs (two groups), 16 words of four
   nibbles, nibble r of word j holding input r*8 + j of the block's first group (j < 8) or 32 + r*8 + (j-8) of
   its second (j >= 8): engines/q4layout.py. The input is quantized to int16 per group of 32 (a scale each), so
   the products are integer multiply-adds; the int16 input keeps seven more bits than the bfloat16 of torch's
   int4 kernel. Every row's products read each weight once. Norms, rotation, attention and the KV cache are
   float32. The kernels are chosen when the file is compiled, by the target's instructions: q4step_x86.h
   (AVX2, AVX-512 VNNI) or q4step_arm.h (NEON, dot products).

   Every entry point checks the shapes it is given before it reads or writes anything, and answers a code:
   Q4_OK, or one of the negative codes of q4step.h (q4_error words them). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "q4step.h"

/* Widths and heights beyond this are refused: every index below then fits in an int, every size in a size_t. */
#define MAX_SIDE (1 << 20)

/* The input of a product: per row, int16 per group of 32 in the kernels' order, each group's scale and sum;
   row r's values start at q + r * cols and scale, sum + r * cols / 32. */
typedef struct {
    int16_t *q;
    float *scale, *sum;
} Input;

static inline float bf16(uint16_t v) {
    uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* e^x's constants: the range clamped, ln 2 in two parts, the polynomial of e^r (about 1 ulp). */
#define EXP_HIGH 88.3762626647949f
#define EXP_LOW -87.3365447505531f
#define LOG2E 1.44269504088896341f
#define LN2_HIGH 0.693359375f
#define LN2_LOW -2.12194440e-4f
#define EXP_P0 1.9875691500e-4f
#define EXP_P1 1.3981999507e-3f
#define EXP_P2 8.3334519073e-3f
#define EXP_P3 4.1665795894e-2f
#define EXP_P4 1.6666665459e-1f
#define EXP_P5 5.0000001201e-1f
/* The largest int16 an input is scaled to. */
#define INPUT_TOP 32767.f

#if defined(__x86_64__) || defined(_M_X64)
#include "q4step_x86.h"
#elif defined(__aarch64__) || defined(_M_ARM64)
#include "q4step_arm.h"
#else
#error "q4step has kernels for x86-64 (AVX2) and aarch64 (NEON) only"
#endif

/* The kernels this build runs, e.g. "x86-64 avx2" or "aarch64 neon-dotprod". */
const char *q4_kernel(void) { return Q4_KERNEL; }

/* What a code means, in words for a log line. */
const char *q4_error(int code) {
    switch (code) {
    case Q4_OK: return "no error";
    case Q4_NO_MEMORY: return "out of memory for its working buffers";
    case Q4_BAD_ROWS: return "a row count outside 1..8";
    case Q4_BAD_MODEL:
        return "a model it cannot run: widths must be multiples of 64 up to 2^20, head_dim x heads = hidden, "
               "qkv 3 hidden x hidden, o hidden x hidden, gate_up 2 inter x hidden, down hidden x inter";
    case Q4_BAD_CALL: return "a call it cannot run: a missing buffer, a negative width or a room not above it";
    default: return "an unknown code";
    }
}

#ifndef Q4_UNCHECKED
static int fits(int n) { return n >= 64 && n <= MAX_SIDE && n % 64 == 0; }
#else
/* Only for tests/test_q4check.py, which shows that AddressSanitizer sees what the check above prevents. */
static int fits(int n) { return n > 0 && n <= MAX_SIDE; }
#endif

static int shaped(const Q4 *w, int rows, int cols) {
    return w->words && w->scale && w->zero && w->rows == rows && w->cols == cols && fits(rows) && fits(cols);
}

/* Q4_OK for a model whose shapes q4_step can run, else Q4_BAD_MODEL. */
int q4_check(const Model *m) {
    if (!m || m->layers < 1 || !fits(m->hidden) || !fits(m->inter) || m->heads < 1 || m->head_dim < 2 ||
        m->head_dim % 2 || (int64_t)m->heads * m->head_dim != m->hidden || !m->inv_freq || !m->norm || !m->layer ||
        !(m->eps >= 0.f))
        return Q4_BAD_MODEL;
    int d = m->hidden, inter = m->inter;
    for (int l = 0; l < m->layers; l++) {
        const Layer *layer = m->layer + l;
        if (!layer->input_norm || !layer->post_norm || !shaped(&layer->qkv, 3 * d, d) || !shaped(&layer->o, d, d) ||
            !shaped(&layer->gate_up, 2 * inter, d) || !shaped(&layer->down, d, inter))
            return Q4_BAD_MODEL;
    }
    return Q4_OK;
}

static void prepare(int rows, int cols, const float *x, Input in) {
    for (int r = 0; r < rows; r++)
        prepare_row(cols, x + (size_t)r * cols, in.q + (size_t)r * cols, in.scale + (size_t)r * cols / 32,
                    in.sum + (size_t)r * cols / 32);
}

/* y (R x w->rows) = W x for R prepared inputs; W's rows split over the team's threads. At one or two inputs the
   product streams W, and each row's words further on are fetched ahead of the kernel (fetch_ahead). */
static void product(const Q4 *w, Input in, int R, float *y, int threads) {
#define ROWS(k)                                                                                                       \
    case k:                                                                                                           \
        _Pragma("omp parallel for num_threads(threads) schedule(static)") for (int n = 0; n < w->rows; n++) {       \
            if (k <= 2) fetch_ahead(w, n);                                                                            \
            product_row(w, in, n, k, y);                                                                              \
        }                                                                                                             \
        break;
    switch (R) {
        ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8)
    }
#undef ROWS
}

/* Output rows of W one thread takes at a time in q4_product: their words stay in its L1 cache while every row
   of the input passes them. */
#define PRODUCT_BLOCK 16

/* y (rows x w->rows) = W x (rows x w->cols), each row's numbers those of a step's product of the same input
   (MAX_ROWS inputs at a time against each block of PRODUCT_BLOCK rows of W). Q4_OK, Q4_BAD_MODEL for a W of
   other shapes, Q4_BAD_CALL, Q4_NO_MEMORY. */
int q4_product(const Q4 *w, int rows, const float *x, float *y, int threads) {
    if (!w || !shaped(w, w->rows, w->cols)) return Q4_BAD_MODEL;
    if (rows < 0 || rows > MAX_SIDE || !x || !y) return Q4_BAD_CALL;
    if (rows == 0) return Q4_OK;
    if (threads < 1) threads = 1;
    int cols = w->cols;
    int16_t *quantized = malloc((size_t)rows * cols * sizeof(int16_t));
    float *stats = malloc((size_t)rows * cols / 16 * sizeof(float));
    if (!quantized || !stats) {
        free(quantized);
        free(stats);
        return Q4_NO_MEMORY;
    }
    Input in = {quantized, stats, stats + (size_t)rows * cols / 32};
    prepare(rows, cols, x, in);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int block = 0; block < w->rows; block += PRODUCT_BLOCK) {
        int end = block + PRODUCT_BLOCK < w->rows ? block + PRODUCT_BLOCK : w->rows;
        for (int start = 0; start < rows; start += MAX_ROWS) {
            Input part = {in.q + (size_t)start * cols, in.scale + (size_t)start * cols / 32,
                          in.sum + (size_t)start * cols / 32};
            float *out = y + (size_t)start * w->rows;
            switch (rows - start < MAX_ROWS ? rows - start : MAX_ROWS) {
#define ROWS(k)                                                                                                       \
    case k:                                                                                                           \
        for (int n = block; n < end; n++) product_row(w, part, n, k, out);                                           \
        break;
                ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8)
#undef ROWS
            }
        }
    }
    free(quantized);
    free(stats);
    return Q4_OK;
}

static void rms(int n, const float *x, const float *weight, float eps, float *out) {
    float r = 1.f / sqrtf(dot(x, x, n) / n + eps);
    for (int i = 0; i < n; i++) out[i] = weight[i] * (x[i] * r);
}

static void rotate(float *x, int heads, int dim, const float *cos_, const float *sin_) {
    int half = dim / 2;
    for (int h = 0; h < heads; h++) {
        float *v = x + (size_t)h * dim;
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
        const float *qh = q + (size_t)r * 3 * m->hidden + (size_t)h * dim;
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
   appends column `width` of each layer's keys and values (keys[l], values[l]: rows x heads x rooms[l] x head_dim,
   rooms[l] > width) and attends to the columns 0..width where `mask` (rows x (width + 1)) is nonzero, or to all
   of them where mask is NULL; the final norm of each row's result goes to out (rows x hidden). Q4_OK;
   Q4_NO_MEMORY; Q4_BAD_ROWS for a row count outside 1..MAX_ROWS; Q4_BAD_MODEL where q4_check refuses `m`;
   Q4_BAD_CALL for a missing buffer, a negative width or a room not above it. Nothing is written unless Q4_OK
   or Q4_NO_MEMORY (then out and column `width` are undefined). */
int q4_step(const Model *m, int rows, const float *x_in, const int64_t *positions, const unsigned char *mask,
            float *const *keys, float *const *values, int width, const int *rooms, int threads, float *out) {
    if (rows < 1 || rows > MAX_ROWS) return Q4_BAD_ROWS;
    if (q4_check(m) != Q4_OK) return Q4_BAD_MODEL;
    if (!x_in || !positions || !keys || !values || !rooms || !out || width < 0 || width >= MAX_SIDE * 16)
        return Q4_BAD_CALL;
    for (int l = 0; l < m->layers; l++)
        if (!keys[l] || !values[l] || rooms[l] <= width) return Q4_BAD_CALL;
    if (threads < 1) threads = 1;
    int d = m->hidden, inter = m->inter, dim = m->head_dim, half = dim / 2, heads = m->heads;
    int widest = d > inter ? d : inter;
    size_t per_row = (size_t)7 * d + (size_t)3 * inter + (size_t)heads * (width + 1) + (size_t)2 * dim + widest / 16;
    float *work = malloc(rows * per_row * sizeof(float));
    int16_t *quantized = malloc((size_t)rows * widest * sizeof(int16_t));
    if (!work || !quantized) {
        free(work);
        free(quantized);
        return Q4_NO_MEMORY;
    }
    float *x = work, *h = x + (size_t)rows * d, *att = h + (size_t)rows * d, *tmp = att + (size_t)rows * d;
    float *qkv = tmp + (size_t)rows * d, *gu = qkv + (size_t)rows * 3 * d, *act = gu + (size_t)rows * 2 * inter;
    float *scores = act + (size_t)rows * inter, *cos_ = scores + (size_t)rows * heads * (width + 1);
    float *sin_ = cos_ + (size_t)rows * dim;
    Input in = {quantized, sin_ + (size_t)rows * dim, sin_ + (size_t)rows * dim + (size_t)rows * widest / 32};
    memcpy(x, x_in, (size_t)rows * d * sizeof(float));
    for (int r = 0; r < rows; r++)
        for (int i = 0; i < half; i++) {
            float f = m->inv_freq[i] * (float)positions[r];
            cos_[r * dim + i] = cos_[r * dim + i + half] = cosf(f);
            sin_[r * dim + i] = sin_[r * dim + i + half] = sinf(f);
        }
    for (int l = 0; l < m->layers; l++) {
        const Layer *layer = m->layer + l;
        for (int r = 0; r < rows; r++) rms(d, x + (size_t)r * d, layer->input_norm, m->eps, h + (size_t)r * d);
        prepare(rows, d, h, in);
        product(&layer->qkv, in, rows, qkv, threads);
        for (int r = 0; r < rows; r++) {
            float *row = qkv + (size_t)r * 3 * d;
            rotate(row, 2 * heads, dim, cos_ + r * dim, sin_ + r * dim);
            for (int head = 0; head < heads; head++) {
                size_t at = (((size_t)r * heads + head) * rooms[l] + width) * dim;
                memcpy(keys[l] + at, row + d + (size_t)head * dim, (size_t)dim * sizeof(float));
                memcpy(values[l] + at, row + 2 * (size_t)d + (size_t)head * dim, (size_t)dim * sizeof(float));
            }
        }
        attend(m, rows, qkv, keys[l], values[l], mask, width, rooms[l], att, scores, threads);
        prepare(rows, d, att, in);
        product(&layer->o, in, rows, tmp, threads);
        for (size_t i = 0; i < (size_t)rows * d; i++) x[i] += tmp[i];
        for (int r = 0; r < rows; r++) rms(d, x + (size_t)r * d, layer->post_norm, m->eps, h + (size_t)r * d);
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
        for (size_t i = 0; i < (size_t)rows * d; i++) x[i] += tmp[i];
    }
    for (int r = 0; r < rows; r++) rms(d, x + (size_t)r * d, m->norm, m->eps, out + (size_t)r * d);
    free(work);
    free(quantized);
    return Q4_OK;
}
