// Shared-memory segment and its links (see shm.h). A channel from rank i to rank j is a ring
// of `slots` slots of `slot_bytes` each; the producer fills slot tail % slots and publishes
// tail + 1 (release), the consumer reads slot head % slots and publishes head + 1. The copy
// into and out of a slot is the transport's cost (copy-in/copy-out); a reduction reads the
// slot directly, so recv-reduce pays one copy.
//
// A send of kDirectMin bytes or more, once direct sends are agreed, fills one slot with a
// descriptor (the sender's address and length, flagged in the slot's size) instead: the
// receiver reads the bytes from the sender's memory with process_vm_readv, into the
// destination itself (a plain receive: one copy in all) or into a small cache-resident bounce
// buffer it reduces from, and then counts the descriptor done; the send completes only then,
// so the sender's buffer stays untouched while it is read.
#include "shm.h"

#include "common.h"

#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <thread>
#include <vector>

namespace autopar {

namespace {
constexpr uint64_t kMagic = 0x6175746f70617231ull;  // "autopar1"
constexpr size_t kLine = 64;
constexpr int kMaxRanks = 256;
constexpr size_t kMaxSlots = 4096;                  // slots per channel
constexpr size_t kMaxSlotBytes = size_t(64) << 20;  // bytes per slot
constexpr uint64_t kDirect = 1ull << 63;            // a slot size flag: the slot is a descriptor
constexpr size_t kDirectMin = 1 << 20;              // sends this large go single-copy
constexpr size_t kPiece = 128 << 10;                // bytes read per call for a reduction
constexpr size_t kCopyPiece = 1 << 20;              // bytes read per call into the destination

size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

// Copy n bytes between local memory and process pid's memory at remote: process_vm_readv, or
// process_vm_writev when `write`, repeated until every byte moved.
void cross_copy(int pid, char* local, uint64_t remote, size_t n, bool write) {
  while (n > 0) {
    iovec here{local, n}, there{reinterpret_cast<void*>(remote), n};
    ssize_t r = write ? process_vm_writev(pid, &here, 1, &there, 1, 0)
                      : process_vm_readv(pid, &here, 1, &there, 1, 0);
    if (r <= 0)
      throw std::runtime_error(std::string(write ? "writing to" : "reading") +
                               " the peer's memory failed (" +
                               (r < 0 ? std::strerror(errno) : "no bytes") + ")");
    local += r, remote += uint64_t(r), n -= size_t(r);
  }
}
}  // namespace

struct ShmHeader {
  uint64_t magic;
  uint64_t total_bytes;
  int32_t nranks;
  uint32_t pad0;
  uint64_t slots;
  uint64_t slot_bytes;
  uint64_t channel_bytes;
  uint64_t channels_offset;
  alignas(kLine) std::atomic<int32_t> abort_flag;
  int32_t abort_rank;
  char abort_msg[512];
  int32_t pids[kMaxRanks];
  std::atomic<uint64_t> probe_addr[kMaxRanks];     // agree_direct: where each rank's probe is
  std::atomic<int32_t> probe_result[kMaxRanks];    // 0 pending, 3 read every peer, then
                                                   // 1 direct sends on, 2 off
};

struct Descriptor {
  uint64_t addr, len;
};

struct ChannelHead {
  alignas(kLine) std::atomic<uint64_t> head;   // consumer position
  alignas(kLine) std::atomic<uint64_t> tail;   // producer position
  alignas(kLine) std::atomic<uint64_t> direct_done;  // descriptors the consumer finished
  alignas(kLine) uint64_t sizes[1];            // `slots` entries follow
};

namespace {

size_t channel_bytes(size_t slots, size_t slot_bytes) {
  return round_up(sizeof(ChannelHead) + slots * sizeof(uint64_t), 4096) + slots * slot_bytes;
}

class ShmLink : public Link {
 public:
  ShmLink(ChannelHead* out, ChannelHead* in, size_t slots, size_t slot_bytes,
          const std::atomic<int32_t>* direct, const int32_t* peer_pid)
      : out_(out), in_(in), slots_(slots), slot_bytes_(slot_bytes), direct_(direct),
        peer_pid_(peer_pid) {}

