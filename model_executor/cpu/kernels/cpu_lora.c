/* LoRA's low-rank products for a whole step in one call per layer (model_executor/lora/): each token
 * row of x under an adapter adds its delta (x A^T) B^T, B already scaled, into its row of out, summed
 * in float32 and rounded once into a bf16 out; a row under no adapter is not touched. Rows of
 * different adapters share the call, as punica and S-LoRA group them on GPUs.
 *
 * Each row runs on its own, in the same order whatever the batch and however the rows are split
 * over threads, so a row's bits never depend on the rows beside it: batch-invariant, as
 * deterministic inference and a restart's replay need.
 *
 * `table` has one entry of LORA_SLOT_WORDS int64 per adapter slot (lora/linear_method.py writes it
 * when an adapter attaches or leaves): A's address (float32 [R, k], the stacked A of the layer's
 * adapted modules), R, the number of parts, then for each part (one adapted module: q, k, v; gate,
 * up) the first of its R rows of A, its rank, its first output column, its number of outputs, and
 * its B's address (float32 [rank, outputs]: transposed). A slot with R 0 adapts nothing here.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "scalar_bf16.h"
#include "srt_kernels.h"

#define LORA_MAX_PARTS 4
#define LORA_SLOT_WORDS (3 + 5 * LORA_MAX_PARTS)

int64_t srt_lora_slot_words(void) { return LORA_SLOT_WORDS; }

static float dot_f32(const float *a, const float *b, const int64_t n) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < n; i++) acc += a[i] * b[i];
    return acc;
}

/* One row: xf its float32 input, t scratch for R sums then a part's outputs, o its row of out. B is
 * stored transposed ([rank, outputs]), so each output's sum over the rank runs down a column in
 * order while the vector lanes take 16 outputs at a time. */
static void lora_row(const float *xf, const int64_t k, const int64_t *entry, float *t, void *o,
                     const int64_t out_f32) {
    const float *a = (const float *)(intptr_t)entry[0];
    const int64_t R = entry[1], parts = entry[2];
    float *sums = t + R;
    for (int64_t r = 0; r < R; r++) t[r] = dot_f32(a + r * k, xf, k);
    for (int64_t p = 0; p < parts; p++) {
        const int64_t *part = entry + 3 + 5 * p;
        const int64_t r0 = part[0], rank = part[1], o0 = part[2], outputs = part[3];
        const float *bt = (const float *)(intptr_t)part[4];
        memset(sums, 0, (size_t)outputs * sizeof(float));
        for (int64_t r = 0; r < rank; r++) {
            const float tr = t[r0 + r], *row = bt + r * outputs;
#pragma omp simd
            for (int64_t j = 0; j < outputs; j++) sums[j] += tr * row[j];
        }
        if (out_f32) {
            float *of = (float *)o + o0;
#pragma omp simd
            for (int64_t j = 0; j < outputs; j++) of[j] += sums[j];
        } else {
            bf16 *ob = (bf16 *)o + o0;
            for (int64_t j = 0; j < outputs; j++) ob[j] = f32_to_bf16(bf16_to_f32(ob[j]) + sums[j]);
        }
    }
}

void srt_lora_delta(const void *x, int64_t x_f32, int64_t m, int64_t k, void *out, int64_t out_f32, int64_t n,
                    const int32_t *row_slot, const int64_t *table, int64_t slots) {
    int64_t most = 0; /* the largest R, for the scratch */
    for (int64_t s = 0; s < slots; s++) most = table[s * LORA_SLOT_WORDS + 1] > most ? table[s * LORA_SLOT_WORDS + 1] : most;
    most += n; /* and a part's sums */
    /* The adapter rows in order of their slot, so that the threads split the adapters between them
     * and each reads an adapter's A and B once, its later rows from cache (a row's sums are its own
     * whatever the order). */
    int64_t *order = malloc((size_t)(m > 0 ? m : 1) * sizeof(int64_t)), count = 0;
    for (int64_t s = 0; s < slots; s++) {
        if (table[s * LORA_SLOT_WORDS + 1] == 0) continue;
        for (int64_t i = 0; i < m; i++)
            if (row_slot[i] == s) order[count++] = i;
    }
#pragma omp parallel if (count > 1)
    {
        float *xf = malloc((size_t)(k + most) * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t c = 0; c < count; c++) {
            const int64_t i = order[c], s = row_slot[i];
            if (x_f32)
                memcpy(xf, (const float *)x + i * k, (size_t)k * sizeof(float));
            else
                for (int64_t j = 0; j < k; j++) xf[j] = bf16_to_f32(((const bf16 *)x)[i * k + j]);
            void *o = out_f32 ? (void *)((float *)out + i * n) : (void *)((bf16 *)out + i * n);
            lora_row(xf, k, table + s * LORA_SLOT_WORDS, xf + k, o, out_f32);
        }
        free(xf);
    }
    free(order);
}
