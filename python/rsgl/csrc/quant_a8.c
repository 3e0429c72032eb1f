/* Projections with int8 activations (`--quantization gguf_a8`): what llama.cpp computes for
   Q4_0, Q4_1 and Q8_0 weights (W4A8 / W8A8), y[M, N] = x[M, K] . W^T.

   Each row of x is quantized per block of 32 values, as llama.cpp's Q8_1: dx = max|x| / 127,
   qx = x / dx rounded to the nearest integer (ties to even), and sx = dx * sum(qx). A weight
   block w = d * q + m (Q4_0: m = -8d; Q8_0: m = 0, q signed) then contributes

       sum(w * x') = d * dx * sum(q * qx) + m * sx,

   where x' = dx * qx is the quantized row and sum(q * qx) an exact integer sum: byte
   products summed in pairs (maddubs), then in fours (madd). Where the exact kernels
   (quant.c) rebuild each float32 weight (a conversion and two multiply-adds per 8 weights),
   this is a few integer instructions and a conversion per 32 weights, and the weights stay
   the file's; what changes is x, rounded to 8 bits per block. So the logits are not the
   float32 model's: `rsgl bench quality --modes gguf_a8` measures the KL divergence that
   costs.

   Two layouts of the weights:
   - GGUF's Q4_0, Q4_1 and Q8_0 blocks are interleaved by eight weight rows when a model
     loads (the second half of this file): a register's lanes are 8 weight rows.
   - The load-time groups keep one row after another (the first half): GGUF's K-quants,
     read as groups (quant.c's I4 for Q4_K, I8H for Q3_K and Q6_K, I8M for Q5_K;
     rsgl/models/gguf_weights.py), with each group's scale (and minimum) a float32 from
     their arrays; I8H's two scales a block of 32 each take the half of the block's 8 lanes
     that sums their 16 weights. (llama.cpp quantizes x per 256 for the K-quants, Q8_K;
     here every format takes Q8_1's blocks of 32.) A row's blocks are summed in 8 lanes,
     two 4-bit blocks a register, 4 lanes each, then in a fixed tree; the offsets' terms in
     four lanes beside, one block each.

   Either way each (row of x, weight row) is summed in one order whatever the batch, so a
   request's logits do not depend on the batch it ran in. */
#include "gguf_blocks.h"

/* Where element i of block b of a quantized row goes. For 4-bit groups (I4) under AVX2 the
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
   (dx, dx * sum(q)) in ds[2b], ds[2b + 1]. The AVX2 path rounds as rintf does (the
   conversion rounds to nearest even) and gives the same bytes for finite x (where x * id
   is not: an infinity, or a block max so small that 127 / max overflows, it writes -128,
   the plain loop's cast 0); at 64 rows it was a twelfth of a step's products in plain C. */
static void quantize_row(const float* x, int64_t K, int paired, int8_t* q, float* ds) {
    const int64_t nb = K / QK;
    for (int64_t b = 0; b < nb; b++) {
        const float* xb = x + b * QK;
#if defined(__AVX2__)
        __m256 v[4], m = _mm256_setzero_ps();
        const __m256 sign = _mm256_set1_ps(-0.f);
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(xb + 8 * i);
            m = _mm256_max_ps(_mm256_andnot_ps(sign, v[i]), m); /* a NaN leaves m */
        }
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
#else
        float amax = 0.f;
        for (int i = 0; i < QK; i++) {
            const float a = xb[i] < 0.f ? -xb[i] : xb[i];
            amax = a > amax ? a : amax;
        }
#endif
        const float d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
        int sum = 0;
#if defined(__AVX2__)
        __m256i n[4], total = _mm256_setzero_si256();
        for (int i = 0; i < 4; i++) {
            n[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(id)));
            total = _mm256_add_epi32(total, n[i]);
        }
        /* Packing works within 128-bit halves: the bytes come out as elements 0-3, 8-11,
           16-19, 24-27, 4-7, ..., and one permute puts them back in order. */
        const __m256i bytes = _mm256_permutevar8x32_epi32(
            _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3])),
            _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm_storeu_si128((__m128i*)(q + qx_index(paired, nb, b, 0)),
                         _mm256_castsi256_si128(bytes));
        _mm_storeu_si128((__m128i*)(q + qx_index(paired, nb, b, 16)),
                         _mm256_extracti128_si256(bytes, 1));
        __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
        sum = _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1)));
#else
        for (int i = 0; i < QK; i++) {
            const int v = (int)__builtin_rintf(xb[i] * id);
            q[qx_index(paired, nb, b, i)] = (int8_t)v;
            sum += v;
        }
#endif
        ds[2 * b] = d;
        ds[2 * b + 1] = d * (float)sum;
    }
}

/* Every row of x[M, K] quantized (quantize_row), rows shared among the threads when there
   are enough of them to pay for it. */
static void quantize_rows(const float* x, int64_t M, int64_t K, int paired, int8_t* q,
                          float* ds, int64_t ds_stride, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && M >= 16)
    for (int64_t r = 0; r < M; r++) quantize_row(x + r * K, K, paired, q + r * K, ds + r * ds_stride);
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
/* Whether x's blocks go in pairs (qx_index) for weights of format fmt: the nibble format. */
#define A8_PAIRED(fmt) ((fmt) == I4)

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
   lanes, its offset term m * sx in the odd ones. I8H's pairs are a block's
   two scales, each times dx. */
static inline __m256 pair_products(int fmt, __m256 w, const float* ds) {
    const __m256 x = _mm256_loadu_ps(ds);
    return _mm256_mul_ps(w, fmt == I8H ? _mm256_moveldup_ps(x) : x);
}

/* The (d, m) pairs of blocks k .. k + 3 of weight row n (fewer at the row's end, the rest
   0), from the load-time format's arrays. */
