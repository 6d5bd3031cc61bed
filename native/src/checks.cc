// Argument checks (see checks.h).
#include "checks.h"

#include <arpa/inet.h>
#include <fcntl.h>

#include <cmath>
#include <sstream>

namespace autopar {

namespace {

[[noreturn]] void bad(const std::string& m) { throw ArgumentError(m); }

bool ipv4(const std::string& host) {
  in_addr a;
  return host.find('\0') == std::string::npos && inet_pton(AF_INET, host.c_str(), &a) == 1;
}

}  // namespace

void check_comm(int rank, int size, int fd, const std::vector<int>& hosts, double timeout) {
  if (size < 1 || size > kMaxTcpRanks)
    bad("Comm: size=" + std::to_string(size) + " must be in [1, " + std::to_string(kMaxTcpRanks) +
        "] (the job's rank count)");
  if (rank < 0 || rank >= size)
    bad("Comm: rank=" + std::to_string(rank) + " must be in [0, size) = [0, " +
        std::to_string(size) + ")");
  if (fd < -1)
    bad("Comm: fd=" + std::to_string(fd) + " must be -1 (no shared memory) or the descriptor of "
        "the job's segment (Segment.fd)");
  if (fd >= 0 && fcntl(fd, F_GETFD) == -1)
    bad("Comm: fd=" + std::to_string(fd) + " is not an open descriptor; pass the job's Segment.fd "
        "(inherited by the worker) or -1");
  if (!hosts.empty() && int(hosts.size()) != size)
    bad("Comm: hosts names " + std::to_string(hosts.size()) + " ranks' hosts; it must name all " +
        std::to_string(size) + " (hosts[r] = rank r's host id) or be empty (one host)");
  for (size_t r = 0; r < hosts.size(); ++r)
    if (hosts[r] < 0)
      bad("Comm: hosts[" + std::to_string(r) + "]=" + std::to_string(hosts[r]) +
          " must be a host id >= 0");
  if (!std::isfinite(timeout) || timeout <= 0 || timeout > kMaxTimeout) {
    std::ostringstream m;
    m << "Comm: timeout=" << timeout << " must be a finite number of seconds in (0, "
      << kMaxTimeout << "]";
    bad(m.str());
  }
}

Group check_group(const std::vector<int>& ranks, int me, int size, const std::string& op) {
  if (ranks.empty()) bad(op + ": ranks is empty; it must list the group's ranks, this one included");
  std::vector<char> seen(size_t(size), 0);
  int pos = -1;
  for (size_t i = 0; i < ranks.size(); ++i) {
    int r = ranks[i];
    if (r < 0 || r >= size)
      bad(op + ": ranks[" + std::to_string(i) + "]=" + std::to_string(r) + " is outside [0, " +
          std::to_string(size) + ") (the job's ranks)");
    if (seen[size_t(r)]) bad(op + ": rank " + std::to_string(r) + " appears twice in ranks");
    seen[size_t(r)] = 1;
    if (r == me) pos = int(i);
  }
  if (pos < 0)
    bad(op + ": rank " + std::to_string(me) + " (this one) is not in ranks; only the group's "
        "members call its collectives");
  return Group{ranks, pos};
}

void check_peer(int peer, int me, int size, const std::string& op) {
  if (peer < 0 || peer >= size || peer == me)
    bad(op + ": peer=" + std::to_string(peer) + " must be another rank in [0, " +
        std::to_string(size) + "), not this one (" + std::to_string(me) + ")");
}

void check_root(int root, int group_size, const std::string& op) {
  if (root < 0 || root >= group_size)
    bad(op + ": root=" + std::to_string(root) + " must be a position in the group, in [0, " +
        std::to_string(group_size) + ")");
}

int check_tcp(const std::string& rendezvous, const std::string& token, const std::string& host) {
  if (token.empty() || token.size() > 63 || token.find('\0') != std::string::npos)
    bad("connect_tcp: the job token must have 1 to 63 characters and no NUL, not " +
        std::to_string(token.size()));
  size_t colon = rendezvous.rfind(':');
  std::string rhost = colon == std::string::npos ? rendezvous : rendezvous.substr(0, colon);
  std::string port = colon == std::string::npos ? "" : rendezvous.substr(colon + 1);
  bool digits = !port.empty() && port.size() <= 5 &&
                port.find_first_not_of("0123456789") == std::string::npos;
  int p = digits ? std::stoi(port) : 0;
  if (!ipv4(rhost) || p < 1 || p > 65535)
    bad("connect_tcp: rendezvous='" + rendezvous + "' must be an IPv4 address and a port in "
        "[1, 65535], as in '127.0.0.1:29500'");
  if (!ipv4(host)) bad("connect_tcp: host='" + host + "' must be this rank's IPv4 address");
  return p;
}

}  // namespace autopar
