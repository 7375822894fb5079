/* Fused CPU kernels for the bf16 decode path: activations are bf16 in memory, the math is fp32.
 *
 * Built once per machine by model_executor/cpu/kernels/build.py (gcc -O3 -march=native -fopenmp) and
 * called through ctypes on tensors' data pointers. Each kernel replaces several small ATen ops
 * whose per-call overhead, not their arithmetic, dominates a decode step on a few cores.
 * OpenMP here is the libgomp that torch already loaded, so kernels share torch's threads.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#include "gguf_layouts.h"
#include "srt_kernels.h"

#include "scalar_bf16.h"
#include "simd_avx2.h"
#include "simd_bf16.h"

/* exp(x) for float, vectorisable (libm's expf is a scalar call): Cephes' range reduction by ln 2
 * in two parts and a degree-5 polynomial, about 1 ulp over the clamped range. n is rounded with
 * the 1.5 * 2^23 trick, which is exact without -ffast-math (this file is built without it). */
static inline float exp_f32(float x) {
    x = x < -87.3f ? -87.3f : (x > 88.7f ? 88.7f : x);
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const float y = p * r * r + r + 1.0f;
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return y * scale;
}

/* Parallel regions only pay above this much work; below it one thread is faster. */
#define PARALLEL_MIN_ELEMS 32768

#if defined(__AVX512BF16__)
#define SIMD_ROWS 1
#else
#define SIMD_ROWS 0
#endif

/* out = rmsnorm(x (+ residual)) * weight, rows of `dim`; x bf16, or float32 with x_f32 (a layer's
 * output as the kernels' float32 epilogue left it). The residual stream is float32: with a
 * residual, the sum x + residual is stored unrounded in residual_out and normalised; without one
 * and with residual_out, x is widened into it (a decoder's first layer). The weight is bf16, or
 * float32 with w_f32 (Gemma's unrounded 1 + w); out is bf16, rounded once, or float32 with o_f32.
 * Callers pass x_f32, w_f32 and o_f32 as constants where they can, so each call site keeps only
 * its own loops. The AVX-512 BF16 loop takes the bf16 weight and output (srt_rmsnorm, the decode
 * layer's q and k norms); the float32 weight or output stays on the portable loop, whose sum of
 * squares is ordered as the compiler vectorises it, so its results are those it always had. */
static inline __attribute__((always_inline)) void rmsnorm_row(const void *xv, const int x_f32, const float *rr,
                                                              const void *wv, const int w_f32, void *ov,
                                                              const int o_f32, float *ro, int64_t dim, float eps) {
#if SIMD_ROWS
    if (!w_f32 && !o_f32) {
#define LOAD_X(i, m) \
    (x_f32 ? _mm512_maskz_loadu_ps(m, (const float *)xv + (i)) : load16_tail((const bf16 *)xv + (i), m))
        const bf16 *weight = (const bf16 *)wv;
        bf16 *o = (bf16 *)ov;
        __m512 acc = _mm512_setzero_ps();
        int64_t i = 0;
        for (; i < dim; i += 16) {
            const __mmask16 m = lanes16(dim - i);
            __m512 v = LOAD_X(i, m);
            if (rr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, rr + i));
            if (ro) _mm512_mask_storeu_ps(ro + i, m, v);
            acc = _mm512_fmadd_ps(v, v, acc);
        }
        const float ss = _mm512_reduce_add_ps(acc);
        const __m512 inv = _mm512_set1_ps(1.0f / sqrtf(ss / (float)dim + eps));
        for (i = 0; i < dim; i += 16) {
            const __mmask16 m = lanes16(dim - i);
            const __m512 v = ro ? _mm512_maskz_loadu_ps(m, ro + i) : LOAD_X(i, m);
            store16_tail(o + i, _mm512_mul_ps(_mm512_mul_ps(v, inv), load16_tail(weight + i, m)), m);
        }
#undef LOAD_X
        return;
    }
#endif
#define X(i) (x_f32 ? ((const float *)xv)[i] : bf16_to_f32(((const bf16 *)xv)[i]))
#define W(i) (w_f32 ? ((const float *)wv)[i] : bf16_to_f32(((const bf16 *)wv)[i]))
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < dim; i++) {
        const float f = X(i) + (rr ? rr[i] : 0.0f);
        if (ro) ro[i] = f;
        ss += f * f;
    }
    const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
    if (o_f32) {
        float *o = (float *)ov;
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) o[i] = (ro ? ro[i] : X(i)) * inv * W(i);
    } else {
        bf16 *o = (bf16 *)ov;
        for (int64_t i = 0; i < dim; i++) o[i] = f32_to_bf16((ro ? ro[i] : X(i)) * inv * W(i));
    }
#undef W
#undef X
}

void srt_rmsnorm(const void *x, int64_t x_f32, const float *residual, const bf16 *weight, bf16 *out,
                 float *residual_out, int64_t rows, int64_t dim, float eps) {
    const size_t x_size = x_f32 ? sizeof(float) : sizeof(bf16);
#pragma omp parallel for if (rows * dim >= PARALLEL_MIN_ELEMS) schedule(static)
    for (int64_t r = 0; r < rows; r++)
        rmsnorm_row((const char *)x + (size_t)(r * dim) * x_size, (int)x_f32, residual ? residual + r * dim : NULL,
                    weight, 0, out + r * dim, 0, residual_out ? residual_out + r * dim : NULL, dim, eps);
}

/* Gemma's RMSNorm: out = rmsnorm(x (+ residual)) * weight with a float32 weight (the checkpoint's
 * 1 + w, unrounded), x bf16 or float32 (x_f32), out bf16 or float32 (out_f32); the residual as in
 * srt_rmsnorm (x + residual stored unrounded in residual_out and normalised). */
void srt_rmsnorm_f32w(const void *x, int64_t x_f32, const float *residual, const float *weight, void *out,
                      int64_t out_f32, float *residual_out, int64_t rows, int64_t dim, float eps) {
    const size_t x_size = x_f32 ? sizeof(float) : sizeof(bf16);
    const size_t o_size = out_f32 ? sizeof(float) : sizeof(bf16);
#pragma omp parallel for if (rows * dim >= PARALLEL_MIN_ELEMS) schedule(static)
    for (int64_t r = 0; r < rows; r++)
        rmsnorm_row((const char *)x + (size_t)(r * dim) * x_size, (int)x_f32, residual ? residual + r * dim : NULL,
                    weight, 1, (char *)out + (size_t)(r * dim) * o_size, (int)out_f32,
                    residual_out ? residual_out + r * dim : NULL, dim, eps);
}

/* out = layernorm(x + residual) * weight + bias (a BERT layer's post-norm), rows of `dim`, in float32
 * (the next residual stream) and, with out_bf16, rounded once to bf16 as well (the next linear's
 * input); x bf16, or float32 with x_f32; weight and bias float32. The mean first, then the biased
 * variance of the differences from it, as torch's layer_norm; the loops are ordered as the compiler
 * vectorises them. */
void srt_layernorm(const void *x, int64_t x_f32, const float *residual, const float *weight, const float *bias,
                   float *out, bf16 *out_bf16, int64_t rows, int64_t dim, float eps) {
#pragma omp parallel for if (rows * dim >= PARALLEL_MIN_ELEMS) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *xf = (const float *)x + r * dim, *rr = residual ? residual + r * dim : NULL;
        const bf16 *xb = (const bf16 *)x + r * dim;
        float *o = out + r * dim;
        if (x_f32)
            memcpy(o, xf, (size_t)dim * sizeof(float));
        else
            for (int64_t i = 0; i < dim; i++) o[i] = bf16_to_f32(xb[i]);
        if (rr)
            for (int64_t i = 0; i < dim; i++) o[i] += rr[i];
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < dim; i++) sum += o[i];
        const float mean = sum / (float)dim;
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < dim; i++) ss += (o[i] - mean) * (o[i] - mean);
        const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) o[i] = (o[i] - mean) * inv * weight[i] + bias[i];
        if (out_bf16)
            for (int64_t i = 0; i < dim; i++) out_bf16[r * dim + i] = f32_to_bf16(o[i]);
    }
}

/* out = gelu(x) = x erfc(-x / sqrt(2)) / 2, the exact GELU of BERT's MLP, x float32 (the dense's
 * unrounded sums) -> bf16, rounded once. erfc(z), z >= 0, by the Chebyshev fit of Numerical
 * Recipes' erfcc (relative error under 1.2e-7 everywhere, so the small negative tail is as exact
 * as the rest) with exp_f32, so the loop vectorises; erfc(-z) = 2 - erfc(z). */