static inline __m256 block_pairs(int fmt, const QMat* a, int64_t n, int64_t k, int64_t count) {
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
    const int64_t nb = x->K / QK, np = pair_blocks(nb);
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
                    const uint8_t* q = w + (n + i) * row_bytes + k * block_bytes(fmt);
                    pair_quants(q, block_bytes(fmt), &lo, &hi);
                    for (int r = 0; r < R; r++) {
                        const __m256 dot = pair_dot(lo, hi, x->q + (r * nb + k) * QK);
                        const __m256 s = pair_scales(sc[i * R + r] + 2 * (k - c0));
                        acc[i * R + r] = _mm256_fmadd_ps(dot, s, acc[i * R + r]);
                    }
                }
        for (; k < c1; k++) {
            for (int i = 0; i < W; i++) {
                const uint8_t* q = w + (n + i) * row_bytes + k * block_bytes(fmt);
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
    const int64_t nb = x->K / QK, np = pair_blocks(nb);
    for (int64_t i = 0; i < W; i++)
        for (int64_t r = 0; r < R; r++) {
            float acc = 0.f, off = 0.f;
            for (int64_t k = 0; k < nb; k++) {
                const uint8_t* b = a->w + (n + i) * a->row_bytes + k * block_bytes(fmt);
                float d, m;
                group_params(fmt, a, n + i, k, &d, &m);
                const uint8_t* q = b;
                const int8_t* qx = x->q + (r * nb + k) * QK;
                const float* ds = x->ds + r * 2 * np + 2 * k;
                int32_t dot = 0, hi = 0; /* hi: I8H's second 16 */
                for (int j = 0; j < QK; j++) {
                    const int wq = fmt == I4 ? (j < 16 ? q[j] & 15 : q[j - 16] >> 4)
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
    quantize_rows(x, M, K, A8_PAIRED(fmt), q, ds, 2 * np, threads);
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

/* bfloat16 activations for either layout's float32 kernel: x widened, the product rounded
   back. */
typedef void (*A8Linear)(const QMat* a, const float* x, int64_t M, int64_t K, int64_t N,
                         float* y, int threads);
static void qlinear_a8_bf16(A8Linear f32, const QMat* a, const uint16_t* x, int64_t M,
                            int64_t K, int64_t N, uint16_t* y, int threads) {
    float* xf = (float*)malloc((size_t)(M * K + M * N) * sizeof(float));
    if (!xf) abort();
    float* yf = xf + M * K;
    widen_bf16(x, xf, M * K);
    f32(a, xf, M, K, N, yf, threads);
    for (int64_t i = 0; i < M * N; i++) bf16_store(y, i, yf[i]);
    free(xf);
}

/* ------------------------------------------------------------------------------------------
   GGUF's Q4_0, Q4_1 and Q8_0 blocks, interleaved by eight weight rows (rsgl_pack_a8_*, when
   a projection is installed). Reading each row's blocks as the file lays them out, a batch-1 product paid,
   per weight row, the blocks' scales and a horizontal sum of 8 lanes, about as many
   instructions as the integer dots themselves for SmolLM2's 576-wide rows. Interleaved, one
   register's 8 lanes are 8 weight rows: a block's 8 scales are one fp16 load, its products
   go straight into the rows' 8 sums, and nothing is summed across lanes.

   A group of 8 rows (the last one padded with zero rows) holds its blocks in order, block k
   of all 8 rows as

       d[8] (fp16, row j's at byte 2j) | Q4_1: m[8] (fp16) | the quants, 32-byte registers

   register g's lane j holding row j's quant bytes 4g .. 4g + 3: Q4_0 and Q4_1 four registers
   (nibble byte t holds element t in its low half and t + 16 in its high one, so register g
   masked gives elements 4g .. 4g + 3 and shifted 16 + 4g .. 19 + 4g), Q8_0 eight. Each lane's
   4 bytes times the same 4 bytes of qx (broadcast to every lane) summed by maddubs and madd
   is 4 products of one row; a block's 8 (Q8_0) or 8 halves (nibbles) summed make its dot.

   Each (row of x, weight row) is summed in one order whatever the batch: per block in order,
   acc = fma(dot, d * dx, acc), then (Q4_1, Q4_0) acc = fma(m, sx, acc). */

static inline int64_t x8_header_bytes(int fmt) { return fmt == Q4_1 ? 32 : 16; }
static inline int64_t x8_block_bytes(int fmt) {
    return x8_header_bytes(fmt) + (fmt == Q8_0 ? 256 : 128);
}
/* The bytes of one block's quants in the file's layout (after its header). */
static inline int64_t file_quant_bytes(int fmt) { return fmt == Q8_0 ? 32 : 16; }

/* Where byte t of row j's quants of a block goes in its interleaved block. */
static inline int64_t x8_quant_offset(int fmt, int j, int64_t t) {
    return x8_header_bytes(fmt) + 32 * (t / 4) + 4 * j + t % 4;
}

/* Copies between rows in the file's layout and the interleaved form: file row i is row
   ids[i] of the interleaved matrix (row i where ids is NULL). `to_x8` packs; else the rows
   come back out as the file held them. */
static void x8_copy(int fmt, uint8_t* file, int64_t K, uint8_t* x8, const int64_t* ids,
                    int64_t n, int to_x8) {
    const int64_t nb = K / QK, bb = block_bytes(fmt), xb = x8_block_bytes(fmt);
    const int64_t qoff = quants_offset(fmt), qbytes = file_quant_bytes(fmt);
    const int64_t headers = fmt == Q4_1 ? 2 : 1;
    for (int64_t i = 0; i < n; i++) {
        const int64_t row = ids ? ids[i] : i;
        const int j = (int)(row % 8);
        for (int64_t k = 0; k < nb; k++) {
            uint8_t* f = file + (i * nb + k) * bb;
            uint8_t* p = x8 + ((row / 8) * nb + k) * xb;
            for (int64_t h = 0; h < headers; h++) { /* d, then Q4_1's m */
                if (to_x8) memcpy(p + 16 * h + 2 * j, f + 2 * h, 2);
                else memcpy(f + 2 * h, p + 16 * h + 2 * j, 2);
            }
            for (int64_t t = 0; t < qbytes; t++) {
                uint8_t* q = p + x8_quant_offset(fmt, j, t);
                if (to_x8) *q = f[qoff + t];
                else f[qoff + t] = *q;
            }
        }
    }
}

/* Quant e (0 .. 31) of row j in interleaved block p, and the row's scale and offset (the plain
   C loops' reads). */
static inline int x8_quant(int fmt, const uint8_t* p, int j, int e) {
    const uint8_t b = p[x8_quant_offset(fmt, j, fmt == Q8_0 ? e : e % 16)];
    return fmt == Q8_0 ? (int8_t)b : e < 16 ? b & 15 : b >> 4;
}
static inline void x8_params(int fmt, const uint8_t* p, int j, float* d, float* m) {
    *d = f16_to_f32(load_u16(p + 2 * j));
    *m = fmt == Q4_1 ? f16_to_f32(load_u16(p + 16 + 2 * j)) : fmt == Q4_0 ? -8.f * *d : 0.f;
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
/* AVX512-VNNI's dpbusd multiplies the bytes and adds each lane's four products to its 32-bit
   sum in one instruction, where AVX2 takes maddubs, madd and an add; the sums are the same
   integers either way (AVX2's 16-bit steps never saturate, as below), so both give the same
   floats. */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define X8_VNNI 1
#else
#define X8_VNNI 0
#endif

/* Rows of x up to which a tile shares a pass over a group's blocks (they stay in L1 for the
   next tile: 18 blocks of a 576-wide row are 2.9 KB). AVX-512's 32 registers hold 8 rows' sums
   and accumulators (on a 2-core Zen 4, SmolLM2's projections at 8 to 64 rows took 0.90-0.95x
   the time of 4-row tiles), AVX2's 16 hold 4. */
#if defined(__AVX512VL__)
#define X8_ROWS 8
#else
#define X8_ROWS 4
#endif

static inline __m256i broadcast4(const int8_t* p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return _mm256_set1_epi32(v);
}

/* Block sums of group `grp` (nb blocks) against rows x[0 .. R) of x (R a constant in each
   inlined copy; R <= X8_ROWS, each row's dot, sum and accumulator in registers). */
static inline __attribute__((always_inline)) void x8_tile(const int fmt, const uint8_t* grp,
                                                          int64_t nb, const int8_t* q,
                                                          const float* ds, const int R,
                                                          float* out) {
    const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    const int64_t xb = x8_block_bytes(fmt), hb = x8_header_bytes(fmt), K = nb * QK;
    __m256 acc[X8_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t k = 0; k < nb; k++) {
        const uint8_t* p = grp + k * xb;
        /* A group's blocks are one stream: ask for them 4 KB ahead (SmolLM2's batch-1
           products on a 2-core Zen 3 ran 1.13x the speed of 2 KB ahead, 1.2x that of
           none; 8 and 16 KB no faster). */
        for (int64_t c = 0; c < xb; c += 64) _mm_prefetch((const char*)p + 4096 + c, _MM_HINT_T0);
        __m256i s[X8_ROWS];
        for (int r = 0; r < R; r++) s[r] = _mm256_setzero_si256();
        if (fmt == Q8_0) {
            /* Signed bytes: maddubs takes their magnitudes, qx their signs. Pairs of
               products reach 2 * 128 * 127, so each register's are summed in 32 bits. */
            for (int g = 0; g < 8; g++) {
                const __m256i v = _mm256_loadu_si256((const __m256i*)(p + hb + 32 * g));
                const __m256i mag = _mm256_abs_epi8(v);
                for (int r = 0; r < R; r++) {
                    const __m256i xs = _mm256_sign_epi8(broadcast4(q + r * K + k * QK + 4 * g), v);
#if X8_VNNI
                    s[r] = _mm256_dpbusd_epi32(s[r], mag, xs);
#else
                    s[r] = _mm256_add_epi32(
                        s[r], _mm256_madd_epi16(_mm256_maddubs_epi16(mag, xs), ones));
#endif
                    __asm__("" : "+x"(s[r])); /* see below */
                }
            }
        } else {
            /* Nibbles: a pair of products is at most 2 * 15 * 127, eight pairs fit 16 bits. */
            for (int g = 0; g < 4; g++) {
                const __m256i v = _mm256_loadu_si256((const __m256i*)(p + hb + 32 * g));
                const __m256i lo = _mm256_and_si256(v, low);
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                for (int r = 0; r < R; r++) {
                    const int8_t* qx = q + r * K + k * QK;
#if X8_VNNI
                    s[r] = _mm256_dpbusd_epi32(s[r], lo, broadcast4(qx + 4 * g));
                    s[r] = _mm256_dpbusd_epi32(s[r], hi, broadcast4(qx + 16 + 4 * g));
#else
                    s[r] = _mm256_add_epi16(s[r], _mm256_maddubs_epi16(lo, broadcast4(qx + 4 * g)));
                    s[r] = _mm256_add_epi16(
                        s[r], _mm256_maddubs_epi16(hi, broadcast4(qx + 16 + 4 * g)));
                    /* Each register's products added as they come: left free, the compiler
                       computed all of a block's products first and spilled them to the
                       stack (64 rows: 14.5 cycles an 8-row block and row, 12.9 pinned). */
                    __asm__("" : "+x"(s[r]));
#endif
                }
            }
#if !X8_VNNI
            for (int r = 0; r < R; r++) s[r] = _mm256_madd_epi16(s[r], ones);
#endif
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
        const __m256 m = fmt == Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 16)))
                         : fmt == Q4_0 ? _mm256_mul_ps(d, _mm256_set1_ps(-8.f))
                                       : _mm256_setzero_ps();
        for (int r = 0; r < R; r++) {
            const float* dsr = ds + r * 2 * nb + 2 * k;
            const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(dsr[0]));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r]), scale, acc[r]);
            if (fmt != Q8_0) acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(dsr[1]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out + 8 * r, acc[r]);
}

static inline __attribute__((always_inline)) void x8_rows(const int fmt, const uint8_t* grp,
                                                          int64_t nb, const int8_t* q,
                                                          const float* ds, int64_t R,
                                                          float* out) {
    switch (R) {
        case 1: x8_tile(fmt, grp, nb, q, ds, 1, out); break;
        case 2: x8_tile(fmt, grp, nb, q, ds, 2, out); break;
        case 3: x8_tile(fmt, grp, nb, q, ds, 3, out); break;
#if X8_ROWS == 8
        case 4: x8_tile(fmt, grp, nb, q, ds, 4, out); break;
        case 5: x8_tile(fmt, grp, nb, q, ds, 5, out); break;
        case 6: x8_tile(fmt, grp, nb, q, ds, 6, out); break;
        case 7: x8_tile(fmt, grp, nb, q, ds, 7, out); break;
#endif
        default: x8_tile(fmt, grp, nb, q, ds, X8_ROWS, out); break;
    }
}
#else
#define X8_ROWS 4 /* (any number of rows would do here) */

/* The same sums in plain C, lane by lane. */
static inline void x8_rows(const int fmt, const uint8_t* grp, int64_t nb, const int8_t* q,
                           const float* ds, int64_t R, float* out) {
    const int64_t xb = x8_block_bytes(fmt), K = nb * QK;
    for (int64_t r = 0; r < R; r++)
        for (int j = 0; j < 8; j++) {
            float acc = 0.f;
            for (int64_t k = 0; k < nb; k++) {
                const uint8_t* p = grp + k * xb;
                const int8_t* qx = q + r * K + k * QK;
                int32_t dot = 0;
                for (int e = 0; e < QK; e++) dot += x8_quant(fmt, p, j, e) * qx[e];
                float d, m;
                x8_params(fmt, p, j, &d, &m);
                const float* dsr = ds + r * 2 * nb + 2 * k;
                acc += (float)dot * (d * dsr[0]);
                if (fmt != Q8_0) acc += m * dsr[1];
            }
            out[8 * r + j] = acc;
        }
}
#endif

/* `a`: gguf_mat over the interleaved bytes (its fmt and w; rows are groups of 8 here). */
static void qlinear_x8_f32(const QMat* a, const float* x, int64_t M, int64_t K, int64_t N,
                           float* y, int threads) {
    if (M <= 0) return;
    const int fmt = a->fmt;
    const uint8_t* w = a->w;
    const int64_t nb = K / QK, groups = (N + 7) / 8, gb = nb * x8_block_bytes(fmt);
    char* buf = (char*)malloc((size_t)(M * K + 2 * M * nb * (int64_t)sizeof(float)));
    if (!buf) abort();
    float* ds = (float*)buf;
    int8_t* q = (int8_t*)(ds + 2 * M * nb);
    quantize_rows(x, M, K, 0, q, ds, 2 * nb, threads);
#pragma omp parallel for num_threads(threads) schedule(static) \
    if (threads > 1 && N * M * K >= 65536)
    for (int64_t G = 0; G < groups; G++) {
        const int64_t lanes = N - 8 * G < 8 ? N - 8 * G : 8;
        for (int64_t r = 0; r < M; r += X8_ROWS) {
            const int64_t R = M - r < X8_ROWS ? M - r : X8_ROWS;
            float out[8 * X8_ROWS];
            switch (fmt) { /* one instance per format */
                case Q4_0: x8_rows(Q4_0, w + G * gb, nb, q + r * K, ds + r * 2 * nb, R, out); break;
                case Q4_1: x8_rows(Q4_1, w + G * gb, nb, q + r * K, ds + r * 2 * nb, R, out); break;
                default: x8_rows(Q8_0, w + G * gb, nb, q + r * K, ds + r * 2 * nb, R, out); break;
            }
            for (int64_t i = 0; i < R; i++) memcpy(y + (r + i) * N + 8 * G, out + 8 * i, lanes * sizeof(float));
        }
    }
    free(buf);
}

/* Per GGUF format: the product over its interleaved blocks (`w` as rsgl_pack_a8_* wrote it,
   N rows), the packing, and rows `ids` back in the file's layout. */
#define A8_FORMAT(name, fmt)                                                                   \
    void rsgl_qlinear_##name##_a8_f32(const float* x, int64_t M, int64_t K, const uint8_t* w, \
                                      int64_t N, float* y, int threads) {                      \
        const QMat a = gguf_mat(fmt, w, K);                                                    \
        qlinear_x8_f32(&a, x, M, K, N, y, threads);                                            \
    }                                                                                          \
    void rsgl_qlinear_##name##_a8_bf16(const uint16_t* x, int64_t M, int64_t K,                \
                                       const uint8_t* w, int64_t N, uint16_t* y, int threads) { \
        const QMat a = gguf_mat(fmt, w, K);                                                    \
        qlinear_a8_bf16(qlinear_x8_f32, &a, x, M, K, N, y, threads);                           \
    }                                                                                          \
    int64_t rsgl_packed_a8_bytes_##name(int64_t N, int64_t K) {                                \
        return (N + 7) / 8 * (K / QK) * x8_block_bytes(fmt);                                   \
    }                                                                                          \
    void rsgl_pack_a8_##name(const uint8_t* w, int64_t N, int64_t K, uint8_t* out) {          \
        memset(out, 0, (size_t)rsgl_packed_a8_bytes_##name(N, K));                             \
        x8_copy(fmt, (uint8_t*)w, K, out, NULL, N, 1);                                         \
    }                                                                                          \
    void rsgl_unpack_rows_a8_##name(const uint8_t* packed, int64_t K, const int64_t* ids,      \
                                    int64_t n, uint8_t* out) {                                 \
        x8_copy(fmt, out, K, (uint8_t*)packed, ids, n, 0);                                     \
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
    qlinear_a8_bf16(qlinear_a8_f32, &a, x, M, K, N, y, threads);
}

