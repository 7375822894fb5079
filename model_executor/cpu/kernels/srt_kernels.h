/* The CPU kernels' interface: every function the shared object exports, declared once.
 *
 * Every .c file includes this header first, so a definition that disagrees with its declaration
 * does not compile, and the build (-Werror=missing-prototypes) refuses an exported function that
 * is not declared here. Python reads its ctypes signatures from this file (build.py), so keep each
 * declaration to the types that parser knows: `void` or `int64_t` results; `int64_t`, `float` or a
 * pointer parameters. Tensors are passed as their data pointers, row-major; `bf16` is bfloat16's
 * bits (torch.bfloat16). Sizes and strides are in elements.
 */
#ifndef SRT_KERNELS_H
#define SRT_KERNELS_H

#include <stdint.h>

typedef uint16_t bf16;

/* cpu_kernels.c: the elementwise ops, decode attention, the GEMV and the fused decoder layer */
void srt_rmsnorm(const void *x, int64_t x_f32, const float *residual, const bf16 *weight, bf16 *out,
                 float *residual_out, int64_t rows, int64_t dim, float eps);
void srt_rmsnorm_f32w(const void *x, int64_t x_f32, const float *residual, const float *weight, void *out,
                      int64_t out_f32, float *residual_out, int64_t rows, int64_t dim, float eps);
void srt_layernorm(const void *x, int64_t x_f32, const float *residual, const float *weight, const float *bias,
                   float *out, bf16 *out_bf16, int64_t rows, int64_t dim, float eps);
void srt_gelu_erf(const float *x, bf16 *out, int64_t n);
void srt_encoder_attention(const float *q, const float *k, const float *v, int64_t stride, bf16 *out,
                           const int64_t *lens, int64_t bs, int64_t heads, int64_t d, float scale);
void srt_bert_layer(float *h, bf16 *hb, int64_t n, int64_t hidden, int64_t inter, const void *const *params,
                    float eps, const int64_t *lens, int64_t bs, int64_t d, float scale, float *scratch);
void srt_silu_mul(const bf16 *x, bf16 *out, int64_t rows, int64_t d);
void srt_gelu_tanh_mul(const bf16 *x, bf16 *out, int64_t rows, int64_t d);
void srt_rope(const bf16 *x, int64_t x_stride, bf16 *out, int64_t n, int64_t heads, int64_t d,
              const int64_t *positions, const bf16 *cos, const bf16 *sin);
void srt_decode_attention(const bf16 *q, int64_t q_stride, const bf16 *k, int64_t k_stride, const bf16 *v,
                          int64_t v_stride, bf16 *k_cache, bf16 *v_cache, const int64_t *out_loc,
                          const int64_t *req_to_token, int64_t rtt_stride, const int64_t *rows,
                          const int64_t *seq_lens, bf16 *out, int64_t bs, int64_t hq, int64_t hkv, int64_t d,
                          float scale, int64_t max_len, int64_t window, float softcap);
void srt_set_split_threads(int64_t threads);
void srt_gemv(const bf16 *x, int64_t m, const bf16 *w, const bf16 *bias, bf16 *out, int64_t n, int64_t k);
int64_t srt_decode_layer(const void *hidden, int64_t hidden_f32, float *residual, int64_t first, const bf16 *ln1, const bf16 *ln2, float eps,
                      const bf16 *w_qkv, const bf16 *b_qkv, const bf16 *w_o, const bf16 *w_gate_up,
                      const bf16 *w_down, const void *p_qkv, const void *p_o, const void *p_gate_up,
                      const void *p_down, const void *p_v, const float *s_qkv, const float *s_o, const float *s_gate_up,
                      const float *s_down, int64_t kinds, const int64_t *positions, const bf16 *cos, const bf16 *sin,
                      bf16 *k_cache, bf16 *v_cache, const int64_t *out_loc, const int64_t *req_to_token,
                      int64_t rtt_stride, const int64_t *rows, const int64_t *seq_lens, int64_t max_len, int64_t m,
                      int64_t hidden_size, int64_t hq, int64_t hkv, int64_t d, int64_t inter, float scale,
                      int64_t window, const bf16 *q_norm, const bf16 *k_norm, const int64_t *moe, int64_t *moe_ids,
                      const int32_t *lora_rows, const int64_t *lora, bf16 *qkv, bf16 *attn, bf16 *x, bf16 *gate_up,
                      bf16 *act, bf16 *out, float *out_f32);
