#include "tessera/checkpoint/storage/sync_queue.h"

#include <utility>

namespace tessera::checkpoint {

SyncQueue::SyncQueue(int threads, size_t max_waiting) : max_waiting_(max_waiting < 1 ? 1 : max_waiting) {
  for (int i = 0; i < (threads < 1 ? 1 : threads); ++i) threads_.emplace_back([this] { work(); });
}

SyncQueue::~SyncQueue() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  ready_.notify_all();
  for (auto& t : threads_) t.join();  // the workers drain the queue before they stop
}

void SyncQueue::add(File f) {
  std::unique_lock<std::mutex> lock(mu_);
  done_.wait(lock, [&] { return queue_.size() < max_waiting_; });
  queue_.push_back(std::move(f));
  lock.unlock();
  ready_.notify_one();
}

void SyncQueue::wait() {
  std::unique_lock<std::mutex> lock(mu_);
  done_.wait(lock, [&] { return queue_.empty() && busy_ == 0; });
  if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
}

void SyncQueue::work() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    ready_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping, nothing left
    File f = std::move(queue_.front());
    queue_.pop_front();
    ++busy_;
    lock.unlock();
    done_.notify_all();  // room in the queue
    std::exception_ptr err;
    try {
      f.fsync();
      f.close();
    } catch (...) {
      err = std::current_exception();
    }
    lock.lock();
    if (err && !error_) error_ = err;
    --busy_;
    done_.notify_all();
  }
}

}  // namespace tessera::checkpoint
