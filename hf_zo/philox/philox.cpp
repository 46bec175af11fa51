// Philox-4x32-10 + Box-Muller perturbation noise for hf_zo, compiled for the CPU.
//
// The noise of parameter `index` for `seed`: Philox-4x32-10 (Salmon et al., SC'11; the generator of cuRAND and
// JAX) with key (seed low, seed high) encrypts the counter (block low, block high, index low, index high) into four
// 32-bit words. Blocks come in tiles of kTileBlocks: word k of block kTileBlocks * t + i gives element
// kTileNumel * t + kTileBlocks * k + i. Gaussian: words (0, 1) and (2, 3) each feed one Box-Muller pair (radius from
// the first, angle from the second); Rademacher: the sign bit of each word. An element depends on (seed, index,
// element) only, never on how a tensor is cut into ranges or threads.
//
// The bits are the same on every machine and in hf_zo/philox/reference.py, which computes the same numbers with
// torch operations step for step: only integer operations, float additions, multiplications and sqrt (each rounded
// once: the file is compiled with -ffp-contract=off), and log/sin/cos as the Cephes single-precision polynomials
// written out here instead of libm's. x86 CPUs run hand-vectorised AVX-512 or AVX2 versions of the same
// operations (the widest the CPU has, chosen when first called), other CPUs the portable scalar loops.

#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HF_ZO_X86 1
#endif

