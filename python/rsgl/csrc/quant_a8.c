/* Projections over GGUF blocks with int8 activations (`--quantization gguf_a8`): what
   llama.cpp computes for Q4_0, Q4_1 and Q8_0 weights (W4A8 / W8A8), y[M, N] = x[M, K] . W^T.

   Each row of x is quantized per block of 32 values, as llama.cpp's Q8_1: dx = max|x| / 127,
   qx = x / dx rounded to the nearest integer (ties to even), and sx = dx * sum(qx). A weight
   block w = d * q + m (Q4_0: m = -8d; Q8_0: m = 0, q signed) then contributes

       sum(w * x') = d * dx * sum(q * qx) + m * sx,

   where x' = dx * qx is the quantized row and sum(q * qx) an exact integer sum: byte
   products summed in pairs (maddubs), then in fours (madd), 8 lanes a block (the byte
   formats) or, two 4-bit blocks a register, 4 lanes each. Where the exact kernels (quant.c)
   rebuild each float32 weight (a conversion and two multiply-adds per 8 weights), this is a
   few integer instructions and a conversion per 32 weights, and the weights stay the file's;
   what changes is x, rounded to 8 bits per block. So the logits are not the float32 model's:
   `rsgl bench quality --modes gguf_a8` measures the KL divergence that costs.

   GGUF's K-quants, read at load time as groups (quant.c's I4 for Q4_K, I8H for Q3_K and
   Q6_K, I8M for Q5_K; rsgl/models/gguf_weights.py), are multiplied the same way: their
   quants are the file's (4 bits, or 3, 5 and 6 bits held in bytes), each group's scale (and
   minimum) a float32 from their arrays instead of a block header; I8H's two scales a block
   of 32 each take the half of the block's 8 lanes that sums their 16 weights. (llama.cpp
   quantizes x per 256 for the K-quants, Q8_K; here every format takes Q8_1's blocks of 32.)

   Each (row of x, weight row) is summed in one order whatever the batch (8 lanes over the
   blocks or pairs of blocks, then a fixed tree; the offsets' terms in four lanes beside,
   one block each), so a request's logits do not depend on the batch it ran in. */
#include "gguf_blocks.h"

/* Where element i of block b of a quantized row goes. For the 4-bit formats under AVX2 the
   blocks go in pairs, each pair's 64 bytes as [a 0..15, b 0..15, a 16..31, b 16..31]: two
   blocks' nibbles in one register (16 bytes each, element j in the low half of byte j and
   j + 16 in the high one; a load and an insert), masked, give the first halves of both
   blocks, shifted and masked their second halves, each beside its 32 bytes of x. A row's
   odd last block stays in order. */
static inline int64_t qx_index(int paired, int64_t nb, int64_t b, int i) {
    if (!paired || (b == nb - 1 && nb % 2)) return b * QK + i;
    return (b & ~(int64_t)1) * QK + (i >= 16) * 32 + (b & 1) * 16 + (i & 15);
}

/* Row x[K] quantized per block: q[K] int8 (laid out by qx_index), and per block the pair
   (dx, dx * sum(q)) in ds[2b], ds[2b + 1]. */
static void quantize_row(const float* x, int64_t K, int paired, int8_t* q, float* ds) {
    const int64_t nb = K / QK;
    for (int64_t b = 0; b < nb; b++) {
        const float* xb = x + b * QK;
        float amax = 0.f;
        for (int i = 0; i < QK; i++) {
            const float a = xb[i] < 0.f ? -xb[i] : xb[i];
            amax = a > amax ? a : amax;
        }
        const float d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
        int sum = 0;
        for (int i = 0; i < QK; i++) {
            const int v = (int)__builtin_rintf(xb[i] * id);
            q[qx_index(paired, nb, b, i)] = (int8_t)v;
            sum += v;
        }
        ds[2 * b] = d;
        ds[2 * b + 1] = d * (float)sum;
    }
}

/* Blocks per row of the pairs array: a multiple of 4, the tail zero (one AVX2 register
   holds four blocks' pairs). */
static inline int64_t pair_blocks(int64_t nb) { return (nb + 3) & ~(int64_t)3; }

/* Rows of x quantized: K bytes of q per row, and pair_blocks(K / 32) pairs per row. */
typedef struct {
    const int8_t* q;
    const float* ds;
    int64_t K;
} QRows;