void srt_gelu_erf(const float *x, bf16 *out, int64_t n) {
    enum { CHUNK = 2048 };
#pragma omp parallel for if (n >= PARALLEL_MIN_ELEMS) schedule(static)
    for (int64_t c = 0; c < n; c += CHUNK) {
        const int64_t len = n - c < CHUNK ? n - c : CHUNK;
        float g[CHUNK];
#pragma omp simd
        for (int64_t i = 0; i < len; i++) {
            const float v = x[c + i], z = fabsf(v) * 0.70710678118654752f;
            const float t = 1.0f / (1.0f + 0.5f * z);
            float p = 0.17087277f;
            p = p * t - 0.82215223f;
            p = p * t + 1.48851587f;
            p = p * t - 1.13520398f;
            p = p * t + 0.27886807f;
            p = p * t - 0.18628806f;
            p = p * t + 0.09678418f;
            p = p * t + 0.37409196f;
            p = p * t + 1.00002368f;
            p = p * t - 1.26551223f;
            const float erfc_z = t * exp_f32(p - z * z);
            g[i] = 0.5f * v * (v < 0.0f ? erfc_z : 2.0f - erfc_z);
        }
        for (int64_t i = 0; i < len; i++) out[c + i] = f32_to_bf16(g[i]);
    }
}

/* An encoder's (BERT's) self-attention: bs requests' tokens packed one after another (request b's
 * lens[b] rows follow the rows of the requests before it), every token attending to every token of
 * its own request, in float32 as torch's math path: s = (q k^T) scale, p = softmax(s), o = p v,
 * rounded to bf16 once. q, k, v float32 rows of `stride` floats (the qkv projection's unrounded
 * output), heads of d contiguous; out bf16 [tokens][heads * d]. A task is one (request, head). It lays its K out
 * transposed, its keys padded to blocks of B, and V padded to d rounded up to B; then it takes its
 * queries QI at a time, so that each product keeps QI independent rows of B accumulators (a
 * vector each) and is not bound by the latency of one chain of multiply-adds. */
enum { ENC_B = 16, ENC_QI = 4 };

void srt_encoder_attention(const float *q, const float *k, const float *v, int64_t stride, bf16 *out,
                           const int64_t *lens, int64_t bs, int64_t heads, int64_t d, float scale) {
    enum { B = ENC_B, QI = ENC_QI };
    int64_t work = 0, *starts = malloc((size_t)bs * sizeof(int64_t));
    for (int64_t b = 0; b < bs; b++) {
        starts[b] = b ? starts[b - 1] + lens[b - 1] : 0;
        work += lens[b] * lens[b];
    }
#pragma omp parallel for if (work * heads * d >= PARALLEL_MIN_ELEMS) schedule(dynamic)
    for (int64_t task = 0; task < bs * heads; task++) {
        const int64_t b = task / heads, h = task % heads, start = starts[b], n = lens[b];
        const int64_t np = (n + B - 1) / B * B, dp = (d + B - 1) / B * B;
        /* kt [d][np] keys, vp [n][dp] values, s [QI][np] scores then probabilities: zero-padded */
        float *kt = calloc((size_t)(d * np + n * dp + QI * np), sizeof(float));
        float *vp = kt + d * np, *s = vp + n * dp;
        for (int64_t j = 0; j < n; j++) {
            const float *kj = k + (start + j) * stride + h * d, *vj = v + (start + j) * stride + h * d;
            for (int64_t c = 0; c < d; c++) kt[c * np + j] = kj[c];
            memcpy(vp + j * dp, vj, (size_t)d * sizeof(float));
        }
        for (int64_t i0 = 0; i0 < n; i0 += QI) {
            const float *qr[QI];
            for (int r = 0; r < QI; r++) /* past the last query: the last again, computed and dropped */
                qr[r] = q + (start + (i0 + r < n ? i0 + r : n - 1)) * stride + h * d;
            for (int64_t jb = 0; jb < np; jb += B) {
                float acc[QI][B] = {{0}};
                for (int64_t c = 0; c < d; c++) {
                    const float *kc = kt + c * np + jb;
                    for (int r = 0; r < QI; r++) {
                        const float qc = qr[r][c];
#pragma omp simd
                        for (int t = 0; t < B; t++) acc[r][t] += qc * kc[t];
                    }
                }
                for (int r = 0; r < QI; r++) memcpy(s + r * np + jb, acc[r], sizeof acc[r]);
            }
            float inv[QI];
            for (int r = 0; r < QI; r++) { /* whole blocks: a padded key's -inf adds exp(-87.3) < 2^-125 */
                float *sr = s + r * np, top = -INFINITY, sum = 0.0f;
                for (int64_t j = n; j < np; j++) sr[j] = -INFINITY;
#pragma omp simd reduction(max : top)
                for (int64_t j = 0; j < np; j++) top = sr[j] > top ? sr[j] : top;
#pragma omp simd reduction(+ : sum)
                for (int64_t j = 0; j < np; j++) {
                    sr[j] = exp_f32((sr[j] - top) * scale);
                    sum += sr[j];
                }
                inv[r] = 1.0f / sum;
            }
            for (int64_t cb = 0; cb < dp; cb += B) {
                float acc[QI][B] = {{0}};
                for (int64_t j = 0; j < n; j++) {
                    const float *vj = vp + j * dp + cb;
                    for (int r = 0; r < QI; r++) {
                        const float p = s[r * np + j];
#pragma omp simd
                        for (int t = 0; t < B; t++) acc[r][t] += p * vj[t];
                    }
                }
                for (int r = 0; r < QI && i0 + r < n; r++) {
                    bf16 rounded[B];
#pragma omp simd
                    for (int t = 0; t < B; t++) rounded[t] = f32_to_bf16(acc[r][t] * inv[r]);
                    memcpy(out + (start + i0 + r) * heads * d + h * d + cb, rounded,
                           (size_t)(d - cb < B ? d - cb : B) * sizeof(bf16));
                }
            }
        }
        free(kt);
    }
    free(starts);
}

/* One BERT encoder layer on one rank (no tensor parallelism), its four linears' weights packed for
 * srt_bf16_linear, in place: h [n][hidden] (float32, the residual stream) and hb (the same rounded
 * to bf16) in, the layer's output out. The kernels the layer's modules call (models/bert.py), in
 * the same order on the same values, so the same bits, in one call instead of a dozen:
 *   qkv = hb W_qkv^T + b (float32); a = attention(qkv) (bf16); d = a W_o^T + b (float32);
 *   h2 = LayerNorm(d + h), hb = h2 in bf16; i = hb W_i^T + b (float32); g = gelu(i) (bf16);
 *   d = g W_out^T + b; h = LayerNorm(d + h2), hb = h in bf16.
 * params: the packed weights, biases (bf16) and LayerNorm weights and biases (float32) in the order
 * qkv w, b; o w, b; LayerNorm 1 w, b; intermediate w, b; output w, b; LayerNorm 2 w, b. The heads
 * are hidden / d; scratch holds n (5.5 hidden + 1.5 inter) floats. */
void srt_bert_layer(float *h, bf16 *hb, int64_t n, int64_t hidden, int64_t inter, const void *const *params,
                    float eps, const int64_t *lens, int64_t bs, int64_t d, float scale, float *scratch) {
    const bf16 *const *w = (const bf16 *const *)params;
    const float *const *ln = (const float *const *)params;
    float *qkv = scratch, *dense = qkv + n * 3 * hidden, *h2 = dense + n * hidden, *act = h2 + n * hidden;
    bf16 *attn = (bf16 *)(act + n * inter), *gelu = attn + n * hidden;
    srt_bf16_linear_f32(hb, n, w[0], w[1], qkv, 3 * hidden, hidden);
    srt_encoder_attention(qkv, qkv + hidden, qkv + 2 * hidden, 3 * hidden, attn, lens, bs, hidden / d, d, scale);
    srt_bf16_linear_f32(attn, n, w[2], w[3], dense, hidden, hidden);
    srt_layernorm(dense, 1, h, ln[4], ln[5], h2, hb, n, hidden, eps);
    srt_bf16_linear_f32(hb, n, w[6], w[7], act, inter, hidden);
    srt_gelu_erf(act, gelu, n * inter);
    srt_bf16_linear_f32(gelu, n, w[8], w[9], dense, hidden, inter);
    srt_layernorm(dense, 1, h2, ln[10], ln[11], h, hb, n, hidden, eps);
}

/* x [rows, 2d] = (gate | up) -> out [rows, d] = gelu_tanh(gate) * up (Gemma's GeGLU, transformers'
 * gelu_pytorch_tanh: 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3)))), in float32, rounded once. */
