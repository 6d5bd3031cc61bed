// Recursive halving-doubling all-reduce (Rabenseifner): reduce-scatter by recursive halving,
// all-gather by recursive doubling, log2(n) steps each. A group that is not a power of two
// first folds its first 2r ranks pairwise (r = n - 2^floor(log2 n)): even ranks hand their
// data to the odd ones and get the result back at the end.
#include <vector>

#include "algorithms.h"

namespace autopar {

void allreduce_halving_doubling(Comm& c, const Group& g, void* buf, size_t count, DType t,
                                ReduceOp op) {
  int n = g.size(), me = g.me;
  if (n < 2 || count == 0) return;
  size_t es = dtype_size(t);
  char* data = static_cast<char*>(buf);
  Reduce red{t, op};
  int p = 1;
  while (p * 2 <= n) p *= 2;
  int r = n - p;
  int vrank;                                     // position among the p active ranks, or -1
  if (me < 2 * r) {
    if (me % 2 == 0) {
      c.send(g.at(me + 1), data, count * es);
      vrank = -1;
    } else {
      std::vector<char> tmp(count * es);
      c.recv(g.at(me - 1), tmp.data(), count * es);
      reduce_into(data, tmp.data(), count, t, op);
      vrank = me / 2;
    }
  } else {
    vrank = me - r;
  }
  auto real = [&](int v) { return g.at(v < r ? 2 * v + 1 : v + r); };
  if (vrank >= 0) {
    Blocks b(count, p);
    int lo = 0, hi = p;                          // the blocks this rank still reduces
    std::vector<std::pair<int, int>> steps;      // (lo, hi) before each halving step
    for (int d = p / 2; d >= 1; d /= 2) {
      int partner = vrank ^ d, mid = lo + (hi - lo) / 2;
      bool lower = (vrank & d) == 0;
      int klo = lower ? lo : mid, khi = lower ? mid : hi;   // kept half
      int slo = lower ? mid : lo, shi = lower ? hi : mid;   // sent half
      size_t so = b.off[slo], sn = (slo < shi ? b.off[shi - 1] + b.len[shi - 1] : so) - so;
      size_t ko = b.off[klo], kn = (klo < khi ? b.off[khi - 1] + b.len[khi - 1] : ko) - ko;
      c.exchange(real(partner), data + so * es, sn * es, real(partner), data + ko * es, kn * es,
                 &red);
      steps.push_back({lo, hi});
      lo = klo, hi = khi;
    }
    for (int d = 1; d < p; d *= 2) {
      auto [plo, phi] = steps.back();
      steps.pop_back();
      int partner = vrank ^ d;
      int mid = plo + (phi - plo) / 2;
      bool lower = (vrank & d) == 0;
      int olo = lower ? mid : plo, ohi = lower ? phi : mid;  // the partner's half
      size_t mo = b.off[lo], mn = b.off[hi - 1] + b.len[hi - 1] - mo;
      size_t oo = b.off[olo], on = b.off[ohi - 1] + b.len[ohi - 1] - oo;
      c.exchange(real(partner), data + mo * es, mn * es, real(partner), data + oo * es, on * es);
      lo = plo, hi = phi;
    }
  }
  if (me < 2 * r) {
    if (me % 2 == 0)
      c.recv(g.at(me + 1), data, count * es);
    else
      c.send(g.at(me - 1), data, count * es);
  }
}

}  // namespace autopar