namespace {

constexpr uint32_t kMul0 = 0xD2511F53u;
constexpr uint32_t kMul1 = 0xCD9E8D57u;
constexpr uint32_t kWeyl0 = 0x9E3779B9u;
constexpr uint32_t kWeyl1 = 0xBB67AE85u;
constexpr int kRounds = 10;

// Philox blocks per tile: 256 blocks give 1024 elements (4 KiB of fp32), which stay in L1 while a tile is updated.
constexpr int64_t kTileBlocks = 256;
constexpr int64_t kTileNumel = 4 * kTileBlocks;
// Elements per parallel work item of a sweep.
constexpr int64_t kGrainNumel = 1 << 16;

// Constants are written as doubles and rounded to float, as torch rounds a Python float scalar.
const float kTwoPow24Inv = static_cast<float>(1.0 / 16777216.0);
const float kSqrtHalf = static_cast<float>(0.70710678118654752440);
const float kLogP0 = static_cast<float>(7.0376836292E-2);
const float kLogP1 = static_cast<float>(-1.1514610310E-1);
const float kLogP2 = static_cast<float>(1.1676998740E-1);
const float kLogP3 = static_cast<float>(-1.2420140846E-1);
const float kLogP4 = static_cast<float>(1.4249322787E-1);
const float kLogP5 = static_cast<float>(-1.6668057665E-1);
const float kLogP6 = static_cast<float>(2.0000714765E-1);
const float kLogP7 = static_cast<float>(-2.4999993993E-1);
const float kLogP8 = static_cast<float>(3.3333331174E-1);
const float kLn2Low = static_cast<float>(-2.12194440E-4);
const float kLn2High = static_cast<float>(0.693359375);
const float kAngleStep = static_cast<float>(6.283185307179586476925 / 16777216.0);
const float kSin0 = static_cast<float>(-1.9515295891E-4);
const float kSin1 = static_cast<float>(8.3321608736E-3);
const float kSin2 = static_cast<float>(-1.6666654611E-1);
const float kCos0 = static_cast<float>(2.443315711809948E-5);
const float kCos1 = static_cast<float>(-1.388731625493765E-3);
const float kCos2 = static_cast<float>(4.166664568298827E-2);

inline float bits_to_float(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

inline uint32_t float_to_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

// sqrt(-2 log u) for u = ((a >> 8) + 1) / 2^24 in (0, 1]: Cephes logf after an exact frexp.
__attribute__((always_inline)) inline float box_muller_radius(uint32_t a) {
  const float u = static_cast<float>(static_cast<int32_t>((a >> 8) + 1u)) * kTwoPow24Inv;  // exact: at most 2^24
  const uint32_t bits = float_to_bits(u);
  int32_t exponent = static_cast<int32_t>(bits >> 23) - 126;
  const uint32_t mantissa_bits = (bits & 0x007FFFFFu) | 0x3F000000u;  // in [0.5, 1)
  // Mantissas below sqrt(1/2) are doubled (exactly, by raising the exponent field) so that x = mantissa - 1 stays in
  // [-0.29, 0.41).
  const int32_t low = bits_to_float(mantissa_bits) < kSqrtHalf ? 1 : 0;
  exponent -= low;
  const float x = bits_to_float(mantissa_bits + (static_cast<uint32_t>(low) << 23)) - 1.0f;
  const float z = x * x;
  float y = kLogP0;
  y = y * x + kLogP1;
  y = y * x + kLogP2;
  y = y * x + kLogP3;
  y = y * x + kLogP4;
  y = y * x + kLogP5;
  y = y * x + kLogP6;
  y = y * x + kLogP7;
  y = y * x + kLogP8;
  y = (y * x) * z;
  const float e = static_cast<float>(exponent);
  y = y + kLn2Low * e;
  y = y - 0.5f * z;
  float log_u = x + y;
  log_u = log_u + kLn2High * e;
  return std::sqrt(-2.0f * log_u);
}

// (cos, sin) of 2 pi t / 2^24 for t = b >> 8: exact reduction to the nearest quarter turn, then Cephes sinf/cosf.
__attribute__((always_inline)) inline void box_muller_angle(uint32_t b, float& cosine, float& sine) {
  const int32_t t = static_cast<int32_t>(b >> 8);
  const int32_t quarter = (t + (1 << 21)) >> 22;
  const float theta = static_cast<float>(t - (quarter << 22)) * kAngleStep;  // in [-pi/4, pi/4)
  const float z = theta * theta;
  const float s = (((kSin0 * z + kSin1) * z + kSin2) * z) * theta + theta;
  const float c = ((((kCos0 * z + kCos1) * z + kCos2) * z) * z - 0.5f * z) + 1.0f;
  // Quarter turn q maps (c, s) to (c, s), (-s, c), (-c, -s), (s, -c): a swap and sign flips, done on the bits.
  const uint32_t q = static_cast<uint32_t>(quarter) & 3u;
  const uint32_t swap = 0u - (q & 1u);
  const uint32_t c_bits = float_to_bits(c), s_bits = float_to_bits(s);
  cosine = bits_to_float(((c_bits & ~swap) | (s_bits & swap)) ^ (((q ^ (q >> 1)) & 1u) << 31));
  sine = bits_to_float(((s_bits & ~swap) | (c_bits & swap)) ^ ((q >> 1) << 31));
}

// Philox-4x32-10 of the counters (block, index) for the kTileBlocks blocks from first_block: words[k][i] is word k
// of block first_block + i. Portable version.
void philox_blocks_portable(uint64_t seed, uint64_t index, uint64_t first_block, uint32_t (*words)[kTileBlocks]) {
  const uint32_t key0 = static_cast<uint32_t>(seed), key1 = static_cast<uint32_t>(seed >> 32);
  for (int64_t i = 0; i < kTileBlocks; ++i) {
    const uint64_t block = first_block + static_cast<uint64_t>(i);
    uint32_t c0 = static_cast<uint32_t>(block), c1 = static_cast<uint32_t>(block >> 32);
    uint32_t c2 = static_cast<uint32_t>(index), c3 = static_cast<uint32_t>(index >> 32);
    uint32_t k0 = key0, k1 = key1;
    for (int round = 0; round < kRounds; ++round) {
      const uint64_t p0 = static_cast<uint64_t>(kMul0) * c0;
      const uint64_t p1 = static_cast<uint64_t>(kMul1) * c2;
      const uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ c1 ^ k0;
      const uint32_t n2 = static_cast<uint32_t>(p0 >> 32) ^ c3 ^ k1;
      c1 = static_cast<uint32_t>(p1);
      c3 = static_cast<uint32_t>(p0);
      c0 = n0;
      c2 = n2;
      k0 += kWeyl0;
      k1 += kWeyl1;
    }
    words[0][i] = c0;
    words[1][i] = c1;
    words[2][i] = c2;
    words[3][i] = c3;
  }
}

// Which vectorised code computes the noise: the widest this CPU runs, lowered by HF_ZO_PHILOX_SIMD ("portable",
// "avx2" or "avx512") in the environment, so that the tests can check every version's bits on one machine.
enum class Simd { kPortable, kAvx2, kAvx512 };

Simd detect_simd() {
  Simd simd = Simd::kPortable;
#ifdef HF_ZO_X86
  if (__builtin_cpu_supports("avx2")) simd = Simd::kAvx2;
  if (__builtin_cpu_supports("avx512f")) simd = Simd::kAvx512;
#endif
  const char* requested = std::getenv("HF_ZO_PHILOX_SIMD");
  if (requested == nullptr || requested[0] == '\0') return simd;
  const std::string name(requested);
  TORCH_CHECK(name == "portable" || name == "avx2" || name == "avx512", "HF_ZO_PHILOX_SIMD must be 'portable', ",
              "'avx2' or 'avx512', got '", name, "'; unset it to use the widest code this CPU runs");
  const Simd cap = name == "portable" ? Simd::kPortable : name == "avx2" ? Simd::kAvx2 : Simd::kAvx512;
  return std::min(simd, cap);
}

// Resolved on first use, so that a bad HF_ZO_PHILOX_SIMD raises a Python error from the call instead of aborting
// the import. Every entry point (fill, apply, simd) calls it first, on the calling thread: once it has returned, the
// noise loops' own calls only read the resolved level and cannot throw. An exception thrown from inside those loops
// is not always catchable (GCC compiles some of their frames as non-throwing, so unwinding through them calls
// std::terminate), and one thrown in a worker std::thread would terminate the process anyway.
Simd simd_level() {
  static const Simd level = detect_simd();
  return level;
}

#ifdef HF_ZO_X86
// The same, eight blocks per AVX2 register: the 32x32->64-bit products of even and odd lanes are formed by two
// vpmuludq and their high and low halves blended back into lanes.
__attribute__((target("avx2"))) inline void mul_hi_lo(__m256i a, __m256i multiplier, __m256i& hi, __m256i& lo) {
  const __m256i even = _mm256_mul_epu32(a, multiplier);
  const __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), multiplier);
  lo = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
  hi = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
}

