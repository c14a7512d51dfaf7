/* Runs a built engines/q4step.c on one case from a file, in a process of its own (engines/q4check.py):

       q4harness LIBRARY CASE RESULT

   CASE is engines/q4case.py's `write`; RESULT gets q4_step's and q4_product's codes (int32 each), the step's
   output (rows x hidden floats), q4_product's output for layer 0's qkv on the same inputs (rows x 3 hidden) and
   every layer's keys and values after the step. Each array of the case lives in a heap block of its own exact
   size, so that an AddressSanitizer build sees any read or write past one. Prints the library's kernels.
   Exits 0 when the library ran (whatever it answered), 2 for a bad case or file, 3 when the library does not
   load. */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "q4step.h"

typedef const char *(*Kernel)(void);
typedef int (*Step)(const Model *, int, const float *, const int64_t *, const unsigned char *, float *const *,
                    float *const *, int, const int *, int, float *);
typedef int (*Product)(const Q4 *, int, const float *, float *, int);

typedef struct {
    const unsigned char *data;
    size_t size, at;
} Reader;

/* A heap copy of the next n bytes of the case; exits 2 where the file is shorter. */
static void *take(Reader *in, size_t n) {
    if (n > in->size - in->at) {
        fprintf(stderr, "q4harness: the case ends %zu bytes early\n", n - (in->size - in->at));
        exit(2);
    }
    void *out = malloc(n ? n : 1);
    if (!out) exit(2);
    memcpy(out, in->data + in->at, n);
    in->at += n;
    return out;
}

static int whole(Reader *in) {
    int *p = take(in, sizeof(int)), v = *p;
    free(p);
    return v;
}

static size_t count(int a, int b) { return a > 0 && b > 0 ? (size_t)a * (size_t)b : 0; }

static Q4 product_of(Reader *in) {
    Q4 w;
    w.rows = whole(in), w.cols = whole(in);
    w.words = take(in, count(w.rows, w.cols / 4) * 2);
    w.scale = take(in, count(w.rows, w.cols / 32) * 2);
    w.zero = take(in, count(w.rows, w.cols / 32) * 2);
    return w;
}

