/* add+RMSNorm and SiLU-and-multiply over float32 rows. */
#include "common.h"

/* residual_out = x + residual (when residual is given, else x); out = rmsnorm(that) * w. */
void rsgl_add_rmsnorm(const float* x, const float* residual, float* residual_out,
                      const float* w, float* out, int64_t rows, int64_t dim, float eps,
                      int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads) \
        if (rows * dim > PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        const float* xr = x + r * dim;
        float* hr = residual_out + r * dim;
        float ss = 0.f;
        if (residual) {
            const float* rr = residual + r * dim;
            #pragma omp simd reduction(+ : ss)
            for (int64_t i = 0; i < dim; i++) {
                const float h = xr[i] + rr[i];
                hr[i] = h;
                ss += h * h;
            }
        } else {
            #pragma omp simd reduction(+ : ss)
            for (int64_t i = 0; i < dim; i++) ss += xr[i] * xr[i];
            hr = (float*)xr;
        }
        const float inv = 1.f / sqrtf(ss / (float)dim + eps);
        float* o = out + r * dim;
        #pragma omp simd
        for (int64_t i = 0; i < dim; i++) o[i] = w[i] * (hr[i] * inv);
    }
}

/* out[r, i] = silu(gate_up[r, i]) * gate_up[r, inter + i] */
void rsgl_silu_mul(const float* gate_up, float* out, int64_t rows, int64_t inter,
                   int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads) \
        if (rows * inter > PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        const float* g = gate_up + r * 2 * inter;
        const float* u = g + inter;
        float* o = out + r * inter;
        #pragma omp simd
        for (int64_t i = 0; i < inter; i++) o[i] = g[i] * sigmoid(g[i]) * u[i];
    }
}