/* ------------------------------------------------------------------------------------------
   bfloat16 activations times the interleaved blocks with the weights exact (`--quantization
   gguf` in bfloat16 where the CPU has AVX512-BF16): the file's numbers, as quant.c rebuilds
   them, but no weight is rebuilt in float32. AVX512-BF16's VDPBF16PS multiplies 32 bfloat16
   pairs a register, each product exact in float32, and adds them in pairs into 16 float32
   lanes. A block's quants are small integers, exact in bfloat16 (a nibble through a 16-entry
   table, Q8_0's bytes through float32), and its scale and offset apply once per block:

       sum(w * x) = d * sum(q * x) + m * sum(x)     (Q4_0: m = -8 d; Q8_0: m = 0).

   Register g of a block holds rows 0-7's quants 4g .. 4g + 3 (elements 4g .. 4g + 3, and for
   nibbles 16 + 4g .. 19 + 4g in the high halves). Widened to 16-bit words it is 16 lanes of
   two products, lanes 2j and 2j + 1 row j's, against x[4g .. 4g + 3] broadcast (one 64-bit
   load). Each (row of x, weight row) is summed in one order whatever the batch: per block
   its dot in the two lanes, acc = fma(dot, d, acc), then acc = fma(m, sum(x), acc) in the
   even lane; the two lanes added last. sum(x) is each row's, per block, in a fixed order. */

