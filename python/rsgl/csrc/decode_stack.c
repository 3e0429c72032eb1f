/* A decode step through every decoder layer in one call, for small decode-only batches of a
   model whose projections are all low-bit (rsgl/layers/decode_stack.py decides when).

   It calls the same kernels the Python layers call, on the same buffers' values and in the
   same order, so its output is the layer-by-layer path's, bit for bit; what it removes is
   the Python between them (per layer: eight kernel calls, each with its argument checks,
   output allocation and module dispatch; at batch 1 that was a third of a step). The
   kernels arrive as function pointers: which instance serves a projection (GGUF format or
   load-time group, activation dtype) or the attention (activation and KV cache dtypes) is
   the Python side's choice, as it is for the layer-by-layer path. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef void (*GgufLinear)(const void* x, int64_t M, int64_t K, const uint8_t* w, int64_t N,
                           void* y, int threads);
typedef void (*GroupLinear)(int bits, const void* x, int64_t M, int64_t K, const uint8_t* w,
                            const float* scales, const float* mins, int64_t group, int64_t N,
                            void* y, int threads);
typedef void (*AddRmsNorm)(const void* x, const void* residual, void* residual_out,
                           const void* w, void* out, int64_t rows, int64_t dim, float eps,
                           int threads);
typedef void (*SiluMul)(const void* gate_up, void* out, int64_t rows, int64_t inter,
                        int threads);
typedef void (*DecodeLayer)(const void* qkv, const float* cis, const int64_t* loc, void* kb,
                            void* vb, float* ks, float* vs, const int32_t* req_to_token,
                            int64_t r2t_stride, const int64_t* req_slots,
                            const int64_t* seq_lens, void* out, int64_t B, int64_t H,
                            int64_t Hkv, int64_t D, float scale, int threads);

/* One projection y[M, n] = x[M, k] . W^T: GGUF blocks (`gguf` set, `bits` unused) or the
   load-time groups (`group_fn`, with `bits`, scales, mins and group). */
typedef struct {
    GgufLinear gguf;
    GroupLinear group_fn;
    const uint8_t* w;
    const float* scales;
    const float* mins;
    int64_t group;
    int64_t n, k;
    int32_t bits;
} StackProj;

/* One decoder layer: its norms' weights, its four projections and its KV cache (the int8
   cache's scales too, else NULL). */
typedef struct {
    const void* input_norm;
    const void* post_norm;
    StackProj qkv, o, gate_up, down;
    void* k_cache;
    void* v_cache;
    float* k_scales;
    float* v_scales;
} StackLayer;

/* What every layer shares: the kernels for the activation dtype, the attention's shapes and
   the step's indices (see rsgl_decode_layer_*). */
typedef struct {
    AddRmsNorm add_rmsnorm;
    SiluMul silu_mul;
    DecodeLayer attend;
    int64_t hidden, heads, kv_heads, head_dim, inter;
    float eps, scale;
    int32_t act_bytes;
} StackModel;

static void project(const StackProj* p, const void* x, int64_t M, void* y, int threads) {
    if (p->gguf)
        p->gguf(x, M, p->k, p->w, p->n, y, threads);
    else
        p->group_fn(p->bits, x, M, p->k, p->w, p->scales, p->mins, p->group, p->n, y, threads);
}

/* x [B, hidden]: the embedded tokens, overwritten. normed [B, hidden]: the last layer's
   output after the final norm (`final_norm`), what the LM head reads. cis [B, head_dim / 2,
   2], loc, req_slots and seq_lens [B], req_to_token as for rsgl_decode_layer_*. Returns 0,
   or -1 when its scratch could not be allocated (nothing written then). */
int rsgl_decode_stack(const StackModel* m, const StackLayer* layers, int64_t num_layers,
                      void* x, void* normed, const void* final_norm, int64_t B,
                      const float* cis, const int64_t* loc, const int32_t* req_to_token,
                      int64_t r2t_stride, const int64_t* req_slots, const int64_t* seq_lens,
                      int threads) {
    const int64_t e = m->act_bytes, hd = m->hidden;
    const int64_t q = m->heads * m->head_dim, width = (m->heads + 2 * m->kv_heads) * m->head_dim;
    /* residual, a second residual (the sum is written apart from its inputs, as the layer
       path allocates a new one), qkv, attention output, gate_up, activation. */
    const int64_t sizes[6] = {B * hd, B * hd, B * width, B * q, B * 2 * m->inter, B * m->inter};
    int64_t total = 0;
    for (int i = 0; i < 6; i++) total += sizes[i];
    char* scratch = (char*)malloc((size_t)(total * e));
    if (!scratch) return -1;
    char* buf[6];
    for (int64_t i = 0, off = 0; i < 6; off += sizes[i] * e, i++) buf[i] = scratch + off;
    char *residual = buf[0], *summed = buf[1], *qkv = buf[2], *attn = buf[3];
    char *gate_up = buf[4], *act = buf[5];
    /* The layer path's first norm has no residual: the embedding is the residual stream. */
    memcpy(residual, x, (size_t)(B * hd * e));
    for (int64_t i = 0; i < num_layers; i++) {
        const StackLayer* l = &layers[i];
        if (i == 0) {
            m->add_rmsnorm(x, NULL, x, l->input_norm, normed, B, hd, m->eps, threads);
        } else {
            m->add_rmsnorm(x, residual, summed, l->input_norm, normed, B, hd, m->eps, threads);
            char* t = residual;
            residual = summed;
            summed = t;
        }
        project(&l->qkv, normed, B, qkv, threads);
        m->attend(qkv, cis, loc, l->k_cache, l->v_cache, l->k_scales, l->v_scales,
                  req_to_token, r2t_stride, req_slots, seq_lens, attn, B, m->heads,
                  m->kv_heads, m->head_dim, m->scale, threads);
        project(&l->o, attn, B, x, threads);
        m->add_rmsnorm(x, residual, summed, l->post_norm, normed, B, hd, m->eps, threads);
        char* t = residual;
        residual = summed;
        summed = t;
        project(&l->gate_up, normed, B, gate_up, threads);
        m->silu_mul(gate_up, act, B, m->inter, threads);
        project(&l->down, act, B, x, threads);
    }
    m->add_rmsnorm(x, residual, summed, final_norm, normed, B, hd, m->eps, threads);
    free(scratch);
    return 0;
}
