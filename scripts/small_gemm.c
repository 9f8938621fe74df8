// A weights-once small-T matmul for scripts/small_gemm_bound.py (a measurement, not part of
// the library): y[t, o] = sum_d x[t, d] * w[o, d], w [O, D] row-major (the [out, in] layout
// of the model's projections), T in 1..9, D % 8 == 0. Each weight row is read from memory once
// and used for all T rows of x, which stay in L1/L2: T FMA chains per row (AVX2), rows split
// over the OpenMP threads.
#include <immintrin.h>

static inline float hsum(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_hadd_ps(lo, lo);
  return _mm_cvtss_f32(_mm_hadd_ps(lo, lo));
}

#define KERNEL(T)                                                                     \
  static void gemm_##T(const float* x, const float* w, float* y, long O, long D) {    \
    _Pragma("omp parallel for schedule(static)")                                      \
    for (long o = 0; o < O; o++) {                                                    \
      __m256 acc[T];                                                                  \
      for (int t = 0; t < T; t++) acc[t] = _mm256_setzero_ps();                       \
      for (long d = 0; d < D; d += 8) {                                               \
        __m256 wv = _mm256_loadu_ps(w + o * D + d);                                   \
        for (int t = 0; t < T; t++)                                                   \
          acc[t] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + t * D + d), acc[t]);       \
      }                                                                               \
      for (int t = 0; t < T; t++) y[t * O + o] = hsum(acc[t]);                        \
    }                                                                                 \
  }
KERNEL(1) KERNEL(2) KERNEL(3) KERNEL(4) KERNEL(5) KERNEL(6) KERNEL(7) KERNEL(8) KERNEL(9)

int small_gemm(const float* x, const float* w, float* y, long T, long O, long D) {
  switch (T) {
    case 1: gemm_1(x, w, y, O, D); return 0;
    case 2: gemm_2(x, w, y, O, D); return 0;
    case 3: gemm_3(x, w, y, O, D); return 0;
    case 4: gemm_4(x, w, y, O, D); return 0;
    case 5: gemm_5(x, w, y, O, D); return 0;
    case 6: gemm_6(x, w, y, O, D); return 0;
    case 7: gemm_7(x, w, y, O, D); return 0;
    case 8: gemm_8(x, w, y, O, D); return 0;
    case 9: gemm_9(x, w, y, O, D); return 0;
  }
  return 1;
}
