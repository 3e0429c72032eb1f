"""Fused CPU kernels for float32 models, compiled on first use: paged decode attention over a
float32, float16 or bfloat16 KV cache (alone, or with the rotary and the KV store of a
decode-only layer step), add+RMSNorm, SiLU-and-multiply.

Eager PyTorch has to gather every decode request's keys and values into a padded copy before
it can attend (measured at batch 64: the gather alone costs more than a third of the model's
matmul time per step). The decode kernel reads K/V straight from the paged buffers through
req_to_token, once, with software prefetch for the indirect rows; `decode_layer` also
rotates q/k and stores k/v in the same pass over each request. The elementwise kernels
replace 4-7 small torch ops each (each op pays a thread-pool round trip at decode sizes).

The source is plain C (no torch headers, so it compiles in a few seconds), built with
the system C compiler into `~/.cache/rsgl/kernels` and called through ctypes, which releases
the GIL during the call. Without a compiler every caller falls back to eager torch ops.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rsgl.cache_dir import rsgl_cache_dir

logger = logging.getLogger(__name__)

_SOURCE = r"""
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
"""

# The attention kernels, written once over the KV element type KV_T and instantiated for
# each KV cache dtype (see _KV_TYPES).
_KV_SOURCE = r"""
/* Attention of one decode query (all H heads, qb) over the request's keys and values, read
   through its req_to_token row: scores for every head from one pass over the K rows, softmax,
   then one pass over the V rows. Query heads jG .. jG + G - 1 read kv head j (G = H / Hkv).
   K/V elements are KV_T, read as floats through FN(widen).
   Always inlined, so callers passing a constant D get fully unrolled inner loops. */
static inline __attribute__((always_inline)) void FN(attend_impl)(
    const float* qb, const KV_T* kb, const KV_T* vb, const int32_t* slots, int64_t len,
    int64_t H, int64_t Hkv, const int64_t D, float scale, float* sc, float* row_tmp,
    float* ob) {
    const int64_t G = H / Hkv;
    const int64_t row = Hkv * D;
    const int64_t row_bytes = row * (int64_t)sizeof(KV_T);
    for (int64_t s = 0; s < len; s++) {
        if (s + PREFETCH_AHEAD < len)
            prefetch_bytes(kb + (int64_t)slots[s + PREFETCH_AHEAD] * row, row_bytes);
        const float* k = FN(widen)(kb + (int64_t)slots[s] * row, row_tmp, row);
        for (int64_t j = 0; j < Hkv; j++) {
            const float* kh = k + j * D;
            for (int64_t h = j * G; h < (j + 1) * G; h++) {
                const float* qh = qb + h * D;
                float acc = 0.f;
                #pragma omp simd reduction(+ : acc)
                for (int64_t d = 0; d < D; d++) acc += qh[d] * kh[d];
                sc[h * len + s] = acc * scale;
            }
        }
    }
    softmax_rows(sc, H, len);
    for (int64_t i = 0; i < H * D; i++) ob[i] = 0.f;
    for (int64_t s = 0; s < len; s++) {
        if (s + PREFETCH_AHEAD < len)
            prefetch_bytes(vb + (int64_t)slots[s + PREFETCH_AHEAD] * row, row_bytes);
        const float* v = FN(widen)(vb + (int64_t)slots[s] * row, row_tmp, row);
        for (int64_t j = 0; j < Hkv; j++) {
            const float* vh = v + j * D;
            for (int64_t h = j * G; h < (j + 1) * G; h++) {
                float* oh = ob + h * D;
                const float p = sc[h * len + s];
                #pragma omp simd
                for (int64_t d = 0; d < D; d++) oh[d] += p * vh[d];
            }
        }
    }
}

