// Collectives that run on a communicator's own thread while the caller computes: the
// all_reduce_start / all_reduce_done custom calls (xla_ffi.cc) hand a bucket's all-reduce to
// it and take the result back where the step first reads it, so XLA runs the compute in
// between (issue 24 item 2). One thread per communicator, started with its first job; jobs run
// in the order they were given (every rank gives them in program order, so they pair).
// A collective run on the caller's thread first drains the queue: two threads never use a
// communicator's links at once. The thread stops, after its queued jobs, when the
// communicator is unregistered (calls.cc).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

namespace autopar {

class Comm;

class Inflight {
 public:
  Inflight() = default;
  ~Inflight();
  Inflight(const Inflight&) = delete;
  Inflight& operator=(const Inflight&) = delete;

  // Copy `bytes` from `from` into a buffer of the job's own (64-byte aligned) and queue
  // job(buffer); returns its id (1, 2, ...: below 2^31 for 2^31 starts per communicator). The caller's memory is free again on return.
  int64_t start(const void* from, size_t bytes, std::function<void(void*)> job);
  // Wait until job `id` ran, copy its buffer to `to` (`bytes`, as started) and forget it; the
  // job's exception is thrown here instead. An id not started (or already waited for) is an
  // ArgumentError.
  void wait(int64_t id, void* to, size_t bytes);
  // Wait until every queued job ran (their outcomes stay for wait).
  void drain();
  // Jobs queued or run but not yet waited for.
  size_t pending();

 private:
  struct Job {
    std::function<void(void*)> fn;
    std::unique_ptr<void, void (*)(void*)> buf{nullptr, std::free};
    size_t bytes = 0;
    bool done = false;
    std::exception_ptr error;
  };
  void loop();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Job>> queue_;
  std::map<int64_t, std::shared_ptr<Job>> jobs_;
  int64_t next_ = 1;
  bool stop_ = false;
  bool running_ = false;
  std::thread thread_;
};

// The communicator's Inflight, made on first use.
Inflight& inflight_of(Comm& c);
// Stop and join c's thread (after its queued jobs) and forget it; nothing when it has none.
void forget_inflight(Comm* c);

}  // namespace autopar
