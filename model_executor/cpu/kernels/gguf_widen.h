/* GGUF blocks widened to bf16 in bf16_pack's order: srt_gguf_linear's per-task scratch, on AVX-512
 * BF16 (cpu_bf16_linear.c) and on AMX tiles (cpu_amx.c). Each weight widens as float32(d q + m) (or
 * d q) rounded to nearest even: the bf16 copy's exact bits. The kinds are gguf_layouts.h's.
 * Include where __AVX512BF16__ holds, after simd_bf16.h. */
#ifndef SRT_GGUF_WIDEN_H
#define SRT_GGUF_WIDEN_H

#include "gguf_layouts.h"

/* A Q6_KS chunk of 48 bytes -> q8_pack's 64 lanes, byte 4j + i = q[j][4c + i] + 32: the low
 * nibbles of bytes 0..31, then their high ones, each ORed with its top two bits (byte b of the
 * last 16 holds those of lanes b, b + 16, b + 32, b + 48 at bits 0, 2, 4, 6: rotated within each
 * 32-bit word by 4, 2, 0 or -2 bits, one 128-bit quarter at a time, they sit at bits 4 and 5) */
static inline __m512i q6ks_chunk(const uint8_t *chunk) {
    const __m512i turn = _mm512_setr_epi32(4, 4, 4, 4, 2, 2, 2, 2, 0, 0, 0, 0, 30, 30, 30, 30);
    const __m256i nibbles = _mm256_loadu_si256((const __m256i *)chunk);
    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(nibbles), _mm256_srli_epi16(nibbles, 4), 1);
    const __m512i top = _mm512_rolv_epi32(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(chunk + 32))), turn);
    return _mm512_ternarylogic_epi32(both, _mm512_set1_epi8(15), _mm512_and_si512(top, _mm512_set1_epi8(0x30)),
                                     0xEA); /* a & b | c */
}

/* 16 lanes: byte i of 16 -> its value as float32 after `nib` (0: low nibble, 4: high, -1: the byte) */
static inline __m512 g_lanes(const uint8_t *p, const int nib) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    if (nib < 0) return _mm512_cvtepi32_ps(v);
    return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, nib), _mm512_set1_epi32(15)));
}

/* One 16-output block of a GGUF weight (k/32 blocks of `bytes` from `src`) -> dst, bf16_pack's
 * [k/32][16 pairs][16 outputs][2]. q4_pack's chunk c of 32 bytes holds pair 2c in its low nibbles
 * and pair 2c + 1 in its high ones, byte i being output i / 2's value i % 2; q8_pack's chunk c of
 * 64 bytes is 16 lanes of four k, so pair 2c is each lane's bytes 0, 1 and pair 2c + 1 bytes 2, 3. */
static inline void gguf_widen(const uint8_t *src, const int64_t kind, bf16 *dst, const int64_t k) {
    const int64_t bytes = gguf_block_bytes(kind);
    const __m512i lo_idx = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    const __m512i hi_idx = _mm512_add_epi32(lo_idx, _mm512_set1_epi32(8));
    /* Q5_K: the fifth bit of byte i's low (word 0) or high (word 1) nibble sits at bit (4 + 16 (i % 2) + i / 2) % 32 */
    const __m512i shift_lo = _mm512_setr_epi32(4, 20, 5, 21, 6, 22, 7, 23, 8, 24, 9, 25, 10, 26, 11, 27);
    const __m512i shift_hi = _mm512_setr_epi32(12, 28, 13, 29, 14, 30, 15, 31, 16, 0, 17, 1, 18, 2, 19, 3);
    for (int64_t kb = 0; kb < k / 32; kb++) {
        const int ks = kind == GGUF_Q4_KS;
        const uint8_t *b = ks ? q4ks_run(src, kb) : src + kb * bytes;
        bf16 *out = dst + kb * 512;
        if (kind <= GGUF_Q5_K || ks) {
            const int f32 = kind != GGUF_Q4_1;
            __m512 d, m;
            if (ks) { /* D sc and M mn: exact */
                const float *head = q4ks_head(src, kb);
                d = _mm512_mul_ps(_mm512_loadu_ps(head), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)b))));
                m = _mm512_mul_ps(_mm512_loadu_ps(head + 16),
                                  _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + 16)))));
            } else {
                d = f32 ? _mm512_loadu_ps((const float *)b) : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)b));
                m = f32 ? _mm512_loadu_ps((const float *)(b + 64)) : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(b + 32)));
            }
            const __m512 d2[2] = {_mm512_permutexvar_ps(lo_idx, d), _mm512_permutexvar_ps(hi_idx, d)};
            const __m512 m2[2] = {_mm512_permutexvar_ps(lo_idx, m), _mm512_permutexvar_ps(hi_idx, m)};
            const uint8_t *nibbles = b + (ks ? 32 : f32 ? 128 : 64);
            for (int c = 0; c < 8; c++)
                for (int half = 0; half < 2; half++) /* output lanes 0..7 (bytes 0..15), 8..15 */
                    for (int nib = 0; nib < 2; nib++) {
                        __m512 q = g_lanes(nibbles + 32 * c + 16 * half, 4 * nib);
                        if (kind == GGUF_Q5_K) {
                            const int32_t word = ((const int32_t *)(b + 384))[2 * c + nib];
                            const __m512i bit = _mm512_and_si512(
                                _mm512_srlv_epi32(_mm512_set1_epi32(word), half ? shift_hi : shift_lo), _mm512_set1_epi32(1));
                            q = _mm512_add_ps(q, _mm512_cvtepi32_ps(_mm512_slli_epi32(bit, 4)));
                        }
                        store16(out + (2 * c + nib) * 32 + 16 * half, _mm512_fmadd_ps(d2[half], q, m2[half]));
                    }
        } else {
            const int q6 = kind == GGUF_Q6_K, q6s = kind == GGUF_Q6_KS;
            const uint8_t *run = q6s ? q6ks_run(src, kb) : b, *quads = b + (q6 ? 128 : 32);
            const float bias = q6s ? 32.0f : 128.0f;
            for (int c = 0; c < 8; c++) {
                const __m512 d =
                    q6s  ? _mm512_mul_ps(_mm512_loadu_ps(q6ks_head(src, kb)),
                                         _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(run + (c < 4 ? 0 : 16))))))
                    : q6 ? _mm512_loadu_ps((const float *)b + (c < 4 ? 0 : 16))
                         : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)b));
                const __m512 d2[2] = {_mm512_permutexvar_ps(lo_idx, d), _mm512_permutexvar_ps(hi_idx, d)};
                const __m512i v = q6s ? q6ks_chunk(run + 32 + 48 * c) : _mm512_loadu_si512(quads + 64 * c);
                for (int pair = 0; pair < 2; pair++) { /* each lane's bytes 0, 1, then 2, 3 */
                    const __m256i words = _mm512_cvtepi32_epi16(_mm512_srli_epi32(v, 16 * pair));
                    uint8_t two[32];
                    _mm256_storeu_si256((__m256i *)two, words);
                    for (int half = 0; half < 2; half++) {
                        const __m512 q = _mm512_sub_ps(g_lanes(two + 16 * half, -1), _mm512_set1_ps(bias));
                        store16(out + (2 * c + pair) * 32 + 16 * half, _mm512_mul_ps(d2[half], q));
                    }
                }
            }
        }
    }
}

#endif