void srt_gelu_tanh_mul(const bf16 *x, bf16 *out, int64_t rows, int64_t d) {
    const float k = 0.7978845608028654f; /* sqrt(2 / pi) */
#pragma omp parallel for if (rows * d >= PARALLEL_MIN_ELEMS) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const bf16 *g = x + r * 2 * d, *u = g + d;
        bf16 *o = out + r * d;
        for (int64_t i = 0; i < d; i++) {
            const float gi = bf16_to_f32(g[i]);
            o[i] = f32_to_bf16(0.5f * gi * (1.0f + tanhf(k * (gi + 0.044715f * gi * gi * gi))) * bf16_to_f32(u[i]));
        }
    }
}

/* x [rows, 2d] = (gate | up) -> out [rows, d] = silu(gate) * up. */
void srt_silu_mul(const bf16 *x, bf16 *out, int64_t rows, int64_t d) {
#pragma omp parallel for if (rows * d >= PARALLEL_MIN_ELEMS) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const bf16 *g = x + r * 2 * d, *u = g + d;
        bf16 *o = out + r * d;
#if SIMD_ROWS
        int64_t i = 0;
        for (; i + 16 <= d; i += 16) store16(o + i, silu_mul16(load16(g + i), load16(u + i)));
        if (i < d) {
            const __mmask16 m = (__mmask16)((1u << (d - i)) - 1);
            store16_tail(o + i, silu_mul16(load16_tail(g + i, m), load16_tail(u + i, m)), m);
        }
#elif defined(__AVX2__) && defined(__FMA__)
        /* silu_mul8, as cpu_avx2_linear.c's gate_up epilogue: the two give the same bits */
        int64_t i = 0;
        for (; i + 8 <= d; i += 8) store8(o + i, silu_mul8(load8(g + i), load8(u + i)));
        if (i < d) {
            bf16 gt[8] = {0}, ut[8] = {0}, ot[8];
            memcpy(gt, g + i, (size_t)(d - i) * sizeof(bf16));
            memcpy(ut, u + i, (size_t)(d - i) * sizeof(bf16));
            store8(ot, silu_mul8(load8(gt), load8(ut)));
            memcpy(o + i, ot, (size_t)(d - i) * sizeof(bf16));
        }
#else
#pragma omp simd
        for (int64_t i = 0; i < d; i++) {
            float gf = bf16_to_f32(g[i]);
            o[i] = f32_to_bf16(gf / (1.0f + exp_f32(-gf)) * bf16_to_f32(u[i]));
        }
#endif
    }
}

/* Rotary embedding, rotate-half layout: x [n, heads, d] (row stride x_stride elements, heads
 * contiguous) -> out [n, heads, d] contiguous. cos/sin are [max_pos, d] tables holding
 * [cos, cos] and [-sin, sin], so out[j] = x[j] * cos[j] + x[(j + d/2) % d] * sin[j]. With AVX-512
 * and d a multiple of 32 (64, 128), a token's cos/sin rows are widened once for all its heads. */
#define ROPE_MAX_D 256
void srt_rope(const bf16 *x, int64_t x_stride, bf16 *out, int64_t n, int64_t heads, int64_t d,
              const int64_t *positions, const bf16 *cos, const bf16 *sin) {
    const int64_t half = d / 2;
#pragma omp parallel for if (n * heads * d >= PARALLEL_MIN_ELEMS) schedule(static)
    for (int64_t t = 0; t < n; t++) {
        const bf16 *c = cos + positions[t] * d, *s = sin + positions[t] * d;
#if SIMD_ROWS
        if (d % 32 == 0 && d <= ROPE_MAX_D) {
            __m512 cv[ROPE_MAX_D / 16], sv[ROPE_MAX_D / 16];
            for (int64_t j = 0; j < d / 16; j++) {
                cv[j] = load16(c + 16 * j);
                sv[j] = load16(s + 16 * j);
            }
            for (int64_t h = 0; h < heads; h++) {
                const bf16 *xi = x + t * x_stride + h * d;
                bf16 *o = out + (t * heads + h) * d;
                for (int64_t j = 0; j < half / 16; j++) {
                    const int64_t jh = j + half / 16;
                    const __m512 x1 = load16(xi + 16 * j), x2 = load16(xi + 16 * jh);
                    store16(o + 16 * j, _mm512_fmadd_ps(x2, sv[j], _mm512_mul_ps(x1, cv[j])));
                    store16(o + 16 * jh, _mm512_fmadd_ps(x1, sv[jh], _mm512_mul_ps(x2, cv[jh])));
                }
            }
            continue;
        }
#endif
        for (int64_t h = 0; h < heads; h++) {
            const bf16 *xi = x + t * x_stride + h * d;
            bf16 *o = out + (t * heads + h) * d;
#pragma omp simd
            for (int64_t j = 0; j < half; j++)
                o[j] = f32_to_bf16(bf16_to_f32(xi[j]) * bf16_to_f32(c[j]) + bf16_to_f32(xi[j + half]) * bf16_to_f32(s[j]));
#pragma omp simd
            for (int64_t j = half; j < d; j++)
                o[j] = f32_to_bf16(bf16_to_f32(xi[j]) * bf16_to_f32(c[j]) + bf16_to_f32(xi[j - half]) * bf16_to_f32(s[j]));
        }
    }
}

/* The two inner loops of decode attention for one kv head and its `group` query heads:
 *   scores[g * stride] = sum_j q[g][j] * k[j]      and      acc[g][j] += p[g * stride] * v[j].
 * Each bf16 K/V row is widened once for the whole group. AVX-512 where the row length allows
 * (gcc does not vectorise the plain loops well here), plain loops otherwise. */
#define MAX_GROUP_SIMD 16
#define K_PREFETCH 8 /* K rows prefetched this many tokens ahead */
#define V_BLOCK 16   /* tokens whose V rows are used for every head before the next block */
#define SPLIT_TOKENS 512 /* srt_decode_attention: at most this many of a request's tokens per task (fast path) */
#define SPLIT_MIN 512     /* and requests of at most this many tokens in one (shorter ones split gained nothing) */

/* The thread count the splits are a multiple of; 0: the threads of the call. A rank whose thread
 * count changes while it serves (scheduler: the thread governor) fixes it at its configured count,
 * so that a request's splits, and so its output bits, do not depend on the threads of the moment. */
static int64_t split_threads = 0;

void srt_set_split_threads(int64_t threads) { split_threads = threads > 0 ? threads : 0; }

/* Prefetches rows [t0, t1) of the slots into L2: `elems` bf16 values from `offset` in each (a
 * task's heads). Into L2 rather than L1: a block's ~100 line prefetches into L1 held the core's
 * L1 miss buffers, and the attention's loads waited behind them (measured on SmolLM2: see
 * docs/performance.md). */
static inline void prefetch_rows(const bf16 *cache, const int64_t *slots, int64_t t0, int64_t t1, int64_t row_elems,
                                 int64_t offset, int64_t elems) {
    for (int64_t t = t0; t < t1; t++)
        for (int64_t c = 0; c < elems; c += 32)
            __builtin_prefetch(cache + slots[t] * row_elems + offset + c, 0, 2); /* 2: prefetcht1 */
}

static inline __attribute__((always_inline)) void group_dots(const float *q, const bf16 *k, int64_t d, int64_t group, float *scores,
                              int64_t stride) {
#ifdef __AVX512F__
    if (d % 16 == 0 && group <= MAX_GROUP_SIMD) {
        __m512 sums[MAX_GROUP_SIMD];
        for (int64_t g = 0; g < group; g++) sums[g] = _mm512_setzero_ps();
        for (int64_t j = 0; j < d; j += 16) {
            __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(k + j)));
            __m512 kv = _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
            for (int64_t g = 0; g < group; g++) sums[g] = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * d + j), kv, sums[g]);
        }
        for (int64_t g = 0; g < group; g++) scores[g * stride] = _mm512_reduce_add_ps(sums[g]);
        return;
    }
#elif defined(__AVX2__) && defined(__FMA__)
    /* eight lanes of partial sums a head, added across at the end: a scalar chain of d dependent
     * adds per score made decode attention most of a long batch-32 step on AVX2 */
    if (d % 8 == 0 && group <= MAX_GROUP_SIMD) {
        __m256 sums[MAX_GROUP_SIMD];
        for (int64_t g = 0; g < group; g++) sums[g] = _mm256_setzero_ps();
        for (int64_t j = 0; j < d; j += 8) {
            const __m256 kv = load8(k + j);
            for (int64_t g = 0; g < group; g++) sums[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * d + j), kv, sums[g]);
        }
        for (int64_t g = 0; g < group; g++) {
            const __m128 half = _mm_add_ps(_mm256_castps256_ps128(sums[g]), _mm256_extractf128_ps(sums[g], 1));
            const __m128 pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
            scores[g * stride] = _mm_cvtss_f32(_mm_add_ss(pair, _mm_shuffle_ps(pair, pair, 1)));
        }
        return;
    }
