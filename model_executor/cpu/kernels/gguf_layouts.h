/* The GGUF block layouts the kernels read, as packing.py writes them: each kind's number (the
 * `kind` of srt_gguf_linear and srt_q4_linear_f32, 4 bits a weight in srt_decode_layer's `kinds`,
 * ops.GGUF_KINDS on the Python side), its bytes per 16 outputs x 32 k, and where a run of 32 k of
 * the two super-block layouts (the file's own scales) sits in a 16-output stream. Scalar only:
 * include it from any ISA path. */
#ifndef SRT_GGUF_LAYOUTS_H
#define SRT_GGUF_LAYOUTS_H

#include <stdint.h>

enum {
    GGUF_Q4_1 = 1,  /* q4_pack: fp16 d and m, then the nibbles */
    GGUF_Q4_K = 2,  /* q4_pack: fp32 d and m, then the nibbles */
    GGUF_Q5_K = 3,  /* q5k_pack: Q4_K's, then the fifth bits */
    GGUF_Q8_0 = 4,  /* q8_pack: fp16 d, then q + 128 */
    GGUF_Q6_K = 5,  /* q8_pack: fp32 D per 16 k, then q + 128 */
    GGUF_Q4_KS = 6, /* q4ks_pack: per 256 k, 16 fp32 D and 16 M, then 8 runs of sc, mn and nibbles */
    GGUF_Q6_KS = 7, /* q6ks_pack: per 256 k, 16 fp32 D, then 8 runs of int8 sc and six-bit chunks */
};
#define Q4KS_SUPER 2432 /* bytes per 16 outputs x 256 k: 128 of D and M, 8 runs of 288 */
#define Q6KS_SUPER 3392 /* bytes per 16 outputs x 256 k: 64 of D, 8 runs of 416 */

/* bytes per 16 outputs x 32 k (the super-block layouts: on average) */
static inline int64_t gguf_block_bytes(const int64_t kind) {
    return kind == GGUF_Q4_1    ? 320
           : kind == GGUF_Q4_K  ? 384
           : kind == GGUF_Q5_K  ? 448
           : kind == GGUF_Q8_0  ? 544
           : kind == GGUF_Q4_KS ? Q4KS_SUPER / 8
           : kind == GGUF_Q6_KS ? Q6KS_SUPER / 8
                                : 640;
}

/* Q4_KS: run kb of a 16-output stream (16 sc, 16 mn, 256 bytes of nibbles), and its super-block's
 * 16 fp32 D (then, 64 bytes on, M) */
static inline const uint8_t *q4ks_run(const uint8_t *w, const int64_t kb) {
    return w + (kb >> 3) * Q4KS_SUPER + 128 + (kb & 7) * 288;
}
static inline const float *q4ks_head(const uint8_t *w, const int64_t kb) {
    return (const float *)(w + (kb >> 3) * Q4KS_SUPER);
}

/* Q6_KS: run kb of a 16-output stream (its 32 int8 sc, then 8 chunks of 48 bytes), and its
 * super-block's 16 fp32 D */
static inline const uint8_t *q6ks_run(const uint8_t *w, const int64_t kb) {
    return w + (kb >> 3) * Q6KS_SUPER + 64 + (kb & 7) * 416;
}
static inline const float *q6ks_head(const uint8_t *w, const int64_t kb) {
    return (const float *)(w + (kb >> 3) * Q6KS_SUPER);
}

#endif