/* Each row of x[M, K] (bfloat16) summed per block of 32: sx[r * nb + b], in float32, in one
   order (pairs, then a tree), whatever M. */
static void block_sums_bf16(const uint16_t* x, int64_t M, int64_t K, float* sx) {
    const int64_t nb = K / QK;
    for (int64_t r = 0; r < M; r++)
        for (int64_t b = 0; b < nb; b++) {
            const uint16_t* xb = x + r * K + b * QK;
            float s[16];
            for (int i = 0; i < 16; i++) s[i] = bf16_to_f32(xb[i]) + bf16_to_f32(xb[16 + i]);
            for (int w = 8; w >= 1; w /= 2)
                for (int i = 0; i < w; i++) s[i] += s[i + w];
            sx[r * nb + b] = s[0];
        }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__F16C__)
#define X8B_NATIVE 1
/* Rows of x a tile shares a pass over a group's blocks with: each row's dot and accumulator
   in registers (16 of the 32), the block's words in 2 more. */
#define X8B_ROWS 8

/* The bfloat16 bits of 0 .. 15 (words 16 .. 31 unused). */
static const uint16_t nibble_bf16[32] = {0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0,
                                         0x40c0, 0x40e0, 0x4100, 0x4110, 0x4120, 0x4130,
                                         0x4140, 0x4150, 0x4160, 0x4170};