#endif
    for (int64_t g = 0; g < group; g++) {
        float sum = 0.0f;
        for (int64_t j = 0; j < d; j++) sum += q[g * d + j] * bf16_to_f32(k[j]);
        scores[g * stride] = sum;
    }
}

/* acc[g][:] += sum_t p[g * stride + t] * V[slots[t]][offset:offset + d] over t in [t0, t1) for a
 * group of query heads: the second half of decode attention. Columns 16 at a time with the group's
 * sums in registers. */
static inline __attribute__((always_inline)) void weighted_sum(float *acc, const float *p, int64_t stride,
                                                               const bf16 *v_cache, const int64_t *slots,
                                                               int64_t t0, int64_t t1, int64_t row_elems,
                                                               int64_t offset, int64_t d, int64_t group) {
#ifdef __AVX512F__
    if (d % 16 == 0 && group <= MAX_GROUP_SIMD) {
        for (int64_t j = 0; j < d; j += 16) {
            __m512 sums[MAX_GROUP_SIMD];
            for (int64_t g = 0; g < group; g++) sums[g] = _mm512_loadu_ps(acc + g * d + j);
            for (int64_t t = t0; t < t1; t++) {
                const bf16 *vt = v_cache + slots[t] * row_elems + offset + j;
                __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)vt));
                __m512 vv = _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
                for (int64_t g = 0; g < group; g++)
                    sums[g] = _mm512_fmadd_ps(_mm512_set1_ps(p[g * stride + t]), vv, sums[g]);
            }
            for (int64_t g = 0; g < group; g++) _mm512_storeu_ps(acc + g * d + j, sums[g]);
        }
        return;
    }
#elif defined(__AVX2__) && defined(__FMA__)
    if (d % 8 == 0 && group <= MAX_GROUP_SIMD) {
        for (int64_t j = 0; j < d; j += 8) {
            __m256 sums[MAX_GROUP_SIMD];
            for (int64_t g = 0; g < group; g++) sums[g] = _mm256_loadu_ps(acc + g * d + j);
            for (int64_t t = t0; t < t1; t++) {
                const __m256 vv = load8(v_cache + slots[t] * row_elems + offset + j);
                for (int64_t g = 0; g < group; g++)
                    sums[g] = _mm256_fmadd_ps(_mm256_set1_ps(p[g * stride + t]), vv, sums[g]);
            }
            for (int64_t g = 0; g < group; g++) _mm256_storeu_ps(acc + g * d + j, sums[g]);
        }
        return;
    }
#endif
    for (int64_t t = t0; t < t1; t++) {
        const bf16 *vt = v_cache + slots[t] * row_elems + offset;
        for (int64_t g = 0; g < group; g++)
            for (int64_t j = 0; j < d; j++) acc[g * d + j] += p[g * stride + t] * bf16_to_f32(vt[j]);
    }
}

/* scores[h * stride + t] for t < len -> their softmax over t, for each of `heads` rows */
static inline __attribute__((always_inline)) void softmax_rows(float *scores, int64_t heads, int64_t stride,
                                                               int64_t len) {
#if SIMD_ROWS
    for (int64_t g = 0; g < heads; g++) softmax16(scores + g * stride, len); /* already scaled */
    return;
#endif
    for (int64_t g = 0; g < heads; g++) {
        float *restrict sg = scores + g * stride, max_score = -INFINITY, sum = 0.0f;
#pragma omp simd reduction(max : max_score)
        for (int64_t t = 0; t < len; t++) max_score = sg[t] > max_score ? sg[t] : max_score;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < len; t++) {
            sg[t] = exp_f32(sg[t] - max_score);
            sum += sg[t];
        }
        const float inv = 1.0f / sum;
#pragma omp simd
        for (int64_t t = 0; t < len; t++) sg[t] *= inv;
    }
}

/* Attention of request b's query heads that share kv heads kv0 .. kv0 + heads_per_task - 1 (see
 * srt_decode_attention); scores/qf/acc are the calling thread's scratch. */
static inline __attribute__((always_inline)) void attend_task(
    const bf16 *q, int64_t q_stride, const bf16 *k_cache, const bf16 *v_cache, const int64_t *req_to_token,
    int64_t rtt_stride, const int64_t *rows, bf16 *out, int64_t b, int64_t kv0, int64_t heads_per_task, int64_t hq,
    int64_t hkv, int64_t d, float scale, float softcap, int64_t max_len, int64_t t_start, int64_t len, int64_t group,
    float *restrict scores, float *restrict qf, float *restrict acc) {
    const int64_t row_elems = hkv * d, task_heads = heads_per_task * group;
    const int64_t *slots = req_to_token + rows[b] * rtt_stride + t_start; /* tokens t_start .. t_start + len */
    const bf16 *qb = q + b * q_stride + kv0 * group * d;
    for (int64_t i = 0; i < task_heads * d; i++) qf[i] = bf16_to_f32(qb[i]) * scale;
    for (int64_t t = 0; t < len; t++) {
        const bf16 *krow = k_cache + slots[t] * row_elems + kv0 * d;
        if (t + K_PREFETCH < len)
            prefetch_rows(k_cache, slots, t + K_PREFETCH, t + K_PREFETCH + 1, row_elems, kv0 * d, heads_per_task * d);
        for (int64_t h = 0; h < heads_per_task; h++)
            group_dots(qf + h * group * d, krow + h * d, d, group, scores + h * group * max_len + t, max_len);
    }
    if (softcap > 0.0f) /* Gemma 2's score soft-capping: softcap * tanh(score / softcap) */
        for (int64_t r = 0; r < task_heads; r++)
            for (int64_t t = 0; t < len; t++) scores[r * max_len + t] = softcap * tanhf(scores[r * max_len + t] / softcap);
    softmax_rows(scores, task_heads, max_len, len);
    /* V in blocks of tokens: a block's rows come from memory once (prefetched during the block
     * before) and from L1 for every head and column chunk (one pass over V per chunk was slower
     * on SmolLM2's batch-32 decode: docs/performance.md). */
    for (int64_t i = 0; i < task_heads * d; i++) acc[i] = 0.0f;
    for (int64_t t0 = 0; t0 < len; t0 += V_BLOCK) {
        const int64_t t1 = t0 + V_BLOCK < len ? t0 + V_BLOCK : len;
        prefetch_rows(v_cache, slots, t1, t1 + V_BLOCK < len ? t1 + V_BLOCK : len, row_elems, kv0 * d,
                      heads_per_task * d);
        for (int64_t h = 0; h < heads_per_task; h++)
            weighted_sum(acc + h * group * d, scores + h * group * max_len, max_len, v_cache, slots, t0, t1,
                         row_elems, (kv0 + h) * d, d, group);
    }
    bf16 *o = out + (b * hq + kv0 * group) * d;
#pragma omp simd
    for (int64_t i = 0; i < task_heads * d; i++) o[i] = f32_to_bf16(acc[i]);
}

#if defined(__AVX512BF16__)
/* The same attention for head sizes of 64 or 128 and groups of at most 8 (D and G compile-time
 * constants), on AVX-512 BF16:
 *   scores: each K row against each query head with vdpbf16ps (bf16 products, fp32 sums; q is the
 *     bf16 the qkv linear wrote, the scale is applied to the fp32 score), 16 tokens at a time,
 *     their 16 horizontal sums taken together (reduce16: 45 shuffles and adds instead of 16
 *     separate reductions, which cost more than the products in the loop above).
 *   weighted sum: P rounded to bf16 (as flash attention's second product) times V by vdpbf16ps,
 *     two tokens at a time: each 32-wide chunk of the two V rows is loaded once and interleaved by
 *     token pairs for every query head of the group. With K and V rows prefetched two blocks ahead,
 *     less time than the fp32 products and one block, for the attention and for whole decode
 *     steps (docs/performance.md, "Decode attention"). */
#define FAST_MAX_GROUP 8
#define FAST_PREFETCH 2 /* 16-token blocks of K (then V) rows prefetched ahead (2-4 alike) */

/* lane i of the result = the sum of the 16 lanes of v[i] */
static inline __attribute__((always_inline)) __m512 reduce16(const __m512 *v) {
    __m512 w[8], x[4];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: partial sums of v[2i] (even) and v[2i+1] (odd) */
        w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* per 128-bit lane: partial sums of v[4i .. 4i + 3] */
        const __m512d a = _mm512_castps_pd(w[2 * i]), b = _mm512_castps_pd(w[2 * i + 1]);
        x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    const __m512 z01 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 z23 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(z01, z23, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(z01, z23, _MM_SHUFFLE(3, 1, 3, 1)));
}