void srt_store_kv(const bf16 *k, int64_t k_stride, const bf16 *v, int64_t v_stride, bf16 *k_cache, bf16 *v_cache,
                  const int64_t *loc, int64_t n, int64_t width);
void srt_argmax(const float *logits, int64_t rows, int64_t n, int64_t *out);

/* cpu_lora.c: LoRA's low-rank products of a step's rows, every adapter in one call per layer */
int64_t srt_lora_slot_words(void);
void srt_lora_delta(const void *x, int64_t x_f32, int64_t m, int64_t k, void *out, int64_t out_f32, int64_t n,
                    const int32_t *row_slot, const int64_t *table, int64_t slots);

/* cpu_amx.c: AMX tiles (each answers 0 / is never called where the compiler's target lacks AMX) */
int64_t srt_amx_init(void);
int64_t srt_amx_granted(void);
int64_t srt_amx_has_int8(void);
void srt_amx_linear(const bf16 *x, int64_t m, const bf16 *packed, const bf16 *bias, bf16 *out, int64_t n, int64_t k);
void srt_amx_linear_f32(const bf16 *x, int64_t m, const bf16 *packed, const bf16 *bias, float *out, int64_t n,
                        int64_t k);
void srt_amx_linear_silu(const bf16 *x, int64_t m, const bf16 *packed, bf16 *act, int64_t d, int64_t k);
void srt_amx_gguf_linear(const bf16 *x, int64_t m, const uint8_t *packed, int64_t kind, const bf16 *bias, void *out,
                         int64_t n, int64_t k, int64_t mode);
void srt_amx_linear_i8(const bf16 *x, int64_t m, const int8_t *packed, const float *w_scale, const bf16 *bias,
                       bf16 *out, int64_t n, int64_t k);
void srt_amx_linear_i8_silu(const bf16 *x, int64_t m, const int8_t *packed, const float *w_scale, bf16 *act,
                            int64_t d, int64_t k);
void srt_amx_prefill_attention(const bf16 *q, int64_t q_stride, const bf16 *k, int64_t k_stride, const bf16 *v,
                               int64_t v_stride, bf16 *out, const int64_t *starts, const int64_t *kstarts,
                               const int64_t *lens, const int64_t *prefixes, int64_t bs, int64_t hq, int64_t hkv,
                               int64_t d, float scale);

/* cpu_bf16_linear.c: bf16 linears on bf16_pack's layout (AMX where granted, else AVX-512 BF16, else
 * AVX2 and FMA) */
int64_t srt_dp_linear_available(void);
void srt_bf16_linear(const bf16 *x, int64_t m, const bf16 *packed, const bf16 *bias, bf16 *out, int64_t n, int64_t k);
void srt_bf16_linear_f32(const bf16 *x, int64_t m, const bf16 *packed, const bf16 *bias, float *out, int64_t n,
                         int64_t k);
void srt_bf16_linear_silu(const bf16 *x, int64_t m, const bf16 *packed, bf16 *act, int64_t d, int64_t k);

/* cpu_avx2_linear.c: the same three on the same layout with AVX2 and FMA, where neither of those runs */
int64_t srt_avx2_linear_available(void);
void srt_avx2_linear(const bf16 *x, int64_t m, const bf16 *packed, const bf16 *bias, bf16 *out, int64_t n, int64_t k);
void srt_avx2_linear_f32(const bf16 *x, int64_t m, const bf16 *packed, const bf16 *bias, float *out, int64_t n,
                         int64_t k);
void srt_avx2_linear_silu(const bf16 *x, int64_t m, const bf16 *packed, bf16 *act, int64_t d, int64_t k);

/* cpu_moe.c: a mixture-of-experts layer's routing and experts on bf16_pack's layout, one call a layer */
void srt_moe_route(const float *logits, int64_t stride, int64_t m, int64_t num_experts, int64_t top_k,
                   int64_t renormalize, int64_t *ids, float *weights);
void srt_moe_block(const bf16 *x, int64_t m, int64_t k, const int64_t *moe, int64_t *ids, float *out);

/* cpu_int8_linear.c: W8A8 int8 linears (AMX int8 where granted, else AVX-512 VNNI) */
int64_t srt_vnni_linear_available(void);
void srt_quantize_rows(const bf16 *x, int64_t m, int64_t k, int8_t *q, float *scales, int32_t *sums);
void srt_int8_linear(const bf16 *x, int64_t m, const int8_t *packed, const float *w_scale, const bf16 *bias,
                     bf16 *out, int64_t n, int64_t k);
void srt_int8_linear_silu(const bf16 *x, int64_t m, const int8_t *packed, const float *w_scale, bf16 *act,
                          int64_t d, int64_t k);

