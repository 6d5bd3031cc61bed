// The hosts of a group, for the two-level (2D) algorithms.
#include <map>

#include "algorithms.h"

namespace autopar {

std::vector<std::vector<int>> host_groups(const Comm& c, const Group& g) {
  std::vector<std::vector<int>> hosts;          // group positions per host
  std::map<int, size_t> index;
  for (int i = 0; i < g.size(); ++i) {
    int h = c.host_of(g.ranks[i]);
    if (!index.count(h)) index[h] = hosts.size(), hosts.emplace_back();
    hosts[index[h]].push_back(i);
  }
  for (const auto& h : hosts)
    if (h.size() != hosts[0].size()) return {};
  return hosts;
}

Group intra_group(const Group& g, const std::vector<std::vector<int>>& hosts) {
  for (const auto& h : hosts)
    for (size_t l = 0; l < h.size(); ++l)
      if (h[l] == g.me) {
        Group out{{}, int(l)};
        for (int i : h) out.ranks.push_back(g.ranks[i]);
        return out;
      }
  return {{g.ranks[g.me]}, 0};
}

Group inter_group(const Group& g, const std::vector<std::vector<int>>& hosts) {
  Group out{{}, 0};
  for (size_t hi = 0; hi < hosts.size(); ++hi)
    for (size_t l = 0; l < hosts[hi].size(); ++l)
      if (hosts[hi][l] == g.me) {
        out.me = int(hi);
        for (const auto& h : hosts) out.ranks.push_back(g.ranks[h[l]]);
      }
  return out;
}

bool two_levels(const Comm& c, const Group& g, Group* intra, Group* inter) {
  auto hosts = host_groups(c, g);
  if (hosts.size() < 2 || hosts[0].size() < 2) return false;
  *intra = intra_group(g, hosts);
  *inter = inter_group(g, hosts);
  return true;
}

}  // namespace autopar