__attribute__((target("avx2"))) void philox_blocks_avx2(uint64_t seed, uint64_t index, uint64_t first_block,
                                                        uint32_t (*words)[kTileBlocks]) {
  const __m256i mul0 = _mm256_set1_epi32(static_cast<int32_t>(kMul0));
  const __m256i mul1 = _mm256_set1_epi32(static_cast<int32_t>(kMul1));
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256i keys0[kRounds], keys1[kRounds];
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < kRounds; ++round) {
    keys0[round] = _mm256_set1_epi32(static_cast<int32_t>(k0));
    keys1[round] = _mm256_set1_epi32(static_cast<int32_t>(k1));
    k0 += kWeyl0;
    k1 += kWeyl1;
  }
  const __m256i index_low = _mm256_set1_epi32(static_cast<int32_t>(static_cast<uint32_t>(index)));
  const __m256i index_high = _mm256_set1_epi32(static_cast<int32_t>(static_cast<uint32_t>(index >> 32)));
  // kInterleave independent groups of eight blocks per iteration hide the latency of a round's dependency chain.
  constexpr int kInterleave = 2;
  for (int64_t i = 0; i < kTileBlocks; i += 8 * kInterleave) {
    __m256i c0[kInterleave], c1[kInterleave], c2[kInterleave], c3[kInterleave];
    for (int g = 0; g < kInterleave; ++g) {
      // The block is a multiple of 8, so the low words of its eight blocks never wrap around.
      const uint64_t block = first_block + static_cast<uint64_t>(i + 8 * g);
      c0[g] = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(static_cast<uint32_t>(block))), lanes);
      c1[g] = _mm256_set1_epi32(static_cast<int32_t>(static_cast<uint32_t>(block >> 32)));
      c2[g] = index_low;
      c3[g] = index_high;
    }
    for (int round = 0; round < kRounds; ++round) {
      for (int g = 0; g < kInterleave; ++g) {
        __m256i hi0, lo0, hi1, lo1;
        mul_hi_lo(c0[g], mul0, hi0, lo0);
        mul_hi_lo(c2[g], mul1, hi1, lo1);
        c0[g] = _mm256_xor_si256(_mm256_xor_si256(hi1, c1[g]), keys0[round]);
        c2[g] = _mm256_xor_si256(_mm256_xor_si256(hi0, c3[g]), keys1[round]);
        c1[g] = lo1;
        c3[g] = lo0;
      }
    }
    for (int g = 0; g < kInterleave; ++g) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(&words[0][i + 8 * g]), c0[g]);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(&words[1][i + 8 * g]), c1[g]);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(&words[2][i + 8 * g]), c2[g]);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(&words[3][i + 8 * g]), c3[g]);
    }
  }
}

// The Box-Muller transform of a tile, eight blocks per AVX2 register: the operations of box_muller_radius and
// box_muller_angle, in the same order (so the same bits), written out so that the radii of N registers
// advance through the logarithm's polynomial side by side. The compiler's vectorisation of the scalar loop leaves
// one register's 20-deep chain of dependent multiplications and additions at a time to the out-of-order window,
// which is too small to overlap them: interleaving the chains makes the transform about a quarter faster.
template <int N>
__attribute__((target("avx2"), always_inline)) inline void box_muller_radii_avx2(const __m256i* a, __m256* radii) {
  __m256 x[N], z[N], y[N], e[N];
  for (int g = 0; g < N; ++g) {
    const __m256i numerator = _mm256_add_epi32(_mm256_srli_epi32(a[g], 8), _mm256_set1_epi32(1));
    const __m256 u = _mm256_mul_ps(_mm256_cvtepi32_ps(numerator), _mm256_set1_ps(kTwoPow24Inv));
    const __m256i bits = _mm256_castps_si256(u);
    const __m256i exponent = _mm256_sub_epi32(_mm256_srli_epi32(bits, 23), _mm256_set1_epi32(126));
    const __m256i mantissa_bits =
        _mm256_or_si256(_mm256_and_si256(bits, _mm256_set1_epi32(0x007FFFFF)), _mm256_set1_epi32(0x3F000000));
    const __m256i low = _mm256_castps_si256(  // all ones where the mantissa is doubled, that is -1 as an integer
        _mm256_cmp_ps(_mm256_castsi256_ps(mantissa_bits), _mm256_set1_ps(kSqrtHalf), _CMP_LT_OQ));
    const __m256i doubled = _mm256_add_epi32(mantissa_bits, _mm256_and_si256(low, _mm256_set1_epi32(0x00800000)));
    x[g] = _mm256_sub_ps(_mm256_castsi256_ps(doubled), _mm256_set1_ps(1.0f));
    e[g] = _mm256_cvtepi32_ps(_mm256_add_epi32(exponent, low));
    z[g] = _mm256_mul_ps(x[g], x[g]);
    y[g] = _mm256_add_ps(_mm256_mul_ps(_mm256_set1_ps(kLogP0), x[g]), _mm256_set1_ps(kLogP1));
  }
  const float coefficients[7] = {kLogP2, kLogP3, kLogP4, kLogP5, kLogP6, kLogP7, kLogP8};
#pragma GCC unroll 7
  for (int k = 0; k < 7; ++k) {
#pragma GCC unroll 8
    for (int g = 0; g < N; ++g) y[g] = _mm256_add_ps(_mm256_mul_ps(y[g], x[g]), _mm256_set1_ps(coefficients[k]));
  }
  for (int g = 0; g < N; ++g) {
    __m256 v = _mm256_mul_ps(_mm256_mul_ps(y[g], x[g]), z[g]);
    v = _mm256_add_ps(v, _mm256_mul_ps(_mm256_set1_ps(kLn2Low), e[g]));
    v = _mm256_sub_ps(v, _mm256_mul_ps(_mm256_set1_ps(0.5f), z[g]));
    v = _mm256_add_ps(x[g], v);
    v = _mm256_add_ps(v, _mm256_mul_ps(_mm256_set1_ps(kLn2High), e[g]));
    radii[g] = _mm256_sqrt_ps(_mm256_mul_ps(_mm256_set1_ps(-2.0f), v));
  }
}

