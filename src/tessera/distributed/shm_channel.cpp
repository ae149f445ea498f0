#include "tessera/distributed/shm_channel.h"

#include <dirent.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <thread>

#include "tessera/core/error.h"
#include "tessera/core/strings.h"
#include "tessera/distributed/shm_times.h"

namespace tessera::distributed {

struct ShmChannel::Desc {
  int32_t op = 0;     // one of the Op codes below
  int32_t dtype = 0;  // at::ScalarType
  int64_t numel = 0;  // elements of the whole collective
  int64_t extra = 0;  // reduce op, or the broadcast source
  uint64_t layout = 0;  // hash of the per-rank counts (all-gather, reduce-scatter)
  bool operator==(const Desc& o) const {
    return op == o.op && dtype == o.dtype && numel == o.numel && extra == o.extra && layout == o.layout;
  }
};

namespace {

// shared_memory_times(): every channel of the process adds to these.
std::atomic<uint64_t> g_ops{0};
std::atomic<int64_t> g_op_ns{0}, g_wait_ns{0};
int64_t ns_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
}

enum Op : int32_t { kAllReduce = 1, kAllGather = 2, kReduceScatter = 3, kBroadcast = 4 };
constexpr uint64_t kMagic = 0x31534d4853534554ull;  // "TESSHMS1"
constexpr size_t kHeaderBytes = 128;
constexpr size_t kPage = 4096;

static_assert(std::atomic<uint32_t>::is_always_lock_free, "cross-process atomics must be lock-free");

// One rank's control block. The counters sit on their own cache lines: `posted` is
// polled by every peer while the owner works on `consumed`.
struct Control {
  alignas(128) std::atomic<uint32_t> posted;    // last round whose slot data is written
  alignas(128) std::atomic<uint32_t> consumed;  // last round whose peers' slots were read
  alignas(128) std::atomic<uint32_t> waiters;   // peers sleeping on this block's counters
  int32_t pid;
  ShmChannel::Desc desc[2];  // the collective of the round in slot 0 / 1
};

struct Header {
  uint64_t magic;
  uint32_t size;
  uint32_t reserved;
  uint64_t chunk;
};

size_t data_offset(int size) {
  const size_t end = kHeaderBytes + sizeof(Control) * static_cast<size_t>(size);
  return (end + kPage - 1) / kPage * kPage;
}
size_t segment_size(int size, size_t chunk) {
  return data_offset(size) + static_cast<size_t>(size) * 2 * chunk;
}

const char* op_name(int32_t op) {
  switch (op) {
    case kAllReduce: return "all_reduce";
    case kAllGather: return "all_gather";
    case kReduceScatter: return "reduce_scatter";
    case kBroadcast: return "broadcast";
  }
  return "nothing";
}

std::string describe(const ShmChannel::Desc& d) {
  return concat(op_name(d.op), " (", static_cast<at::ScalarType>(d.dtype), ", ", d.numel, " elements",
                d.op == kBroadcast ? concat(", from rank ", d.extra) : std::string(), ")");
}

long futex(std::atomic<uint32_t>* word, int op, uint32_t val, const timespec* ts) {
  return ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, val, ts, nullptr, 0);
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#else
  std::this_thread::yield();
#endif
}

inline bool reached(uint32_t value, uint32_t target) { return static_cast<int32_t>(value - target) >= 0; }

// False when `pid` is gone or a zombie (a killed rank stays a zombie until reaped).
bool process_alive(int pid) {
  if (pid <= 0) return true;
  if (::kill(pid, 0) != 0 && errno == ESRCH) return false;
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string s;
  if (!std::getline(f, s)) return true;
  const auto p = s.rfind(')');
  if (p == std::string::npos || p + 2 >= s.size()) return true;
  return s[p + 2] != 'Z' && s[p + 2] != 'X';
}

std::string read_line(const char* path) {
  std::ifstream f(path);
  std::string s;
  std::getline(f, s);
  return s;
}

std::string read_link(const char* path) {
  char buf[256];
  const ssize_t n = ::readlink(path, buf, sizeof(buf) - 1);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
}

