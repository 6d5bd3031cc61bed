// Element-wise reduction kernels: dst = dst op src, one loop per (type, operator). float16 and
// bfloat16 are widened to float, combined and rounded back (round-to-nearest-even).
#include <algorithm>
#include <cstring>

#include "common.h"

namespace autopar {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32: case DType::i32: return 4;
    case DType::f64: case DType::i64: return 8;
    case DType::f16: case DType::bf16: return 2;
  }
  return 1;
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "float32";
    case DType::f64: return "float64";
    case DType::f16: return "float16";
    case DType::bf16: return "bfloat16";
    case DType::i32: return "int32";
    case DType::i64: return "int64";
  }
  return "?";
}

namespace {

float bf16_to_float(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

float f16_to_float(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {                                   // subnormal: normalise
      int e = -1;
      do { ++e; man <<= 1; } while ((man & 0x400u) == 0);
      u = sign | uint32_t(127 - 15 - e) << 23 | (man & 0x3ffu) << 13;
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | man << 13;
  } else {
    u = sign | (exp + 127 - 15) << 23 | man << 13;
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t float_to_f16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return uint16_t(sign | 0x7e00u);               // NaN
  if (abs >= 0x477ff000u) return uint16_t(sign | 0x7c00u);              // overflow -> inf
  if (abs < 0x38800000u) {                                              // subnormal or zero
    if (abs < 0x33000000u) return uint16_t(sign);
    uint32_t e = abs >> 23, man = (abs & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126 - e;                                           // 14..24
    uint32_t half = man >> shift, rest = man & ((1u << shift) - 1), mid = 1u << (shift - 1);
    if (rest > mid || (rest == mid && (half & 1u))) ++half;
    return uint16_t(sign | half);
  }
  uint32_t h = ((abs - 0x38000000u) >> 13);
  uint32_t rest = abs & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;
  return uint16_t(sign | h);
}

template <typename T, typename F>
void loop(void* dst, const void* src, size_t n, F f) {
  T* d = static_cast<T*>(dst);
  const T* s = static_cast<const T*>(src);
  for (size_t i = 0; i < n; ++i) d[i] = f(d[i], s[i]);
}

template <typename T>
T same(T x) { return x; }

// Stored type S, computed in C (C = S except for the half types, computed in float).
template <typename S, typename C = S, C (*Up)(S) = same<S>, S (*Down)(C) = same<S>>
void typed(void* dst, const void* src, size_t n, ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: loop<S>(dst, src, n, [](S a, S b) { return Down(C(Up(a) + Up(b))); }); break;
    case ReduceOp::prod: loop<S>(dst, src, n, [](S a, S b) { return Down(C(Up(a) * Up(b))); }); break;
    case ReduceOp::max: loop<S>(dst, src, n, [](S a, S b) { return Down(std::max(Up(a), Up(b))); }); break;
    case ReduceOp::min: loop<S>(dst, src, n, [](S a, S b) { return Down(std::min(Up(a), Up(b))); }); break;
  }
}

}  // namespace

void reduce_into(void* dst, const void* src, size_t n, DType t, ReduceOp op) {
  switch (t) {
    case DType::f32: typed<float>(dst, src, n, op); break;
    case DType::f64: typed<double>(dst, src, n, op); break;
    case DType::i32: typed<int32_t>(dst, src, n, op); break;
    case DType::i64: typed<int64_t>(dst, src, n, op); break;
    case DType::f16: typed<uint16_t, float, f16_to_float, float_to_f16>(dst, src, n, op); break;
    case DType::bf16: typed<uint16_t, float, bf16_to_float, float_to_bf16>(dst, src, n, op); break;
  }
}

}  // namespace autopar
