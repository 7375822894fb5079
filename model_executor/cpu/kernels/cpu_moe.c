/* A mixture-of-experts MLP (model_executor/layers/moe.py's SparseMoeBlock, through cpu/moe.py) in
 * one call: the router's float32 logits, the softmax and top k of each token, and each active
 * expert in ascending id: its tokens' rows of x gathered, silu(gate) * up and down on the expert's
 * packed bf16 weights (cpu_bf16_linear.c), and each row's float32 output, times the token's routing
 * weight, added to the token's row of out; then Qwen2-MoE's gated shared expert. Each active
 * expert's weights are read once a call whatever its number of tokens, and a token's routing and
 * sum depend on its own row only, in the same order in any batch. The fused decoder layer
 * (srt_decode_layer) calls srt_moe_block for a MoE layer's MLP, so a decode step and a prefill
 * route alike. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "srt_kernels.h"

/* Each row of logits (`stride` floats apart, the first num_experts of them read): the softmax's
 * top_k largest probabilities in descending order, equal ones in ascending expert id (as a stable
 * descending sort), into ids [m][top_k] and weights [m][top_k], divided by their sum where
 * `renormalize`. */
void srt_moe_route(const float *logits, int64_t stride, int64_t m, int64_t num_experts, int64_t top_k,
                   int64_t renormalize, int64_t *ids, float *weights) {
    float *probs = malloc((size_t)num_experts * sizeof(float));
    for (int64_t r = 0; r < m; r++) {
        const float *l = logits + r * stride;
        float top = -INFINITY, total = 0.0f;
        for (int64_t e = 0; e < num_experts; e++) top = l[e] > top ? l[e] : top;
        for (int64_t e = 0; e < num_experts; e++) total += probs[e] = expf(l[e] - top);
        for (int64_t e = 0; e < num_experts; e++) probs[e] /= total;
        int64_t *id = ids + r * top_k;
        float *w = weights + r * top_k, chosen = 0.0f;
        for (int64_t t = 0; t < top_k; t++) {
            int64_t best = -1;
            for (int64_t e = 0; e < num_experts; e++) /* strictly larger: a tie stays with the lower id */
                if (probs[e] >= 0.0f && (best < 0 || probs[e] > probs[best])) best = e;
            id[t] = best;
            chosen += w[t] = probs[best];
            probs[best] = -1.0f; /* taken */
        }
        if (renormalize)
            for (int64_t t = 0; t < top_k; t++) w[t] /= chosen;
    }
    free(probs);
}

/* x [m][k] bf16; expert e's packed gate_up ([2d, k]) and down ([k, d]) weights at gate_up[e] and
 * down[e] (addresses); counts[e] tokens routed to it, their rows of x listed in rows[] expert after
 * expert (ascending expert id, tokens ascending), their routing weights in weights[] alike;
 * scratch xg [m][k], act [m][d], y [m][k]; out [m][k] float32, added to. k % 32 == 0, d % 32 == 0. */
static void moe_experts(const bf16 *x, int64_t m, int64_t k, int64_t d, int64_t num_experts, const int64_t *gate_up,
                        const int64_t *down, const int64_t *counts, const int64_t *rows, const float *weights,
                        bf16 *xg, bf16 *act, float *y, float *out) {
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

/* The block of one layer on this rank: out [m][k] float32 = sum over each token's top_k experts
 * (ascending id) of weight * expert(x) (+ sigmoid(shared gate) * shared expert(x)), this rank's
 * part before the all-reduce; the chosen experts into ids [m][top_k]; each expert's token count
 * added to expert_tokens. `moe` describes the block (cpu/moe.py's FusedExperts.descriptor):
 *   [0] num_experts  [1] top_k  [2] renormalize  [3] d, an expert's intermediate size (this rank's)
 *   [4] gate_up, [5] down: addresses of num_experts addresses of packed weights
 *   [6] the router's packed weight ([6 + 1] rows of it, a multiple of 32)  [8] expert_tokens (int64)
 *   [9] the shared expert's d, 0 without one  [10] its gate_up  [11] its down  [12] its packed gate
 *   ([1, k] padded to 32 rows)
 * Scratch is allocated here. */
void srt_moe_block(const bf16 *x, int64_t m, int64_t k, const int64_t *moe, int64_t *ids, float *out) {
    const int64_t num_experts = moe[0], top_k = moe[1], d = moe[3], router_rows = moe[7], shared_d = moe[9];
    const int64_t act_d = shared_d > d ? shared_d : d;
    float *logits = malloc((size_t)(m * router_rows) * sizeof(float));
    float *routed = malloc((size_t)(m * top_k) * sizeof(float));
    float *slot_weights = malloc((size_t)(m * top_k) * sizeof(float));
    int64_t *counts = calloc((size_t)num_experts, sizeof(int64_t));
    int64_t *next = malloc((size_t)num_experts * sizeof(int64_t));
    int64_t *rows = malloc((size_t)(m * top_k) * sizeof(int64_t));
    bf16 *xg = malloc((size_t)(m * k) * sizeof(bf16));
    bf16 *act = malloc((size_t)(m * act_d) * sizeof(bf16));
    float *y = malloc((size_t)(m * k) * sizeof(float));
    int64_t *expert_tokens = (int64_t *)(intptr_t)moe[8];

    srt_bf16_linear_f32(x, m, (const bf16 *)(intptr_t)moe[6], NULL, logits, router_rows, k);
    srt_moe_route(logits, router_rows, m, num_experts, top_k, moe[2], ids, routed);
    /* each expert's (token, slot) pairs, expert after expert, tokens ascending: a counting sort */
    for (int64_t i = 0; i < m * top_k; i++) counts[ids[i]]++;
    for (int64_t e = 0, at = 0; e < num_experts; e++) {
        next[e] = at;
        at += counts[e];
        expert_tokens[e] += counts[e];
    }
    for (int64_t i = 0; i < m * top_k; i++) {
        const int64_t at = next[ids[i]]++;
        rows[at] = i / top_k;
        slot_weights[at] = routed[i];
    }
    memset(out, 0, (size_t)(m * k) * sizeof(float));
    moe_experts(x, m, k, d, num_experts, (const int64_t *)(intptr_t)moe[4], (const int64_t *)(intptr_t)moe[5], counts,
                rows, slot_weights, xg, act, y, out);
    if (shared_d) { /* out += sigmoid(x . gate) * down(silu(gate_up(x))), the gate's one logit per row */
        srt_bf16_linear_f32(x, m, (const bf16 *)(intptr_t)moe[12], NULL, logits, 32, k);
        srt_bf16_linear_silu(x, m, (const bf16 *)(intptr_t)moe[10], act, shared_d, k);
        srt_bf16_linear_f32(act, m, (const bf16 *)(intptr_t)moe[11], NULL, y, k, shared_d);
        for (int64_t r = 0; r < m; r++) {
            const float g = 1.0f / (1.0f + expf(-logits[r * 32]));
            for (int64_t j = 0; j < k; j++) out[r * k + j] += g * y[r * k + j];
        }
    }
    free(logits);
    free(routed);
    free(slot_weights);
    free(counts);
    free(next);
    free(rows);
    free(xg);
    free(act);
    free(y);
}
