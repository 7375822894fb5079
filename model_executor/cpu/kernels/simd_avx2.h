/* bf16 <-> fp32, exp and silu on eight AVX2 lanes, for CPUs with AVX2 and FMA but no AVX-512 BF16:
 * cpu_avx2_linear.c's silu epilogue and srt_silu_mul use the same silu_mul8, so the fused gate_up
 * product gives the bits of the two passes. Included after srt_kernels.h and immintrin.h. Empty
 * without AVX2 and FMA. */
#ifndef SRT_SIMD_AVX2_H
#define SRT_SIMD_AVX2_H
#if defined(__AVX2__) && defined(__FMA__)

/* eight bf16 -> fp32 (exact: the bits shifted into the high half) */
static inline __m256 load8(const bf16 *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
/* eight fp32 -> bf16, rounded to nearest even with NaN kept quiet, as torch's cast and f32_to_bf16 */
static inline __m128i bf16x8(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    const __m256i r = _mm256_blendv_epi8(rounded, quiet, nan);
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}
static inline void store8(bf16 *p, __m256 v) { _mm_storeu_si128((__m128i *)p, bf16x8(v)); }
/* each lane rounded to bf16 and widened back: the value a bf16 store then load gives */
static inline __m256 round8(__m256 v) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bf16x8(v)), 16));
}
/* cpu_kernels.c's exp_f32 on eight lanes: the same clamp, reduction and polynomial, 2^n put into
 * the exponent bits */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.7f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f),
                                     _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x));
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}
/* silu(g) * u = g / (1 + exp(-g)) * u, with a true division (AVX2 has no rcp14) */
static inline __m256 silu_mul8(__m256 g, __m256 u) {
    const __m256 den = _mm256_add_ps(exp8(_mm256_sub_ps(_mm256_setzero_ps(), g)), _mm256_set1_ps(1.0f));
    return _mm256_mul_ps(_mm256_div_ps(g, den), u);
}
#endif
#endif
