/* engines/q4step.c's kernels for aarch64 with NEON (the Armv8.2 dot-product instructions where the compiler
   targets them: `__ARM_FEATURE_DOTPROD`): the float helpers, an input's int16 form and the 4-bit products.
   Included by q4step.c only.

   A group's 32 weights are 8 words, 16 bytes: one 128-bit register. Without dot products, nibble r of the
   words, masked out, gives 8 lanes of 16 bits (inputs r*8..r*8+7 of the group) for 16-bit multiply-adds into
   32 bits, the input laid out as on x86. With them, the bytes' low and high nibbles give 16 lanes of 8 bits each
   (byte 2j + s: input 16s + j, or 8 + 16s + j), and each int16 input is split into its high byte (signed) and
   its low byte (unsigned) in that order: q.x = 256 q.high + q.low, SDOT and UDOT, the very same integer dot. */
#include <arm_neon.h>

#if defined(__ARM_FEATURE_DOTPROD)
#define Q4_KERNEL "aarch64 neon-dotprod"
#else
#define Q4_KERNEL "aarch64 neon"
#endif

/* e^x for 4 floats, by exp8's steps on x86 (q4step_x86.h). */
static inline float32x4_t exp4(float32x4_t x) {
    x = vmaxq_f32(vminq_f32(x, vdupq_n_f32(EXP_HIGH)), vdupq_n_f32(EXP_LOW));
    float32x4_t n = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(LOG2E)));
    float32x4_t r = vfmsq_f32(x, n, vdupq_n_f32(LN2_HIGH));
    r = vfmsq_f32(r, n, vdupq_n_f32(LN2_LOW));
    float32x4_t p = vdupq_n_f32(EXP_P0);
    p = vfmaq_f32(vdupq_n_f32(EXP_P1), p, r);
    p = vfmaq_f32(vdupq_n_f32(EXP_P2), p, r);
    p = vfmaq_f32(vdupq_n_f32(EXP_P3), p, r);
    p = vfmaq_f32(vdupq_n_f32(EXP_P4), p, r);
    p = vfmaq_f32(vdupq_n_f32(EXP_P5), p, r);
    p = vfmaq_f32(vaddq_f32(r, vdupq_n_f32(1.f)), vmulq_f32(p, r), r);
    int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23);
    return vmulq_f32(p, vreinterpretq_f32_s32(e));
}

/* e^x over n floats in place, each by exp4 whatever its place (a row's numbers never depend on its padding). */
static void exp_all(float *x, int n) {
    int i = 0;
    for (; i + 4 <= n; i += 4) vst1q_f32(x + i, exp4(vld1q_f32(x + i)));
    if (i < n) {
        float last[4] = {0};
        memcpy(last, x + i, (size_t)(n - i) * sizeof(float));
        vst1q_f32(last, exp4(vld1q_f32(last)));
        memcpy(x + i, last, (size_t)(n - i) * sizeof(float));
    }
}

/* The dot product of n floats, summed in an order that depends on n alone (never on the addresses). */
static inline float dot(const float *a, const float *b, int n) {
    float32x4_t acc0 = vdupq_n_f32(0.f), acc1 = vdupq_n_f32(0.f);
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        acc0 = vfmaq_f32(acc0, vld1q_f32(a + i), vld1q_f32(b + i));
        acc1 = vfmaq_f32(acc1, vld1q_f32(a + i + 4), vld1q_f32(b + i + 4));
    }
    float sum = vaddvq_f32(vaddq_f32(acc0, acc1));
    for (; i < n; i++) sum += a[i] * b[i];
    return sum;
}

#if defined(__ARM_FEATURE_DOTPROD)
/* 16 int16 lanes (a, b zipped: a0 b0 a1 b1 ...) as 16 high bytes at out and 16 low bytes at out + 32. */
static inline void split(int16x8_t a, int16x8_t b, int8_t *out) {
    int16x8_t first = vzip1q_s16(a, b), second = vzip2q_s16(a, b);
    vst1q_s8(out, vcombine_s8(vshrn_n_s16(first, 8), vshrn_n_s16(second, 8)));
    vst1q_s8(out + 32, vcombine_s8(vmovn_s16(first), vmovn_s16(second)));
}
#endif

