/* bf16 <-> fp32, exp and silu on sixteen AVX-512 lanes, shared by cpu_kernels.c and cpu_amx.c (each
 * includes it after srt_kernels.h and immintrin.h). Empty without AVX-512 BF16. */
#ifndef SRT_SIMD_BF16_H
#define SRT_SIMD_BF16_H
#if defined(__AVX512BF16__)
#include <math.h>

/* Sixteen lanes at a time: bf16 <-> fp32 (the store rounds to nearest even, as torch's cast) and
 * cpu_kernels.c's exp_f32 with the same reduction and polynomial (2^n applied by scalef). A tail
 * of n < 16 lanes uses masked loads and stores. */
static inline __m512 load16(const bf16 *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline __m512 load16_tail(const bf16 *p, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
static inline void store16(bf16 *p, __m512 v) {
    _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh(v));
}
static inline void store16_tail(bf16 *p, __m512 v, __mmask16 m) {
    _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v));
}
/* each lane rounded to bf16 (nearest even) and widened back: the value a bf16 store then load gives */
static inline __m512 round16(__m512 v) { return _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(v)); }
static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.7f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f),
                                     _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(y, n);
}
/* silu(g) * u: g / (1 + exp(-g)) with the reciprocal from rcp14 and one Newton step (~23 bits,
 * far below bf16's 8), which costs a fraction of a vector division. */
static inline __m512 silu_mul16(__m512 g, __m512 u) {
    const __m512 den = _mm512_add_ps(exp16(_mm512_sub_ps(_mm512_setzero_ps(), g)), _mm512_set1_ps(1.0f));
    __m512 inv = _mm512_rcp14_ps(den);
    inv = _mm512_mul_ps(inv, _mm512_fnmadd_ps(den, inv, _mm512_set1_ps(2.0f)));
    return _mm512_mul_ps(_mm512_mul_ps(g, inv), u);
}
/* Two rows' 32 bf16 values e and o interleaved as vdpbf16ps pairs: *lo = e0 o0 e1 o1 .. e15 o15,
 * *hi = the same for values 16 .. 31 (16 dims of two tokens each, for P V) */
static inline void interleave32(__m512i e, __m512i o, __m512i *lo, __m512i *hi) {
    const __m512i pair_lo = _mm512_setr_epi32(0x00200000, 0x00210001, 0x00220002, 0x00230003, 0x00240004, 0x00250005,
                                              0x00260006, 0x00270007, 0x00280008, 0x00290009, 0x002a000a, 0x002b000b,
                                              0x002c000c, 0x002d000d, 0x002e000e, 0x002f000f);
    *lo = _mm512_permutex2var_epi16(e, pair_lo, o);
    *hi = _mm512_permutex2var_epi16(e, _mm512_add_epi16(pair_lo, _mm512_set1_epi16(16)), o);
}
/* the first n lanes (none for n <= 0, all for n >= 16) */
static inline __mmask16 lanes16(int64_t n) {
    return (__mmask16)(n <= 0 ? 0u : n >= 16 ? 0xffffu : (1u << n) - 1u);
}
/* max of s[0 .. len) (len >= 1) */
static inline float max16(const float *s, int64_t len) {
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    for (int64_t t = 0; t < len; t += 16) {
        const __mmask16 m = lanes16(len - t);
        vmax = _mm512_mask_max_ps(vmax, m, vmax, _mm512_maskz_loadu_ps(m, s + t));
    }
    return _mm512_reduce_max_ps(vmax);
}
/* s[0 .. len) -> exp(s - top), in place (len >= 1; top: max16(s, len)); returns their sum: a
 * softmax with the division left to the caller (decode attention divides its output instead of
 * the scores, and a split of its tokens keeps top to combine with the other splits) */
static inline float exp_shifted16(float *s, int64_t len, float top) {
    __m512 vsum = _mm512_setzero_ps();
    const __m512 mx = _mm512_set1_ps(top);
    for (int64_t t = 0; t < len; t += 16) {
        const __mmask16 m = lanes16(len - t);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + t), mx));
        _mm512_mask_storeu_ps(s + t, m, e);
        vsum = _mm512_mask_add_ps(vsum, m, vsum, e);
    }
    return _mm512_reduce_add_ps(vsum);
}
/* s[0 .. len) -> softmax(s), in place (len >= 1) */
static inline void softmax16(float *s, int64_t len) {
    const __m512 inv = _mm512_set1_ps(1.0f / exp_shifted16(s, len, max16(s, len)));
    for (int64_t t = 0; t < len; t += 16) {
        const __mmask16 m = lanes16(len - t);
        _mm512_mask_storeu_ps(s + t, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, s + t), inv));
    }
}
#endif
#endif