static inline __attribute__((always_inline)) void attend_task_fast(
    const bf16 *q, int64_t q_stride, const bf16 *k_cache, const bf16 *v_cache, const int64_t *req_to_token,
    int64_t rtt_stride, const int64_t *rows, bf16 *out, int64_t b, int64_t kv0, int64_t heads_per_task, int64_t hq,
    int64_t hkv, const int64_t D, float scale, int64_t max_len, int64_t t_start, int64_t len, const int64_t G,
    float *restrict scores, float *restrict acc, bf16 *restrict probs, float *restrict partial) {
    const int64_t row_elems = hkv * D, chunks = D / 32;
    const int64_t *slots = req_to_token + rows[b] * rtt_stride + t_start; /* tokens t_start .. t_start + len */
    const bf16 *qb = q + b * q_stride + kv0 * G * D;
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t t0 = 0; t0 < len; t0 += 16) {
        const int64_t n = len - t0 < 16 ? len - t0 : 16;
        /* K rows FAST_PREFETCH blocks ahead, and past the last K rows the first V rows */
        for (int64_t f = t0 ? FAST_PREFETCH : 1; f <= FAST_PREFETCH; f++) {
            const int64_t at = t0 + 16 * f;
            const bf16 *cache = at < len ? k_cache : v_cache;
            const int64_t from = at < len ? at : at - len;
            prefetch_rows(cache, slots, from < len ? from : len, from + 16 < len ? from + 16 : len, row_elems, kv0 * D,
                          heads_per_task * D);
        }
        for (int64_t h = 0; h < heads_per_task; h++) {
            const bf16 *krows[16];
            for (int64_t i = 0; i < n; i++) krows[i] = k_cache + slots[t0 + i] * row_elems + (kv0 + h) * D;
            for (int64_t g = 0; g < G; g++) {
                const bf16 *qh = qb + (h * G + g) * D;
                __m512bh qv[4];
                for (int64_t c = 0; c < chunks; c++) qv[c] = (__m512bh)_mm512_loadu_si512(qh + 32 * c);
                __m512 dots[16];
                for (int64_t i = 0; i < 16; i++) {
                    __m512 s = _mm512_setzero_ps();
                    if (i < n)
                        for (int64_t c = 0; c < chunks; c++)
                            s = _mm512_dpbf16_ps(s, qv[c], (__m512bh)_mm512_loadu_si512(krows[i] + 32 * c));
                    dots[i] = s;
                }
                _mm512_mask_storeu_ps(scores + (h * G + g) * max_len + t0, (__mmask16)((1u << n) - 1u),
                                      _mm512_mul_ps(reduce16(dots), vscale));
            }
        }
    }
    const int64_t task_heads = heads_per_task * G;
    float exp_sum[task_heads]; /* sums of exp: softmax's division, applied to the output rows at the end */
    /* P in bf16 (flash attention's rounding), a zero past the last token: pairs of tokens for
     * vdpbf16ps against V rows interleaved by token pairs */
    const int64_t pstride = (max_len + 2) & ~(int64_t)1;
    float top[task_heads];
    for (int64_t g = 0; g < task_heads; g++) {
        float *sg = scores + g * max_len;
        bf16 *pg = probs + g * pstride;
        top[g] = max16(sg, len);
        exp_sum[g] = exp_shifted16(sg, len, top[g]);
        for (int64_t t = 0; t < len; t += 16) {
            const __mmask16 m = lanes16(len - t);
            store16_tail(pg + t, _mm512_maskz_loadu_ps(m, sg + t), m);
        }
        pg[len] = 0;
    }
    for (int64_t i = 0; i < task_heads * D; i++) acc[i] = 0.0f;
    for (int64_t t0 = 0; t0 < len; t0 += V_BLOCK) {
        const int64_t t1 = t0 + V_BLOCK < len ? t0 + V_BLOCK : len;
        const int64_t at = t0 + 16 * FAST_PREFETCH;
        if (at < len)
            prefetch_rows(v_cache, slots, at, at + 16 < len ? at + 16 : len, row_elems, kv0 * D, heads_per_task * D);
        for (int64_t h = 0; h < heads_per_task; h++)
            for (int64_t c = 0; c < chunks; c++) {
                __m512 lo[FAST_MAX_GROUP], hi[FAST_MAX_GROUP];
                for (int64_t g = 0; g < G; g++) {
                    lo[g] = _mm512_loadu_ps(acc + (h * G + g) * D + 32 * c);
                    hi[g] = _mm512_loadu_ps(acc + (h * G + g) * D + 32 * c + 16);
                }
                for (int64_t t = t0; t < t1; t += 2) {
                    const int64_t off = (kv0 + h) * D + 32 * c;
                    const __m512i e = _mm512_loadu_si512(v_cache + slots[t] * row_elems + off);
                    const __m512i o = t + 1 < len ? _mm512_loadu_si512(v_cache + slots[t + 1] * row_elems + off)
                                                  : _mm512_setzero_si512();
                    __m512i vlo, vhi;
                    interleave32(e, o, &vlo, &vhi);
                    for (int64_t g = 0; g < G; g++) {
                        const int32_t pair = *(const int32_t *)(probs + (h * G + g) * pstride + t);
                        const __m512bh p = (__m512bh)_mm512_set1_epi32(pair);
                        lo[g] = _mm512_dpbf16_ps(lo[g], (__m512bh)vlo, p);
                        hi[g] = _mm512_dpbf16_ps(hi[g], (__m512bh)vhi, p);
                    }
                }
                for (int64_t g = 0; g < G; g++) {
                    _mm512_storeu_ps(acc + (h * G + g) * D + 32 * c, lo[g]);
                    _mm512_storeu_ps(acc + (h * G + g) * D + 32 * c + 16, hi[g]);
                }
            }
    }
    if (partial) { /* one split of the tokens: per query head its max score, sum of exp and sum of P V */
        for (int64_t g = 0; g < task_heads; g++) {
            float *pp = partial + g * (D + 2);
            pp[0] = top[g];
            pp[1] = exp_sum[g];
            for (int64_t i = 0; i < D; i += 16) _mm512_storeu_ps(pp + 2 + i, _mm512_loadu_ps(acc + g * D + i));
        }
        return;
    }
    bf16 *o = out + (b * hq + kv0 * G) * D;
    for (int64_t i = 0; i < task_heads * D; i += 16)
        store16(o + i, _mm512_mul_ps(_mm512_loadu_ps(acc + i), _mm512_set1_ps(1.0f / exp_sum[i / D])));
}
#endif

/* One decode step of paged attention for a batch.
 *
 * Writes each request's new k/v row into slot out_loc[b] of the caches ([slots, hkv, d]), then
 * for every (request b, kv head) attends the group of query heads that share that kv head over
 * the request's seq_lens[b] slots, listed in row rows[b] of req_to_token: each K and V row is
 * read and widened once per group. With a sliding window (window > 0) only the request's last
 * `window` slots, positions seq_lens[b] - window .. seq_lens[b] - 1, as transformers' sliding mask;
 * with softcap > 0 each score s becomes softcap * tanh(s / softcap) (Gemma 2) on the generic path.
 * q/k/v rows are strided (columns of one qkv tensor); out is [bs, hq, d] contiguous. Scores,
 * softmax and the weighted sum are fp32. */