#if defined(__AVX512F__)
/* The same attention with AVX-512 intrinsics, for D a multiple of 16 up to 256 (C = D / 16
   vectors per head), used for 16-bit caches (see attend_one). Two things the compiler does
   not do on its own:
   - a score's 16-lane partial sum is parked until 16 positions are done, then one
     transposing reduction (45 shuffles and adds) finishes 16 scores instead of a horizontal
     sum per score;
   - V accumulates in registers: per kv head, up to 16 vectors of its query heads' outputs
     over all positions, so each V element is widened once per group of (up to 4) heads
     that share it.
   K rows are read whole and in order: within a row the hardware prefetcher follows; across
   rows (indirect slots) software prefetch does. */

/* lane t of the result = the sum of the 16 lanes of v[t] */
static inline __m512 FN(sum16)(const __m512* v) {
    __m512 x[4];
    for (int i = 0; i < 4; i++) {
        const __m512* w = v + 4 * i;
        const __m512 a =
            _mm512_add_ps(_mm512_unpacklo_ps(w[0], w[1]), _mm512_unpackhi_ps(w[0], w[1]));
        const __m512 b =
            _mm512_add_ps(_mm512_unpacklo_ps(w[2], w[3]), _mm512_unpackhi_ps(w[2], w[3]));
        /* per 128-bit lane: [w0, w1, w2, w3] partial sums */
        x[i] = _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
    }
    const __m512 y0 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 y1 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(y0, y1, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(y0, y1, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* ob[h0 .. h0 + ng - 1] = the probabilities sc of those heads times V (kv head offset jD).
   The first group of a request prefetches whole V rows, so later groups find them cached. */
static inline __attribute__((always_inline)) void FN(v_group)(
    const float* sc, const KV_T* vb, const int32_t* slots, int64_t len, int64_t row,
    int64_t jD, const int64_t C, const int64_t ng, int64_t h0, int prefetch, float* ob) {
    const int64_t row_bytes = row * (int64_t)sizeof(KV_T);
    const int64_t D = 16 * C;
    __m512 acc[64]; /* ng * C <= 16 are used; the bound covers every ng, C pair */
    for (int64_t i = 0; i < ng * C; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t s = 0; s < len; s++) {
        if (prefetch && s + PREFETCH_AHEAD < len)
            prefetch_bytes(vb + (int64_t)slots[s + PREFETCH_AHEAD] * row, row_bytes);
        const KV_T* v = vb + (int64_t)slots[s] * row + jD;
        for (int64_t c = 0; c < C; c++) {
            const __m512 vc = KV_LOAD16(v + 16 * c);
            for (int64_t g = 0; g < ng; g++)
                acc[g * C + c] =
                    _mm512_fmadd_ps(_mm512_set1_ps(sc[(h0 + g) * len + s]), vc, acc[g * C + c]);
        }
    }
    for (int64_t g = 0; g < ng; g++)
        for (int64_t c = 0; c < C; c++)
            _mm512_storeu_ps(ob + (h0 + g) * D + 16 * c, acc[g * C + c]);
}

static inline __attribute__((always_inline)) void FN(attend_avx512_impl)(
    const float* qb, const KV_T* kb, const KV_T* vb, const int32_t* slots, int64_t len,
    int64_t H, int64_t Hkv, const int64_t D, float scale, float* sc, float* tmp, float* ob) {
    const int64_t G = H / Hkv, C = D / 16, row = Hkv * D;
    float* row_tmp = tmp;  /* a widened row */
    float* part = tmp + row;  /* H x 16 partial-sum vectors */
    const int64_t row_bytes = row * (int64_t)sizeof(KV_T);
    const __m512 vscale = _mm512_set1_ps(scale);
    /* Whole K rows in order, prefetched PREFETCH_AHEAD rows ahead; each
       score's 16-lane partial sum waits in part (H x 16 vectors) until 16 positions are
       done, then one transposing reduction per head finishes them. */
    int64_t s0 = 0;
    for (; s0 + 16 <= len; s0 += 16) {
        for (int64_t t = 0; t < 16; t++) {
            const int64_t s = s0 + t;
            if (s + PREFETCH_AHEAD < len)
                prefetch_bytes(kb + (int64_t)slots[s + PREFETCH_AHEAD] * row, row_bytes);
            const float* k = FN(widen)(kb + (int64_t)slots[s] * row, row_tmp, row);
            for (int64_t h = 0; h < H; h++) {
                const float* kh = k + (h / G) * D;
                const float* qh = qb + h * D;
                __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qh), _mm512_loadu_ps(kh));
                for (int64_t c = 1; c < C; c++)
                    a = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * c),
                                        _mm512_loadu_ps(kh + 16 * c), a);
                _mm512_storeu_ps(part + (h * 16 + t) * 16, a);
            }
        }
        for (int64_t h = 0; h < H; h++) {
            __m512 v[16];
            for (int64_t t = 0; t < 16; t++) v[t] = _mm512_loadu_ps(part + (h * 16 + t) * 16);
            _mm512_storeu_ps(sc + h * len + s0, _mm512_mul_ps(FN(sum16)(v), vscale));
        }
    }
    for (int64_t s = s0; s < len; s++) {
        const KV_T* k = kb + (int64_t)slots[s] * row;
        for (int64_t h = 0; h < H; h++) {
            const KV_T* kh = k + (h / G) * D;
            const float* qh = qb + h * D;
            __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qh), KV_LOAD16(kh));
            for (int64_t c = 1; c < C; c++)
                a = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * c), KV_LOAD16(kh + 16 * c), a);
            sc[h * len + s] = _mm512_reduce_add_ps(a) * scale;
        }
    }
    softmax_rows(sc, H, len);
    /* Per kv head, its query heads in groups of up to 4 (and 16 / C), so the group's
       accumulators stay in registers over all positions. */
    const int64_t NG = C >= 16 ? 1 : (16 / C < 4 ? 16 / C : 4);
    for (int64_t j = 0; j < Hkv; j++) {
        for (int64_t g0 = 0; g0 < G; g0 += NG) {
            const int64_t h0 = j * G + g0;
            const int pf = j == 0 && g0 == 0;
            switch (G - g0 < NG ? G - g0 : NG) {
                case 1: FN(v_group)(sc, vb, slots, len, row, j * D, C, 1, h0, pf, ob); break;
                case 2: FN(v_group)(sc, vb, slots, len, row, j * D, C, 2, h0, pf, ob); break;
                case 3: FN(v_group)(sc, vb, slots, len, row, j * D, C, 3, h0, pf, ob); break;
                default: FN(v_group)(sc, vb, slots, len, row, j * D, C, 4, h0, pf, ob); break;
            }
        }
    }
}
#endif

