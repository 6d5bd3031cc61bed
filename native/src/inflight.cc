// inflight.h: a communicator's own thread for the collectives a step starts and later awaits.
#include "inflight.h"

#include <cstring>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "common.h"

namespace autopar {

Inflight::~Inflight() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

int64_t Inflight::start(const void* from, size_t bytes, std::function<void(void*)> job) {
  auto j = std::make_shared<Job>();
  j->fn = std::move(job);
  j->bytes = bytes;
  size_t rounded = (bytes + 63) / 64 * 64;
  j->buf.reset(std::aligned_alloc(64, rounded ? rounded : 64));
  if (!j->buf) throw std::bad_alloc();
  if (bytes) std::memcpy(j->buf.get(), from, bytes);
  int64_t id;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!thread_.joinable()) thread_ = std::thread([this] { loop(); });
    id = next_++;
    jobs_[id] = j;
    queue_.push_back(j);
  }
  cv_.notify_all();
  return id;
}

void Inflight::wait(int64_t id, void* to, size_t bytes) {
  std::shared_ptr<Job> j;
  {
    std::unique_lock<std::mutex> lock(mu_);
    auto it = jobs_.find(id);
    if (it == jobs_.end())
      throw ArgumentError("all_reduce_done: no started all-reduce has id " + std::to_string(id) +
                          " (each all_reduce_start's id is awaited once, on the rank that "
                          "started it)");
    j = it->second;
    cv_.wait(lock, [&] { return j->done; });
    jobs_.erase(it);
  }
  if (j->error) std::rethrow_exception(j->error);
  if (bytes != j->bytes)
    throw ArgumentError("all_reduce_done: the output has " + std::to_string(bytes) +
                        " bytes, the started all-reduce " + std::to_string(j->bytes));
  if (bytes) std::memcpy(to, j->buf.get(), bytes);
}

void Inflight::drain() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return queue_.empty() && !running_; });
}

void Inflight::settle() {
  std::exception_ptr first;
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return queue_.empty() && !running_; });
    for (auto& kv : jobs_)
      if (!first && kv.second->error) first = kv.second->error;
    jobs_.clear();
  }
  if (first) std::rethrow_exception(first);
}

size_t Inflight::pending() {
  std::lock_guard<std::mutex> lock(mu_);
  return jobs_.size();
}

void Inflight::loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;                // stopping, nothing left to run
    std::shared_ptr<Job> j = queue_.front();
    queue_.pop_front();
    running_ = true;
    lock.unlock();
    try {
      j->fn(j->buf.get());
    } catch (...) {
      j->error = std::current_exception();
    }
    j->fn = nullptr;
    lock.lock();
    j->done = true;
    running_ = false;
    cv_.notify_all();
  }
}

namespace {
using Lanes = std::map<std::pair<Comm*, int>, std::unique_ptr<Inflight>>;
std::mutex registry_mu;
Lanes& registry() {
  static Lanes m;
  return m;
}
// c's lanes from `first` on, in lane order (the registry is sorted by communicator, then lane).
template <typename F>
void each_lane(Comm* c, int first, F f) {
  for (auto it = registry().lower_bound({c, first}); it != registry().end() && it->first.first == c;
       ++it)
    f(it);
}
}  // namespace

Inflight& inflight_of(Comm& c, int lane) {
  std::lock_guard<std::mutex> lock(registry_mu);
  auto& slot = registry()[{&c, lane}];
  if (!slot) slot = std::make_unique<Inflight>();
  return *slot;
}

void settle_sends(Comm& c) {
  std::vector<Inflight*> lanes;
  {
    std::lock_guard<std::mutex> lock(registry_mu);
    each_lane(&c, 1, [&](Lanes::iterator it) { lanes.push_back(it->second.get()); });
  }
  for (Inflight* l : lanes) l->settle();       // lanes live until c is unregistered
}

void forget_inflight(Comm* c) {
  std::vector<std::unique_ptr<Inflight>> gone;
  {
    std::lock_guard<std::mutex> lock(registry_mu);
    std::vector<Lanes::iterator> mine;
    each_lane(c, 0, [&](Lanes::iterator it) { mine.push_back(it); });
    for (auto it : mine) {
      gone.push_back(std::move(it->second));
      registry().erase(it);
    }
  }
  gone.clear();                                // joins outside the registry's lock
}

}  // namespace autopar
