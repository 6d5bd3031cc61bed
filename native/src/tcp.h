// The TCP transport between hosts: a rendezvous at rank 0 that admits only connections
// presenting the job's token, then one connection (or several) per pair of ranks that no shared memory
// joins (ranks on different hosts, or every pair when the job has no segment).
#pragma once

#include <string>

#include "comm.h"

namespace autopar {

// rendezvous: "host:port" where rank 0 listens; host: the address this rank listens on;
// streams: connections per pair of ranks (the same on every rank), several carrying one
// stream in chunks (tcp.cc: MultiTcpLink).
void connect_tcp_links(Comm& comm, const std::string& rendezvous, const std::string& token,
                       const std::string& host, int streams = 1);

}  // namespace autopar
