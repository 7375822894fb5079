/* bf16 <-> float for one value, as torch casts them; plain C, so loops of them vectorise. */
#ifndef SRT_SCALAR_BF16_H
#define SRT_SCALAR_BF16_H

#include <stdint.h>
#include <string.h>

#include "srt_kernels.h"

static inline float bf16_to_f32(bf16 x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to nearest even, as torch's float -> bfloat16 cast; a NaN stays a (quiet) NaN. A select,
 * not a branch, so that a loop of it vectorises. */
static inline bf16 f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16, quiet = (u >> 16) | 0x40u;
    return (bf16)((u & 0x7fffffffu) > 0x7f800000u ? quiet : rounded);
}

#endif
