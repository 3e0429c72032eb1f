/* Helpers shared by rsgl's CPU kernels (see rsgl/layers/cpu_kernels.py): prefetching,
   fast exp and sigmoid, widening 16-bit KV rows to floats, softmax, and FN(name), which
   names a kernel instance after the KV element type it was compiled for. */
#ifndef RSGL_COMMON_H
#define RSGL_COMMON_H
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

/* Rows this many positions ahead are prefetched: KV slots are indirect, so the hardware
   prefetcher cannot follow them when the core's allocator scattered a request's pages. */
#define PREFETCH_AHEAD 4

static inline void prefetch_bytes(const void* p, int64_t n) {
    for (int64_t i = 0; i < n; i += 64) __builtin_prefetch((const char*)p + i);
}

/* exp(x) for x <= 0: range reduction to [-ln2/2, ln2/2], a degree-6 polynomial (Cephes
   coefficients, ~1 ulp), and the power of two put straight into the exponent bits. Plain
   arithmetic, so the softmax loop vectorizes; libm's expf is a scalar call per element. */
static inline float exp_nonpos(float x) {
    x = x < -87.f ? -87.f : x;
    const float n = __builtin_rintf(x * 1.44269504088896341f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    union { float f; int32_t i; } u;
    u.i = ((int32_t)n + 127) << 23;
    return p * u.f;
}

/* exp(x) for any x, through exp_nonpos: e^x = 1 / e^-x for x > 0. */
static inline float sigmoid(float x) {
    const float e = exp_nonpos(x > 0.f ? -x : x);
    return x > 0.f ? 1.f / (1.f + e) : e / (1.f + e);
}

/* The elementwise kernels split rows over threads above this many elements (~150 KB per
   operand): below it the fork/join costs more than it saves. */
#define PARALLEL_MIN_ELEMS 32768

/* A KV row as floats: float32 rows are used in place; 16-bit rows are widened into tmp
   (n floats), so the attention loops run on floats whatever the cache stores. */
static inline const float* widen_f32(const float* src, float* tmp, int64_t n) {
    (void)tmp;
    (void)n;
    return src;
}

#if defined(__FLT16_MAX__)
/* float16 needs the compiler's _Float16 (GCC 12, clang 15 on x86-64); without it the float16
   kernels are left out and a float16 cache uses the eager torch path. */
static inline const float* widen_f16(const _Float16* src, float* tmp, int64_t n) {
    int64_t i = 0;
#if defined(__F16C__)
    /* GCC 12 cannot vectorize _Float16 -> float without AVX512-FP16; F16C can. */
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(tmp + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(src + i))));
#endif
    for (; i < n; i++) tmp[i] = (float)src[i];
    return tmp;
}
#endif

/* bfloat16 is the top half of a float32: widening is a shift; narrowing rounds to nearest
   even (as torch's .to(torch.bfloat16) does) and keeps NaN a quiet NaN. */
static inline const float* widen_bf16(const uint16_t* src, float* tmp, int64_t n) {
    #pragma omp simd
    for (int64_t i = 0; i < n; i++) {
        union { uint32_t u; float f; } c;
        c.u = (uint32_t)src[i] << 16;
        tmp[i] = c.f;
    }
    return tmp;
}

static inline void bf16_store(uint16_t* p, int64_t i, float x) {
    union { float f; uint32_t u; } c;
    c.f = x;
    if ((c.u & 0x7fffffffu) > 0x7f800000u)
        p[i] = (uint16_t)((c.u >> 16) | 0x40u);
    else
        p[i] = (uint16_t)((c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16);
}

/* Scratch floats attend_one needs: a widened row (Hkv * D) and H x 16 x 16 partial sums. */
#define ATTEND_TMP(H, Hkv, D) ((Hkv) * (D) + 256 * (H))

/* Each of the H rows of sc (len scores) becomes its softmax. */
static void softmax_rows(float* sc, int64_t H, int64_t len) {
    for (int64_t h = 0; h < H; h++) {
        float* sh = sc + h * len;
        float mx = -FLT_MAX;
        for (int64_t s = 0; s < len; s++) mx = sh[s] > mx ? sh[s] : mx;
        float sum = 0.f;
        for (int64_t s = 0; s < len; s++) {
            sh[s] = exp_nonpos(sh[s] - mx);
            sum += sh[s];
        }
        const float inv = 1.f / sum;
        for (int64_t s = 0; s < len; s++) sh[s] *= inv;
    }
}

/* FN(name) pastes the KV element suffix onto a name: rsgl_decode_layer_f16, ... */
#define FN_PASTE(name, suffix) name##_##suffix
#define FN_EXPAND(name, suffix) FN_PASTE(name, suffix)
#define FN(name) FN_EXPAND(name, KV_SUFFIX)

#endif /* RSGL_COMMON_H */
