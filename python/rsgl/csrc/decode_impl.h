/* The decode entry points over a batch (attention alone, and the fused decode layer step),
   written once over the activation (model) dtype and the KV element type. attention.c
   includes this file after each attention_impl.h instance (KV_* still defined), once per
   activation dtype, with ACT_BF16 defined: 1 for bfloat16 q/qkv/out rows, 0 for float32.
   Names carry both: rsgl_decode_layer_bf16_f16 takes bfloat16 rows over a float16 cache.
   Attention itself runs on float32 queries (FN(attend_one)); bfloat16 rows are widened on
   the way in and rounded to nearest even on the way out. Their queries hold bfloat16
   values, which ATTEND_Q16 (attention_impl.h) may use for the scores. */
#if ACT_BF16
#define ATTEND ATTEND_Q16
#define ACT_T uint16_t
#define ACT_LOAD(p, i) bf16_to_f32((p)[i])
#define ACT_ROUND(x) bf16_round(x)
#define ENTRY(name) FN_EXPAND(name, FN_EXPAND(bf16, KV_SUFFIX))
#else
#define ATTEND FN(attend_one)
#define ACT_T float
#define ACT_LOAD(p, i) ((p)[i])
#define ACT_ROUND(x) (x)
#define ENTRY(name) FN_EXPAND(name, FN_EXPAND(f32, KV_SUFFIX))
#endif

/* Extra scratch floats per request for bfloat16 rows: the widened query and the float32
   output before it is rounded. */
#define ACT_TMP(H, D) (ACT_BF16 ? 2 * (H) * (D) : 0)

/* out[b, h] = softmax(q[b, h] . K[b]^T * scale) V[b] for one query per request, where the
   keys of request b are the rows kb[req_to_token[req_slots[b], 0:seq_lens[b]]]. One request
   per work item. */
void ENTRY(rsgl_decode_attention)(
    const ACT_T* q, const KV_T* kb, const KV_T* vb, const float* ks, const float* vs,
    const int32_t* req_to_token,
    int64_t r2t_stride, const int64_t* req_slots, const int64_t* seq_lens, ACT_T* out,
    int64_t B, int64_t H, int64_t Hkv, int64_t D, float scale, int nthreads) {
    #pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int64_t b = 0; b < B; b++) {
        const int64_t len = seq_lens[b];
        const int64_t scratch = len * H + ATTEND_TMP(H, Hkv, D) + ACT_TMP(H, D);
        float* sc = (float*)malloc(sizeof(float) * (size_t)scratch);
        float* tmp = sc + len * H;
#if ACT_BF16
        float* qf = tmp + ATTEND_TMP(H, Hkv, D);
        float* of = qf + H * D;
        widen_bf16(q + b * H * D, qf, H * D);
#else
        const float* qf = q + b * H * D;
        float* of = out + b * H * D;
#endif
        ATTEND(qf, kb, vb, ks, vs, req_to_token + req_slots[b] * r2t_stride, len, H, Hkv, D,
                       scale, sc, tmp, of);
#if ACT_BF16
        for (int64_t i = 0; i < H * D; i++) bf16_store(out + b * H * D, i, of[i]);
#endif
        free(sc);
    }
}

/* A decode-only layer step after the QKV projection, per request b: rotate q and k of row b
   of qkv ([B, (H + 2 Hkv) D], pair-interleaved rotary layout) by cis[b] ([D / 2] (cos, sin)
   pairs, float32), store the rotated k and v at KV slot loc[b] (rounded to KV_T), then
   attend as rsgl_decode_attention. The rotated q and k are rounded to the activation dtype
   first, as the eager rotary's output is. Request b's own key is among those it reads
   (req_to_token already maps position seq_lens[b] - 1 to loc[b]); other requests never
   read row loc[b]. ks / vs: the int8 cache's scales ([slots, Hkv], stored too), else NULL. */
void ENTRY(rsgl_decode_layer)(
    const ACT_T* qkv, const float* cis, const int64_t* loc, KV_T* kb, KV_T* vb, float* ks,
    float* vs, const int32_t* req_to_token, int64_t r2t_stride, const int64_t* req_slots,
    const int64_t* seq_lens, ACT_T* out, int64_t B, int64_t H, int64_t Hkv, int64_t D,
    float scale, int nthreads) {
    const int64_t row = Hkv * D;
    const int64_t width = (H + 2 * Hkv) * D;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int64_t b = 0; b < B; b++) {
        const int64_t len = seq_lens[b];
        const ACT_T* x = qkv + b * width;
        const float* cs = cis + b * D;
        const int64_t scratch = H * D + len * H + ATTEND_TMP(H, Hkv, D) + ACT_TMP(H, D);
        float* q = (float*)malloc(sizeof(float) * (size_t)scratch);
        float* sc = q + H * D;
        float* tmp = sc + len * H;
#if ACT_BF16
        float* of = tmp + ATTEND_TMP(H, Hkv, D);
#else
        float* of = out + b * H * D;
#endif
        KV_T* k = kb + loc[b] * row;
        for (int64_t h = 0; h < H; h++) {
            const ACT_T* xh = x + h * D;
            float* dst = q + h * D;
            for (int64_t i = 0; i < D / 2; i++) {
                const float c = cs[2 * i], s = cs[2 * i + 1];
                const float x0 = ACT_LOAD(xh, 2 * i), x1 = ACT_LOAD(xh, 2 * i + 1);
                dst[2 * i] = ACT_ROUND(x0 * c - x1 * s);
                dst[2 * i + 1] = ACT_ROUND(x0 * s + x1 * c);
            }
        }
        /* Each kv head's rotated key, then its value, as floats in tmp, then stored. */
        const ACT_T* v = x + (H + Hkv) * D;
        KV_T* vdst = vb + loc[b] * row;
        for (int64_t h = 0; h < Hkv; h++) {
            const ACT_T* xh = x + (H + h) * D;
            for (int64_t i = 0; i < D / 2; i++) {
                const float c = cs[2 * i], s = cs[2 * i + 1];
                const float x0 = ACT_LOAD(xh, 2 * i), x1 = ACT_LOAD(xh, 2 * i + 1);
                tmp[2 * i] = ACT_ROUND(x0 * c - x1 * s);
                tmp[2 * i + 1] = ACT_ROUND(x0 * s + x1 * c);
            }
            FN(store_head)(k + h * D, KV_SCALED ? ks + loc[b] * Hkv + h : NULL, tmp, D);
            for (int64_t i = 0; i < D; i++) tmp[i] = ACT_LOAD(v, h * D + i);
            FN(store_head)(vdst + h * D, KV_SCALED ? vs + loc[b] * Hkv + h : NULL, tmp, D);
        }
        ATTEND(q, kb, vb, ks, vs, req_to_token + req_slots[b] * r2t_stride, len, H, Hkv, D,
                       scale, sc, tmp, of);
#if ACT_BF16
        for (int64_t i = 0; i < H * D; i++) bf16_store(out + b * H * D, i, of[i]);
#endif
        free(q);
    }
}

#undef ATTEND
#undef ACT_T
#undef ACT_LOAD
#undef ACT_ROUND
#undef ENTRY
#undef ACT_TMP
