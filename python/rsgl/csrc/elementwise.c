/* add+RMSNorm, SiLU-and-multiply and rotary over float32 rows (..._f32) and bfloat16 rows
   (..._bf16). */
#include "common.h"

#define ACT_BF16 0
#include "elementwise_impl.h"
#undef ACT_BF16

#define ACT_BF16 1
#include "elementwise_impl.h"
#undef ACT_BF16