static inline __m512i bcast_x4(const uint16_t* p) {
    int64_t v;
    memcpy(&v, p, sizeof v);
    return _mm512_set1_epi64(v);
}

static inline __attribute__((always_inline)) void x8b_tile(const int fmt, const uint8_t* grp,
                                                           int64_t nb, const uint16_t* x,
                                                           const float* sx, const int R,
                                                           float* out) {
    const int64_t xb = x8_block_bytes(fmt), hb = x8_header_bytes(fmt), K = nb * QK;
    const __m512i table = _mm512_loadu_si512(nibble_bf16);
    const __m256i low = _mm256_set1_epi8(15);
    /* lane 2j and 2j + 1 <- row j */
    const __m512i pairs = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    __m512 acc[X8B_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < nb; k++) {
        const uint8_t* p = grp + k * xb;
        for (int64_t c = 0; c < xb; c += 64) _mm_prefetch((const char*)p + 4096 + c, _MM_HINT_T0);
        __m512 s[X8B_ROWS];
        for (int r = 0; r < R; r++) s[r] = _mm512_setzero_ps();
        if (fmt == Q8_0) {
            for (int g = 0; g < 8; g++) {
                const __m256i v = _mm256_loadu_si256((const __m256i*)(p + hb + 32 * g));
                const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(v)));
                const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(v, 1)));
                const __m512bh w = _mm512_cvtne2ps_pbh(hi, lo);
                for (int r = 0; r < R; r++)
                    s[r] = _mm512_dpbf16_ps(s[r], w, (__m512bh)bcast_x4(x + r * K + k * QK + 4 * g));
            }
        } else {
            for (int g = 0; g < 4; g++) {
                const __m256i v = _mm256_loadu_si256((const __m256i*)(p + hb + 32 * g));
                const __m256i lo = _mm256_and_si256(v, low);
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                const __m512bh wl = (__m512bh)_mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(lo), table);
                const __m512bh wh = (__m512bh)_mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(hi), table);
                for (int r = 0; r < R; r++) {
                    const uint16_t* xr = x + r * K + k * QK;
                    s[r] = _mm512_dpbf16_ps(s[r], wl, (__m512bh)bcast_x4(xr + 4 * g));
                    s[r] = _mm512_dpbf16_ps(s[r], wh, (__m512bh)bcast_x4(xr + 16 + 4 * g));
                }
            }
        }
        const __m512 d8 = _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)));
        const __m512 d = _mm512_permutexvar_ps(pairs, d8);
        for (int r = 0; r < R; r++) acc[r] = _mm512_fmadd_ps(s[r], d, acc[r]);
        if (fmt != Q8_0) {
            const __m512 m8 =
                fmt == Q4_1
                    ? _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 16))))
                    : _mm512_mul_ps(d8, _mm512_set1_ps(-8.f));
            const __m512 m = _mm512_maskz_permutexvar_ps(0x5555, pairs, m8);
            for (int r = 0; r < R; r++)
                acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[r * nb + k]), acc[r]);
        }
    }
    const __m512i evens = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 0, 2, 4, 6, 8, 10, 12, 14);
    const __m512i odds = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 1, 3, 5, 7, 9, 11, 13, 15);
    for (int r = 0; r < R; r++) {
        const __m512 sum = _mm512_add_ps(_mm512_permutexvar_ps(evens, acc[r]),
                                         _mm512_permutexvar_ps(odds, acc[r]));
        _mm256_storeu_ps(out + 8 * r, _mm512_castps512_ps256(sum));
    }
}

static inline __attribute__((always_inline)) void x8b_rows(const int fmt, const uint8_t* grp,
                                                           int64_t nb, const uint16_t* x,
                                                           const float* sx, int64_t R,
                                                           float* out) {
    switch (R) {
        case 1: x8b_tile(fmt, grp, nb, x, sx, 1, out); break;
        case 2: x8b_tile(fmt, grp, nb, x, sx, 2, out); break;
        case 3: x8b_tile(fmt, grp, nb, x, sx, 3, out); break;
        case 4: x8b_tile(fmt, grp, nb, x, sx, 4, out); break;
        case 5: x8b_tile(fmt, grp, nb, x, sx, 5, out); break;
        case 6: x8b_tile(fmt, grp, nb, x, sx, 6, out); break;
        case 7: x8b_tile(fmt, grp, nb, x, sx, 7, out); break;
        default: x8b_tile(fmt, grp, nb, x, sx, X8B_ROWS, out); break;
    }
}
#else
#define X8B_NATIVE 0
#define X8B_ROWS 4 /* (any number of rows would do here) */

/* The same sums in plain C, lane by lane (each block's dot in element order), so a machine
   without AVX512-BF16 computes the product it defines, to float32 rounding. */