/* sc: len * H scores, tmp: ATTEND_TMP(H, Hkv, D) floats of scratch. */
static void FN(attend_one)(const float* qb, const KV_T* kb, const KV_T* vb,
                           const int32_t* slots, int64_t len, int64_t H, int64_t Hkv, int64_t D,
                           float scale, float* sc, float* tmp, float* ob) {
#if defined(__AVX512F__)
    /* Measured per element type (decode at batch 64, ~165 positions): for 16-bit caches the
       intrinsics path is ~20% faster on contiguous rows and equal on scattered ones; for
       float32 the compiler's loops below are ~15% faster on contiguous rows (equal on
       scattered), so float32 stays on them. */
    if (KV_AVX512 && D == 64)
        return FN(attend_avx512_impl)(qb, kb, vb, slots, len, H, Hkv, 64, scale, sc, tmp, ob);
    if (KV_AVX512 && D == 128)
        return FN(attend_avx512_impl)(qb, kb, vb, slots, len, H, Hkv, 128, scale, sc, tmp, ob);
    if (KV_AVX512 && D % 16 == 0 && D <= 256)
        return FN(attend_avx512_impl)(qb, kb, vb, slots, len, H, Hkv, D, scale, sc, tmp, ob);
#endif
    if (D == 64)
        FN(attend_impl)(qb, kb, vb, slots, len, H, Hkv, 64, scale, sc, tmp, ob);
    else if (D == 128)
        FN(attend_impl)(qb, kb, vb, slots, len, H, Hkv, 128, scale, sc, tmp, ob);
    else
        FN(attend_impl)(qb, kb, vb, slots, len, H, Hkv, D, scale, sc, tmp, ob);
}