  size_t send_some(const char* p, size_t n) override {
    if (posted_) {                    // a descriptor of p is out: done once the peer read it
      if (out_->direct_done.load(std::memory_order_acquire) < posted_) return 0;
      posted_ = 0;
      return posted_len_;
    }
    size_t taken = 0;
    uint64_t tail = out_->tail.load(std::memory_order_relaxed);
    if (n >= kDirectMin && direct_->load(std::memory_order_relaxed) == 1) {
      if (tail - out_->head.load(std::memory_order_acquire) >= slots_) return 0;
      size_t s = tail % slots_;
      Descriptor d{reinterpret_cast<uint64_t>(p), n};
      std::memcpy(data(out_) + s * slot_bytes_, &d, sizeof d);
      out_->sizes[s] = kDirect | n;
      out_->tail.store(++tail, std::memory_order_release);
      posted_ = ++descriptors_, posted_len_ = n;
      return 0;
    }
    while (n > 0 && tail - out_->head.load(std::memory_order_acquire) < slots_) {
      size_t k = std::min(n, slot_bytes_);
      size_t s = tail % slots_;
      std::memcpy(data(out_) + s * slot_bytes_, p, k);
      out_->sizes[s] = k;
      out_->tail.store(++tail, std::memory_order_release);
      p += k, n -= k, taken += k;
    }
    return taken;
  }

  size_t recv_some(size_t n, size_t align, char* direct,
                   const std::function<void(const char*, size_t)>& consume) override {
    size_t got = 0;
    uint64_t head = in_->head.load(std::memory_order_relaxed);
    while (n > 0 && head < in_->tail.load(std::memory_order_acquire)) {
      size_t s = head % slots_;
      uint64_t size = in_->sizes[s];
      const char* slot = data(in_) + s * slot_bytes_;
      size_t k;
      if (size & kDirect) {
        Descriptor d;
        std::memcpy(&d, slot, sizeof d);
        k = std::min<size_t>(n, std::min(d.len - offset_, direct ? kCopyPiece : kPiece));
        if (k < n && k % align) k -= k % align;
        if (k == 0) break;
        char* to = direct ? direct + got : bounce(k);
        read_remote(to, d.addr + offset_, k);
        consume(to, k);
        size &= ~kDirect;
      } else {
        k = std::min<size_t>(n, size - offset_);
        if (k < n && k % align) k -= k % align;   // producers send whole elements; defensive
        if (k == 0) break;
        consume(slot + offset_, k);
      }
      offset_ += k, n -= k, got += k;
      if (offset_ == size) {
        offset_ = 0;
        if (in_->sizes[s] & kDirect)
          in_->direct_done.store(in_->direct_done.load(std::memory_order_relaxed) + 1,
                                 std::memory_order_release);
        in_->head.store(++head, std::memory_order_release);
      }
    }
    return got;
  }

  std::string kind() const override { return "shm"; }