static inline void x8b_rows(const int fmt, const uint8_t* grp, int64_t nb, const uint16_t* x,
                            const float* sx, int64_t R, float* out) {
    const int64_t xb = x8_block_bytes(fmt), K = nb * QK;
    for (int64_t r = 0; r < R; r++)
        for (int j = 0; j < 8; j++) {
            float acc = 0.f;
            for (int64_t k = 0; k < nb; k++) {
                const uint8_t* p = grp + k * xb;
                const uint16_t* xr = x + r * K + k * QK;
                float dot = 0.f, d, m;
                for (int e = 0; e < QK; e++) dot += (float)x8_quant(fmt, p, j, e) * bf16_to_f32(xr[e]);
                x8_params(fmt, p, j, &d, &m);
                acc += dot * d;
                if (fmt != Q8_0) acc += m * sx[r * nb + k];
            }
            out[8 * r + j] = acc;
        }
}
#endif

/* AMX's layout of GGUF's blocks (rsgl_pack_amx_*, when a bfloat16 model loads where AMX's
   tiles serve the exact products): weight rows in groups of 16 (the last padded with zero
   rows), each group's block k of its 16 rows in 16 blocks' bytes:

       d[16] (fp16, row n's at byte 2n) | Q4_1: m[16] (fp16) | the quants as B (below)

   B is a tile multiply's second operand: 16 rows of 32 words, row i holding elements 2i and
   2i + 1 of weight row n in words 2n and 2n + 1. Q8_0 keeps those words' int8 quants in
   that order (32 bytes a row of B); the nibble formats pack four rows of B into 64 bytes,
   word w of chunk c holding row 4c + s's word w in bits 4s .. 4s + 3, so that a chunk's
   load and three shifts give its four rows, each word's nibble in its low bits. */
static inline int64_t amx_block_bytes(int fmt) { return 16 * block_bytes(fmt); }
static inline int64_t amx_header_bytes(int fmt) { return fmt == Q4_1 ? 64 : 32; }

/* Where element e (0 .. 31) of weight row n (0 .. 15) of a block goes: its byte in the
   quants, and (nibble formats) the shift of its nibble in that byte. */
static inline int64_t amx_quant_at(int fmt, int n, int e, int* shift) {
    const int i = e / 2, w = 2 * n + e % 2;
    *shift = 0;
    if (fmt == Q8_0) return 32 * i + w;
    const int s = i % 4;
    *shift = 4 * (s % 2);
    return 64 * (i / 4) + 2 * w + s / 2;
}

/* Copies between rows in the file's layout and AMX's: file row i is row ids[i] of the packed
   matrix (row i where ids is NULL). `to_amx` packs (into zeroed bytes); else the rows come
   back out as the file held them. */
static void amx_copy(int fmt, uint8_t* file, int64_t K, uint8_t* amx, const int64_t* ids,
                     int64_t n, int to_amx) {
    const int64_t nb = K / QK, bb = block_bytes(fmt), ab = amx_block_bytes(fmt);
    const int64_t qoff = quants_offset(fmt), hb = amx_header_bytes(fmt);
    const int64_t headers = fmt == Q4_1 ? 2 : 1;
    for (int64_t i = 0; i < n; i++) {
        const int64_t row = ids ? ids[i] : i;
        const int j = (int)(row % 16);
        for (int64_t k = 0; k < nb; k++) {
            uint8_t* f = file + (i * nb + k) * bb;
            uint8_t* p = amx + ((row / 16) * nb + k) * ab;
            for (int64_t h = 0; h < headers; h++) { /* d, then Q4_1's m */
                if (to_amx) memcpy(p + 32 * h + 2 * j, f + 2 * h, 2);
                else memcpy(f + 2 * h, p + 32 * h + 2 * j, 2);
            }
            if (!to_amx && fmt != Q8_0) memset(f + qoff, 0, 16);
            for (int e = 0; e < QK; e++) {
                int shift;
                uint8_t* q = p + hb + amx_quant_at(fmt, j, e, &shift);
                if (fmt == Q8_0) {
                    if (to_amx) *q = f[qoff + e];
                    else f[qoff + e] = *q;
                    continue;
                }
                /* the file's byte e % 16 holds element e < 16 low, e >= 16 high */
                uint8_t* fq = f + qoff + e % 16;
                const int fshift = e < 16 ? 0 : 4;
                if (to_amx) *q |= (uint8_t)(((*fq >> fshift) & 15) << shift);
                else *fq |= (uint8_t)(((*q >> shift) & 15) << fshift);
            }
        }
    }
}

#if X8B_NATIVE && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define AMX_NATIVE 1
#include <sys/syscall.h>
#include <unistd.h>

/* The exact bfloat16 product on AMX's tiles: a tile multiply (TDPBF16PS) takes up to 16 rows
   of x (A: a block's 32 bfloat16 values a row, read in place) against one block of 16 weight
   rows (B, rebuilt from AMX's layout: the quants as bfloat16, exact), giving each (row of x,
   weight row) its block's sum(q * x), exact products summed in float32 in the tile's fixed
   order. Each is then scaled in a register, acc = fma(sum, d, acc), acc = fma(m, sum(x), acc),
   block by block, so a row of x gets the same bits in any tile, and every batch the loader
   sends to the exact blocks runs here, a single row included.

   Where x8b_tile spends a dot product (two cycles each on a 2-core Xeon with AMX) per 32
   products and row of x, a block's tile multiply serves every row at once: on a 2-core Xeon
   with AMX a 3072 x 576 Q4_1 projection took 54 us at 1 row, 76 at 8, 110 at 16 and 204 at
   32 (x8b_tile 57, 197, 382 and 750; the dense bfloat16 copy on oneDNN's AMX ~210 from 2
   rows). */
#define AMX_ROWS 16
/* Blocks a pass of amx_tile takes (B and C for each: 1 KiB and up to 1 KiB). 8 keeps them in
   half of L1 beside the weights streaming through: SmolLM2's one-batch steps took 11.7,
   17.2 and 32.7 ms at 8, 16 and 32 rows against 14.3, 21.5 and 38.9 with 16 (alternated, on
   a 2-core Xeon with AMX; 8.8 against 9.1 at 1 row). */
#define AMX_SPAN 8

