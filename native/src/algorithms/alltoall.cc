// Pairwise all-to-all: n - 1 steps; in step s rank i sends its block for i + s and receives
// the block of i - s, so every link carries one block per step.
#include <cstring>

#include "algorithms.h"

namespace autopar {

void alltoall_pairwise(Comm& c, const Group& g, const void* in, void* out, size_t count, size_t es) {
  int n = g.size(), me = g.me;
  size_t bytes = count * es;
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  std::memcpy(dst + size_t(me) * bytes, src + size_t(me) * bytes, bytes);
  for (int s = 1; s < n && bytes; ++s) {
    int to = (me + s) % n, from = ((me - s) % n + n) % n;
    c.exchange(g.at(to), src + size_t(to) * bytes, bytes, g.at(from), dst + size_t(from) * bytes,
               bytes);
  }
}

}  // namespace autopar