/* out[b, h] = softmax(q[b, h] . K[b]^T * scale) V[b] for one query per request, where the
   keys of request b are the rows kb[req_to_token[req_slots[b], 0:seq_lens[b]]]. One request
   per work item. */
void FN(rsgl_decode_attention)(
    const float* q, const KV_T* kb, const KV_T* vb, const int32_t* req_to_token,
    int64_t r2t_stride, const int64_t* req_slots, const int64_t* seq_lens, float* out,
    int64_t B, int64_t H, int64_t Hkv, int64_t D, float scale, int nthreads) {
    #pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int64_t b = 0; b < B; b++) {
        const int64_t len = seq_lens[b];
        float* sc = (float*)malloc(sizeof(float) * (size_t)(len * H + ATTEND_TMP(H, Hkv, D)));
        FN(attend_one)(q + b * H * D, kb, vb, req_to_token + req_slots[b] * r2t_stride, len, H,
                       Hkv, D, scale, sc, sc + len * H, out + b * H * D);
        free(sc);
    }
}

/* A decode-only layer step after the QKV projection, per request b: rotate q and k of row b
   of qkv ([B, (H + 2 Hkv) D], pair-interleaved rotary layout) by cis[b] ([D / 2] (cos, sin)
   pairs), store the rotated k and v at KV slot loc[b] (rounded to KV_T), then attend as
   rsgl_decode_attention. Request b's own key is among those it reads (req_to_token already
   maps position seq_lens[b] - 1 to loc[b]); other requests never read row loc[b]. */
