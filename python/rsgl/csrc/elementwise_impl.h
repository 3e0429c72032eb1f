/* add+RMSNorm, SiLU-and-multiply and the rotary of q/k, written once over the activation
   (model) dtype.
   elementwise.c includes this file once per dtype with ACT_BF16 defined: 1 for bfloat16
   rows, 0 for float32. Arithmetic is float32; a bfloat16 instance rounds every
   intermediate the eager torch ops would round, in the same order, so it matches them. */
#if ACT_BF16
#define ACT_T uint16_t
#define ACT_LOAD(p, i) bf16_to_f32((p)[i])
#define ACT_STORE(p, i, x) bf16_store(p, i, x)
#define ACT_ROUND(x) bf16_round(x)
#define ACT_FN(name) FN_PASTE(name, bf16)
#else
#define ACT_T float
#define ACT_LOAD(p, i) ((p)[i])
#define ACT_STORE(p, i, x) ((p)[i] = (x))
#define ACT_ROUND(x) (x)
#define ACT_FN(name) FN_PASTE(name, f32)
#endif

/* residual_out = x + residual (when residual is given, else x); out = rmsnorm(that) * w.
   As HF computes it: the sum is rounded to the model dtype, its statistics are float32,
   the normalized row is rounded before the weight multiplies it. */
void ACT_FN(rsgl_add_rmsnorm)(const ACT_T* x, const ACT_T* residual, ACT_T* residual_out,
                              const ACT_T* w, ACT_T* out, int64_t rows, int64_t dim,
                              float eps, int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads) \
        if (rows * dim > PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        const ACT_T* xr = x + r * dim;
        const ACT_T* hr = xr;
        float ss = 0.f;
#if ACT_BF16 && defined(__AVX512F__)
        /* By hand, as in silu_mul: GCC's loops spend most of their time in the bfloat16
           conversions (a [2000, 576] prefill row block: 0.66 ms before). */
        if (dim % 16 == 0) {
            ACT_T* o = out + r * dim;
            __m512 acc = _mm512_setzero_ps();
            if (residual) {
                const ACT_T* rr = residual + r * dim;
                ACT_T* sum = residual_out + r * dim;
                for (int64_t i = 0; i < dim; i += 16) {
                    const __m512 h =
                        bf16x16_round(_mm512_add_ps(bf16x16_load(xr + i), bf16x16_load(rr + i)));
                    bf16x16_store(sum + i, h);
                    acc = _mm512_fmadd_ps(h, h, acc);
                }
                hr = sum;
            } else {
                for (int64_t i = 0; i < dim; i += 16) {
                    const __m512 h = bf16x16_load(xr + i);
                    acc = _mm512_fmadd_ps(h, h, acc);
                }
            }
            const __m512 inv = _mm512_set1_ps(
                1.f / sqrtf(_mm512_reduce_add_ps(acc) / (float)dim + eps));
            for (int64_t i = 0; i < dim; i += 16) {
                const __m512 normed = bf16x16_round(_mm512_mul_ps(bf16x16_load(hr + i), inv));
                bf16x16_store(o + i, _mm512_mul_ps(bf16x16_load(w + i), normed));
            }
            continue;
        }
#endif
        if (residual) {
            const ACT_T* rr = residual + r * dim;
            ACT_T* sum = residual_out + r * dim;
            #pragma omp simd reduction(+ : ss)
            for (int64_t i = 0; i < dim; i++) {
                const float h = ACT_ROUND(ACT_LOAD(xr, i) + ACT_LOAD(rr, i));
                ACT_STORE(sum, i, h);
                ss += h * h;
            }
            hr = sum;
        } else {
            #pragma omp simd reduction(+ : ss)
            for (int64_t i = 0; i < dim; i++) ss += ACT_LOAD(xr, i) * ACT_LOAD(xr, i);
        }
        const float inv = 1.f / sqrtf(ss / (float)dim + eps);
        ACT_T* o = out + r * dim;
        #pragma omp simd
        for (int64_t i = 0; i < dim; i++)
            ACT_STORE(o, i, ACT_LOAD(w, i) * ACT_ROUND(ACT_LOAD(hr, i) * inv));
    }
}