/* A tile configuration (palette 1): tiles 0 and 3 hold sums (C: R rows of 16 float32), 1 and
   4 rows of x (A: R rows of 32 bfloat16), 2 and 5 weights (B: 16 rows of 16 pairs); blocks
   alternate between the two sets so that one block's multiply overlaps the next's loads. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

static void amx_configure(int R) {
    TileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 6; t++) {
        c.colsb[t] = 64;
        c.rows[t] = t % 3 == 2 ? 16 : (uint8_t)R;
    }
    _tile_loadconfig(&c);
}

/* The bfloat16 bits of j & 15: a permute reads only its index's low 5 bits. */
static const uint16_t amx_nibbles[32] = {
    0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0, 0x4100, 0x4110, 0x4120,
    0x4130, 0x4140, 0x4150, 0x4160, 0x4170, 0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0,
    0x40c0, 0x40e0, 0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};

/* Block p's quants as B (16 rows of 32 bfloat16 words). */
static inline __attribute__((always_inline)) void amx_weights(const int fmt, const uint8_t* p,
                                                              __m512i* b) {
    const uint8_t* q = p + amx_header_bytes(fmt);
    if (fmt == Q8_0) {
        for (int i = 0; i < 16; i++) {
            const __m256i v = _mm256_loadu_si256((const __m256i*)(q + 32 * i));
            const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(v)));
            const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(v, 1)));
            _mm512_store_si512(b + i, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
        return;
    }
    const __m512i table = _mm512_loadu_si512(amx_nibbles);
    for (int c = 0; c < 4; c++) {
        const __m512i v = _mm512_loadu_si512(q + 64 * c);
        _mm512_store_si512(b + 4 * c, _mm512_permutexvar_epi16(v, table));
        _mm512_store_si512(b + 4 * c + 1, _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), table));
        _mm512_store_si512(b + 4 * c + 2, _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 8), table));
        _mm512_store_si512(b + 4 * c + 3, _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 12), table));
    }
}

/* Rows x[0 .. R) (R <= AMX_ROWS, a constant in each inlined copy) times the 16 weight rows of
   group grp, into out[r * 16 + n]. */
static inline __attribute__((always_inline)) void amx_tile(const int fmt, const uint8_t* grp,
                                                           int64_t nb, const uint16_t* x,
                                                           int64_t K, const float* sx,
                                                           const int R, float* out) {
    const int64_t ab = amx_block_bytes(fmt);
    __m512i b[AMX_SPAN][16] __attribute__((aligned(64)));
    float c[AMX_SPAN][AMX_ROWS * 16] __attribute__((aligned(64)));
    __m512 acc[AMX_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    /* In spans of blocks, three passes: rebuild the span's weights as B, multiply its blocks
       on the tiles, then scale their sums. A tile load that reads what vector stores have
       just written, and vector loads of what a tile store has just written, each wait for
       the other side's memory: interleaved block by block they took three quarters of the
       time (150 cycles a block of 16 weight rows at 8 rows of x). */
    for (int64_t k0 = 0; k0 < nb; k0 += AMX_SPAN) {
        const int64_t n = nb - k0 < AMX_SPAN ? nb - k0 : AMX_SPAN;
        for (int64_t i = 0; i < n; i++) {
            const uint8_t* p = grp + (k0 + i) * ab;
            for (int64_t o = 0; o < ab; o += 64) _mm_prefetch((const char*)p + 4096 + o, _MM_HINT_T0);
            amx_weights(fmt, p, b[i]);
        }
        __asm__ volatile("" ::: "memory"); /* the tile loads below read b */
        for (int64_t i = 0; i < n; i++) {
            const uint16_t* xk = x + (k0 + i) * QK;
            if (i % 2 == 0) {
                _tile_loadd(2, b[i], 64);
                _tile_loadd(1, xk, 2 * K);
                _tile_zero(0);
                _tile_dpbf16ps(0, 1, 2);
                _tile_stored(0, c[i], 64);
            } else {
                _tile_loadd(5, b[i], 64);
                _tile_loadd(4, xk, 2 * K);
                _tile_zero(3);
                _tile_dpbf16ps(3, 4, 5);
                _tile_stored(3, c[i], 64);
            }
        }
        for (int64_t i = 0; i < n; i++) {
            const int64_t k = k0 + i;
            const uint8_t* p = grp + k * ab;
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
            for (int r = 0; r < R; r++)
                acc[r] = _mm512_fmadd_ps(_mm512_load_ps(c[i] + 16 * r), d, acc[r]);
            if (fmt == Q8_0) continue;
            const __m512 m = fmt == Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(p + 32)))
                                         : _mm512_mul_ps(d, _mm512_set1_ps(-8.f));
            for (int r = 0; r < R; r++)
                acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[r * nb + k]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out + 16 * r, acc[r]);
}

static inline __attribute__((always_inline)) void amx_rows(const int fmt, const uint8_t* grp,
                                                           int64_t nb, const uint16_t* x,
                                                           int64_t K, const float* sx,
                                                           int64_t R, float* out) {
#define AMX_CASE(n) \
    case n: amx_tile(fmt, grp, nb, x, K, sx, n, out); break;
    switch (R) {
        AMX_CASE(1) AMX_CASE(2) AMX_CASE(3) AMX_CASE(4) AMX_CASE(5) AMX_CASE(6) AMX_CASE(7)
        AMX_CASE(8) AMX_CASE(9) AMX_CASE(10) AMX_CASE(11) AMX_CASE(12) AMX_CASE(13)
        AMX_CASE(14) AMX_CASE(15) default: amx_tile(fmt, grp, nb, x, K, sx, AMX_ROWS, out);
    }
#undef AMX_CASE
}

/* y[M, N] = x[M, K] . W^T for W in AMX's layout: x's rows AMX_ROWS at a time, a pass over
   the weights each (columns of y split over threads 16 at a time; each thread configures its
   tiles once a pass). */