__attribute__((target("avx2"), always_inline)) inline void box_muller_angle_avx2(__m256i b, __m256& cosine,
                                                                                  __m256& sine) {
  const __m256i t = _mm256_srli_epi32(b, 8);
  const __m256i quarter = _mm256_srai_epi32(_mm256_add_epi32(t, _mm256_set1_epi32(1 << 21)), 22);
  const __m256 theta = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(t, _mm256_slli_epi32(quarter, 22))),
                                     _mm256_set1_ps(kAngleStep));
  const __m256 z = _mm256_mul_ps(theta, theta);
  __m256 s = _mm256_add_ps(_mm256_mul_ps(_mm256_set1_ps(kSin0), z), _mm256_set1_ps(kSin1));
  s = _mm256_add_ps(_mm256_mul_ps(s, z), _mm256_set1_ps(kSin2));
  s = _mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(s, z), theta), theta);
  __m256 c = _mm256_add_ps(_mm256_mul_ps(_mm256_set1_ps(kCos0), z), _mm256_set1_ps(kCos1));
  c = _mm256_add_ps(_mm256_mul_ps(c, z), _mm256_set1_ps(kCos2));
  c = _mm256_sub_ps(_mm256_mul_ps(_mm256_mul_ps(c, z), z), _mm256_mul_ps(_mm256_set1_ps(0.5f), z));
  c = _mm256_add_ps(c, _mm256_set1_ps(1.0f));
  // Bit 31 of odd is q & 1 (swap cosine and sine), of high q >> 1; blendv selects on bit 31.
  const __m256i q = _mm256_and_si256(quarter, _mm256_set1_epi32(3));
  const __m256i odd = _mm256_slli_epi32(q, 31);
  const __m256i high = _mm256_slli_epi32(_mm256_srli_epi32(q, 1), 31);
  const __m256 swapped_c = _mm256_blendv_ps(c, s, _mm256_castsi256_ps(odd));
  const __m256 swapped_s = _mm256_blendv_ps(s, c, _mm256_castsi256_ps(odd));
  cosine = _mm256_xor_ps(swapped_c, _mm256_castsi256_ps(_mm256_xor_si256(odd, high)));
  sine = _mm256_xor_ps(swapped_s, _mm256_castsi256_ps(high));
}

// out[0 : kTileNumel] <- the Gaussians of a tile's Philox words (as the scalar loop in noise_tile computes them).
__attribute__((target("avx2"))) void gaussian_tile_avx2(const uint32_t (*words)[kTileBlocks], float* out) {
  constexpr int kGroups = 2;  // 4 radius chains at a time; more spill registers and run slower
  for (int64_t i = 0; i < kTileBlocks; i += 8 * kGroups) {
    __m256i radius_words[2 * kGroups];
    __m256 radii[2 * kGroups];
    for (int g = 0; g < kGroups; ++g) {
      radius_words[g] = _mm256_load_si256(reinterpret_cast<const __m256i*>(&words[0][i + 8 * g]));
      radius_words[kGroups + g] = _mm256_load_si256(reinterpret_cast<const __m256i*>(&words[2][i + 8 * g]));
    }
    box_muller_radii_avx2<2 * kGroups>(radius_words, radii);
    for (int g = 0; g < kGroups; ++g) {
      const int64_t j = i + 8 * g;
      __m256 cos0, sin0, cos1, sin1;
      box_muller_angle_avx2(_mm256_load_si256(reinterpret_cast<const __m256i*>(&words[1][j])), cos0, sin0);
      box_muller_angle_avx2(_mm256_load_si256(reinterpret_cast<const __m256i*>(&words[3][j])), cos1, sin1);
      _mm256_storeu_ps(out + j, _mm256_mul_ps(radii[g], cos0));
      _mm256_storeu_ps(out + kTileBlocks + j, _mm256_mul_ps(radii[g], sin0));
      _mm256_storeu_ps(out + 2 * kTileBlocks + j, _mm256_mul_ps(radii[kGroups + g], cos1));
      _mm256_storeu_ps(out + 3 * kTileBlocks + j, _mm256_mul_ps(radii[kGroups + g], sin1));
    }
  }
}