/* out[r, i] = silu(gate_up[r, i]) * gate_up[r, inter + i], the SiLU rounded first. */
void ACT_FN(rsgl_silu_mul)(const ACT_T* gate_up, ACT_T* out, int64_t rows, int64_t inter,
                           int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads) \
        if (rows * inter > PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        const ACT_T* g = gate_up + r * 2 * inter;
        const ACT_T* u = g + inter;
        ACT_T* o = out + r * inter;
        int64_t start = 0;
#if ACT_BF16 && defined(__AVX512F__)
        /* GCC's own vectorization of this loop ran at half the float32 loop's speed (the
           bfloat16 conversions); by hand it is 16 lanes of float32 arithmetic. */
        for (; start + 16 <= inter; start += 16) {
            const __m512 gi = bf16x16_load(g + start);
            const __m512 silu = bf16x16_round(_mm512_mul_ps(gi, sigmoid16(gi)));
            bf16x16_store(o + start, _mm512_mul_ps(silu, bf16x16_load(u + start)));
        }
#endif
        #pragma omp simd
        for (int64_t i = start; i < inter; i++) {
            const float gi = ACT_LOAD(g, i);
            ACT_STORE(o, i, ACT_ROUND(gi * sigmoid(gi)) * ACT_LOAD(u, i));
        }
    }
}

/* Rotates in place the first `heads` D-wide slices of each row of x ([rows, width], the
   pair-interleaved rotary layout: q heads then k heads of a fused QKV row) by the row's
   cis ([D / 2] float32 (cos, sin) pairs), rounding as the eager rotary does (one float32
   complex multiply, then the activation dtype). */
void ACT_FN(rsgl_rotary)(ACT_T* x, const float* cis, int64_t rows, int64_t width,
                         int64_t heads, int64_t D, int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads) \
        if (rows * heads * D > PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        const float* cs = cis + r * D;
        for (int64_t h = 0; h < heads; h++) {
            ACT_T* xh = x + r * width + h * D;
            #pragma omp simd
            for (int64_t i = 0; i < D / 2; i++) {
                const float c = cs[2 * i], s = cs[2 * i + 1];
                const float x0 = ACT_LOAD(xh, 2 * i), x1 = ACT_LOAD(xh, 2 * i + 1);
                ACT_STORE(xh, 2 * i, x0 * c - x1 * s);
                ACT_STORE(xh, 2 * i + 1, x0 * s + x1 * c);
            }
        }
    }
}

/* out[r] = the index of the largest element of row r of x ([rows, cols]), as torch.argmax
   picks it: the first of equal maxima, and a NaN is larger than everything (the first NaN
   wins). Two passes over each row (it stays in cache between them): a max and a NaN flag,
   which vectorize, then the first position holding that value. Used by greedy sampling,
   straight on the LM head's bfloat16 logits (widening is exact, so the index is the one
   the float32 logits give). */
void ACT_FN(rsgl_argmax_rows)(const ACT_T* x, int64_t rows, int64_t cols, int64_t* out,
                              int nthreads) {
    /* One thread per row: a single row (a batch-1 step's logits) opens no parallel region,
       whose join would wait on a second thread with nothing to do. */
    #pragma omp parallel for schedule(static) num_threads(nthreads) \
        if (rows > 1 && rows * cols > PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        const ACT_T* xr = x + r * cols;
        float best = -INFINITY;
        int nan = 0;
        #pragma omp simd reduction(max : best) reduction(| : nan)
        for (int64_t i = 0; i < cols; i++) {
            const float v = ACT_LOAD(xr, i);
            nan |= v != v;
            best = v > best ? v : best;
        }
        int64_t at = 0;
        for (int64_t i = 0; i < cols; i++) {
            const float v = ACT_LOAD(xr, i);
            if (nan ? v != v : v == best) {
                at = i;
                break;
            }
        }
        out[r] = at;
    }
}

#undef ACT_T
#undef ACT_LOAD
#undef ACT_STORE
#undef ACT_ROUND
#undef ACT_FN
