// Pipelined chain broadcast: root -> root + 1 -> ... -> root + n - 1, every inner rank
// forwarding each piece as it arrives (recv-copy-send), so the time is about one message
// transfer plus n - 1 pieces.
#include "algorithms.h"

namespace autopar {

void broadcast_chain(Comm& c, const Group& g, void* buf, size_t bytes, int root) {
  int n = g.size(), pos = ((g.me - root) % n + n) % n;
  if (n < 2 || bytes == 0) return;
  if (pos == 0)
    c.send(g.at(g.me + 1), buf, bytes);
  else if (pos == n - 1)
    c.recv(g.at(g.me - 1), buf, bytes);
  else
    c.recv_copy_send(g.at(g.me - 1), {g.at(g.me + 1)}, buf, bytes);
}

}  // namespace autopar