at::Tensor flat_view(void* p, int64_t n, at::ScalarType dt) {
  return at::from_blob(p, {n}, at::TensorOptions().dtype(dt));
}

// out = a (op) b, elementwise; `out` may be `a`.
void combine(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b, ReduceOp op) {
  at::Tensor o = out;
  switch (op) {
    case ReduceOp::Min: at::minimum_out(o, a, b); break;
    case ReduceOp::Max: at::maximum_out(o, a, b); break;
    default: at::add_out(o, a, b);
  }
}

int64_t clamp_len(int64_t count, int64_t from, int64_t chunk) {
  return std::max<int64_t>(0, std::min(chunk, count - from));
}

// FNV-1a over the per-rank counts: ranks that split a collective differently disagree.
uint64_t layout_hash(const std::vector<int64_t>& counts) {
  uint64_t h = 1469598103934665603ull;
  for (int64_t c : counts) {
    for (int b = 0; b < 8; ++b) {
      h ^= static_cast<uint64_t>(c >> (8 * b)) & 0xff;
      h *= 1099511628211ull;
    }
  }
  return h;
}

// Removes names left in /dev/shm by creators that died between create and unlink (a
// window of a few collectives during set-up). Names carry the creator's pid.
void remove_stale_segments() {
  DIR* d = ::opendir("/dev/shm");
  if (!d) return;
  while (dirent* e = ::readdir(d)) {
    const std::string n = e->d_name;
    if (n.rfind("tessera-", 0) != 0) continue;
    const int pid = std::atoi(n.c_str() + 8);
    if (pid > 0 && !process_alive(pid)) ::shm_unlink(("/" + n).c_str());
  }
  ::closedir(d);
}

}  // namespace

std::string shm_host_key() {
  const std::string boot = read_line("/proc/sys/kernel/random/boot_id");
  const std::string mnt = read_link("/proc/self/ns/mnt"), net = read_link("/proc/self/ns/net"),
                    pid = read_link("/proc/self/ns/pid");
  char host[256] = {0};
  ::gethostname(host, sizeof(host) - 1);
  if (boot.empty() || mnt.empty() || net.empty() || pid.empty()) return "";
  return concat(host, "|", boot, "|", mnt, "|", net, "|", pid);
}

namespace {
Control& control(char* base, int r) {
  return *reinterpret_cast<Control*>(base + kHeaderBytes + sizeof(Control) * static_cast<size_t>(r));
}
}  // namespace

std::unique_ptr<ShmChannel> ShmChannel::adopt(const std::string& name, int rank, int size, size_t chunk,
                                               void* mapping) {
  std::unique_ptr<ShmChannel> ch(new ShmChannel());
  ch->name_ = name;
  ch->rank_ = rank;
  ch->size_ = size;
  ch->chunk_ = chunk;
  ch->bytes_ = segment_size(size, chunk);
  ch->base_ = static_cast<char*>(mapping);
  return ch;
}

std::unique_ptr<ShmChannel> ShmChannel::create(int size, size_t chunk) {
  TESSERA_CHECK(size >= 2 && chunk >= 4096 && chunk % 64 == 0, "shared-memory channel: bad size ", size,
                " or chunk ", chunk);
  remove_stale_segments();
  std::random_device rd;
  char tag[32];
  std::snprintf(tag, sizeof(tag), "%08x%08x", rd(), rd());
  const std::string name = concat("/tessera-", ::getpid(), "-", tag);
  const int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  TESSERA_CHECK(fd >= 0, "shm_open(", name, ") failed: ", std::strerror(errno));
  const size_t bytes = segment_size(size, chunk);
  // posix_fallocate reserves the pages now: a full /dev/shm is an error here, not a
  // SIGBUS at the first write.
  const int rc = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  void* p = rc == 0 ? ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
  const int map_errno = errno;
  ::close(fd);
  if (p == MAP_FAILED) {
    ::shm_unlink(name.c_str());
    throw Error(concat("cannot reserve ", bytes, " bytes of shared memory for ", size, " ranks (", name, "): ",
                       std::strerror(rc != 0 ? rc : map_errno), rc == ENOSPC ? " (is /dev/shm too small?)" : ""));
  }
  auto ch = adopt(name, 0, size, chunk, p);
  ch->owner_ = true;
  auto* h = reinterpret_cast<Header*>(ch->base_);
  h->size = static_cast<uint32_t>(size);
  h->chunk = chunk;
  control(ch->base_, 0).pid = ::getpid();
  __atomic_store_n(&h->magic, kMagic, __ATOMIC_RELEASE);  // the header is complete
  return ch;
}

