// Argument checks at the binding's entry points: the numbers and lists a Python caller passes
// (ranks, sizes, descriptors, hosts, timeouts, groups, peers, roots, addresses, tokens), each
// checked before any C++ code uses it. A bad one throws ArgumentError (autopar's
// NativeArgumentError) naming the argument, the value and the valid range. Array checks need
// numpy and live in binding.cc.
#pragma once

#include <string>
#include <vector>

#include "comm.h"

namespace autopar {

constexpr int kMaxTcpRanks = 65536;    // ranks of a Comm without a segment (TCP links only)
constexpr double kMaxTimeout = 1e9;    // seconds; larger ones overflow the clocks' arithmetic

// Comm(rank, size, fd, hosts, timeout): size in [1, kMaxTcpRanks], rank in [0, size), fd -1 (no
// segment) or an open descriptor, hosts empty or one non-negative id per rank, timeout finite
// in (0, kMaxTimeout]. The segment's own checks (ShmSegment::attach, its rank count) follow.
void check_comm(int rank, int size, int fd, const std::vector<int>& hosts, double timeout);
// The group `ranks` of a collective on rank me of size ranks: non-empty, each in [0, size),
// no rank twice, me among them. Returns it with me's position.
Group check_group(const std::vector<int>& ranks, int me, int size, const std::string& op);
// A point-to-point peer: in [0, size) and not me.
void check_peer(int peer, int me, int size, const std::string& op);
// A root given as a group position: in [0, group_size).
void check_root(int root, int group_size, const std::string& op);
// connect_tcp's arguments: rendezvous "a.b.c.d:port" (port 1-65535), a token of 1 to 63
// characters without NUL, this rank's IPv4 address. Returns the rendezvous port.
int check_tcp(const std::string& rendezvous, const std::string& token, const std::string& host);

}  // namespace autopar
