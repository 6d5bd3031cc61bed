// Work that runs on a communicator's own threads while the caller computes.
// Lane 0: the all_reduce_start / all_reduce_done custom calls (xla_ffi.cc) hand a bucket's
// all-reduce to it and take the result back where the step first reads it, so XLA runs the
// compute in between; jobs run in the order they were given (every rank gives them in program
// order, so they pair), and a collective run on the caller's thread first drains the lane: two
// threads never use the same links at once. Lane p + 1: the sends to rank p (a pipeline
// stage's transfers), so a stage never waits for its receiver; a link's two directions are
// independent, and a stage's collectives use other links. Each lane is one thread, started with
// its first job; they stop, after their queued jobs, when the communicator is unregistered
// (calls.cc).
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
  // Wait until every queued job ran, forget them all, and throw the first one's exception
  // (for jobs nobody waits for one by one: a stage's sends).
  void settle();
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

// The communicator's Inflight of `lane` (0: collectives; p + 1: sends to rank p), made on first
// use.
Inflight& inflight_of(Comm& c, int lane = 0);
// Settle (Inflight::settle) every send lane of c: the first failed send's exception.
void settle_sends(Comm& c);
// Stop and join c's threads (after their queued jobs) and forget them; nothing when it has none.
void forget_inflight(Comm* c);

}  // namespace autopar