// The same three functions for AVX-512 (sixteen blocks per register), with the operations it adds: a masked
// shuffle puts the high or low halves of the even and odd products in place in one instruction (instead of a shift
// and a blend), one ternary-logic instruction xors three words, comparisons give masks that select lanes, and 32
// registers hold more chains side by side. Every float operation is the one the AVX2 code does, in the same order.
__attribute__((target("avx512f"), always_inline)) inline void mul_hi_lo_avx512(__m512i a, __m512i multiplier,
                                                                                __m512i& hi, __m512i& lo) {
  const __m512i even = _mm512_mul_epu32(a, multiplier);  // (low, high) of lane 2k's product in lanes (2k, 2k + 1)
  const __m512i odd = _mm512_mul_epu32(_mm512_srli_epi64(a, 32), multiplier);  // the same for lane 2k + 1
  lo = _mm512_mask_shuffle_epi32(even, 0xAAAA, odd, _MM_PERM_CDAB);
  hi = _mm512_mask_shuffle_epi32(odd, 0x5555, even, _MM_PERM_CDAB);
}

__attribute__((target("avx512f"))) void philox_blocks_avx512(uint64_t seed, uint64_t index, uint64_t first_block,
                                                             uint32_t (*words)[kTileBlocks]) {
  const __m512i mul0 = _mm512_set1_epi32(static_cast<int32_t>(kMul0));
  const __m512i mul1 = _mm512_set1_epi32(static_cast<int32_t>(kMul1));
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512i keys0[kRounds], keys1[kRounds];
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < kRounds; ++round) {
    keys0[round] = _mm512_set1_epi32(static_cast<int32_t>(k0));
    keys1[round] = _mm512_set1_epi32(static_cast<int32_t>(k1));
    k0 += kWeyl0;
    k1 += kWeyl1;
  }
  const __m512i index_low = _mm512_set1_epi32(static_cast<int32_t>(static_cast<uint32_t>(index)));
  const __m512i index_high = _mm512_set1_epi32(static_cast<int32_t>(static_cast<uint32_t>(index >> 32)));
  constexpr int kInterleave = 2;
  for (int64_t i = 0; i < kTileBlocks; i += 16 * kInterleave) {
    __m512i c0[kInterleave], c1[kInterleave], c2[kInterleave], c3[kInterleave];
    for (int g = 0; g < kInterleave; ++g) {
      // The block is a multiple of 16, so the low words of its sixteen blocks never wrap around.
      const uint64_t block = first_block + static_cast<uint64_t>(i + 16 * g);
      c0[g] = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(static_cast<uint32_t>(block))), lanes);
      c1[g] = _mm512_set1_epi32(static_cast<int32_t>(static_cast<uint32_t>(block >> 32)));
      c2[g] = index_low;
      c3[g] = index_high;
    }
    for (int round = 0; round < kRounds; ++round) {
      for (int g = 0; g < kInterleave; ++g) {
        __m512i hi0, lo0, hi1, lo1;
        mul_hi_lo_avx512(c0[g], mul0, hi0, lo0);
        mul_hi_lo_avx512(c2[g], mul1, hi1, lo1);
        c0[g] = _mm512_ternarylogic_epi32(hi1, c1[g], keys0[round], 0x96);  // hi1 ^ c1 ^ key0
        c2[g] = _mm512_ternarylogic_epi32(hi0, c3[g], keys1[round], 0x96);
        c1[g] = lo1;
        c3[g] = lo0;
      }
    }
    for (int g = 0; g < kInterleave; ++g) {
      _mm512_store_si512(&words[0][i + 16 * g], c0[g]);
      _mm512_store_si512(&words[1][i + 16 * g], c1[g]);
      _mm512_store_si512(&words[2][i + 16 * g], c2[g]);
      _mm512_store_si512(&words[3][i + 16 * g], c3[g]);
    }
  }
}

template <int N>
__attribute__((target("avx512f"), always_inline)) inline void box_muller_radii_avx512(const __m512i* a,
                                                                                       __m512* radii) {
  __m512 x[N], z[N], y[N], e[N];
  for (int g = 0; g < N; ++g) {
    const __m512i numerator = _mm512_add_epi32(_mm512_srli_epi32(a[g], 8), _mm512_set1_epi32(1));
    const __m512 u = _mm512_mul_ps(_mm512_cvtepi32_ps(numerator), _mm512_set1_ps(kTwoPow24Inv));
    const __m512i bits = _mm512_castps_si512(u);
    const __m512i exponent = _mm512_sub_epi32(_mm512_srli_epi32(bits, 23), _mm512_set1_epi32(126));
    const __m512i mantissa_bits =
        _mm512_or_si512(_mm512_and_si512(bits, _mm512_set1_epi32(0x007FFFFF)), _mm512_set1_epi32(0x3F000000));
    const __mmask16 low =
        _mm512_cmp_ps_mask(_mm512_castsi512_ps(mantissa_bits), _mm512_set1_ps(kSqrtHalf), _CMP_LT_OQ);
    const __m512i doubled = _mm512_mask_add_epi32(mantissa_bits, low, mantissa_bits, _mm512_set1_epi32(0x00800000));
    x[g] = _mm512_sub_ps(_mm512_castsi512_ps(doubled), _mm512_set1_ps(1.0f));
    e[g] = _mm512_cvtepi32_ps(_mm512_mask_sub_epi32(exponent, low, exponent, _mm512_set1_epi32(1)));
    z[g] = _mm512_mul_ps(x[g], x[g]);
    y[g] = _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(kLogP0), x[g]), _mm512_set1_ps(kLogP1));
  }
  const float coefficients[7] = {kLogP2, kLogP3, kLogP4, kLogP5, kLogP6, kLogP7, kLogP8};