/* Where a block's quants start (after a GGUF header), and whether they are signed bytes (the
   byte formats: as quant.c reads them; Q5_K's I8M holds 0..31). */
static inline int64_t quants_offset(int fmt) {
    return fmt == Q4_1 ? 4 : fmt == Q4_0 || fmt == Q8_0 ? 2 : 0;
}
static inline int signed_quants(int fmt) { return int8_quants(fmt); }

/* Whether a block's weights have an offset m (w = d * q + m), summed as m * sx. */
static inline int has_offset(int fmt) { return fmt != Q8_0 && fmt != I8 && fmt != I8H; }

/* Block k of weight row n's scale and offset (I8H: its two scales) from a load-time
   format's arrays. */
static inline void group_params(int fmt, const QMat* a, int64_t n, int64_t k, float* d,
                                float* m) {
    const int64_t g = n * a->groups + k / blocks_per_scale(fmt, a) * scales_per_block(fmt);
    *d = a->scales[g];
    *m = fmt == I8H ? a->scales[g + 1] : a->mins ? a->mins[g] : 0.f;
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
/* Whether x's blocks go in pairs (qx_index) for weights of format fmt: the nibble formats. */
#define A8_PAIRED(fmt) ((fmt) == Q4_0 || (fmt) == Q4_1 || (fmt) == I4)

/* A weight block's 32 quants as bytes in element order, and (signed formats) their signs.
   Nibble byte j holds element j (low half) and j + 16 (high half): the 16 bytes broadcast
   to both halves, the high half shifted down 4, then masked. */
static inline __m256i block_quants(int fmt, const uint8_t* q) {
    if (!A8_PAIRED(fmt)) return _mm256_loadu_si256((const __m256i*)q);
    const __m256i both = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)q));
    const __m256i shifted = _mm256_blend_epi32(both, _mm256_srli_epi16(both, 4), 0xf0);
    return _mm256_and_si256(shifted, _mm256_set1_epi8(15));
}

/* sum(q * qx) of one block in 8 int32 lanes (lanes 0..3: elements 0..15), as floats.
   maddubs multiplies unsigned bytes by signed ones: nibbles are unsigned as they are; byte
   quants give their magnitudes and their signs move onto qx (|qx| <= 127, so no product
   saturates: 2 * 15 * 127 and 2 * 128 * 127 fit in 16 bits). */
static inline __m256 block_dot(int fmt, __m256i wq, const int8_t* qx) {
    __m256i a = _mm256_loadu_si256((const __m256i*)qx);
    if (signed_quants(fmt)) {
        a = _mm256_sign_epi8(a, wq);
        wq = _mm256_abs_epi8(wq);
    }
    const __m256i pairs = _mm256_maddubs_epi16(wq, a);
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

/* Two consecutive 4-bit blocks' quants (q: the first one's nibbles, bb bytes apart): elements
   0..15 of both in lo, 16..31 in hi, the first block's in the low 16 bytes of each. */
static inline void pair_quants(const uint8_t* q, int64_t bb, __m256i* lo, __m256i* hi) {
    const __m256i v = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)q)),
        _mm_loadu_si128((const __m128i*)(q + bb)), 1);
    *lo = _mm256_and_si256(v, _mm256_set1_epi8(15));
    *hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(15));
}

/* sum(q * qx) of a pair of blocks as floats, the first's in lanes 0..3 and the second's in
   4..7 (qx laid out by qx_index). The halves' byte products are summed in pairs and the two
   added in 16 bits: at most 2 * 2 * 15 * 127, no saturation. */
static inline __m256 pair_dot(__m256i lo, __m256i hi, const int8_t* qx) {
    const __m256i sums = _mm256_add_epi16(
        _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i*)qx)),
        _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i*)(qx + 32))));
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(sums, _mm256_set1_epi16(1)));
}

/* A pair of blocks' scales d * dx (sc: the first one's (scale, offset term) pair, then the
   second's) spread to the lanes pair_dot gives each block. */
static inline __m256 pair_scales(const float* sc) {
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_loadu_ps(sc)),
                                    _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2));
}

/* Four blocks' (d, m) pairs times x's (dx, sx) pairs: each block's scale d * dx in the even
   lanes, its offset term m * sx in the odd ones (Q4_0's m is -8d). I8H's pairs are a block's
   two scales, each times dx. */
