// The shared-memory transport: one segment per job (a memfd, mode 0600, never named in
// /dev/shm, so nothing outlives the job's processes), holding a header (ranks, pids, the abort
// flag) and one single-producer single-consumer ring of slots per ordered pair of ranks.
// Small messages are copied through the slots (copy-in, copy-out); large ones are read by the
// receiver straight from the sender's memory (Linux cross-memory attach, process_vm_readv:
// one copy), when every rank of the job has shown it may do so (agree_direct).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "link.h"

namespace autopar {

struct ShmHeader;

class ShmSegment {
 public:
  // Create a segment for nranks ranks (the launcher); fd() is passed to the workers.
  static std::shared_ptr<ShmSegment> create(int nranks, size_t slots, size_t slot_bytes);
  // Map a segment created by create() from an inherited descriptor (a worker).
  static std::shared_ptr<ShmSegment> attach(int fd);
  ~ShmSegment();

  int fd() const { return fd_; }
  int nranks() const;
  size_t bytes() const { return bytes_; }
  void set_pid(int rank, int pid);
  int pid(int rank) const;
  // The first failure wins: every rank's next wait raises it.
  void abort(int rank, const std::string& why);
  bool aborted() const;
  std::string abort_reason() const;
  // Called by every rank once, right after set_pid: publish a probe word, read every other
  // rank's with process_vm_readv and enable single-copy sends from this rank only when all of
  // them could read each other (waits up to timeout_s for the others). A rank that is not
  // `wanted` (the job's runtime options turned direct collectives off) publishes no probe, which
  // turns them off for every rank. Returns whether they are enabled.
  bool agree_direct(int me, double timeout_s, bool wanted);
  bool direct(int me) const;
  // Copy n bytes between this process and rank peer's memory at addr (Linux cross-memory
  // attach): read them into `to`, or write `from` there. Throws std::runtime_error when the
  // peer's memory cannot be reached (it exited, or direct access is not permitted).
  void read_peer(int peer, uint64_t addr, void* to, size_t n) const;
  void write_peer(int peer, uint64_t addr, const void* from, size_t n) const;
  // The link from rank me to rank peer; the segment must outlive it.
  std::unique_ptr<Link> link(int me, int peer);

 private:
  ShmSegment(int fd, void* base, size_t bytes) : fd_(fd), base_(base), bytes_(bytes) {}
  ShmHeader* header() const { return static_cast<ShmHeader*>(base_); }
  int fd_;
  void* base_;
  size_t bytes_;
};

}  // namespace autopar