void FN(rsgl_decode_layer)(
    const float* qkv, const float* cis, const int64_t* loc, KV_T* kb, KV_T* vb,
    const int32_t* req_to_token, int64_t r2t_stride, const int64_t* req_slots,
    const int64_t* seq_lens, float* out, int64_t B, int64_t H, int64_t Hkv, int64_t D,
    float scale, int nthreads) {
    const int64_t row = Hkv * D;
    const int64_t width = (H + 2 * Hkv) * D;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int64_t b = 0; b < B; b++) {
        const int64_t len = seq_lens[b];
        const float* x = qkv + b * width;
        const float* cs = cis + b * D;
        const int64_t scratch = H * D + len * H + ATTEND_TMP(H, Hkv, D);
        float* q = (float*)malloc(sizeof(float) * (size_t)scratch);
        float* sc = q + H * D;
        KV_T* k = kb + loc[b] * row;
        for (int64_t h = 0; h < H; h++) {
            const float* xh = x + h * D;
            float* dst = q + h * D;
            for (int64_t i = 0; i < D / 2; i++) {
                const float c = cs[2 * i], s = cs[2 * i + 1];
                const float x0 = xh[2 * i], x1 = xh[2 * i + 1];
                dst[2 * i] = x0 * c - x1 * s;
                dst[2 * i + 1] = x0 * s + x1 * c;
            }
        }
        for (int64_t h = 0; h < Hkv; h++) {
            const float* xh = x + (H + h) * D;
            KV_T* dst = k + h * D;
            for (int64_t i = 0; i < D / 2; i++) {
                const float c = cs[2 * i], s = cs[2 * i + 1];
                const float x0 = xh[2 * i], x1 = xh[2 * i + 1];
                KV_STORE(dst, 2 * i, x0 * c - x1 * s);
                KV_STORE(dst, 2 * i + 1, x0 * s + x1 * c);
            }
        }
        const float* v = x + (H + Hkv) * D;
        KV_T* vdst = vb + loc[b] * row;
        for (int64_t i = 0; i < row; i++) KV_STORE(vdst, i, v[i]);
        FN(attend_one)(q, kb, vb, req_to_token + req_slots[b] * r2t_stride, len, H, Hkv, D,
                       scale, sc, sc + len * H, out + b * H * D);
        free(q);
    }
}
"""


@dataclass(frozen=True, slots=True)
class _KvType:
    """How the C source spells one KV cache element type."""

    c_type: str
    suffix: str
    store: str  # KV_STORE(p, i, x): element i of p = x, rounded to nearest even
    load16: str  # KV_LOAD16(p) (AVX-512 only): elements p[0:16] as a __m512 of floats
    avx512: bool  # attend with the AVX-512 intrinsics path when the CPU has it
    guard: str = "1"  # a preprocessor condition: the type's kernels exist only where it holds


_KV_TYPES: dict[torch.dtype, _KvType] = {
    torch.float32: _KvType("float", "f32", "((p)[i] = (x))", "_mm512_loadu_ps(p)", False),
    torch.float16: _KvType(
        "_Float16",
        "f16",
        "((p)[i] = (_Float16)(x))",
        "_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(p)))",
        True,
        "defined(__FLT16_MAX__)",
    ),
    torch.bfloat16: _KvType(
        "uint16_t",
        "bf16",
        "bf16_store(p, i, x)",
        "_mm512_castsi512_ps(_mm512_slli_epi32("
        "_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(p))), 16))",
        True,
    ),
}


def _full_source() -> str:
    parts = [_SOURCE]
    for kv in _KV_TYPES.values():
        parts.append(
            f"#if {kv.guard}\n#define KV_T {kv.c_type}\n#define KV_SUFFIX {kv.suffix}\n"
            f"#define KV_STORE(p, i, x) {kv.store}\n#define KV_LOAD16(p) {kv.load16}\n"
            f"#define KV_AVX512 {int(kv.avx512)}\n"
        )
        parts.append(_KV_SOURCE)
        parts.append(
            "#undef KV_T\n#undef KV_SUFFIX\n#undef KV_STORE\n#undef KV_LOAD16\n#undef KV_AVX512\n"
            "#endif\n"
        )
    return "".join(parts)


# Compile flags. -ffast-math is for compiling only: a shared library *linked* with it gets
# crtfastmath, which turns on flush-to-zero for the whole process, torch included.
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-fopenmp", "-fPIC"]
_LINK_FLAGS = ["-shared", "-fopenmp"]


def _check(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if not t.is_contiguous() or t.device.type != "cpu" or t.dtype != torch.float32:
            raise ValueError("CPU kernels take contiguous float32 CPU tensors")


def _check_kv(
    kernels: dict[torch.dtype, Any], k_buffer: torch.Tensor, v_buffer: torch.Tensor, heads: int
) -> None:
    for t in (k_buffer, v_buffer):
        if not t.is_contiguous() or t.device.type != "cpu" or t.dtype != k_buffer.dtype:
            raise ValueError("the K and V buffers must be contiguous CPU tensors of one dtype")
    if k_buffer.dim() != 3 or k_buffer.shape != v_buffer.shape:
        raise ValueError("the K and V buffers must both be [slots, kv_heads, head_dim]")
    if k_buffer.dtype not in kernels:
        supported = ", ".join(str(d) for d in kernels)
        raise ValueError(f"KV buffers of {k_buffer.dtype}: the kernels were built for {supported}")
    if heads % k_buffer.shape[1]:
        raise ValueError(f"{heads} query heads do not divide into {k_buffer.shape[1]} kv heads")


def _check_index(t: torch.Tensor, dtype: torch.dtype) -> None:
    if not t.is_contiguous() or t.device.type != "cpu" or t.dtype != dtype:
        raise ValueError(f"CPU kernels take contiguous {dtype} CPU index tensors")


class CpuKernels:
    """ctypes handles on the compiled kernels; every method writes into `out`."""

    def __init__(self, library: Path) -> None:
        self.library = library
        lib = ctypes.CDLL(str(library))
        ptr, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
        # Per KV cache dtype: the attention kernels instantiated for its element type (a type
        # whose guard failed at compile time has none).
        self._decode: dict[torch.dtype, Any] = {}
        self._decode_layer: dict[torch.dtype, Any] = {}
        for dtype, kv in _KV_TYPES.items():
            if not hasattr(lib, f"rsgl_decode_attention_{kv.suffix}"):
                continue
            decode = getattr(lib, f"rsgl_decode_attention_{kv.suffix}")
            decode.argtypes = [ptr, ptr, ptr, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, f32, i32]
            layer = getattr(lib, f"rsgl_decode_layer_{kv.suffix}")
            layer.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, i64, ptr, ptr, ptr]
            layer.argtypes += [i64, i64, i64, i64, f32, i32]
            self._decode[dtype], self._decode_layer[dtype] = decode, layer
        self._add_rmsnorm = lib.rsgl_add_rmsnorm
        self._add_rmsnorm.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64, f32, i32]
        self._silu_mul = lib.rsgl_silu_mul
        self._silu_mul.argtypes = [ptr, ptr, i64, i64, i32]
        for fn in (*self._decode.values(), *self._decode_layer.values()):
            fn.restype = None
        self._add_rmsnorm.restype = self._silu_mul.restype = None

    @property
    def kv_dtypes(self) -> tuple[torch.dtype, ...]:
        """The KV cache dtypes the attention kernels were built for."""
        return tuple(self._decode)

    def decode_attention(
        self,
        q: torch.Tensor,
        k_buffer: torch.Tensor,
        v_buffer: torch.Tensor,
        req_to_token: torch.Tensor,
        req_slots: torch.Tensor,
        seq_lens: torch.Tensor,
        out: torch.Tensor,
        scale: float,
    ) -> None:
        """q/out: [B, H, D] float32; buffers [N, Hkv, D] of a KV dtype (float32, float16,
        bfloat16); req_to_token int32; slots/lens int64 [B]."""
        _check(q, out)
        _check_kv(self._decode, k_buffer, v_buffer, q.shape[1])
        _check_index(req_to_token, torch.int32)
        _check_index(req_slots, torch.int64)
        _check_index(seq_lens, torch.int64)
        b, h, d = q.shape
        if d != k_buffer.shape[2] or out.shape != q.shape:
            raise ValueError("decode_attention: q, out and the KV buffers' head_dim must agree")
        if req_slots.shape != (b,) or seq_lens.shape != (b,):
            raise ValueError(f"decode_attention: req_slots and seq_lens must have shape ({b},)")
        self._decode[k_buffer.dtype](
            q.data_ptr(),
            k_buffer.data_ptr(),
            v_buffer.data_ptr(),
            req_to_token.data_ptr(),
            req_to_token.stride(0),
            req_slots.data_ptr(),
            seq_lens.data_ptr(),
            out.data_ptr(),
            b,
            h,
            k_buffer.shape[1],
            d,
            scale,
            torch.get_num_threads(),
        )

    def decode_layer(
        self,
        qkv: torch.Tensor,
        cis: torch.Tensor,
        out_cache_loc: torch.Tensor,
        k_buffer: torch.Tensor,
        v_buffer: torch.Tensor,
        req_to_token: torch.Tensor,
        req_slots: torch.Tensor,
        seq_lens: torch.Tensor,
        num_heads: int,
        scale: float,
    ) -> torch.Tensor:
        """Rotary + KV store + decode attention for a decode-only batch, in one call.

        qkv: [B, (H + 2 Hkv) D] (pair-interleaved q/k); cis: [B, D / 2, 2] float32 (cos, sin);
        out_cache_loc, req_slots, seq_lens: int64 [B]. Returns [B, H * D].
        """
        _check(qkv, cis)
        _check_kv(self._decode_layer, k_buffer, v_buffer, num_heads)
        _check_index(req_to_token, torch.int32)
        b = qkv.shape[0]
        for t in (out_cache_loc, req_slots, seq_lens):
            _check_index(t, torch.int64)
            if t.shape != (b,):
                raise ValueError(f"decode_layer: index tensors must have shape ({b},)")
        _, kv_heads, d = k_buffer.shape
        if qkv.shape[1] != (num_heads + 2 * kv_heads) * d or cis.numel() != b * d:
            raise ValueError("decode_layer: qkv / cis shapes do not match the KV buffers")
        out = torch.empty((b, num_heads * d), dtype=qkv.dtype)
        self._decode_layer[k_buffer.dtype](
            qkv.data_ptr(),
            cis.data_ptr(),
            out_cache_loc.data_ptr(),
            k_buffer.data_ptr(),
            v_buffer.data_ptr(),
            req_to_token.data_ptr(),
            req_to_token.stride(0),
            req_slots.data_ptr(),
            seq_lens.data_ptr(),
            out.data_ptr(),
            b,
            num_heads,
            kv_heads,
            d,
            scale,
            torch.get_num_threads(),
        )
        return out

    def add_rmsnorm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        weight: torch.Tensor,
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rmsnorm(x + residual) * weight, x + residual); without residual, (norm(x), x)."""
        _check(x, weight) if residual is None else _check(x, residual, weight)
        rows, dim = x.shape
        out = torch.empty_like(x)
        summed = x if residual is None else torch.empty_like(x)
        self._add_rmsnorm(
            x.data_ptr(),
            None if residual is None else residual.data_ptr(),
            summed.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            rows,
            dim,
            eps,
            torch.get_num_threads(),
        )
        return out, summed

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for gate_up = [gate | up] ([rows, 2 * inter])."""
        _check(gate_up)
        rows, width = gate_up.shape
        out = torch.empty((rows, width // 2), dtype=gate_up.dtype)
        self._silu_mul(
            gate_up.data_ptr(), out.data_ptr(), rows, width // 2, torch.get_num_threads()
        )
        return out


def _cpu_fingerprint() -> str:
    # -march=native code must not be reused on a CPU with other instruction sets.
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


@functools.lru_cache(maxsize=1)
def load_cpu_kernels() -> CpuKernels | None:
    """Compile (once per source and CPU) and load the kernels; None when they cannot be built.

    Set RSGL_CPU_KERNELS=0 to force the eager torch paths.
    """
    if os.environ.get("RSGL_CPU_KERNELS", "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    source = _full_source()
    flags = " ".join(_FLAGS + _LINK_FLAGS)
    key = hashlib.sha256((source + flags + _cpu_fingerprint()).encode()).hexdigest()
    out_dir = rsgl_cache_dir() / "kernels"
    library = out_dir / f"cpu_kernels-{key[:16]}.so"
    if not library.exists():
        out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
            src = Path(tmp) / "cpu_kernels.c"
            src.write_text(source, encoding="utf-8")
            obj, tmp_lib = Path(tmp) / "cpu_kernels.o", Path(tmp) / "cpu_kernels.so"
            for cmd in (
                [compiler, *_FLAGS, "-c", str(src), "-o", str(obj)],
                [compiler, *_LINK_FLAGS, str(obj), "-o", str(tmp_lib)],
            ):
                result = subprocess.run(cmd, capture_output=True, text=True, check=False)
                if result.returncode != 0:
                    break
            if result.returncode != 0:
                logger.warning(
                    "the CPU kernels did not compile (%s); using eager torch ops:\n%s",
                    compiler,
                    result.stderr[-2000:],
                )
                return None
            # Rename is atomic, so concurrent first loads never see a half-written library.
            os.replace(tmp_lib, library)
    try:
        return CpuKernels(library)
    except OSError:
        return None