/* One row's input (cols a multiple of 64) as int16 per group of 32, each group's scale and sum. Without dot
   products in the words' order (x86's); with them group g's 64 bytes are the high bytes of inputs in the low
   nibbles' order, then in the high nibbles' order, then the low bytes likewise. */
static void prepare_row(int cols, const float *x, int16_t *q, float *scales, float *sums) {
    for (int g = 0; g < cols / 32; g++) {
        const float *xg = x + (size_t)g * 32;
        float32x4_t v[8], top = vdupq_n_f32(0.f), sum = vdupq_n_f32(0.f);
        for (int i = 0; i < 8; i++) {
            v[i] = vld1q_f32(xg + i * 4);
            top = vmaxq_f32(top, vabsq_f32(v[i]));
        }
        /* Summed as x86 sums its eight lanes' partial sums: vectors 0-3 and 4-7 of the group side by side. */
        for (int i = 0; i < 4; i++) sum = vaddq_f32(sum, vaddq_f32(v[2 * i], v[2 * i + 1]));
        float most = vmaxvq_f32(top);
        float scale = most > 0.f ? most / INPUT_TOP : 1.f;
        scales[g] = scale;
        sums[g] = vaddvq_f32(sum);
        float32x4_t inverse = vdupq_n_f32(1.f / scale);
        int16x8_t n[4];
        for (int r = 0; r < 4; r++) {
            int32x4_t lo = vcvtnq_s32_f32(vmulq_f32(v[2 * r], inverse));
            int32x4_t hi = vcvtnq_s32_f32(vmulq_f32(v[2 * r + 1], inverse));
            n[r] = vcombine_s16(vqmovn_s32(lo), vqmovn_s32(hi));
        }
#if defined(__ARM_FEATURE_DOTPROD)
        int8_t *bytes = (int8_t *)q + (size_t)g * 64;
        split(n[0], n[2], bytes);
        split(n[1], n[3], bytes + 16);
#else
        int16_t *block = q + (size_t)(g / 2) * 64 + (g % 2) * 8;
        for (int r = 0; r < 4; r++) vst1q_s16(block + r * 16, n[r]);
#endif
    }
}

/* A group's 32 weights (its 8 words) as the products take them. */
typedef struct {
#if defined(__ARM_FEATURE_DOTPROD)
    uint8x16_t low, high; /* byte 2j + s: weight 16s + j, and 8 + 16s + j */
#else
    int16x8_t n[4]; /* lane j of n[r]: weight r*8 + j */
#endif
} Group;

static inline Group group_of(const uint16_t *words) {
    Group w;
#if defined(__ARM_FEATURE_DOTPROD)
    uint8x16_t bytes = vld1q_u8((const uint8_t *)words);
    w.low = vandq_u8(bytes, vdupq_n_u8(0x0f));
    w.high = vshrq_n_u8(bytes, 4);
#else
    uint16x8_t v = vld1q_u16(words), m = vdupq_n_u16(0x000f);
    w.n[0] = vreinterpretq_s16_u16(vandq_u16(v, m));
    w.n[1] = vreinterpretq_s16_u16(vandq_u16(vshrq_n_u16(v, 4), m));
    w.n[2] = vreinterpretq_s16_u16(vandq_u16(vshrq_n_u16(v, 8), m));
    w.n[3] = vreinterpretq_s16_u16(vshrq_n_u16(v, 12));
#endif
    return w;
}