static unsigned char *slurp(const char *path, size_t *size) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    unsigned char *data = NULL;
    size_t got = 0, room = 0, n;
    do {
        if (got == room) {
            unsigned char *more = realloc(data, room = room ? 2 * room : 1 << 20);
            if (!more) break;
            data = more;
        }
        n = fread(data + got, 1, room - got, f);
        got += n;
    } while (n > 0);
    fclose(f);
    *size = got;
    return data;
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: q4harness LIBRARY CASE RESULT\n");
        return 2;
    }
    void *lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        fprintf(stderr, "q4harness: %s\n", dlerror());
        return 3;
    }
    Kernel kernel = (Kernel)dlsym(lib, "q4_kernel");
    Step step = (Step)dlsym(lib, "q4_step");
    Product product = (Product)dlsym(lib, "q4_product");
    if (!kernel || !step || !product) {
        fprintf(stderr, "q4harness: %s lacks q4_kernel, q4_step or q4_product\n", argv[1]);
        return 3;
    }
    printf("%s\n", kernel());
    size_t size = 0;
    unsigned char *data = slurp(argv[2], &size);
    if (!data || size < 48 || memcmp(data, "Q4C1", 4) != 0) {
        fprintf(stderr, "q4harness: %s is not a case\n", argv[2]);
        return 2;
    }
    Reader in = {data, size, 4};
    Model m;
    m.layers = whole(&in), m.hidden = whole(&in), m.heads = whole(&in), m.head_dim = whole(&in);
    m.inter = whole(&in);
    int rows = whole(&in), width = whole(&in), threads = whole(&in), has_mask = whole(&in);
    float *scalars = take(&in, 2 * sizeof(float));
    m.eps = scalars[0], m.scaling = scalars[1];
    if (m.layers < 1 || m.layers > 1024 || rows < 1 || rows > 1024 || width < 0 || m.hidden < 1 || m.heads < 1 ||
        m.head_dim < 1 || m.inter < 1) {
        fprintf(stderr, "q4harness: %s has sizes out of range\n", argv[2]);
        return 2;
    }
    m.inv_freq = take(&in, count(m.head_dim / 2, 1) * sizeof(float));
    m.norm = take(&in, count(m.hidden, 1) * sizeof(float));
    Layer *layers = calloc((size_t)m.layers, sizeof(Layer));
    for (int l = 0; l < m.layers; l++) {
        layers[l].input_norm = take(&in, count(m.hidden, 1) * sizeof(float));
        layers[l].post_norm = take(&in, count(m.hidden, 1) * sizeof(float));
        layers[l].qkv = product_of(&in), layers[l].o = product_of(&in);
        layers[l].gate_up = product_of(&in), layers[l].down = product_of(&in);
    }
    m.layer = layers;
    float *x = take(&in, count(rows, m.hidden) * sizeof(float));
    int64_t *positions = take(&in, count(rows, 1) * sizeof(int64_t));
    unsigned char *mask = has_mask ? take(&in, count(rows, width + 1)) : NULL;
    int *rooms = take(&in, count(m.layers, 1) * sizeof(int));
    float **keys = calloc((size_t)m.layers, sizeof(float *)), **values = calloc((size_t)m.layers, sizeof(float *));
    size_t cache = 0;
    for (int l = 0; l < m.layers; l++) {
        size_t n = count(rows, m.heads) * count(rooms[l], m.head_dim);
        keys[l] = take(&in, n * sizeof(float)), values[l] = take(&in, n * sizeof(float));
        cache += n;
    }
    if (in.at != size) {
        fprintf(stderr, "q4harness: %zu bytes of %s are left over\n", size - in.at, argv[2]);
        return 2;
    }
    float *out = calloc(count(rows, m.hidden), sizeof(float));
    float *made = calloc(count(rows, layers[0].qkv.rows), sizeof(float));
    int codes[2];
    codes[0] = step(&m, rows, x, positions, mask, keys, values, width, rooms, threads, out);
    codes[1] = product(&layers[0].qkv, rows, x, made, threads);
    FILE *f = fopen(argv[3], "wb");
    if (!f) {
        fprintf(stderr, "q4harness: cannot write %s\n", argv[3]);
        return 2;
    }
    size_t wrote = fwrite(codes, sizeof(int), 2, f) + fwrite(out, sizeof(float), count(rows, m.hidden), f);
    wrote += fwrite(made, sizeof(float), count(rows, layers[0].qkv.rows), f);
    for (int l = 0; l < m.layers; l++) {
        size_t n = count(rows, m.heads) * count(rooms[l], m.head_dim);
        wrote += fwrite(keys[l], sizeof(float), n, f) + fwrite(values[l], sizeof(float), n, f);
    }
    if (fclose(f) != 0 || wrote != 2 + count(rows, m.hidden) + count(rows, layers[0].qkv.rows) + 2 * cache) {
        fprintf(stderr, "q4harness: writing %s failed\n", argv[3]);
        return 2;
    }
    for (int l = 0; l < m.layers; l++) {
        const Q4 *ws[4] = {&layers[l].qkv, &layers[l].o, &layers[l].gate_up, &layers[l].down};
        for (int i = 0; i < 4; i++) free((void *)ws[i]->words), free((void *)ws[i]->scale), free((void *)ws[i]->zero);
        free((void *)layers[l].input_norm), free((void *)layers[l].post_norm), free(keys[l]), free(values[l]);
    }
    free(layers), free(keys), free(values), free(out), free(made), free(x), free(positions), free(mask), free(rooms);
    free((void *)m.inv_freq), free((void *)m.norm), free(scalars), free(data);
    return 0;
}
