// Shared-memory segment and its links (see shm.h). A channel from rank i to rank j is a ring
// of `slots` slots of `slot_bytes` each; the producer fills slot tail % slots and publishes
// tail + 1 (release), the consumer reads slot head % slots and publishes head + 1. The copy
// into and out of a slot is the transport's cost (copy-in/copy-out); a reduction reads the
// slot directly, so recv-reduce pays one copy.
#include "shm.h"

#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>

namespace autopar {

namespace {
constexpr uint64_t kMagic = 0x6175746f70617231ull;  // "autopar1"
constexpr size_t kLine = 64;
constexpr int kMaxRanks = 256;

size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }
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
};

struct ChannelHead {
  alignas(kLine) std::atomic<uint64_t> head;   // consumer position
  alignas(kLine) std::atomic<uint64_t> tail;   // producer position
  alignas(kLine) uint64_t sizes[1];            // `slots` entries follow
};

namespace {

size_t channel_bytes(size_t slots, size_t slot_bytes) {
  return round_up(sizeof(ChannelHead) + slots * sizeof(uint64_t), 4096) + slots * slot_bytes;
}

class ShmLink : public Link {
 public:
  ShmLink(ChannelHead* out, ChannelHead* in, size_t slots, size_t slot_bytes)
      : out_(out), in_(in), slots_(slots), slot_bytes_(slot_bytes) {}

  size_t send_some(const char* p, size_t n) override {
    size_t taken = 0;
    uint64_t tail = out_->tail.load(std::memory_order_relaxed);
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

  size_t recv_some(size_t n, size_t align,
                   const std::function<void(const char*, size_t)>& consume) override {
    size_t got = 0;
    uint64_t head = in_->head.load(std::memory_order_relaxed);
    while (n > 0 && head < in_->tail.load(std::memory_order_acquire)) {
      size_t s = head % slots_;
      size_t avail = in_->sizes[s] - offset_;
      size_t k = std::min(n, avail);
      if (k < n && k % align) k -= k % align;   // producers send whole elements; defensive
      if (k == 0) break;
      consume(data(in_) + s * slot_bytes_ + offset_, k);
      offset_ += k, n -= k, got += k;
      if (offset_ == in_->sizes[s]) {
        offset_ = 0;
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
  ChannelHead* out_;
  ChannelHead* in_;
  size_t slots_, slot_bytes_;
  size_t offset_ = 0;                 // bytes already consumed from the current input slot
};

}  // namespace

std::shared_ptr<ShmSegment> ShmSegment::create(int nranks, size_t slots, size_t slot_bytes) {
  if (nranks < 1 || nranks > kMaxRanks) throw std::invalid_argument("nranks out of range");
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
  ShmHeader probe;
  if (pread(fd, &probe, sizeof(probe), 0) != ssize_t(sizeof(probe)) || probe.magic != kMagic)
    throw std::runtime_error("descriptor " + std::to_string(fd) + " is not an autopar segment");
  size_t total = probe.total_bytes;
  void* base = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) throw std::runtime_error(std::string("mmap: ") + std::strerror(errno));
  return std::shared_ptr<ShmSegment>(new ShmSegment(dup(fd), base, total));
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

std::unique_ptr<Link> ShmSegment::link(int me, int peer) {
  ShmHeader* h = header();
  auto channel = [&](int from, int to) {
    return reinterpret_cast<ChannelHead*>(static_cast<char*>(base_) + h->channels_offset +
                                          (size_t(from) * h->nranks + to) * h->channel_bytes);
  };
  return std::make_unique<ShmLink>(channel(me, peer), channel(peer, me), h->slots, h->slot_bytes);
}

}  // namespace autopar
