/* The experts of one mixture-of-experts layer in one call (model_executor/layers/moe.py's
 * SparseMoeBlock, through cpu/moe.py): for each active expert in ascending id, its tokens' rows of
 * x gathered, silu(gate) * up and down on the expert's packed bf16 weights (cpu_bf16_linear.c), and
 * each row's float32 output, times the token's routing weight, added to the token's row of out.
 * Each active expert's weights are read once a step whatever its number of tokens, and a token's
 * sum runs over its experts in the same order in any batch. */
#include <stdint.h>
#include <string.h>

#include "srt_kernels.h"

/* x [m][k] bf16; expert e's packed gate_up ([2d, k]) and down ([k, d]) weights at gate_up[e] and
 * down[e] (addresses); counts[e] tokens routed to it, their rows of x listed in rows[] expert after
 * expert (ascending expert id, tokens ascending), their routing weights in weights[] alike;
 * scratch xg [m][k], act [m][d], y [m][k]; out [m][k] float32, added to. k % 32 == 0, d % 32 == 0. */
void srt_moe_experts_bf16(const bf16 *x, int64_t m, int64_t k, int64_t d, int64_t num_experts,
                          const int64_t *gate_up, const int64_t *down, const int64_t *counts, const int64_t *rows,
                          const float *weights, bf16 *xg, bf16 *act, float *y, float *out) {
    int64_t start = 0;
    for (int64_t e = 0; e < num_experts; e++) {
        const int64_t c = counts[e];
        if (c <= 0) continue;
        const int64_t *r = rows + start;
        int whole = c == m; /* every row of x, in order: no gather */
        for (int64_t i = 0; whole && i < c; i++) whole = r[i] == i;
        const bf16 *xe = x;
        if (!whole) {
            for (int64_t i = 0; i < c; i++) memcpy(xg + i * k, x + r[i] * k, (size_t)k * sizeof(bf16));
            xe = xg;
        }
        srt_bf16_linear_silu(xe, c, (const bf16 *)(intptr_t)gate_up[e], act, d, k);
        srt_bf16_linear_f32(act, c, (const bf16 *)(intptr_t)down[e], NULL, y, k, d);
        for (int64_t i = 0; i < c; i++) {
            float *o = out + r[i] * k;
            const float *yi = y + i * k;
            const float w = weights[start + i];
            for (int64_t j = 0; j < k; j++) o[j] += yi[j] * w;
        }
        start += c;
    }
}