void srt_decode_attention(const bf16 *q, int64_t q_stride, const bf16 *k, int64_t k_stride, const bf16 *v,
                          int64_t v_stride, bf16 *k_cache, bf16 *v_cache, const int64_t *out_loc,
                          const int64_t *req_to_token, int64_t rtt_stride, const int64_t *rows,
                          const int64_t *seq_lens, bf16 *out, int64_t bs, int64_t hq, int64_t hkv, int64_t d,
                          float scale, int64_t max_len, int64_t window, float softcap) {
    const int64_t row_elems = hkv * d, group = hq / hkv;
#define FIRST_KEY(b) (window > 0 && seq_lens[b] > window ? seq_lens[b] - window : 0)
    for (int64_t b = 0; b < bs; b++) {
        memcpy(k_cache + out_loc[b] * row_elems, k + b * k_stride, (size_t)row_elems * sizeof(bf16));
        memcpy(v_cache + out_loc[b] * row_elems, v + b * v_stride, (size_t)row_elems * sizeof(bf16));
    }
    /* A task is one request's kv heads (whole K/V rows, read front to back) or, when there are
     * too few requests to share out, one (request, kv head). A (request, kv head, slot) costs
     * little: below 1024 of them one thread is faster (two threads from 1024 rather than 4096 made
     * small-batch SmolLM2 steps faster: docs/performance.md). */
    const int64_t heads_per_task = bs >= 8 ? hkv : 1, groups = hkv / heads_per_task;
    const int64_t task_heads = heads_per_task * group; /* query heads of a task */
#if defined(__AVX512BF16__)
    const int fast = (d == 64 || d == 128) && group <= FAST_MAX_GROUP && softcap == 0.0f;
#else
    const int fast = 0;
#endif
    /* On the fast path a request of more than SPLIT_MIN tokens goes in splits of about equal size
     * and at most SPLIT_TOKENS, their count a multiple of the threads (but no split under 64
     * tokens), each split its own task, the partial sums combined at the end (flash decoding): at
     * batch 1 there would be only the kv heads to share out (SmolLM2: 3 for 2 threads). The splits
     * follow from each request's own length, never from the batch, so a request's output has the
     * same bits in any batch. split_at[b]: request b's first split among all; partial: (D + 2)
     * floats per query head of a split (max score, sum of exp, sum of P V). */
    int64_t *split_at = malloc((size_t)(bs + 1) * sizeof(int64_t));
    split_at[0] = 0;
    const int64_t threads = split_threads > 0 ? split_threads : omp_get_max_threads();
    for (int64_t b = 0; b < bs; b++) {
        const int64_t keys = seq_lens[b] - FIRST_KEY(b);
        const int64_t n = (keys + SPLIT_TOKENS - 1) / SPLIT_TOKENS, most = keys / 64;
        const int64_t rounded = (n + threads - 1) / threads * threads; /* many threads: splits of >= 64 */
        split_at[b + 1] = split_at[b] + (fast && keys > SPLIT_MIN ? (rounded < most ? rounded : most) : 1);
    }
    const int64_t splits = split_at[bs], tasks = splits * groups;
    float *partial = splits > bs ? malloc((size_t)(splits * hq * (d + 2)) * sizeof(float)) : NULL;
#pragma omp parallel if (bs * hkv * max_len >= 1024)
    {
        float *restrict scores = malloc((size_t)(task_heads * max_len) * sizeof(float));
        float *restrict qf = malloc((size_t)(task_heads * d) * sizeof(float));
        float *restrict acc = malloc((size_t)(task_heads * d) * sizeof(float));
        bf16 *restrict probs = malloc((size_t)(task_heads * (max_len + 2)) * sizeof(bf16));
#pragma omp for schedule(static)
        for (int64_t task = 0; task < tasks; task++) {
            const int64_t split = task / groups, kv0 = (task % groups) * heads_per_task;
            int64_t b = 0;
            while (split_at[b + 1] <= split) b++;
            /* split i of n of the request's keys (from its first key in the window): keys
             * [i keys / n, (i + 1) keys / n), the bounds rounded down to 16 */
            const int64_t nsplit = split_at[b + 1] - split_at[b], i = split - split_at[b];
            const int64_t first = FIRST_KEY(b), keys = seq_lens[b] - first;
            const int64_t from = (i * keys / nsplit) & ~(int64_t)15;
            const int64_t len = (i + 1 == nsplit ? keys : ((i + 1) * keys / nsplit) & ~(int64_t)15) - from;
            const int64_t s0 = first + from;
            /* A constant group size lets the compiler keep the per-head sums in registers. */
#if defined(__AVX512BF16__)
            float *part = nsplit == 1 ? NULL : partial + (split * hq + kv0 * group) * (d + 2);
#define FAST(G, D) attend_task_fast(q, q_stride, k_cache, v_cache, req_to_token, rtt_stride, rows, out, b, kv0, \
                                 heads_per_task, hq, hkv, D, scale, max_len, s0, len, G, scores, acc, probs, part)
#define FAST_GROUPS(D)                                                                                      \
    switch (group) {                                                                                        \
    case 1: FAST(1, D); break;                                                                              \
    case 2: FAST(2, D); break;                                                                              \
    case 3: FAST(3, D); break;                                                                              \
    case 4: FAST(4, D); break;                                                                              \
    case 5: FAST(5, D); break;                                                                              \
    case 6: FAST(6, D); break;                                                                              \
    case 7: FAST(7, D); break;                                                                              \
    default: FAST(8, D); break;                                                                             \
    }
            if (fast) {
                if (d == 64)
                    FAST_GROUPS(64)
                else
                    FAST_GROUPS(128)
                continue;
            }
#undef FAST_GROUPS
#undef FAST
#endif
            switch (group) {
#define ATTEND(G) attend_task(q, q_stride, k_cache, v_cache, req_to_token, rtt_stride, rows, out, b, kv0, heads_per_task, \
                              hq, hkv, d, scale, softcap, max_len, s0, len, G, scores, qf, acc)
            case 1: ATTEND(1); break;
            case 2: ATTEND(2); break;
            case 3: ATTEND(3); break;
            case 4: ATTEND(4); break;
            case 5: ATTEND(5); break;
            case 6: ATTEND(6); break;
            case 7: ATTEND(7); break;
            case 8: ATTEND(8); break;
            default: ATTEND(group); break;
#undef ATTEND
            }
        }
        if (partial) { /* each query head of a split request: its splits' sums rescaled to one max */
#pragma omp for schedule(static)
            for (int64_t bh = 0; bh < bs * hq; bh++) {
                const int64_t b = bh / hq, h = bh % hq, n = split_at[b + 1] - split_at[b];
                if (n == 1)
                    continue;
                const float *pp = partial + (split_at[b] * hq + h) * (d + 2);
                float top = -INFINITY, total = 0.0f;
                for (int64_t i = 0; i < n; i++) top = pp[i * hq * (d + 2)] > top ? pp[i * hq * (d + 2)] : top;
                for (int64_t j = 0; j < d; j++) acc[j] = 0.0f;
                for (int64_t i = 0; i < n; i++) {
                    const float *pi = pp + i * hq * (d + 2), w = exp_f32(pi[0] - top);
                    total += w * pi[1];
                    for (int64_t j = 0; j < d; j++) acc[j] += w * pi[2 + j];
                }
                bf16 *o = out + (b * hq + h) * d;
                for (int64_t j = 0; j < d; j++) o[j] = f32_to_bf16(acc[j] / total);
            }
        }
        free(scores);
        free(qf);
        free(acc);
        free(probs);
    }
    free(partial);
    free(split_at);
#undef FIRST_KEY
}

/* out[r][i] = sum_j x[r][j] * w[i][j] (+ bias[i]) for a few rows of x (m <= GEMV_MAX_ROWS): the
 * linear layers of a small decode batch, where streaming the weight once is the whole cost.
 * w is [n, k] row-major bf16, as stored; GEMV_BLOCK weight rows at a time share each load of x. */
#define GEMV_MAX_ROWS 4
#define GEMV_BLOCK 4

static inline __attribute__((always_inline)) void gemv_block(const bf16 *x, int64_t m, const bf16 *w, const bf16 *bias, bf16 *out, int64_t n,
                              int64_t k, int64_t i0) {
    const int64_t rows = n - i0 < GEMV_BLOCK ? n - i0 : GEMV_BLOCK;
#if defined(__AVX512BF16__)
    if (k % 32 == 0 && rows == GEMV_BLOCK) {
        __m512 acc[GEMV_MAX_ROWS][GEMV_BLOCK];
        for (int64_t r = 0; r < m; r++)
            for (int64_t b = 0; b < GEMV_BLOCK; b++) acc[r][b] = _mm512_setzero_ps();
        for (int64_t j = 0; j < k; j += 32) {
            __m512bh wv[GEMV_BLOCK];
            for (int64_t b = 0; b < GEMV_BLOCK; b++)
                wv[b] = (__m512bh)_mm512_loadu_si512((const void *)(w + (i0 + b) * k + j));
            for (int64_t r = 0; r < m; r++) {
                const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + r * k + j));
                for (int64_t b = 0; b < GEMV_BLOCK; b++) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], wv[b], xv);
            }
        }
        for (int64_t r = 0; r < m; r++)
            for (int64_t b = 0; b < GEMV_BLOCK; b++) {
                float sum = _mm512_reduce_add_ps(acc[r][b]);
                if (bias) sum += bf16_to_f32(bias[i0 + b]);
                out[r * n + i0 + b] = f32_to_bf16(sum);
            }
        return;
    }
#endif
    for (int64_t r = 0; r < m; r++)
        for (int64_t b = 0; b < rows; b++) {
            const bf16 *wr = w + (i0 + b) * k, *xr = x + r * k;
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int64_t j = 0; j < k; j++) sum += bf16_to_f32(xr[j]) * bf16_to_f32(wr[j]);
            if (bias) sum += bf16_to_f32(bias[i0 + b]);
            out[r * n + i0 + b] = f32_to_bf16(sum);
        }
}