#pragma GCC unroll 7
  for (int k = 0; k < 7; ++k) {
#pragma GCC unroll 8
    for (int g = 0; g < N; ++g) y[g] = _mm512_add_ps(_mm512_mul_ps(y[g], x[g]), _mm512_set1_ps(coefficients[k]));
  }
  for (int g = 0; g < N; ++g) {
    __m512 v = _mm512_mul_ps(_mm512_mul_ps(y[g], x[g]), z[g]);
    v = _mm512_add_ps(v, _mm512_mul_ps(_mm512_set1_ps(kLn2Low), e[g]));
    v = _mm512_sub_ps(v, _mm512_mul_ps(_mm512_set1_ps(0.5f), z[g]));
    v = _mm512_add_ps(x[g], v);
    v = _mm512_add_ps(v, _mm512_mul_ps(_mm512_set1_ps(kLn2High), e[g]));
    radii[g] = _mm512_sqrt_ps(_mm512_mul_ps(_mm512_set1_ps(-2.0f), v));
  }
}

__attribute__((target("avx512f"), always_inline)) inline void box_muller_angle_avx512(__m512i b, __m512& cosine,
                                                                                      __m512& sine) {
  const __m512i t = _mm512_srli_epi32(b, 8);
  const __m512i quarter = _mm512_srai_epi32(_mm512_add_epi32(t, _mm512_set1_epi32(1 << 21)), 22);
  const __m512 theta = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(t, _mm512_slli_epi32(quarter, 22))),
                                     _mm512_set1_ps(kAngleStep));
  const __m512 z = _mm512_mul_ps(theta, theta);
  __m512 s = _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(kSin0), z), _mm512_set1_ps(kSin1));
  s = _mm512_add_ps(_mm512_mul_ps(s, z), _mm512_set1_ps(kSin2));
  s = _mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(s, z), theta), theta);
  __m512 c = _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(kCos0), z), _mm512_set1_ps(kCos1));
  c = _mm512_add_ps(_mm512_mul_ps(c, z), _mm512_set1_ps(kCos2));
  c = _mm512_sub_ps(_mm512_mul_ps(_mm512_mul_ps(c, z), z), _mm512_mul_ps(_mm512_set1_ps(0.5f), z));
  c = _mm512_add_ps(c, _mm512_set1_ps(1.0f));
  const __m512i q = _mm512_and_si512(quarter, _mm512_set1_epi32(3));
  const __mmask16 odd = _mm512_test_epi32_mask(q, _mm512_set1_epi32(1));  // swap cosine and sine
  const __m512i high = _mm512_slli_epi32(_mm512_srli_epi32(q, 1), 31);
  const __m512i cosine_sign = _mm512_slli_epi32(_mm512_xor_si512(q, _mm512_srli_epi32(q, 1)), 31);
  cosine = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(_mm512_mask_blend_ps(odd, c, s)), cosine_sign));
  sine = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(_mm512_mask_blend_ps(odd, s, c)), high));
}

__attribute__((target("avx512f"))) void gaussian_tile_avx512(const uint32_t (*words)[kTileBlocks], float* out) {
  constexpr int kGroups = 2;  // 4 radius chains at a time, as in the AVX2 code (8 measured no faster)
  for (int64_t i = 0; i < kTileBlocks; i += 16 * kGroups) {
    __m512i radius_words[2 * kGroups];
    __m512 radii[2 * kGroups];
    for (int g = 0; g < kGroups; ++g) {
      radius_words[g] = _mm512_load_si512(&words[0][i + 16 * g]);
      radius_words[kGroups + g] = _mm512_load_si512(&words[2][i + 16 * g]);
    }
    box_muller_radii_avx512<2 * kGroups>(radius_words, radii);
    for (int g = 0; g < kGroups; ++g) {
      const int64_t j = i + 16 * g;
      __m512 cos0, sin0, cos1, sin1;
      box_muller_angle_avx512(_mm512_load_si512(&words[1][j]), cos0, sin0);
      box_muller_angle_avx512(_mm512_load_si512(&words[3][j]), cos1, sin1);
      _mm512_storeu_ps(out + j, _mm512_mul_ps(radii[g], cos0));
      _mm512_storeu_ps(out + kTileBlocks + j, _mm512_mul_ps(radii[g], sin0));
      _mm512_storeu_ps(out + 2 * kTileBlocks + j, _mm512_mul_ps(radii[kGroups + g], cos1));
      _mm512_storeu_ps(out + 3 * kTileBlocks + j, _mm512_mul_ps(radii[kGroups + g], sin1));
    }
  }
}
#endif

