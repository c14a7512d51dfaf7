/* engines/q4step.c's kernels for x86-64 with AVX2 and FMA (AVX-512 VNNI's fused multiply-add where the compiler
   targets it): the float helpers, an input's int16 form and the 4-bit products. Included by q4step.c only.

   A block of 64 inputs (two groups) is 16 weight words: one 256-bit register whose nibble r, masked out, gives
   16 lanes of 16 bits (lanes 0-7: inputs r*8..r*8+7 of the block's first group; 8-15: of its second). The int16
   input is laid out in the same order, so a block's 64 products are four 16-bit multiply-adds. */
#include <immintrin.h>

#if !defined(__AVX2__) || !defined(__FMA__)
#error "q4step on x86-64 needs AVX2 and FMA"
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define Q4_KERNEL "x86-64 avx512-vnni"
#else
#define Q4_KERNEL "x86-64 avx2"
#endif

static inline float hsum(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    return _mm_cvtss_f32(_mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1)));
}

/* e^x for 8 floats: x = n ln2 + r, e^r by a degree-6 polynomial (about 1 ulp), 2^n in the exponent bits. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(EXP_HIGH)), _mm256_set1_ps(EXP_LOW));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)), _MM_FROUND_TO_NEAREST_INT);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HIGH), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LOW), r);
    __m256 p = _mm256_set1_ps(EXP_P0);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P1));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P5));
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
        memcpy(last, x + i, (size_t)(n - i) * sizeof(float));
        _mm256_storeu_ps(last, exp8(_mm256_loadu_ps(last)));
        memcpy(x + i, last, (size_t)(n - i) * sizeof(float));
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

/* One row's input (cols a multiple of 64) as int16 per group of 32 in the words' order, each group's scale and
   sum. */
static void prepare_row(int cols, const float *x, int16_t *q, float *scales, float *sums) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    for (int g = 0; g < cols / 32; g++) {
        const float *xg = x + (size_t)g * 32;
        __m256 v[4], top = _mm256_setzero_ps(), sum = _mm256_setzero_ps();
        for (int r = 0; r < 4; r++) {
            v[r] = _mm256_loadu_ps(xg + r * 8);
            top = _mm256_max_ps(top, _mm256_andnot_ps(sign, v[r]));
            sum = _mm256_add_ps(sum, v[r]);
        }
        __m128 t = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
        t = _mm_max_ps(t, _mm_movehl_ps(t, t));
        float most = _mm_cvtss_f32(_mm_max_ss(t, _mm_shuffle_ps(t, t, 1)));
        float scale = most > 0.f ? most / INPUT_TOP : 1.f;
        scales[g] = scale;
        sums[g] = hsum(sum);
        __m256 inverse = _mm256_set1_ps(1.f / scale);
        /* Eight inputs r*8..r*8+7 of the group go to lanes (g % 2) * 8.. of the block's vector r. */
        int16_t *block = q + (size_t)(g / 2) * 64 + (g % 2) * 8;
        for (int r = 0; r < 4; r++) {
            __m256i n = _mm256_cvtps_epi32(_mm256_mul_ps(v[r], inverse));
            __m128i packed = _mm_packs_epi32(_mm256_castsi256_si128(n), _mm256_extracti128_si256(n, 1));
            _mm_storeu_si128((__m128i *)(block + r * 16), packed);
        }
    }
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

/* Row n's words as they lie 2 KiB further on (the next rows' words, since a thread's rows of W lie one after
   another), fetched into L1 ahead of the kernel: at one or two inputs a product is a stream of the weights,
   which the hardware prefetcher alone falls behind. A step's products ask for it; a prefill's do not, as their
   arithmetic is the bound and a block of W is read again from L1 for every eight inputs. */
static inline void fetch_ahead(const Q4 *w, int n) {
    /* An address, not a pointer into W: past W's last rows it points at nothing, and a prefetch never faults. */
    uintptr_t row = (uintptr_t)(w->words + (size_t)n * (w->cols / 4)) + 2048;
    for (int at = 0; at < w->cols / 2; at += 64) _mm_prefetch((const char *)(row + (uintptr_t)at), _MM_HINT_T0);
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
            offset[r] = _mm256_fmadd_ps(z, _mm256_loadu_ps(in.sum + (size_t)r * groups + g), offset[r]);
            m[r] = _mm256_mul_ps(s, _mm256_loadu_ps(in.scale + (size_t)r * groups + g));
        }
        for (int pair = 0; pair < 4; pair++) {
            int b = g / 2 + pair;
            nibbles(words + (size_t)b * 16, q);
            for (int r = 0; r < R; r++) {
                __m256i dot = block_dot(q, in.q + (size_t)r * cols + (size_t)b * 64);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_permutevar8x32_ps(m[r], lanes[pair]), acc[r]);
            }
        }
    }
    for (; g < groups; g += 2) {
        float s0 = bf16(scale[g]), s1 = bf16(scale[g + 1]);
        float z0 = bf16(zero[g]) - 8.f * s0, z1 = bf16(zero[g + 1]) - 8.f * s1;
        nibbles(words + (size_t)(g / 2) * 16, q);
        for (int r = 0; r < R; r++) {
            const float *is = in.scale + (size_t)r * groups + g, *sum = in.sum + (size_t)r * groups + g;
            __m256i dot = block_dot(q, in.q + (size_t)r * cols + (size_t)(g / 2) * 64);
            __m256 mr = _mm256_setr_m128(_mm_set1_ps(s0 * is[0]), _mm_set1_ps(s1 * is[1]));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), mr, acc[r]);
            tail[r] += z0 * sum[0] + z1 * sum[1];
        }
    }
    for (int r = 0; r < R; r++) y[(size_t)r * w->rows + n] = hsum(_mm256_add_ps(acc[r], offset[r])) + tail[r];
}