void srt_gemv(const bf16 *x, int64_t m, const bf16 *w, const bf16 *bias, bf16 *out, int64_t n, int64_t k) {
    const int64_t blocks = (n + GEMV_BLOCK - 1) / GEMV_BLOCK;
    /* A constant row count keeps the m x GEMV_BLOCK sums in registers. */
#define GEMV_ROWS(M)                                                                                        \
    _Pragma("omp parallel for if (n * k >= PARALLEL_MIN_ELEMS) schedule(static)")                            \
    for (int64_t blk = 0; blk < blocks; blk++) gemv_block(x, M, w, bias, out, n, k, blk * GEMV_BLOCK);
    switch (m) {
    case 1: GEMV_ROWS(1) break;
    case 2: GEMV_ROWS(2) break;
    case 3: GEMV_ROWS(3) break;
    case 4: GEMV_ROWS(4) break;
    default: GEMV_ROWS(m) break;
    }
#undef GEMV_ROWS
}

/* What a decode layer's packed weight holds besides bf16_pack's or int8_pack's layout: 4 bits a
 * weight in srt_decode_layer's `kinds` (qkv, o, gate_up, down, then a split qkv's v, from the
 * lowest), each KIND_PLAIN or one of gguf_layouts.h's GGUF_* */
#define KIND_PLAIN 0
/* ... or with this bit, those blocks through srt_gguf_linear (any rows: more than their kernel takes) */
#define KIND_TILES 8
#define KIND_OF(kinds, i) (((kinds) >> (4 * (i))) & 15)
#define IS_8_BIT(kind) ((kind) == GGUF_Q8_0 || (kind) == GGUF_Q6_K || (kind) == GGUF_Q6_KS)
#define IS_4_BIT(kind) ((kind) == GGUF_Q4_1 || (kind) == GGUF_Q4_K || (kind) == GGUF_Q5_K || (kind) == GGUF_Q4_KS)

/* x @ w.T on a GGUF weight's 8-bit blocks (Q8_0, Q5_0, Q4_0 as q8_pack lays them out, or Q6_K's),
 * float32 sums into out_f32, or (+ bias) rounded to bf16 into out as Q8Weight's op-by-op product is */
static void q8_layer_linear(const bf16 *x, int64_t m, const void *packed, int64_t kind, const bf16 *bias, bf16 *out,
                            float *out_f32, int64_t n, int64_t k) {
    float *sums = out_f32 ? out_f32 : malloc((size_t)(m * n) * sizeof(float));
    if (kind == GGUF_Q6_K)
        srt_q6k_linear(x, m, (const uint8_t *)packed, sums, n, k);
    else if (kind == GGUF_Q6_KS)
        srt_q6ks_linear(x, m, (const uint8_t *)packed, sums, n, k);
    else
        srt_q8_linear(x, m, (const uint8_t *)packed, sums, n, k);
    if (!out_f32) {
        for (int64_t i = 0; i < m * n; i++) out[i] = f32_to_bf16(bias ? sums[i] + bf16_to_f32(bias[i % n]) : sums[i]);
        free(sums);
    }
}

/* x @ w.T through a packed-weight kernel where the caller packed the weight (cpu_bf16_linear.c: AMX
 * or AVX-512 BF16; cpu_int8_linear.c when it has scales, --quantization w8a8_int8: AMX or AVX-512
 * VNNI; cpu_q4_linear.c / cpu_q8_linear.c for a GGUF weight's blocks, by `kind`), else srt_gemv */
static void layer_linear(const bf16 *x, int64_t m, const bf16 *w, const void *packed, const float *scale,
                         int64_t kind, const bf16 *bias, bf16 *out, int64_t n, int64_t k) {
    if (packed && (kind & KIND_TILES))
        srt_gguf_linear(x, m, (const uint8_t *)packed, kind & 7, bias, out, n, k, 0);
    else if (packed && IS_8_BIT(kind))
        q8_layer_linear(x, m, packed, kind, bias, out, NULL, n, k);
    else if (packed && kind == GGUF_Q4_1)
        srt_q4_linear(x, m, (const uint8_t *)packed, bias, out, n, k);
    else if (packed && kind == GGUF_Q4_K)
        srt_q4k_linear(x, m, (const uint8_t *)packed, bias, out, n, k);
    else if (packed && kind == GGUF_Q5_K)
        srt_q5k_linear(x, m, (const uint8_t *)packed, bias, out, n, k);
    else if (packed && kind == GGUF_Q4_KS)
        srt_q4ks_linear(x, m, (const uint8_t *)packed, bias, out, n, k);
    else if (packed && scale)
        srt_int8_linear(x, m, (const int8_t *)packed, scale, bias, out, n, k);
    else if (packed)
        srt_bf16_linear(x, m, (const bf16 *)packed, bias, out, n, k);
    else
        srt_gemv(x, m, w, bias, out, n, k);
}

/* A qkv product whose v rows are on another kind of blocks (packing.SplitWeight): q and k's `qk`
 * outputs from p_qk, v's `v` from p_v, side by side in each row of `out` (each part's kernel writes
 * rows of its own width; more than one row goes through a buffer) */
static void split_qkv_linear(const bf16 *x, int64_t m, const void *p_qk, int64_t qk_kind, const void *p_v,
                             int64_t v_kind, const bf16 *bias, bf16 *out, int64_t qk, int64_t v, int64_t k) {
    const bf16 *v_bias = bias ? bias + qk : NULL;
    if (m == 1) {
        layer_linear(x, 1, NULL, p_qk, NULL, qk_kind, bias, out, qk, k);
        layer_linear(x, 1, NULL, p_v, NULL, v_kind, v_bias, out + qk, v, k);
        return;
    }
    bf16 *parts = malloc((size_t)(m * (qk + v)) * sizeof(bf16));
    layer_linear(x, m, NULL, p_qk, NULL, qk_kind, bias, parts, qk, k);
    layer_linear(x, m, NULL, p_v, NULL, v_kind, v_bias, parts + m * qk, v, k);
    for (int64_t r = 0; r < m; r++) {
        memcpy(out + r * (qk + v), parts + r * qk, (size_t)qk * sizeof(bf16));
        memcpy(out + r * (qk + v) + qk, parts + m * qk + r * v, (size_t)v * sizeof(bf16));
    }
    free(parts);
}

/* A product that feeds the residual stream (o_proj, down_proj): into `out_f32` unrounded where the
 * weight is bf16_pack'd for srt_bf16_linear or on a GGUF weight's blocks (-> 1), else as layer_linear into
 * `out` (-> 0), as PackedLinearMethod gives it to RowParallelLinear op by op. */
static int residual_linear(const bf16 *x, int64_t m, const bf16 *w, const void *packed, const float *scale,
                           int64_t kind, bf16 *out, float *out_f32, int64_t n, int64_t k) {
    if (packed && kind == KIND_PLAIN && !scale) {
        srt_bf16_linear_f32(x, m, (const bf16 *)packed, NULL, out_f32, n, k);
        return 1;
    }
    if (packed && (kind & KIND_TILES)) { /* float32 sums, as srt_bf16_linear_f32 on a bf16 copy */
        srt_gguf_linear(x, m, (const uint8_t *)packed, kind & 7, NULL, out_f32, n, k, 1);
        return 1;
    }
    if (packed && IS_8_BIT(kind)) {
        q8_layer_linear(x, m, packed, kind, NULL, NULL, out_f32, n, k);
        return 1;
    }
    if (packed && IS_4_BIT(kind)) {
        srt_q4_linear_f32(x, m, (const uint8_t *)packed, kind, NULL, out_f32, n, k);
        return 1;
    }
    layer_linear(x, m, w, packed, scale, kind, NULL, out, n, k);
    return 0;
}

/* With LoRA (`lora`: for qkv, o, gate_up and down in turn, srt_lora_delta's table of the layer's
 * adapters, or 0 for none, and its slots), the deltas of product i for the rows `lora_rows` gives a
 * slot (NULL: none this step), added as LoraLinearMethod adds them op by op */
#define LORA_TABLE(lora, i) ((lora) ? (const int64_t *)(intptr_t)(lora)[2 * (i)] : NULL)
static void lora_add(const int32_t *lora_rows, const int64_t *lora, int i, const bf16 *x, int64_t m, int64_t k,
                     void *out, int64_t out_f32, int64_t n) {
    if (lora_rows && LORA_TABLE(lora, i)) srt_lora_delta(x, 0, m, k, out, out_f32, n, lora_rows, LORA_TABLE(lora, i), lora[2 * i + 1]);
}