/* The 32 products of group g's weights with a row's prepared input `q`, in 4 lanes. */
static inline int32x4_t group_dot(const Group *w, const int16_t *q, int g) {
#if defined(__ARM_FEATURE_DOTPROD)
    const int8_t *x = (const int8_t *)q + (size_t)g * 64;
    int32x4_t upper = vdotq_s32(vdupq_n_s32(0), vreinterpretq_s8_u8(w->low), vld1q_s8(x));
    upper = vdotq_s32(upper, vreinterpretq_s8_u8(w->high), vld1q_s8(x + 16));
    uint32x4_t lower = vdotq_u32(vdupq_n_u32(0), w->low, vld1q_u8((const uint8_t *)x + 32));
    lower = vdotq_u32(lower, w->high, vld1q_u8((const uint8_t *)x + 48));
    return vaddq_s32(vshlq_n_s32(upper, 8), vreinterpretq_s32_u32(lower));
#else
    const int16_t *x = q + (size_t)(g / 2) * 64 + (g % 2) * 8;
    int32x4_t acc = vdupq_n_s32(0);
    for (int r = 0; r < 4; r++) {
        int16x8_t in = vld1q_s16(x + r * 16);
        acc = vmlal_s16(acc, vget_low_s16(w->n[r]), vget_low_s16(in));
        acc = vmlal_high_s16(acc, w->n[r], in);
    }
    return acc;
#endif
}

static inline float32x4_t bf16x4(const uint16_t *p) {
    return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16));
}

/* The x86 kernels fetch a step's words ahead of the products; here the hardware prefetcher alone does (not
   measured on aarch64 hardware). */
static inline void fetch_ahead(const Q4 *w, int n) {
    (void)w;
    (void)n;
}

/* Row n of W times each of R prepared inputs, to y[r * w->rows + n]: four groups at a time, each group's integer
   dot scaled by its weights' scale times the input's, plus (zero - 8 scale) times the input's sum. Inlined with
   R constant. */
static inline __attribute__((always_inline)) void product_row(const Q4 *w, Input in, int n, const int R, float *y) {
    int cols = w->cols, groups = cols / 32;
    const uint16_t *words = w->words + (size_t)n * (cols / 4);
    const uint16_t *scale = w->scale + (size_t)n * groups, *zero = w->zero + (size_t)n * groups;
    float32x4_t acc[MAX_ROWS], offset[MAX_ROWS];
    for (int r = 0; r < R; r++) acc[r] = offset[r] = vdupq_n_f32(0.f);
    const int32x4_t none = vdupq_n_s32(0);
    for (int g = 0; g < groups; g += 4) {
        /* A width of 64 times an odd number ends on two groups: the other two lanes are zeros. */
        int two = g + 4 > groups;
        float32x4_t s, z;
        Group q[4];
        q[0] = group_of(words + (size_t)g * 8), q[1] = group_of(words + (size_t)g * 8 + 8);
        if (two) {
            uint16_t sp[4] = {scale[g], scale[g + 1], 0, 0}, zp[4] = {zero[g], zero[g + 1], 0, 0};
            s = bf16x4(sp), z = bf16x4(zp);
        } else {
            q[2] = group_of(words + (size_t)g * 8 + 16), q[3] = group_of(words + (size_t)g * 8 + 24);
            s = bf16x4(scale + g), z = bf16x4(zero + g);
        }
        z = vfmsq_f32(z, vdupq_n_f32(8.f), s);
        for (int r = 0; r < R; r++) {
            const int16_t *x = in.q + (size_t)r * cols;
            const float *is = in.scale + (size_t)r * groups + g, *sum = in.sum + (size_t)r * groups + g;
            int32x4_t pair = vpaddq_s32(group_dot(&q[0], x, g), group_dot(&q[1], x, g + 1)), rest = none;
            float32x4_t mine, sums;
            if (two) {
                float ip[4] = {is[0], is[1], 0.f, 0.f}, sp[4] = {sum[0], sum[1], 0.f, 0.f};
                mine = vld1q_f32(ip), sums = vld1q_f32(sp);
            } else {
                rest = vpaddq_s32(group_dot(&q[2], x, g + 2), group_dot(&q[3], x, g + 3));
                mine = vld1q_f32(is), sums = vld1q_f32(sum);
            }
            acc[r] = vfmaq_f32(acc[r], vcvtq_f32_s32(vpaddq_s32(pair, rest)), vmulq_f32(s, mine));
            offset[r] = vfmaq_f32(offset[r], z, sums);
        }
    }
    for (int r = 0; r < R; r++) y[(size_t)r * w->rows + n] = vaddvq_f32(vaddq_f32(acc[r], offset[r]));
}
