/* One KV element type's kernels: the attention (attention_impl.h), then the decode entry
   points for float32 and for bfloat16 activations (decode_impl.h). attention.c defines the
   type's KV_* macros and includes this once per type. */
#include "attention_impl.h"
#define ACT_BF16 0
#include "decode_impl.h"
#undef ACT_BF16
#define ACT_BF16 1
#include "decode_impl.h"
#undef ACT_BF16
#undef ATTEND_Q16
