/* What engines/q4step.c takes and answers, for engines/q4harness.c (engines/q4step.py mirrors it in ctypes). */
#ifndef Q4STEP_H
#define Q4STEP_H
#include <stdint.h>

/* Rows one call of the step takes: the products keep that many rows' sums in registers. */
#define MAX_ROWS 8

/* What every entry point answers. */
enum { Q4_OK = 0, Q4_NO_MEMORY = -1, Q4_BAD_ROWS = -2, Q4_BAD_MODEL = -3, Q4_BAD_CALL = -4 };

/* A product's 4-bit weights, engines/q4layout.py's layout. */
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

const char *q4_kernel(void);
const char *q4_error(int code);
int q4_check(const Model *m);
int q4_product(const Q4 *w, int rows, const float *x, float *y, int threads);
int q4_step(const Model *m, int rows, const float *x_in, const int64_t *positions, const unsigned char *mask,
            float *const *keys, float *const *values, int width, const int *rooms, int threads, float *out);
#endif