static void qlinear_amx(int fmt, const uint8_t* w, const uint16_t* x, int64_t M, int64_t K,
                        int64_t N, uint16_t* y, int threads) {
    if (M <= 0) return;
    const int64_t nb = K / QK, groups = (N + 15) / 16, gb = nb * amx_block_bytes(fmt);
    float* sx = (float*)malloc((size_t)(M * nb + 1) * sizeof(float));
    if (!sx) abort();
    block_sums_bf16(x, M, K, sx);
    for (int64_t r = 0; r < M; r += AMX_ROWS) {
        const int64_t R = M - r < AMX_ROWS ? M - r : AMX_ROWS;
#pragma omp parallel num_threads(threads) if (threads > 1 && N * M * K >= 65536)
        {
            amx_configure((int)R);
#pragma omp for schedule(static)
            for (int64_t G = 0; G < groups; G++) {
                float out[AMX_ROWS * 16];
                const uint16_t* xr = x + r * K;
                const float* sr = sx + r * nb;
                switch (fmt) { /* one instance per format */
                    case Q4_0: amx_rows(Q4_0, w + G * gb, nb, xr, K, sr, R, out); break;
                    case Q4_1: amx_rows(Q4_1, w + G * gb, nb, xr, K, sr, R, out); break;
                    default: amx_rows(Q8_0, w + G * gb, nb, xr, K, sr, R, out); break;
                }
                const int64_t lanes = N - 16 * G < 16 ? N - 16 * G : 16;
                for (int64_t i = 0; i < R; i++)
                    for (int64_t j = 0; j < lanes; j++)
                        bf16_store(y, (r + i) * N + 16 * G + j, out[16 * i + j]);
            }
            _tile_release();
        }
    }
    free(sx);
}

/* Whether this build has AMX's kernels and Linux grants this process AMX's tiles (arch_prctl's
   ARCH_REQ_XCOMP_PERM for XTILEDATA); asked before any tile is used. */
int rsgl_amx_enable(void) {
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                   18 /* XFEATURE_XTILEDATA */) == 0;
}
#else
#define AMX_NATIVE 0
/* Never called: the loader packs for AMX only where rsgl_amx_enable says it runs. */
static void qlinear_amx(int fmt, const uint8_t* w, const uint16_t* x, int64_t M, int64_t K,
                        int64_t N, uint16_t* y, int threads) {
    (void)fmt, (void)w, (void)x, (void)M, (void)K, (void)N, (void)y, (void)threads;
    abort();
}
int rsgl_amx_enable(void) { return 0; }
#endif

/* Per GGUF format: the exact bfloat16 product over AMX's layout, its packing, and rows `ids`
   back in the file's layout. */
#define AMX_FORMAT(name, fmt)                                                                  \
    void rsgl_qlinear_##name##_amx_bf16(const uint16_t* x, int64_t M, int64_t K,               \
                                        const uint8_t* w, int64_t N, uint16_t* y, int threads) { \
        qlinear_amx(fmt, w, x, M, K, N, y, threads);                                           \
    }                                                                                          \
    int64_t rsgl_packed_amx_bytes_##name(int64_t N, int64_t K) {                               \
        return (N + 15) / 16 * (K / QK) * amx_block_bytes(fmt);                                \
    }                                                                                          \
    void rsgl_pack_amx_##name(const uint8_t* w, int64_t N, int64_t K, uint8_t* out) {         \
        memset(out, 0, (size_t)rsgl_packed_amx_bytes_##name(N, K));                            \
        amx_copy(fmt, (uint8_t*)w, K, out, NULL, N, 1);                                        \
    }                                                                                          \
    void rsgl_unpack_rows_amx_##name(const uint8_t* packed, int64_t K, const int64_t* ids,     \
                                     int64_t n, uint8_t* out) {                                \
        amx_copy(fmt, out, K, (uint8_t*)packed, ids, n, 0);                                    \
    }

AMX_FORMAT(q4_0, Q4_0)
AMX_FORMAT(q4_1, Q4_1)
AMX_FORMAT(q8_0, Q8_0)

/* `a`: gguf_mat over the interleaved bytes (its fmt and w; rows are groups of 8 here). */
static void qlinear_x8b(const QMat* a, const uint16_t* x, int64_t M, int64_t K, int64_t N,
                        uint16_t* y, int threads) {
    if (M <= 0) return;
    const int fmt = a->fmt;
    const uint8_t* w = a->w;
    const int64_t nb = K / QK, groups = (N + 7) / 8, gb = nb * x8_block_bytes(fmt);
    float* sx = (float*)malloc((size_t)(M * nb + 1) * sizeof(float));
    if (!sx) abort();
    block_sums_bf16(x, M, K, sx);
#pragma omp parallel for num_threads(threads) schedule(static) \
    if (threads > 1 && N * M * K >= 65536)
    for (int64_t G = 0; G < groups; G++) {
        const int64_t lanes = N - 8 * G < 8 ? N - 8 * G : 8;
        for (int64_t r = 0; r < M; r += X8B_ROWS) {
            const int64_t R = M - r < X8B_ROWS ? M - r : X8B_ROWS;
            float out[8 * X8B_ROWS];
            const uint16_t* xr = x + r * K;
            const float* sr = sx + r * nb;
            switch (fmt) { /* one instance per format */
                case Q4_0: x8b_rows(Q4_0, w + G * gb, nb, xr, sr, R, out); break;
                case Q4_1: x8b_rows(Q4_1, w + G * gb, nb, xr, sr, R, out); break;
                default: x8b_rows(Q8_0, w + G * gb, nb, xr, sr, R, out); break;
            }
            for (int64_t i = 0; i < R; i++)
                for (int64_t j = 0; j < lanes; j++) bf16_store(y, (r + i) * N + 8 * G + j, out[8 * i + j]);
        }
    }
    free(sx);
}

/* Whether the kernels below run on AVX512-BF16 (else in plain C, far slower: the loader
   picks them only where they do). */
int rsgl_x8b_native(void) { return X8B_NATIVE; }

#define X8B_FORMAT(name, fmt)                                                                  \
    void rsgl_qlinear_##name##_x8b_bf16(const uint16_t* x, int64_t M, int64_t K,               \
                                        const uint8_t* w, int64_t N, uint16_t* y, int threads) { \
        const QMat a = gguf_mat(fmt, w, K);                                                    \
        qlinear_x8b(&a, x, M, K, N, y, threads);                                               \
    }

X8B_FORMAT(q4_0, Q4_0)
X8B_FORMAT(q4_1, Q4_1)
X8B_FORMAT(q8_0, Q8_0)
