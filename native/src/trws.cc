// TRW-S message passing: see trws.h and autopar/strategies/solvers/trws.py.
#include "trws.h"

#include <algorithm>
#include <limits>
#include <utility>

namespace autopar {

MessagePassing::MessagePassing(std::vector<int64_t> sizes, std::vector<int64_t> edges,
                               std::vector<double> forward, std::vector<double> backward,
                               std::vector<int64_t> offsets)
    : sizes_(std::move(sizes)),
      forward_(std::move(forward)),
      backward_(std::move(backward)) {
  const int64_t n = static_cast<int64_t>(sizes_.size());
  node_off_.assign(n + 1, 0);
  int64_t widest = 1;
  for (int64_t i = 0; i < n; ++i) {
    node_off_[i + 1] = node_off_[i] + sizes_[i];
    widest = std::max(widest, sizes_[i]);
  }
  incoming_.assign(node_off_[n], 0.0);
  before_.resize(n);
  after_.resize(n);
  const int64_t m = static_cast<int64_t>(edges.size()) / 2;
  int64_t msg = 0;
  for (int64_t e = 0; e < m; ++e) {
    const int64_t u = edges[2 * e], v = edges[2 * e + 1];
    const int64_t into_u = msg, into_v = msg + sizes_[u];
    msg += sizes_[u] + sizes_[v];
    Link at_u{v, forward_.data() + offsets[e], into_u, into_v};
    Link at_v{u, backward_.data() + offsets[e], into_v, into_u};
    if (u < v) {
      after_[u].push_back(at_u);
      before_[v].push_back(at_v);
    } else {
      before_[u].push_back(at_u);
      after_[v].push_back(at_v);
    }
  }
  messages_.assign(msg, 0.0);
  gamma_.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    const size_t most = std::max<size_t>({1, before_[i].size(), after_[i].size()});
    gamma_[i] = 1.0 / static_cast<double>(most);
  }
  h_.resize(widest);
  hg_.resize(widest);
  p_.resize(widest);
  msg_.resize(widest);
}

double MessagePassing::send(int64_t i, const double* h, const std::vector<Link>& links) {
  const int64_t si = sizes_[i];
  const double g = gamma_[i];
  for (int64_t s = 0; s < si; ++s) hg_[s] = g * h[s];
  double shifted = 0.0;
  for (const Link& l : links) {
    const int64_t sj = sizes_[l.other];
    const double* into = messages_.data() + l.into_self;
    std::fill(msg_.begin(), msg_.begin() + sj, std::numeric_limits<double>::infinity());
    for (int64_t s = 0; s < si; ++s) {
      const double a = hg_[s] - into[s];
      const double* row = l.mat + s * sj;
      for (int64_t t = 0; t < sj; ++t) msg_[t] = std::min(msg_[t], a + row[t]);
    }
    double low = msg_[0];
    for (int64_t t = 1; t < sj; ++t) low = std::min(low, msg_[t]);
    shifted += low;
    double* out = messages_.data() + l.into_other;
    double* in_j = incoming_.data() + node_off_[l.other];
    for (int64_t t = 0; t < sj; ++t) {
      const double fresh = msg_[t] - low;
      in_j[t] += fresh - out[t];
      out[t] = fresh;
    }
  }
  return shifted;
}

double MessagePassing::sweep(const double* unary, int sweeps, int64_t* choice) {
  const int64_t n = num_nodes();
  double bound = -std::numeric_limits<double>::infinity();
  for (int pass = 0; pass < sweeps; ++pass) {
    for (int64_t i = 0; i < n; ++i) {
      const int64_t si = sizes_[i];
      const double* u = unary + node_off_[i];
      const double* in = incoming_.data() + node_off_[i];
      for (int64_t s = 0; s < si; ++s) p_[s] = h_[s] = u[s] + in[s];
      for (const Link& l : before_[i]) {
        const int64_t sj = sizes_[l.other];
        const int64_t xj = choice[l.other];
        const double* into = messages_.data() + l.into_self;
        for (int64_t s = 0; s < si; ++s) p_[s] += l.mat[s * sj + xj] - into[s];
      }
      int64_t best = 0;
      for (int64_t s = 1; s < si; ++s)
        if (p_[s] < p_[best]) best = s;
      choice[i] = best;
      send(i, h_.data(), after_[i]);
    }
    bound = 0.0;
    for (int64_t i = n - 1; i >= 0; --i) {
      const int64_t si = sizes_[i];
      const double* u = unary + node_off_[i];
      const double* in = incoming_.data() + node_off_[i];
      double low = std::numeric_limits<double>::infinity();
      for (int64_t s = 0; s < si; ++s) {
        h_[s] = u[s] + in[s];
        low = std::min(low, h_[s]);
      }
      for (int64_t s = 0; s < si; ++s) h_[s] -= low;
      bound += low + send(i, h_.data(), before_[i]);
    }
  }
  return bound;
}

}  // namespace autopar
