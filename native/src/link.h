// A Link is one direction-pair of byte streams between this rank and one peer: the transports
// (shared memory inside a host, TCP between hosts) implement it, and Comm's verbs drive every
// open Link from one progress loop. Both calls never block.
#pragma once

#include <cstddef>
#include <functional>
#include <string>

namespace autopar {

class Link {
 public:
  virtual ~Link() = default;
  // Accept up to n bytes from p for the peer; returns how many were taken (0: full for now).
  virtual size_t send_some(const char* p, size_t n) = 0;
  // Hand received bytes to consume(data, len): at most n in all, in pieces that are multiples
  // of align unless they end the n; returns how many were consumed (0: nothing yet). When
  // `direct` is given the caller copies the bytes to direct[0..n): the link may write them
  // there itself and pass data == direct, so consume must not copy then.
  // Throws std::runtime_error when the peer is gone.
  virtual size_t recv_some(size_t n, size_t align, char* direct,
                           const std::function<void(const char*, size_t)>& consume) = 0;
  virtual std::string kind() const = 0;
};

}  // namespace autopar