 private:
  char* data(ChannelHead* c) const {
    return reinterpret_cast<char*>(c) + round_up(sizeof(ChannelHead) + slots_ * sizeof(uint64_t), 4096);
  }
  static char* bounce(size_t k) {
    thread_local std::vector<char> buf;
    if (buf.size() < k) buf.resize(k);
    return buf.data();
  }
  void read_remote(char* to, uint64_t from, size_t k) const { cross_copy(*peer_pid_, to, from, k, false); }
  ChannelHead* out_;
  ChannelHead* in_;
  size_t slots_, slot_bytes_;
  const std::atomic<int32_t>* direct_;  // this rank's agreement: 1 when direct sends are on
  const int32_t* peer_pid_;
  size_t offset_ = 0;                 // bytes already consumed from the current input slot
  uint64_t descriptors_ = 0;          // descriptors posted so far
  uint64_t posted_ = 0;               // the number of the one awaiting the peer, 0: none
  size_t posted_len_ = 0;
};

}  // namespace

std::shared_ptr<ShmSegment> ShmSegment::create(int nranks, size_t slots, size_t slot_bytes) {
  if (nranks < 1 || nranks > kMaxRanks)
    throw ArgumentError("Segment.create: nranks=" + std::to_string(nranks) + " must be in [1, " +
                        std::to_string(kMaxRanks) + "]");
  if (slots < 1 || slots > kMaxSlots)
    throw ArgumentError("Segment.create: slots=" + std::to_string(slots) + " must be in [1, " +
                        std::to_string(kMaxSlots) + "]");
  if (slot_bytes < 1 || slot_bytes > kMaxSlotBytes)
    throw ArgumentError("Segment.create: slot_bytes=" + std::to_string(slot_bytes) +
                        " must be in [1, " + std::to_string(kMaxSlotBytes) + "]");
  slot_bytes = round_up(std::max<size_t>(slot_bytes, 4096), 64);
  size_t cb = channel_bytes(slots, slot_bytes);
  size_t off = round_up(sizeof(ShmHeader), 4096);
  size_t total = off + size_t(nranks) * size_t(nranks) * cb;
  int fd = memfd_create("autopar", MFD_CLOEXEC);
  if (fd < 0) throw std::runtime_error(std::string("memfd_create: ") + std::strerror(errno));
  if (ftruncate(fd, off_t(total)) != 0) {
    int e = errno;
    close(fd);
    throw std::runtime_error(std::string("ftruncate: ") + std::strerror(e));
  }
  fchmod(fd, 0600);
  void* base = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) {
    int e = errno;
    close(fd);
    throw std::runtime_error(std::string("mmap: ") + std::strerror(e));
  }
  auto* h = new (base) ShmHeader();
  h->total_bytes = total;
  h->nranks = nranks;
  h->slots = slots;
  h->slot_bytes = slot_bytes;
  h->channel_bytes = cb;
  h->channels_offset = off;
  h->abort_flag.store(0);
  h->magic = kMagic;
  return std::shared_ptr<ShmSegment>(new ShmSegment(fd, base, total));
}

std::shared_ptr<ShmSegment> ShmSegment::attach(int fd) {
  // the header is checked field by field against create()'s arithmetic and the file's size
  // before anything is mapped: links built from it stay inside the mapping
  auto refuse = [fd](const std::string& why) {
    return ArgumentError("Comm: fd=" + std::to_string(fd) + " is not an autopar segment (" + why +
                         "); pass the job's Segment.fd or -1");
  };
  ShmHeader probe;
  struct stat st;
  if (fstat(fd, &st) != 0) throw refuse(std::strerror(errno));
  if (pread(fd, &probe, sizeof(probe), 0) != ssize_t(sizeof(probe)) || probe.magic != kMagic)
    throw refuse("no segment header");
  size_t n = size_t(probe.nranks), off = round_up(sizeof(ShmHeader), 4096);
  bool fits = probe.nranks >= 1 && probe.nranks <= kMaxRanks && probe.slots >= 1 &&
              probe.slots <= kMaxSlots && probe.slot_bytes >= 4096 &&
              probe.slot_bytes <= round_up(kMaxSlotBytes, 4096) && probe.slot_bytes % 64 == 0;
  if (!fits || probe.channel_bytes != channel_bytes(probe.slots, probe.slot_bytes) ||
      probe.channels_offset != off || probe.total_bytes != off + n * n * probe.channel_bytes)
    throw refuse("its header's sizes do not add up");
  if (uint64_t(st.st_size) < probe.total_bytes) throw refuse("the file is shorter than its header says");
  size_t total = probe.total_bytes;
  void* base = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) throw std::runtime_error(std::string("mmap: ") + std::strerror(errno));
  int own = dup(fd);
  if (own < 0) {
    int e = errno;
    munmap(base, total);
    throw std::runtime_error(std::string("dup: ") + std::strerror(e));
  }
  return std::shared_ptr<ShmSegment>(new ShmSegment(own, base, total));
}

ShmSegment::~ShmSegment() {
  munmap(base_, bytes_);
  close(fd_);
}