void philox_blocks(uint64_t seed, uint64_t index, uint64_t first_block, uint32_t (*words)[kTileBlocks]) {
#ifdef HF_ZO_X86
  if (simd_level() == Simd::kAvx512) {
    philox_blocks_avx512(seed, index, first_block, words);
    return;
  }
  if (simd_level() == Simd::kAvx2) {
    philox_blocks_avx2(seed, index, first_block, words);
    return;
  }
#endif
  philox_blocks_portable(seed, index, first_block, words);
}

// Noise elements [4 * first_block, 4 * first_block + kTileNumel) into out[0 : kTileNumel], first_block a multiple
// of kTileBlocks: word k of block first_block + i gives element 4 * first_block + kTileBlocks * k + i.
__attribute__((always_inline)) inline void noise_tile(uint64_t seed, uint64_t index, uint64_t first_block,
                                                      bool gaussian, float* out) {
  alignas(64) uint32_t words[4][kTileBlocks];
  philox_blocks(seed, index, first_block, words);
  if (gaussian) {
#ifdef HF_ZO_X86
    if (simd_level() == Simd::kAvx512) {
      gaussian_tile_avx512(words, out);
      return;
    }
    if (simd_level() == Simd::kAvx2) {
      gaussian_tile_avx2(words, out);
      return;
    }
#endif
    for (int64_t i = 0; i < kTileBlocks; ++i) {
      const float r0 = box_muller_radius(words[0][i]);
      const float r1 = box_muller_radius(words[2][i]);
      float cos0, sin0, cos1, sin1;
      box_muller_angle(words[1][i], cos0, sin0);
      box_muller_angle(words[3][i], cos1, sin1);
      out[i] = r0 * cos0;
      out[kTileBlocks + i] = r0 * sin0;
      out[2 * kTileBlocks + i] = r1 * cos1;
      out[3 * kTileBlocks + i] = r1 * sin1;
    }
  } else {
    for (int64_t k = 0; k < 4; ++k) {
      for (int64_t i = 0; i < kTileBlocks; ++i) {
        out[k * kTileBlocks + i] = bits_to_float(0x3F800000u | (words[k][i] & 0x80000000u));  // +1 or -1
      }
    }
  }
}

// Calls visit(tile_start, noise, begin, end) for the tiles covering elements [start, stop) of the noise: the
// tile's noise covers elements [tile_start, tile_start + kTileNumel), of which [begin, end) are wanted.
template <typename Visit>
__attribute__((always_inline)) inline void for_each_tile(uint64_t seed, uint64_t index, int64_t start, int64_t stop,
                                                         bool gaussian, Visit visit) {
  alignas(64) float noise[kTileNumel];
  for (int64_t tile_start = (start / kTileNumel) * kTileNumel; tile_start < stop; tile_start += kTileNumel) {
    noise_tile(seed, index, static_cast<uint64_t>(tile_start / 4), gaussian, noise);
    const int64_t begin = std::max(start, tile_start), end = std::min(stop, tile_start + kTileNumel);
    visit(tile_start, noise, begin, end);
  }
}

// x[0 : stop - start] <- noise elements [start, stop).
#ifdef HF_ZO_X86
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
void fill_range(float* x, uint64_t seed, uint64_t index, int64_t start, int64_t stop, bool gaussian) {
  for_each_tile(seed, index, start, stop, gaussian,
                [&](int64_t tile_start, const float* noise, int64_t begin, int64_t end) {
                  for (int64_t k = begin; k < end; ++k) x[k - start] = noise[k - tile_start];
                });
}

// x[0 : stop - start] <- decay * x + sum_j coeffs[j] * z(seeds[j]) over elements [start, stop), a tile at a time:
// first the decay, then each term in order, each rounded to float as the unfused torch operations round them.
#ifdef HF_ZO_X86
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
void apply_range(float* x, uint64_t index, int64_t start, int64_t stop, float decay, const int64_t* seeds,
                 const float* coeffs, int64_t num_terms, bool gaussian) {
  for (int64_t tile = start; tile < stop; tile += kTileNumel) {
    const int64_t tile_stop = std::min(stop, tile + kTileNumel);
    if (decay != 1.0f) {
      for (int64_t k = tile; k < tile_stop; ++k) x[k - start] = x[k - start] * decay;
    }
    for (int64_t j = 0; j < num_terms; ++j) {
      const float coeff = coeffs[j];
      for_each_tile(static_cast<uint64_t>(seeds[j]), index, tile, tile_stop, gaussian,
                    [&](int64_t tile_start, const float* noise, int64_t b, int64_t e) {
                      for (int64_t k = b; k < e; ++k) x[k - start] = x[k - start] + coeff * noise[k - tile_start];
                    });
    }
  }
}

void check_vector(const at::Tensor& tensor, const char* name) {
  TORCH_CHECK(tensor.device().is_cpu(), name, " must be on the CPU, got ", tensor.device());
  TORCH_CHECK(tensor.scalar_type() == at::kFloat, name, " must be float32, got ", tensor.scalar_type());
  TORCH_CHECK(tensor.is_contiguous(), name, " must be contiguous");
}