static inline __m256 pair_products(int fmt, __m256 w, const float* ds) {
    if (fmt == Q4_0)
        w = _mm256_mul_ps(_mm256_moveldup_ps(w), _mm256_setr_ps(1, -8, 1, -8, 1, -8, 1, -8));
    const __m256 x = _mm256_loadu_ps(ds);
    return _mm256_mul_ps(w, fmt == I8H ? _mm256_moveldup_ps(x) : x);
}

/* The (d, m) pairs of blocks k .. k + 3 of weight row n (fewer at the row's end, the rest
   0): GGUF's from their headers, the load-time formats' from their arrays. */
static inline __m256 block_pairs(int fmt, const QMat* a, int64_t n, int64_t k, int64_t count) {
    if (!load_time(fmt))
        return header_pairs(fmt, a->w + n * a->row_bytes + k * block_bytes(fmt), count);
    if (count >= 4 && fmt == I8H)
        return _mm256_loadu_ps(a->scales + n * a->groups + 2 * k);
    if (count >= 4 && blocks_per_scale(fmt, a) == 1) {
        const __m128 d = _mm_loadu_ps(a->scales + n * a->groups + k);
        const __m128 m =
            a->mins ? _mm_loadu_ps(a->mins + n * a->groups + k) : _mm_setzero_ps();
        return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_unpacklo_ps(d, m)),
                                    _mm_unpackhi_ps(d, m), 1);
    }
    float p[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t i = 0; i < count && i < 4; i++)
        group_params(fmt, a, n, k + i, p + 2 * i, p + 2 * i + 1);
    return _mm256_setr_ps(p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7]);
}

/* A single block's scale for its 8 lanes (sc: its pair): d * dx in all, or I8H's two scales,
   one for each half. */
static inline __m256 block_scale(int fmt, const float* sc) {
    if (fmt != I8H) return _mm256_broadcast_ss(sc);
    const __m128 two = _mm_castsi128_ps(_mm_loadl_epi64((const __m128i*)sc));
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(two),
                                    _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
}

/* Rows x[0 .. R) times weight rows n .. n + W - 1 (R * W <= 8, constants in each inlined
   copy), into y[r * N + n + i]: each weight pair's quants unpacked once for the R rows. A
   chunk of blocks first gets every (weight row, x row)'s block scales and offset terms, four
   blocks a multiply; the block loop is then the integer dot and one multiply-add. */
static inline __attribute__((always_inline)) void a8_tile(const int fmt, const QMat* a,
                                                          int64_t n, const QRows* x,
                                                          const int R, const int W, float* y,
                                                          int64_t N) {
    const uint8_t* w = a->w;
    const int64_t row_bytes = a->row_bytes;
    /* (weight row i, row r)'s sums at [i * R + r] */
    __m256 acc[8], offs[8];
    for (int t = 0; t < R * W; t++) acc[t] = offs[t] = _mm256_setzero_ps();
    const int64_t nb = x->K / QK, np = pair_blocks(nb), qoff = quants_offset(fmt);
    float sc[8][2 * HEADER_CHUNK];
    for (int64_t c0 = 0; c0 < nb; c0 += HEADER_CHUNK) {
        const int64_t c1 = c0 + HEADER_CHUNK < nb ? c0 + HEADER_CHUNK : nb;
        for (int i = 0; i < W; i++)
            for (int64_t j = 0; j < c1 - c0; j += 4) {
                const __m256 h = block_pairs(fmt, a, n + i, c0 + j, c1 - c0 - j);
                for (int r = 0; r < R; r++) {
                    const __m256 p = pair_products(fmt, h, x->ds + r * 2 * np + 2 * (c0 + j));
                    _mm256_storeu_ps(sc[i * R + r] + 2 * j, p);
                    offs[i * R + r] = _mm256_add_ps(offs[i * R + r], p);
                }
            }
        int64_t k = c0; /* even: HEADER_CHUNK is */
        if (A8_PAIRED(fmt))
            for (; k + 1 < c1; k += 2)
                for (int i = 0; i < W; i++) {
                    __m256i lo, hi;
                    const uint8_t* q = w + (n + i) * row_bytes + k * block_bytes(fmt) + qoff;
                    pair_quants(q, block_bytes(fmt), &lo, &hi);
                    for (int r = 0; r < R; r++) {
                        const __m256 dot = pair_dot(lo, hi, x->q + (r * nb + k) * QK);
                        const __m256 s = pair_scales(sc[i * R + r] + 2 * (k - c0));
                        acc[i * R + r] = _mm256_fmadd_ps(dot, s, acc[i * R + r]);
                    }
                }
        for (; k < c1; k++) {
            for (int i = 0; i < W; i++) {
                const uint8_t* q = w + (n + i) * row_bytes + k * block_bytes(fmt) + qoff;
                const __m256i wq = block_quants(fmt, q);
                for (int r = 0; r < R; r++) {
                    const __m256 s = block_scale(fmt, sc[i * R + r] + 2 * (k - c0));
                    const __m256 dot = block_dot(fmt, wq, x->q + (r * nb + k) * QK);
                    acc[i * R + r] = _mm256_fmadd_ps(dot, s, acc[i * R + r]);
                }
            }
        }
    }
    const __m256 zero = _mm256_setzero_ps();
    for (int i = 0; i < W; i++)
        for (int r = 0; r < R; r++) {
            const __m256 o = _mm256_blend_ps(zero, offs[i * R + r], 0xaa);
            const float off = has_offset(fmt) ? hsum_lanes(o) : 0.f;
            y[r * N + n + i] = hsum_lanes(acc[i * R + r]) + off;
        }
}

