// Types shared by the transports, the algorithms and the binding: element types, reduction
// operators and the two error types (translated to autopar.CollectiveError and
// autopar.NativeArgumentError at the binding).
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace autopar {

enum class DType : int { f32 = 0, f64 = 1, f16 = 2, bf16 = 3, i32 = 4, i64 = 5 };
enum class ReduceOp : int { sum = 0, prod = 1, max = 2, min = 3 };

size_t dtype_size(DType t);
const char* dtype_name(DType t);

// An argument that cannot work (out of range, the wrong kind, not matching the segment),
// found before it is used: the binding translates it to autopar.NativeArgumentError. The
// message names the argument and its valid range.
class ArgumentError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// A collective failed: which rank, in which operation, and why.
class CollectiveError : public std::runtime_error {
 public:
  CollectiveError(int rank, std::string op, std::string cause)
      : std::runtime_error("rank " + std::to_string(rank) + ", " + op + ": " + cause),
        rank_(rank), op_(std::move(op)), cause_(std::move(cause)) {}
  int rank() const { return rank_; }
  const std::string& op() const { return op_; }
  const std::string& cause() const { return cause_; }

 private:
  int rank_;
  std::string op_;
  std::string cause_;
};

// dst[i] = dst[i] op src[i] for n elements of type t (half types reduced in float).
void reduce_into(void* dst, const void* src, size_t n, DType t, ReduceOp op);

}  // namespace autopar