// out <- noise elements [start, start + out.numel()) of parameter `index` for `seed`. Runs on the calling thread.
void fill(at::Tensor out, int64_t seed, int64_t index, int64_t start, bool gaussian) {
  simd_level();  // a bad HF_ZO_PHILOX_SIMD raises here, before the noise loops (see simd_level)
  check_vector(out, "out");
  TORCH_CHECK(start >= 0, "start must be >= 0, got ", start);
  fill_range(out.data_ptr<float>(), static_cast<uint64_t>(seed), static_cast<uint64_t>(index), start,
             start + out.numel(), gaussian);
}

// tensors[t] <- decays[t] * tensors[t] + sum_j coeffs[t][j] * z(seeds[t][j], indices[t]), every tensor whole, in
// one pass over memory split across torch.get_num_threads() threads.
void apply(const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& indices,
           const std::vector<double>& decays, const std::vector<std::vector<int64_t>>& seeds,
           const std::vector<std::vector<double>>& coeffs, bool gaussian) {
  simd_level();  // a bad HF_ZO_PHILOX_SIMD raises here, on the calling thread, before any worker starts
  const size_t count = tensors.size();
  TORCH_CHECK(indices.size() == count && decays.size() == count && seeds.size() == count && coeffs.size() == count,
              "apply needs one index, decay, seed list and coefficient list per tensor");
  std::vector<std::vector<float>> float_coeffs(count);
  struct Item {
    size_t tensor;
    int64_t start, stop;
  };
  std::vector<Item> items;
  for (size_t t = 0; t < count; ++t) {
    check_vector(tensors[t], "every tensor");
    TORCH_CHECK(seeds[t].size() == coeffs[t].size(), "tensor ", t, " has ", seeds[t].size(), " seeds but ",
                coeffs[t].size(), " coefficients");
    for (double c : coeffs[t]) float_coeffs[t].push_back(static_cast<float>(c));
    for (int64_t start = 0; start < tensors[t].numel(); start += kGrainNumel) {
      items.push_back({t, start, std::min(tensors[t].numel(), start + kGrainNumel)});
    }
  }
  // Each thread takes the next item until none is left, so a thread that the OS pauses delays only its own item.
  // std::thread rather than at::parallel_for: its OpenMP pragmas would need this file built with torch's OpenMP.
  std::vector<float*> data(count);
  for (size_t t = 0; t < count; ++t) data[t] = tensors[t].data_ptr<float>();
  std::atomic<int64_t> next{0};
  const int64_t num_items = static_cast<int64_t>(items.size());
  // An exception must never leave a worker (std::terminate would abort the Python process): the first one is kept,
  // the remaining items are skipped, and it is rethrown on the calling thread once every worker has joined.
  std::exception_ptr error;
  std::mutex error_mutex;
  auto work = [&]() noexcept {
    try {
      for (int64_t i = next++; i < num_items; i = next++) {
        const Item& item = items[i];
        apply_range(data[item.tensor] + item.start, static_cast<uint64_t>(indices[item.tensor]), item.start,
                    item.stop, static_cast<float>(decays[item.tensor]), seeds[item.tensor].data(),
                    float_coeffs[item.tensor].data(), static_cast<int64_t>(seeds[item.tensor].size()), gaussian);
      }
    } catch (...) {
      next = num_items;
      const std::lock_guard<std::mutex> lock(error_mutex);
      if (!error) error = std::current_exception();
    }
  };
  const int64_t num_threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_items));
  std::vector<std::thread> helpers;
  helpers.reserve(static_cast<size_t>(num_threads - 1));
  for (int64_t t = 1; t < num_threads; ++t) {
    try {
      helpers.emplace_back(work);
    } catch (const std::system_error&) {
      break;  // no more threads to be had: the ones running (and this one) take the remaining items
    }
  }
  work();
  for (std::thread& helper : helpers) helper.join();
  if (error) std::rethrow_exception(error);
}

// Which code computes the noise on this CPU: "avx512", "avx2" or "portable".
std::string simd() {
  return simd_level() == Simd::kAvx512 ? "avx512" : simd_level() == Simd::kAvx2 ? "avx2" : "portable";
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Philox-4x32-10 + Box-Muller perturbation noise (hf_zo)";
  m.def("fill", &fill, "Write noise elements [start, start + out.numel()) into out",
        py::arg("out"), py::arg("seed"), py::arg("index"), py::arg("start"), py::arg("gaussian"),
        py::call_guard<py::gil_scoped_release>());
  m.def("apply", &apply, "tensors[t] <- decays[t] * tensors[t] + sum_j coeffs[t][j] * z(seeds[t][j], indices[t])",
        py::arg("tensors"), py::arg("indices"), py::arg("decays"), py::arg("seeds"), py::arg("coeffs"),
        py::arg("gaussian"), py::call_guard<py::gil_scoped_release>());
  m.def("simd", &simd, "Which code computes the noise: 'avx512', 'avx2' or 'portable' (see HF_ZO_PHILOX_SIMD)");
}
