/* The block matmuls layer.c calls in ggml_q.c (see there). Written for specdec. */
#ifndef GQ_MATMUL_H
#define GQ_MATMUL_H
#include <stdint.h>

/* One matrix of a grouped call: y [rows] (rows ystride apart) = x [rows][in] @ W^T, W `out` rows of GGUF blocks */
typedef struct {
    int type;
    const uint8_t *W;
    int64_t out;
    const float *x;
    int64_t rows;
    float *y;
    int64_t ystride;
} gq_job_t;

int gq_matmul_parts(int nparts, const int *types, const uint8_t *const *Ws, const int64_t *outs, int64_t in,
                    const float *x, int64_t rows, float *y, int nthreads, int path);
int gq_matmul_jobs(int n, const gq_job_t *jobs, int64_t in, int nthreads, int path);
#endif