/* One instance per tile shape: rows r .. r + R of x against weight rows n .. n + W - 1. */
static inline __attribute__((always_inline)) void a8_rows(const int fmt, const QMat* a,
                                                          int64_t n, const QRows* x, int64_t R,
                                                          int64_t W, float* y, int64_t N) {
#define A8_TILE(r, c) a8_tile(fmt, a, n, x, r, c, y, N)
    TILE_SHAPES(R, W, A8_TILE);
#undef A8_TILE
}
#else
#define A8_PAIRED(fmt) 0

/* The same sums in plain C: per block an exact integer dot, scaled as above. */
static inline void a8_rows(const int fmt, const QMat* a, int64_t n, const QRows* x, int64_t R,
                           int64_t W, float* y, int64_t N) {
    const int64_t nb = x->K / QK, np = pair_blocks(nb), qoff = quants_offset(fmt);
    const int nibbles = fmt == Q4_0 || fmt == Q4_1 || fmt == I4;
    for (int64_t i = 0; i < W; i++)
        for (int64_t r = 0; r < R; r++) {
            float acc = 0.f, off = 0.f;
            for (int64_t k = 0; k < nb; k++) {
                const uint8_t* b = a->w + (n + i) * a->row_bytes + k * block_bytes(fmt);
                float d, m;
                if (load_time(fmt)) {
                    group_params(fmt, a, n + i, k, &d, &m);
                } else {
                    d = f16_to_f32(load_u16(b));
                    m = fmt == Q4_1 ? f16_to_f32(load_u16(b + 2)) : -8.f * d;
                }
                const uint8_t* q = b + qoff;
                const int8_t* qx = x->q + (r * nb + k) * QK;
                const float* ds = x->ds + r * 2 * np + 2 * k;
                int32_t dot = 0, hi = 0; /* hi: I8H's second 16 */
                for (int j = 0; j < QK; j++) {
                    const int wq = nibbles ? (j < 16 ? q[j] & 15 : q[j - 16] >> 4)
                                   : signed_quants(fmt) ? (int8_t)q[j] : q[j];
                    if (fmt == I8H && j >= 16) hi += wq * qx[j];
                    else dot += wq * qx[j];
                }
                if (fmt == I8H) acc += (float)dot * (d * ds[0]) + (float)hi * (m * ds[0]);
                else acc += (float)dot * (d * ds[0]);
                if (has_offset(fmt)) off += m * ds[1];
            }
            y[r * N + n + i] = acc + off;
        }
}
#endif

