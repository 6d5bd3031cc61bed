// local_search's state loops: see search_state.h and
// autopar/strategies/solvers/search_state.py.
#include "search_state.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <utility>

namespace autopar {

namespace {

using Clock = std::chrono::steady_clock;

Clock::time_point deadline(double seconds) {
  return Clock::now() +
         std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

}  // namespace

SearchState::SearchState(std::vector<int64_t> sizes, std::vector<double> node_costs,
                         std::vector<int64_t> edges, std::vector<double> forward,
                         std::vector<double> backward, std::vector<int64_t> offsets,
                         std::vector<int64_t> piece_off, std::vector<int64_t> piece_start,
                         std::vector<int64_t> piece_len, std::vector<int64_t> table,
                         std::vector<int64_t> table_off, std::vector<int64_t> capacity)
    : sizes_(std::move(sizes)),
      node_costs_(std::move(node_costs)),
      forward_(std::move(forward)),
      backward_(std::move(backward)),
      piece_off_(std::move(piece_off)),
      piece_start_(std::move(piece_start)),
      piece_len_(std::move(piece_len)),
      table_(std::move(table)),
      table_off_(std::move(table_off)),
      capacity_(std::move(capacity)) {
  const int64_t n = static_cast<int64_t>(sizes_.size());
  node_off_.assign(n + 1, 0);
  int64_t widest = 1, most_pieces = 1;
  for (int64_t i = 0; i < n; ++i) {
    node_off_[i + 1] = node_off_[i] + sizes_[i];
    widest = std::max(widest, sizes_[i]);
    most_pieces = std::max(most_pieces, piece_off_[i + 1] - piece_off_[i]);
  }
  links_.resize(n);
  const int64_t m = static_cast<int64_t>(edges.size()) / 2;
  for (int64_t e = 0; e < m; ++e) {      // edge order, as the Python State sums neighbours
    const int64_t u = edges[2 * e], v = edges[2 * e + 1];
    links_[u].push_back({v, forward_.data() + offsets[e]});
    links_[v].push_back({u, backward_.data() + offsets[e]});
  }
  loc_.resize(widest);
  low_.resize(most_pieces);
}

void SearchState::load(const int64_t* choice, int64_t* slack) const {
  const int64_t steps = num_steps();
  std::vector<int64_t> delta(steps + 1, 0);
  for (int64_t x = 0; x < num_nodes(); ++x) {
    const int64_t pieces = piece_off_[x + 1] - piece_off_[x];
    const int64_t* row = table_.data() + table_off_[x] + choice[x] * pieces;
    for (int64_t p = 0; p < pieces; ++p) {
      const int64_t at = piece_start_[piece_off_[x] + p];
      delta[at] += row[p];
      delta[at + piece_len_[piece_off_[x] + p]] -= row[p];
    }
  }
  int64_t used = 0;
  for (int64_t t = 0; t < steps; ++t) {
    used += delta[t];
    slack[t] = capacity_[t] - used;
  }
}

void SearchState::consistent(const double* score, int64_t* choice) const {
  const int64_t n = num_nodes();
  std::vector<uint8_t> left(num_values()), support;
  for (int64_t i = 0; i < num_values(); ++i) left[i] = std::isfinite(node_costs_[i]);
  std::vector<int64_t> queue, todo;
  std::fill(choice, choice + n, -1);
  for (int64_t root = 0; root < n; ++root) {
    if (choice[root] != -1) continue;
    queue.assign(1, root);
    choice[root] = -2;                                      // queued
    for (size_t head = 0; head < queue.size(); ++head) {
      const int64_t x = queue[head], sx = sizes_[x];
      uint8_t* lx = left.data() + node_off_[x];
      const double* sc = score + node_off_[x];
      const bool none = std::find(lx, lx + sx, uint8_t{1}) == lx + sx;
      int64_t best = -1;
      for (int64_t s = 0; s < sx; ++s)
        if ((none || lx[s]) && (best < 0 || sc[s] < sc[best])) best = s;
      choice[x] = best;
      std::fill(lx, lx + sx, uint8_t{0});
      lx[best] = 1;
      todo.assign(1, x);
      while (!todo.empty()) {                                // spread the narrowing
        const int64_t y = todo.back();
        todo.pop_back();
        const uint8_t* ly = left.data() + node_off_[y];
        for (const Link& l : links_[y]) {
          const int64_t w = l.other, sw = sizes_[w];
          uint8_t* lw = left.data() + node_off_[w];
          support.assign(sw, 0);
          for (int64_t a = 0; a < sizes_[y]; ++a) {
            if (!ly[a]) continue;
            const double* row = l.mat + a * sw;
            for (int64_t b = 0; b < sw; ++b)
              if (std::isfinite(row[b])) support[b] = 1;
          }
          bool any = false, narrower = false;
          for (int64_t b = 0; b < sw; ++b) {
            support[b] &= lw[b];
            any |= support[b] != 0;
            narrower |= support[b] != lw[b];
          }
          if (any && narrower) {
            std::copy(support.begin(), support.end(), lw);
            todo.push_back(w);
          }
        }
      }
      for (const Link& l : links_[x])
        if (choice[l.other] == -1) {
          choice[l.other] = -2;
          queue.push_back(l.other);
        }
    }
  }
}

void SearchState::price(const double* lam, double* out) const {
  for (int64_t x = 0; x < num_nodes(); ++x) {
    const int64_t pieces = piece_off_[x + 1] - piece_off_[x];
    double* o = out + node_off_[x];
    const double* c = node_costs_.data() + node_off_[x];
    for (int64_t s = 0; s < sizes_[x]; ++s) o[s] = c[s];
    for (int64_t p = 0; p < pieces; ++p) {
      const int64_t at = piece_start_[piece_off_[x] + p];
      double sum = 0.0;
      for (int64_t t = at; t < at + piece_len_[piece_off_[x] + p]; ++t) sum += lam[t];
      const int64_t* col = table_.data() + table_off_[x] + p;
      for (int64_t s = 0; s < sizes_[x]; ++s)
        o[s] += static_cast<double>(col[s * pieces]) * sum;
    }
  }
}

void SearchState::local(int64_t x, const int64_t* choice, double* out) const {
  const int64_t sx = sizes_[x];
  const double* c = node_costs_.data() + node_off_[x];
  for (int64_t s = 0; s < sx; ++s) out[s] = c[s];
  for (const Link& l : links_[x]) {
    const int64_t sw = sizes_[l.other];
    const double* col = l.mat + choice[l.other];
    for (int64_t s = 0; s < sx; ++s) out[s] += col[s * sw];
  }
}

void SearchState::move(int64_t x, int64_t s, int64_t* choice, int64_t* slack) const {
  const int64_t old = choice[x];
  const int64_t pieces = piece_off_[x + 1] - piece_off_[x];
  const int64_t* t = table_.data() + table_off_[x];
  for (int64_t p = 0; p < pieces; ++p) {
    const int64_t diff = t[s * pieces + p] - t[old * pieces + p];
    if (diff == 0) continue;
    const int64_t at = piece_start_[piece_off_[x] + p];
    for (int64_t k = at; k < at + piece_len_[piece_off_[x] + p]; ++k) slack[k] -= diff;
  }
  choice[x] = s;
}

void SearchState::allowance(int64_t x, const int64_t* choice, const int64_t* slack) const {
  const int64_t pieces = piece_off_[x + 1] - piece_off_[x];
  const int64_t* t = table_.data() + table_off_[x] + choice[x] * pieces;
  for (int64_t p = 0; p < pieces; ++p) {
    const int64_t* lo = slack + piece_start_[piece_off_[x] + p];
    low_[p] = *std::min_element(lo, lo + piece_len_[piece_off_[x] + p]) + t[p];
  }
}

int64_t SearchState::descend(int64_t* choice, int64_t* slack, const int64_t* order,
                             int64_t count, double seconds) {
  const auto end = deadline(seconds);
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<int64_t> todo(order, order + count);
  std::vector<char> queued(num_nodes(), 0);
  for (int64_t x : todo) queued[x] = 1;
  int64_t moves = 0;
  for (size_t head = 0; head < todo.size(); ++head) {
    if (head % 256 == 0 && Clock::now() >= end) break;
    const int64_t x = todo[head];
    queued[x] = 0;
    local(x, choice, loc_.data());
    const int64_t sx = sizes_[x], cur = choice[x];
    const int64_t pieces = piece_off_[x + 1] - piece_off_[x];
    if (pieces > 0) {     // a strategy fits where its usage is within what the others leave
      const int64_t* t = table_.data() + table_off_[x];
      allowance(x, choice, slack);
      for (int64_t s = 0; s < sx; ++s)
        for (int64_t p = 0; p < pieces; ++p)
          if (t[s * pieces + p] > low_[p]) {
            loc_[s] = inf;
            break;
          }
    }
    int64_t best = 0;
    for (int64_t s = 1; s < sx; ++s)
      if (loc_[s] < loc_[best]) best = s;
    if (loc_[best] < loc_[cur]) {
      move(x, best, choice, slack);
      ++moves;
      for (const Link& l : links_[x])
        if (!queued[l.other]) {
          queued[l.other] = 1;
          todo.push_back(l.other);
        }
    }
  }
  return moves;
}

int64_t SearchState::repair(int64_t* choice, int64_t* slack, const int64_t* order,
                            int64_t count, double seconds) {
  const auto end = deadline(seconds);
  const double inf = std::numeric_limits<double>::infinity();
  const int64_t steps = num_steps();
  std::vector<int64_t> over(steps + 1, 0), excess;
  int64_t moves = 0, seen = 0;
  bool moved = true, late = false;
  while (moved && !late) {
    for (int64_t t = 0; t < steps; ++t) over[t + 1] = over[t] + (slack[t] < 0);
    if (over[steps] == 0) break;
    moved = false;
    for (int64_t i = 0; i < count; ++i) {
      if (++seen % 256 == 0 && Clock::now() >= end) {
        late = true;
        break;
      }
      const int64_t x = order[i];
      const int64_t pieces = piece_off_[x + 1] - piece_off_[x];
      if (pieces == 0) continue;
      const int64_t last = piece_off_[x + 1] - 1;
      const int64_t lo = piece_start_[piece_off_[x]], hi = piece_start_[last] + piece_len_[last];
      if (over[hi] == over[lo]) continue;       // no step of its span overflowed
      allowance(x, choice, slack);
      const int64_t sx = sizes_[x], cur = choice[x];
      const int64_t* t = table_.data() + table_off_[x];
      excess.assign(sx, 0);
      for (int64_t s = 0; s < sx; ++s)
        for (int64_t p = 0; p < pieces; ++p)
          excess[s] += std::max<int64_t>(t[s * pieces + p] - low_[p], 0);
      if (excess[cur] == 0) continue;
      local(x, choice, loc_.data());
      const bool stuck = !std::isfinite(loc_[cur]);   // in a forbidden pair: any move is free
      int64_t best = -1;
      double best_score = inf;
      for (int64_t s = 0; s < sx; ++s) {
        const int64_t gain = excess[cur] - excess[s];
        if (gain <= 0 || !std::isfinite(loc_[s])) continue;
        const double extra = stuck ? 0.0 : std::max(loc_[s] - loc_[cur], 0.0);
        const double score = (extra + 1.0) / static_cast<double>(gain);
        if (score < best_score) {
          best_score = score;
          best = s;
        }
      }
      if (best < 0) continue;
      move(x, best, choice, slack);
      ++moves;
      moved = true;
    }
  }
  return moves;
}

}  // namespace autopar