std::unique_ptr<ShmChannel> ShmChannel::open(const std::string& name, int rank, int size, size_t chunk) {
  const int fd = ::shm_open(name.c_str(), O_RDWR, 0);
  TESSERA_CHECK(fd >= 0, "shm_open(", name, ") failed on group rank ", rank, ": ", std::strerror(errno));
  const size_t bytes = segment_size(size, chunk);
  struct stat st {};
  if (::fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) != bytes) {
    ::close(fd);
    throw Error(concat("shared-memory segment ", name, " has ", st.st_size, " bytes, expected ", bytes));
  }
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int map_errno = errno;
  ::close(fd);
  TESSERA_CHECK(p != MAP_FAILED, "mmap of ", name, " failed: ", std::strerror(map_errno));
  auto ch = adopt(name, rank, size, chunk, p);
  const auto* h = reinterpret_cast<const Header*>(ch->base_);
  TESSERA_CHECK(__atomic_load_n(&h->magic, __ATOMIC_ACQUIRE) == kMagic && h->size == static_cast<uint32_t>(size) && h->chunk == chunk,
                "shared-memory segment ", name, " was made for another group (", h->size, " ranks, chunk ",
                h->chunk, ")");
  control(ch->base_, rank).pid = ::getpid();
  return ch;
}

ShmChannel::~ShmChannel() {
  unlink();
  if (base_) ::munmap(base_, bytes_);
}

void ShmChannel::unlink() {
  if (owner_) ::shm_unlink(name_.c_str());
  owner_ = false;
}

char* ShmChannel::slot(int rank, int which) const {
  return base_ + data_offset(size_) + (static_cast<size_t>(rank) * 2 + static_cast<size_t>(which)) * chunk_;
}

void ShmChannel::post(std::atomic<uint32_t>& word, uint32_t value) {
  word.store(value, std::memory_order_seq_cst);
  if (control(base_, rank_).waiters.load(std::memory_order_seq_cst) > 0) futex(&word, FUTEX_WAKE, INT_MAX, nullptr);
}

void ShmChannel::wait_until(std::atomic<uint32_t>& word, uint32_t target, int peer, const Desc* joining) {
  auto what = [&] { return joining ? "to join " + describe(*joining) : std::string("to read this rank's previous data"); };
  if (reached(word.load(std::memory_order_acquire), target)) return;
  // The peer is not there yet: from here on this rank waits for it (spinning, then asleep).
  struct Timed {
    std::atomic<int64_t>& ns;
    std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
    ~Timed() { ns.fetch_add(ns_since(t0), std::memory_order_relaxed); }
  } timed{g_wait_ns};
  for (int i = 0; i < 2000; ++i) {
    if (reached(word.load(std::memory_order_acquire), target)) return;
    cpu_relax();
  }
  Control& c = control(base_, peer);
  auto next_check = std::chrono::steady_clock::now();
  for (;;) {
    // Announce the sleep before reading the word: a poster that stores after our read
    // sees the announcement and wakes us (both sides are sequentially consistent).
    c.waiters.fetch_add(1, std::memory_order_seq_cst);
    const uint32_t v = word.load(std::memory_order_seq_cst);
    if (!reached(v, target)) {
      const timespec ts{0, 20 * 1000 * 1000};
      futex(&word, FUTEX_WAIT, v, &ts);
    }
    c.waiters.fetch_sub(1, std::memory_order_seq_cst);
    if (reached(word.load(std::memory_order_acquire), target)) return;
    const auto now = std::chrono::steady_clock::now();
    if (now >= next_check) {
      // Every peer, not only the awaited one: it may be waiting in turn for a dead rank.
      for (int p = 0; p < size_; ++p) {
        const int pid = control(base_, p).pid;
        if (p == rank_ || process_alive(pid)) continue;
        throw Error(concat("rank ", p, " (pid ", pid, ") exited while this rank waited for ",
                           p == peer ? "it" : concat("rank ", peer), " ", what(), " in the shared-memory channel"));
      }
      next_check = now + std::chrono::milliseconds(50);
    }
    if (now - op_start_ > timeout_) {
      throw Error(concat("timed out after ", timeout_.count(), " ms waiting for rank ", peer, " ", what(),
                         " in the shared-memory channel"));
    }
  }
}