/* One whole Llama-style decoder layer for a decode step on one rank (no tensor parallelism): the
 * Python glue of ~12 small calls per layer costs more than their arithmetic at this size. Without
 * packed weights (bf16, int8 with scales, or a GGUF weight's blocks by its 4 bits of `kinds`), at
 * most GEMV_MAX_ROWS requests. In the layer's order:
 *   residual = hidden (+ residual unless first; float32); x = rmsnorm(residual) * ln1
 *   qkv = x @ w_qkv.T (+ b_qkv; with p_v, v's rows from their own blocks); rotate q and k in place; decode attention (stores k, v; within
 *   the last `window` keys where window > 0)
 *   residual += attn @ w_o.T; x = rmsnorm(residual) * ln2
 *   out = silu_mul(x @ w_gate_up.T) @ w_down.T (one call for the first product and silu_mul with
 *   packed weights, the gate_up output never stored)
 * With q_norm and k_norm (Qwen3's per-head RMSNorm) each head of q and k is normalised before it
 * is rotated. With `moe` the MLP is a mixture of experts (srt_moe_block, its descriptor; the dense
 * MLP's weights unused), its chosen experts into moe_ids [m][top_k], its output out_f32.
 * hidden is bf16, or float32 with hidden_f32; the o and down products go to `out_f32` unrounded
 * where their weights are bf16_pack'd (residual_linear), else to `out`. Returns whether the layer's
 * output is out_f32 (1) or out (0). Scratch `qkv`, `attn`, `x`, `gate_up`, `act` are [m, ...]
 * buffers of the caller's. With `lora` each product adds its adapters' deltas (lora_add), and the
 * MLP takes the gate_up product then the activation, as LoRA's layers do op by op. */
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
                      bf16 *act, bf16 *out, float *out_f32) {
    const int64_t qkv_size = (hq + 2 * hkv) * d;
    srt_rmsnorm(hidden, hidden_f32, first ? NULL : residual, ln1, x, residual, m, hidden_size, eps);
    if (p_v)
        split_qkv_linear(x, m, p_qkv, KIND_OF(kinds, 0), p_v, KIND_OF(kinds, 4), b_qkv, qkv, (hq + hkv) * d, hkv * d,
                         hidden_size);
    else
        layer_linear(x, m, w_qkv, p_qkv, s_qkv, KIND_OF(kinds, 0), b_qkv, qkv, qkv_size, hidden_size);
    lora_add(lora_rows, lora, 0, x, m, hidden_size, qkv, 0, qkv_size);
    /* q and k heads sit side by side at the start of each qkv row: normalise (in place, each
     * value read before it is written) and rotate them in place */
    bf16 rotated[(hq + hkv) * d];
    for (int64_t r = 0; r < m; r++) {
        bf16 *row = qkv + r * qkv_size;
        if (q_norm && k_norm)
            for (int64_t h = 0; h < hq + hkv; h++)
                rmsnorm_row(row + h * d, 0, NULL, h < hq ? q_norm : k_norm, 0, row + h * d, 0, NULL, d, eps);
        srt_rope(row, qkv_size, rotated, 1, hq + hkv, d, positions + r, cos, sin);
        memcpy(row, rotated, sizeof rotated);
    }
    srt_decode_attention(qkv, qkv_size, qkv + hq * d, qkv_size, qkv + (hq + hkv) * d, qkv_size, k_cache, v_cache,
                         out_loc, req_to_token, rtt_stride, rows, seq_lens, attn, m, hq, hkv, d, scale, max_len, window, 0.0f);
    const int64_t o_f32 = residual_linear(attn, m, w_o, p_o, s_o, KIND_OF(kinds, 1), out, out_f32, hidden_size, hq * d);
    lora_add(lora_rows, lora, 1, attn, m, hq * d, o_f32 ? (void *)out_f32 : (void *)out, o_f32, hidden_size);
    srt_rmsnorm(o_f32 ? (const void *)out_f32 : out, o_f32, residual, ln2, x, residual, m, hidden_size, eps);
    if (moe) {
        srt_moe_block(x, m, hidden_size, moe, moe_ids, out_f32);
        return 1;
    }
    const int64_t gate_up_kind = KIND_OF(kinds, 2);
    if (lora) { /* with LoRA on: the product, its adapters' deltas, then the activation, as op by op */
        layer_linear(x, m, w_gate_up, p_gate_up, s_gate_up, gate_up_kind, NULL, gate_up, 2 * inter, hidden_size);
        lora_add(lora_rows, lora, 2, x, m, hidden_size, gate_up, 0, 2 * inter);
        srt_silu_mul(gate_up, act, m, inter);
    } else if (p_gate_up && (gate_up_kind & KIND_TILES)) {
        srt_gguf_linear(x, m, (const uint8_t *)p_gate_up, gate_up_kind & 7, NULL, act, inter, hidden_size, 2);
    } else if (p_gate_up && gate_up_kind == GGUF_Q4_1) { /* packed: silu * up in the gate_up product's epilogue */
        srt_q4_linear_silu(x, m, (const uint8_t *)p_gate_up, act, inter, hidden_size);
    } else if (p_gate_up && gate_up_kind == GGUF_Q4_K) {
        srt_q4k_linear_silu(x, m, (const uint8_t *)p_gate_up, act, inter, hidden_size);
    } else if (p_gate_up && gate_up_kind == GGUF_Q5_K) {
        srt_q5k_linear_silu(x, m, (const uint8_t *)p_gate_up, act, inter, hidden_size);
    } else if (p_gate_up && gate_up_kind == GGUF_Q4_KS) {
        srt_q4ks_linear_silu(x, m, (const uint8_t *)p_gate_up, act, inter, hidden_size);
    } else if (p_gate_up && s_gate_up) {
        srt_int8_linear_silu(x, m, (const int8_t *)p_gate_up, s_gate_up, act, inter, hidden_size);
    } else if (p_gate_up && !IS_8_BIT(gate_up_kind)) {
        srt_bf16_linear_silu(x, m, (const bf16 *)p_gate_up, act, inter, hidden_size);
    } else {
        layer_linear(x, m, w_gate_up, p_gate_up, s_gate_up, gate_up_kind, NULL, gate_up, 2 * inter, hidden_size);
        srt_silu_mul(gate_up, act, m, inter);
    }
    const int64_t down_f32 = residual_linear(act, m, w_down, p_down, s_down, KIND_OF(kinds, 3), out, out_f32, hidden_size, inter);
    lora_add(lora_rows, lora, 3, act, m, inter, down_f32 ? (void *)out_f32 : (void *)out, down_f32, hidden_size);
    return down_f32;
}

/* k_cache[loc[i]] = k[i] and v_cache[loc[i]] = v[i] for n tokens of `width` values each (kv heads x
 * head dim, contiguous in the row); rows of k and v `k_stride` / `v_stride` apart (columns of a qkv
 * output). Faster than torch's index_copy_ on these rows (docs/performance.md). */
void srt_store_kv(const bf16 *k, int64_t k_stride, const bf16 *v, int64_t v_stride, bf16 *k_cache, bf16 *v_cache,
                  const int64_t *loc, int64_t n, int64_t width) {
    const size_t bytes = (size_t)width * sizeof(bf16);
#pragma omp parallel for if (n * width >= PARALLEL_MIN_ELEMS) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        memcpy(k_cache + loc[i] * width, k + i * k_stride, bytes);
        memcpy(v_cache + loc[i] * width, v + i * v_stride, bytes);
    }
}

/* out[r] = the first index of the largest of logits[r][0 .. n) (torch.argmax's answer for rows
 * without NaN); rows in parallel; faster than torch's CPU argmax (docs/performance.md). */
void srt_argmax(const float *logits, int64_t rows, int64_t n, int64_t *out) {
#pragma omp parallel for if (rows * n >= 16 * PARALLEL_MIN_ELEMS) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *x = logits + r * n;
        float best = -INFINITY;
        int64_t j = 0;
#ifdef __AVX512F__
        /* per lane the first maximum of its column; the winning lane is settled below */
        __m512 vbest = _mm512_set1_ps(-INFINITY);
        __m512i vidx = _mm512_setzero_si512(), idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,
                                                                          13, 14, 15);
        const __m512i step = _mm512_set1_epi32(16);
        if (n < INT32_MAX)
            for (; j + 16 <= n; j += 16) {
                const __m512 v = _mm512_loadu_ps(x + j);
                const __mmask16 gt = _mm512_cmp_ps_mask(v, vbest, _CMP_GT_OQ);
                vbest = _mm512_mask_blend_ps(gt, vbest, v);
                vidx = _mm512_mask_blend_epi32(gt, vidx, idx);
                idx = _mm512_add_epi32(idx, step);
            }
        float lanes[16];
        int32_t lane_idx[16];
        _mm512_storeu_ps(lanes, vbest);
        _mm512_storeu_si512(lane_idx, vidx);
        int64_t arg = 0;
        for (int l = 0; l < 16 && j > 0; l++)
            if (lanes[l] > best || (lanes[l] == best && lane_idx[l] < arg)) {
                best = lanes[l];
                arg = lane_idx[l];
            }
#else
        int64_t arg = 0;
#endif
        for (; j < n; j++)
            if (x[j] > best) {
                best = x[j];
                arg = j;
            }
        out[r] = arg;
    }
}