int ShmSegment::nranks() const { return header()->nranks; }
void ShmSegment::set_pid(int rank, int pid) { header()->pids[rank] = pid; }
int ShmSegment::pid(int rank) const { return header()->pids[rank]; }

void ShmSegment::abort(int rank, const std::string& why) {
  int expected = 0;
  ShmHeader* h = header();
  if (h->abort_flag.compare_exchange_strong(expected, 1)) {
    h->abort_rank = rank;
    size_t k = std::min(why.size(), sizeof(h->abort_msg) - 1);
    std::memcpy(h->abort_msg, why.data(), k);
    h->abort_msg[k] = 0;
    h->abort_flag.store(2, std::memory_order_release);
  }
}

bool ShmSegment::aborted() const { return header()->abort_flag.load(std::memory_order_acquire) != 0; }

std::string ShmSegment::abort_reason() const {
  const ShmHeader* h = header();
  for (int i = 0; i < 1000 && h->abort_flag.load(std::memory_order_acquire) == 1; ++i) usleep(100);
  return h->abort_rank >= 0 ? std::string(h->abort_msg) : std::string("aborted");
}

bool ShmSegment::agree_direct(int me, double timeout_s, bool wanted) {
  static uint64_t probe;                 // lives as long as the process
  ShmHeader* h = header();
  int n = h->nranks;
  probe = kMagic ^ uint64_t(uint32_t(getpid()));
  h->probe_addr[me].store(wanted ? reinterpret_cast<uint64_t>(&probe) : 0, std::memory_order_release);
  // 1. read every peer's probe word once it is published
  auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  bool ok = wanted;
  for (int p = 0; p < n && ok; ++p) {
    if (p == me) continue;
    uint64_t addr;
    while ((addr = h->probe_addr[p].load(std::memory_order_acquire)) == 0 &&
           h->probe_result[p].load(std::memory_order_acquire) == 0 && !aborted() &&
           std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    uint64_t got = 0;
    iovec local{&got, sizeof got}, remote{reinterpret_cast<void*>(addr), sizeof got};
    ok = addr != 0 && process_vm_readv(h->pids[p], &local, 1, &remote, 1, 0) == ssize_t(sizeof got) &&
         got == (kMagic ^ uint64_t(uint32_t(h->pids[p])));
  }
  // 2. send single-copy only when every rank read every other (a rank that is late or failed
  // leaves this one on the slots; receiving descriptors works either way)
  int32_t mine = ok ? 1 : 2;
  h->probe_result[me].store(mine == 1 ? 3 : 2, std::memory_order_release);   // 3: read all, deciding
  bool all = ok;
  for (int p = 0; p < n && all; ++p) {
    int32_t r;
    while ((r = h->probe_result[p].load(std::memory_order_acquire)) == 0 && !aborted() &&
           std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    all = r == 1 || r == 3;
  }
  h->probe_result[me].store(all ? 1 : 2, std::memory_order_release);
  return all;
}

bool ShmSegment::direct(int me) const {
  return header()->probe_result[me].load(std::memory_order_acquire) == 1;
}

void ShmSegment::read_peer(int peer, uint64_t addr, void* to, size_t n) const {
  cross_copy(pid(peer), static_cast<char*>(to), addr, n, false);
}

void ShmSegment::write_peer(int peer, uint64_t addr, const void* from, size_t n) const {
  cross_copy(pid(peer), static_cast<char*>(const_cast<void*>(from)), addr, n, true);
}

std::unique_ptr<Link> ShmSegment::link(int me, int peer) {
  ShmHeader* h = header();
  auto channel = [&](int from, int to) {
    return reinterpret_cast<ChannelHead*>(static_cast<char*>(base_) + h->channels_offset +
                                          (size_t(from) * h->nranks + to) * h->channel_bytes);
  };
  return std::make_unique<ShmLink>(channel(me, peer), channel(peer, me), h->slots, h->slot_bytes,
                                   &h->probe_result[me], &h->pids[peer]);
}

}  // namespace autopar