template <typename Write, typename Read>
void ShmChannel::round(const Desc& d, Write&& write, Read&& read) {
  const uint32_t s = ++seq_;
  const int which = static_cast<int>(s & 1u);
  if (rounds_ >= 2) {
    for (int p = 0; p < size_; ++p)
      if (p != rank_) wait_until(control(base_, p).consumed, s - 2, p, nullptr);
  }
  write(slot(rank_, which));
  Control& me = control(base_, rank_);
  me.desc[which] = d;
  post(me.posted, s);
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    Control& c = control(base_, p);
    wait_until(c.posted, s, p, &d);
    const Desc theirs = c.desc[which];
    if (!(theirs == d)) {
      throw Error(concat("collective mismatch: rank ", p, " is in ", describe(theirs), " while rank ", rank_,
                         " is in ", describe(d)));
    }
  }
  read(which);
  post(me.consumed, s);
  ++rounds_;
}

void ShmChannel::fail_if_broken() const {
  TESSERA_CHECK(broken_.empty(), "the shared-memory channel is unusable after an earlier failure (", broken_, ")");
}

template <typename F>
void ShmChannel::run_op(F&& f) {
  std::lock_guard<std::mutex> lock(mu_);
  fail_if_broken();
  op_start_ = std::chrono::steady_clock::now();
  try {
    f();
  } catch (const std::exception& e) {
    broken_ = e.what();
    throw;
  }
  g_op_ns.fetch_add(ns_since(op_start_), std::memory_order_relaxed);
  g_ops.fetch_add(1, std::memory_order_relaxed);
}

SharedMemoryTimes shared_memory_times() {
  SharedMemoryTimes t;
  t.collectives = g_ops.load(std::memory_order_relaxed);
  t.seconds = static_cast<double>(g_op_ns.load(std::memory_order_relaxed)) * 1e-9;
  t.waiting_seconds = static_cast<double>(g_wait_ns.load(std::memory_order_relaxed)) * 1e-9;
  return t;
}

void ShmChannel::all_reduce(const at::Tensor& t, ReduceOp op) {
  run_op([&] {
    const at::ScalarType dt = t.scalar_type();
    const int64_t isz = t.element_size(), n = t.numel(), e = static_cast<int64_t>(chunk_) / isz;
    const Desc d{kAllReduce, static_cast<int32_t>(dt), n, static_cast<int64_t>(op)};
    char* data = static_cast<char*>(t.data_ptr());
    for (int64_t off = 0; off < n; off += e) {
      const int64_t len = std::min(e, n - off);
      round(
          d, [&](char* mine) { std::memcpy(mine, data + off * isz, static_cast<size_t>(len * isz)); },
          [&](int which) {
            auto part = [&](int k) { return flat_view(slot(k, which), len, dt); };
            // Fresh tensors over the same memory: no version-counter bump on `t`.
            const at::Tensor out = flat_view(data + off * isz, len, dt);
            combine(out, part(0), part(1), op);
            for (int k = 2; k < size_; ++k) combine(out, out, part(k), op);
          });
    }
  });
}