static void qlinear_a8_f32(const QMat* a, const float* x, int64_t M, int64_t K, int64_t N,
                           float* y, int threads) {
    if (M <= 0) return;
    const int fmt = a->fmt;
    const int64_t nb = K / QK, np = pair_blocks(nb);
    char* buf = (char*)calloc((size_t)(M * K + 2 * M * np * (int64_t)sizeof(float)), 1);
    if (!buf) abort();
    float* ds = (float*)buf;
    int8_t* q = (int8_t*)(ds + 2 * M * np);
    for (int64_t r = 0; r < M; r++)
        quantize_row(x + r * K, K, A8_PAIRED(fmt), q + r * K, ds + r * 2 * np);
    /* Tiles of equal height (tile_height). */
    const int64_t row_bytes = a->row_bytes, height = tile_height(M);
    const int64_t step = tile_weight_rows(height);
#pragma omp parallel for num_threads(threads) schedule(static) \
    if (threads > 1 && N * M * K >= 65536)
    for (int64_t n = 0; n < N; n += step) {
        /* Weight rows are short and streamed from memory: ask for the rows 8 ahead. */
        prefetch_bytes(a->w + (n + 8) * row_bytes, step * row_bytes);
        if (a->scales) { /* a load-time format's scales and minimums are rows of their own */
            const int64_t bytes = step * a->groups * (int64_t)sizeof(float);
            prefetch_bytes(a->scales + (n + 8) * a->groups, bytes);
            if (a->mins) prefetch_bytes(a->mins + (n + 8) * a->groups, bytes);
        }
        for (int64_t r = 0; r < M; r += height) {
            const int64_t R = M - r < height ? M - r : height;
            const QRows rows = {q + r * K, ds + r * 2 * np, K};
            const int64_t end = n + step < N ? n + step : N;
            for (int64_t j = n, W; j < end; j += W) {
                W = end - j < tile_weight_rows(R) ? end - j : tile_weight_rows(R);
                /* One instance per format, so each inner loop knows its block layout. */
                switch (fmt) {
                    case Q4_0: a8_rows(Q4_0, a, j, &rows, R, W, y + r * N, N); break;
                    case Q4_1: a8_rows(Q4_1, a, j, &rows, R, W, y + r * N, N); break;
                    case Q8_0: a8_rows(Q8_0, a, j, &rows, R, W, y + r * N, N); break;
                    case I4: a8_rows(I4, a, j, &rows, R, W, y + r * N, N); break;
                    case I8: a8_rows(I8, a, j, &rows, R, W, y + r * N, N); break;
                    case I8H: a8_rows(I8H, a, j, &rows, R, W, y + r * N, N); break;
                    default: a8_rows(I8M, a, j, &rows, R, W, y + r * N, N); break;
                }
            }
        }
    }
    free(buf);
}

static void qlinear_a8_bf16(const QMat* a, const uint16_t* x, int64_t M, int64_t K, int64_t N,
                            uint16_t* y, int threads) {
    float* xf = (float*)malloc((size_t)(M * K + M * N) * sizeof(float));
    if (!xf) abort();
    float* yf = xf + M * K;
    widen_bf16(x, xf, M * K);
    qlinear_a8_f32(a, xf, M, K, N, yf, threads);
    for (int64_t i = 0; i < M * N; i++) bf16_store(y, i, yf[i]);
    free(xf);
}

#define A8_FORMAT(name, fmt)                                                                   \
    void rsgl_qlinear_##name##_a8_f32(const float* x, int64_t M, int64_t K, const uint8_t* w, \
                                      int64_t N, float* y, int threads) {                      \
        const QMat a = gguf_mat(fmt, w, K);                                                    \
        qlinear_a8_f32(&a, x, M, K, N, y, threads);                                            \
    }                                                                                          \
    void rsgl_qlinear_##name##_a8_bf16(const uint16_t* x, int64_t M, int64_t K,                \
                                       const uint8_t* w, int64_t N, uint16_t* y, int threads) { \
        const QMat a = gguf_mat(fmt, w, K);                                                    \
        qlinear_a8_bf16(&a, x, M, K, N, y, threads);                                           \
    }

A8_FORMAT(q4_0, Q4_0)
A8_FORMAT(q4_1, Q4_1)
A8_FORMAT(q8_0, Q8_0)

void rsgl_qlinear_group_a8_f32(int bits, const float* x, int64_t M, int64_t K, const uint8_t* w,
                               const float* scales, const float* mins, int64_t group, int64_t N,
                               float* y, int threads) {
    const QMat a = group_mat(bits, w, scales, mins, K, group);
    qlinear_a8_f32(&a, x, M, K, N, y, threads);
}

void rsgl_qlinear_group_a8_bf16(int bits, const uint16_t* x, int64_t M, int64_t K,
                                const uint8_t* w, const float* scales, const float* mins,
                                int64_t group, int64_t N, uint16_t* y, int threads) {
    const QMat a = group_mat(bits, w, scales, mins, K, group);
    qlinear_a8_bf16(&a, x, M, K, N, y, threads);
}