/* cpu_q4_linear.c: linears on GGUF Q4_1 blocks (q4_pack's layout) */
int64_t srt_q4_linear_available(void);
void srt_q4_linear(const bf16 *x, int64_t m, const uint8_t *packed, const bf16 *bias, bf16 *out, int64_t n,
                   int64_t k);
void srt_q4_linear_silu(const bf16 *x, int64_t m, const uint8_t *packed, bf16 *act, int64_t d, int64_t k);
void srt_q4_linear_f32(const bf16 *x, int64_t m, const uint8_t *packed, int64_t kind, const bf16 *bias, float *out,
                       int64_t n, int64_t k);
/* the same on GGUF Q4_K blocks (q4_pack's layout with fp32 scales) */
int64_t srt_q4k_linear_available(void);
void srt_q4k_linear(const bf16 *x, int64_t m, const uint8_t *packed, const bf16 *bias, bf16 *out, int64_t n,
                    int64_t k);
void srt_q4k_linear_silu(const bf16 *x, int64_t m, const uint8_t *packed, bf16 *act, int64_t d, int64_t k);
/* the same on GGUF Q4_K blocks with their six-bit scales (packing.q4ks_pack's layout) */
void srt_q4ks_linear(const bf16 *x, int64_t m, const uint8_t *packed, const bf16 *bias, bf16 *out, int64_t n,
                     int64_t k);
void srt_q4ks_linear_silu(const bf16 *x, int64_t m, const uint8_t *packed, bf16 *act, int64_t d, int64_t k);
/* the same on GGUF Q5_K blocks (packing.q5k_pack's layout: Q4_K's and the fifth bits) */
int64_t srt_q5k_linear_available(void);
void srt_q5k_linear(const bf16 *x, int64_t m, const uint8_t *packed, const bf16 *bias, bf16 *out, int64_t n,
                    int64_t k);
void srt_q5k_linear_silu(const bf16 *x, int64_t m, const uint8_t *packed, bf16 *act, int64_t d, int64_t k);

/* cpu_q8_linear.c: linears on GGUF Q8_0, Q5_0 or Q4_0 blocks (q8_pack's layout), fp32 out */
int64_t srt_q8_linear_available(void);
void srt_q8_linear(const bf16 *x, int64_t m, const uint8_t *packed, float *out, int64_t n, int64_t k);
/* the same on GGUF Q6_K blocks (q8_pack's layout with fp32 scales, one per 16 k; runs where srt_q8_linear does) */
void srt_q6k_linear(const bf16 *x, int64_t m, const uint8_t *packed, float *out, int64_t n, int64_t k);
/* a GGUF file's Q4_K and Q6_K super-blocks (n rows of k / 256) in q4ks_pack's and q6ks_pack's layouts
 * (gguf_repack.c) */
void srt_pack_q4k_file(const uint8_t *raw, int64_t n, int64_t k, uint8_t *out);
void srt_pack_q6k_file(const uint8_t *raw, int64_t n, int64_t k, uint8_t *out);

/* the same on GGUF Q6_K blocks with their int8 scales (packing.q6ks_pack's layout; AVX-512 VNNI) */
int64_t srt_q6ks_linear_available(void);
void srt_q6ks_linear(const bf16 *x, int64_t m, const uint8_t *packed, float *out, int64_t n, int64_t k);

/* cpu_bf16_linear.c: a GGUF weight's blocks (q4_pack's, q5k_pack's or q8_pack's layout; kind as
 * cpu_kernels.c's KIND_*) for any number of rows, each task's blocks widened to bf16 first (AVX-512
 * BF16); mode 0: bf16 out (+ bias), 1: float32 sums, 2: silu(gate) * up of a gate_up weight */
int64_t srt_gguf_linear_available(void);
void srt_gguf_linear(const bf16 *x, int64_t m, const uint8_t *packed, int64_t kind, const bf16 *bias, void *out,
                     int64_t n, int64_t k, int64_t mode);

/* cpu_prefill_attention.c: causal prefill attention (AMX where granted, else AVX-512 BF16) */
int64_t srt_dp_prefill_attention_available(void);
void srt_prefill_attention(const bf16 *q, int64_t q_stride, const bf16 *k, int64_t k_stride, const bf16 *v,
                           int64_t v_stride, bf16 *out, const int64_t *starts, const int64_t *kstarts,
                           const int64_t *lens, const int64_t *prefixes, int64_t bs, int64_t hq, int64_t hkv,
                           int64_t d, float scale);

#endif