void ShmChannel::all_gather(const at::Tensor& local, const std::vector<int64_t>& counts, const at::Tensor& out) {
  run_op([&] {
    const at::ScalarType dt = local.scalar_type();
    const int64_t isz = local.element_size(), e = static_cast<int64_t>(chunk_) / isz;
    const std::vector<int64_t> off = core::exclusive_offsets(counts);
    const Desc d{kAllGather, static_cast<int32_t>(dt), off.back(), 0, layout_hash(counts)};
    const char* src = static_cast<const char*>(local.data_ptr());
    char* dst = static_cast<char*>(out.data_ptr());
    const int64_t mine = counts[static_cast<size_t>(rank_)];
    if (mine > 0 && dst + off[rank_] * isz != src) {
      std::memcpy(dst + off[rank_] * isz, src, static_cast<size_t>(mine * isz));
    }
    const int64_t most = *std::max_element(counts.begin(), counts.end());
    for (int64_t k0 = 0; k0 < most; k0 += e) {
      round(
          d,
          [&](char* slot_mine) {
            const int64_t len = clamp_len(mine, k0, e);
            if (len > 0) std::memcpy(slot_mine, src + k0 * isz, static_cast<size_t>(len * isz));
          },
          [&](int which) {
            for (int p = 0; p < size_; ++p) {
              const int64_t len = p == rank_ ? 0 : clamp_len(counts[p], k0, e);
              if (len > 0) std::memcpy(dst + (off[p] + k0) * isz, slot(p, which), static_cast<size_t>(len * isz));
            }
          });
    }
  });
}

void ShmChannel::reduce_scatter(const at::Tensor& in, const std::vector<int64_t>& counts, ReduceOp op,
                                const at::Tensor& out) {
  run_op([&] {
    const at::ScalarType dt = in.scalar_type();
    const int64_t isz = in.element_size();
    // Each slot is cut into one region per destination rank (multiples of 16 elements
    // where the slot allows).
    const int64_t per = static_cast<int64_t>(chunk_) / isz / size_;
    TESSERA_CHECK(per >= 1, "shared-memory channel: a ", chunk_, "-byte slot cannot hold one ", dt,
                  " element for each of ", size_, " ranks");
    const int64_t region = per >= 16 ? per / 16 * 16 : per;
    const std::vector<int64_t> off = core::exclusive_offsets(counts);
    const Desc d{kReduceScatter, static_cast<int32_t>(dt), off.back(), static_cast<int64_t>(op), layout_hash(counts)};
    char* src = static_cast<char*>(in.data_ptr());
    char* dst = static_cast<char*>(out.data_ptr());
    const int64_t mine = counts[static_cast<size_t>(rank_)];
    const int64_t most = *std::max_element(counts.begin(), counts.end());
    for (int64_t k0 = 0; k0 < most; k0 += region) {
      round(
          d,
          [&](char* slot_mine) {
            for (int p = 0; p < size_; ++p) {
              const int64_t len = p == rank_ ? 0 : clamp_len(counts[p], k0, region);
              if (len > 0) {
                std::memcpy(slot_mine + p * region * isz, src + (off[p] + k0) * isz, static_cast<size_t>(len * isz));
              }
            }
          },
          [&](int which) {
            const int64_t len = clamp_len(mine, k0, region);
            if (len == 0) return;
            auto part = [&](int k) {
              char* p = k == rank_ ? src + (off[rank_] + k0) * isz : slot(k, which) + rank_ * region * isz;
              return flat_view(p, len, dt);
            };
            const at::Tensor o = flat_view(dst + k0 * isz, len, dt);
            combine(o, part(0), part(1), op);
            for (int k = 2; k < size_; ++k) combine(o, o, part(k), op);
          });
    }
  });
}

void ShmChannel::broadcast(const at::Tensor& t, int src) {
  run_op([&] {
    const at::ScalarType dt = t.scalar_type();
    const int64_t isz = t.element_size(), n = t.numel(), e = static_cast<int64_t>(chunk_) / isz;
    const Desc d{kBroadcast, static_cast<int32_t>(dt), n, src};
    char* data = static_cast<char*>(t.data_ptr());
    for (int64_t off = 0; off < n; off += e) {
      const int64_t len = std::min(e, n - off);
      round(
          d,
          [&](char* mine) {
            if (rank_ == src) std::memcpy(mine, data + off * isz, static_cast<size_t>(len * isz));
          },
          [&](int which) {
            if (rank_ != src) std::memcpy(data + off * isz, slot(src, which), static_cast<size_t>(len * isz));
          });
    }
  });
}

}  // namespace tessera::distributed
