// Rank programs for the runtime tests: collectives, subgroups, failures.
#include <ATen/ATen.h>
#include <signal.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <iostream>
#include <thread>

#include "support/scenario.h"
#include "tessera/core/cpu_allocator.h"
#include "tessera/core/env.h"
#include "tessera/distributed/shm_times.h"

using namespace tessera;
using namespace tessera::testing;
using distributed::ReduceOp;

namespace {

// Uneven dim-0 sizes with empty pieces: rank r gets (3r + 2) % 5 rows (2, 0, 3, 1, ...).
std::vector<int64_t> uneven_sizes(int n) {
  std::vector<int64_t> s(n);
  for (int r = 0; r < n; ++r) s[r] = (3 * r + 2) % 5;
  return s;
}

void check_equal(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  WCHECK(got.sizes() == want.sizes(), what, ": shape ", got.sizes(), " != ", want.sizes());
  WCHECK(got.scalar_type() == want.scalar_type(), what, ": dtype ", got.scalar_type(), " != ", want.scalar_type());
  WCHECK(at::equal(got, want), what, ": values differ\ngot  ", got, "\nwant ", want);
}

void run_collectives(distributed::Communicator& c, at::ScalarType dt) {
  const int n = c.size(), r = c.rank();
  const std::string tag = concat(dt, " n=", n, " rank=", r);
  auto opt = at::TensorOptions().dtype(dt);

  // all_reduce: values small integers, exact in bf16.
  for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Min, ReduceOp::Max}) {
    at::Tensor t = at::arange(6, opt).reshape({2, 3}) + 2 * (r + 1);
    c.all_reduce(t, op);
    at::Tensor want = at::zeros({2, 3}, at::kDouble);
    at::Tensor base = at::arange(6, at::kDouble).reshape({2, 3});
    if (op == ReduceOp::Sum) want = base * n + 2.0 * n * (n + 1) / 2;
    if (op == ReduceOp::Avg) want = base + (n + 1);  // mean of 2(r+1) is n+1
    if (op == ReduceOp::Min) want = base + 2;
    if (op == ReduceOp::Max) want = base + 2 * n;
    check_equal(t, want.to(dt), concat("all_reduce ", distributed::to_string(op), " ", tag));
  }
  // all_reduce of a non-contiguous view writes back into the view.
  {
    at::Tensor m = at::ones({4, 4}, opt);
    at::Tensor col = m.select(1, 2);
    c.all_reduce(col, ReduceOp::Sum);
    WCHECK(at::equal(m.select(1, 2), at::full({4}, n, opt)), "non-contiguous all_reduce ", tag);
    WCHECK(at::equal(m.select(1, 0), at::ones({4}, opt)), "non-contiguous all_reduce touched others ", tag);
  }

  // all_gather, even and uneven (with empty pieces), rows tagged by owner and index.
  for (bool even : {true, false}) {
    std::vector<int64_t> sizes = even ? std::vector<int64_t>(n, 3) : uneven_sizes(n);
    auto rows = [&](int owner) {
      return (at::arange(sizes[owner] * 2, at::kDouble).reshape({sizes[owner], 2}) + 10 * owner).to(dt);
    };
    at::Tensor got = c.all_gather(rows(r), sizes);
    std::vector<at::Tensor> parts;
    for (int k = 0; k < n; ++k) parts.push_back(rows(k));
    check_equal(got, at::cat(parts, 0), concat("all_gather even=", even, " ", tag));
    at::Tensor got2 = c.all_gather(rows(r));  // sizes discovered
    check_equal(got2, at::cat(parts, 0), concat("all_gather (discovered sizes) even=", even, " ", tag));
    // Into a caller's tensor: a view in the middle of a larger buffer, whose
    // surroundings must stay untouched.
    at::Tensor host = at::full({got.size(0) + 2, 2}, -7.0, at::kDouble).to(dt);
    at::Tensor into = host.narrow(0, 1, got.size(0));
    at::Tensor same = c.all_gather_async(rows(r), sizes, into).wait();
    WCHECK(same.data_ptr() == into.data_ptr(), "all_gather into a given tensor returned another ", tag);
    check_equal(into, at::cat(parts, 0), concat("all_gather into a given tensor even=", even, " ", tag));
    WCHECK(host[0].eq(-7).all().item<bool>() && host[-1].eq(-7).all().item<bool>(),
           "all_gather into a given tensor wrote outside it ", tag);
  }

  // reduce_scatter, even and uneven: rank k contributes (k+1) * base.
  for (bool even : {true, false}) {
    std::vector<int64_t> sizes = even ? std::vector<int64_t>(n, 2) : uneven_sizes(n);
    int64_t total = 0;
    for (auto s : sizes) total += s;
    at::Tensor base = at::arange(total * 3, at::kDouble).reshape({total, 3}).remainder(7);
    int64_t off = 0;
    for (int k = 0; k < r; ++k) off += sizes[k];
    for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min}) {
      at::Tensor full = (base * (r + 1)).to(dt);
      at::Tensor got = c.reduce_scatter(full, sizes, op);
      at::Tensor piece = base.narrow(0, off, sizes[r]);
      at::Tensor want;
      if (op == ReduceOp::Sum) want = piece * (n * (n + 1) / 2);
      if (op == ReduceOp::Avg) want = piece * (n * (n + 1) / 2) / n;
      if (op == ReduceOp::Max) want = piece * n;
      if (op == ReduceOp::Min) want = piece;
      if (op == ReduceOp::Avg && dt == at::kBFloat16) {
        WCHECK(at::allclose(got.to(at::kDouble), want, 1e-2, 1e-2), "reduce_scatter avg bf16 ", tag);
      } else {
        check_equal(got, want.to(dt), concat("reduce_scatter ", distributed::to_string(op), " even=", even, " ", tag));
      }
    }
  }

  // broadcast from the last rank.
  at::Tensor b = r == n - 1 ? at::arange(5, opt) * 3 : at::zeros({5}, opt);
  c.broadcast(b, n - 1);
  check_equal(b, at::arange(5, opt) * 3, "broadcast " + tag);

  // async all_reduce and all_gather overlap: start both, then wait.
  at::Tensor x = at::full({1000}, r + 1, opt);
  auto p1 = c.all_reduce_async(x, ReduceOp::Sum);
  // Over the shared-memory channel the call does the whole collective (docs/architecture.md,
  // "What overlaps, per transport"): the sum is in place before wait().
  if (c.uses_shared_memory() && x.is_cpu())
    WCHECK(at::equal(x, at::full({1000}, n * (n + 1) / 2, opt)), "shared memory: all_reduce_async returned early ",
           tag);
  auto p2 = c.all_gather_async(at::full({2}, r, opt), std::vector<int64_t>(n, 2));
  at::Tensor g = p2.wait();
  p1.wait();
  WCHECK(at::equal(x, at::full({1000}, n * (n + 1) / 2, opt)), "async all_reduce ", tag);
  WCHECK(g.size(0) == 2 * n && g[2 * (n - 1)].item<double>() == n - 1, "async all_gather ", tag);

  // Tensors of thousands of rows: many rounds of a shared-memory channel with small
  // chunks, uneven and empty pieces. Values stay small integers (exact in bf16).
  {
    at::Tensor t = at::arange(5003, at::kDouble).remainder(13) + r;
    at::Tensor sum = t.to(dt), mx = t.to(dt);
    c.all_reduce(sum, ReduceOp::Sum);
    c.all_reduce(mx, ReduceOp::Max);
    at::Tensor base = at::arange(5003, at::kDouble).remainder(13);
    check_equal(sum, (base * n + n * (n - 1) / 2).to(dt), "large all_reduce sum " + tag);
    check_equal(mx, (base + n - 1).to(dt), "large all_reduce max " + tag);

    std::vector<int64_t> sizes(n);
    for (int k = 0; k < n; ++k) sizes[k] = 1000 * (k % 3) + 7 * k;  // rank 0 empty
    std::vector<int64_t> off(n + 1, 0);
    for (int k = 0; k < n; ++k) off[k + 1] = off[k] + sizes[k];
    auto rows = [&](int owner) {
      return (at::arange(sizes[owner] * 3, at::kDouble).reshape({sizes[owner], 3}).remainder(17) + owner).to(dt);
    };
    std::vector<at::Tensor> parts;
    for (int k = 0; k < n; ++k) parts.push_back(rows(k));
    check_equal(c.all_gather(rows(r), sizes), at::cat(parts, 0), "large uneven all_gather " + tag);

    at::Tensor full = at::arange(off[n] * 3, at::kDouble).reshape({off[n], 3}).remainder(11);
    at::Tensor got = c.reduce_scatter((full * (r + 1)).to(dt), sizes, ReduceOp::Sum);
    check_equal(got, (full.narrow(0, off[r], sizes[r]) * (n * (n + 1) / 2)).to(dt),
                "large uneven reduce_scatter " + tag);

    at::Tensor b2 = r == n - 1 ? (at::arange(4099, at::kDouble).remainder(9)).to(dt) : at::zeros({4099}, opt);
    c.broadcast(b2, n - 1);
    check_equal(b2, at::arange(4099, at::kDouble).remainder(9).to(dt), "large broadcast " + tag);
  }
}

}  // namespace

SCENARIO("collectives") {
  auto c = comm();
  run_collectives(*c, at::kFloat);
  run_collectives(*c, at::kBFloat16);
  run_collectives(*c, at::kLong);
  // bytes
  const int n = c->size(), r = c->rank();
  std::string msg = c->broadcast_bytes(r == 0 ? std::string("path/\0with/nul", 14) : std::string("x"), 0);
  WCHECK(msg == std::string("path/\0with/nul", 14), "broadcast_bytes");
  auto all = c->all_gather_bytes(std::string(static_cast<size_t>(r), 'a' + r));
  WCHECK(static_cast<int>(all.size()) == n, "all_gather_bytes size");
  for (int k = 0; k < n; ++k) WCHECK(all[k] == std::string(static_cast<size_t>(k), 'a' + k), "all_gather_bytes ", k);
  WCHECK(c->all_reduce_int(r + 1, ReduceOp::Max) == n, "all_reduce_int");
  WCHECK(c->all_reduce_double(0.5, ReduceOp::Sum) == 0.5 * n, "all_reduce_double");
  c->barrier();
  // Which Gloo route the even all-gather / reduce-scatter took: -1 never tried (point to
  // point), 0 tried and unsupported by this Gloo, 1 Gloo's single-tensor form.
  const auto caps = c->capabilities();
  std::cout << "gloo single-tensor all_gather " << caps.allgather_base << " reduce_scatter "
            << caps.reduce_scatter_base << "\n";
  std::cout << "transport " << (c->uses_shared_memory() ? "shm" : "gloo") << "\n";
  std::cout << "collectives ok rank " << r << " of " << n << "\n";
  return 0;
}

// Rank 0 enters an all_reduce while the others enter an all_gather. Over shared memory
// every rank raises an error naming both collectives, and the channel then refuses use.
SCENARIO("collective_mismatch") {
  auto c = comm();
  const int n = c->size(), r = c->rank();
  WCHECK(c->uses_shared_memory(), "the shared-memory channel is off");
  try {
    if (r == 0) {
      at::Tensor t = at::ones({1024});
      c->all_reduce(t);
    } else {
      c->all_gather(at::ones({2}), std::vector<int64_t>(n, 2));
    }
    std::cout << "no error on rank " << r << "\n";
    return 1;
  } catch (const CommError& e) {
    const std::string m = e.what();
    WCHECK(m.find("collective mismatch") != std::string::npos && m.find("all_reduce (Float, 1024 elements)") != std::string::npos &&
               m.find("all_gather (Float, " + std::to_string(2 * n) + " elements)") != std::string::npos,
           "unexpected error: ", m);
  }
  try {
    c->barrier();
    std::cout << "barrier after a failure passed on rank " << r << "\n";
    return 1;
  } catch (const CommError& e) {
    WCHECK(std::string(e.what()).find("unusable after an earlier failure") != std::string::npos, "unexpected: ", e.what());
  }
  std::cout << "mismatch detected rank " << r << "\n";
  return 0;
}

// Rank 1 joins an all-reduce 300 ms after rank 0: rank 0's shared-memory times show the
// wait, rank 1's (which found rank 0 there) do not; each counts the one collective.
SCENARIO("shm_times") {
  auto c = comm();
  const int r = c->rank();
  WCHECK(c->uses_shared_memory(), "the shared-memory channel is off");
  c->barrier();
  const auto before = distributed::shared_memory_times();
  if (r == 1) std::this_thread::sleep_for(std::chrono::milliseconds(300));
  at::Tensor t = at::ones({1 << 20});  // 4 MiB: several rounds of the default 1 MiB chunks
  c->all_reduce(t);
  const auto after = distributed::shared_memory_times();
  WCHECK(at::equal(t, at::full({1 << 20}, 2.0f)), "all_reduce result");
  const double waited = after.waiting_seconds - before.waiting_seconds, in = after.seconds - before.seconds;
  WCHECK(after.collectives == before.collectives + 1, "collectives ", before.collectives, " -> ", after.collectives);
  WCHECK(waited >= 0 && in >= waited, "rank ", r, ": in collectives ", in, " s, waiting ", waited, " s");
  at::Tensor w = at::full({1}, waited, at::kDouble);
  const at::Tensor both = c->all_gather(w, std::vector<int64_t>{1, 1});
  const double w0 = both[0].item<double>(), w1 = both[1].item<double>();
  WCHECK(w0 >= 0.15, "rank 0 waited ", w0, " s for a rank 300 ms late");
  WCHECK(w1 < w0 / 2, "rank 1 (the late one) waited ", w1, " s, rank 0 ", w0, " s");
  std::cout << "shm times ok rank " << r << "\n";
  return 0;
}

SCENARIO("subgroups") {
  auto c = comm();
  const int n = c->size(), r = c->rank();
  // Hybrid layout: "nodes" of `per` ranks; shard group = same node, replicate group =
  // same local index across nodes.
  const int per = static_cast<int>(args.int_arg(0, 2));
  WCHECK(n % per == 0, "world size ", n, " not divisible by ", per);
  std::vector<std::vector<int>> nodes, replicas;
  for (int g = 0; g < n / per; ++g) {
    nodes.emplace_back();
    for (int i = 0; i < per; ++i) nodes.back().push_back(g * per + i);
  }
  for (int i = 0; i < per; ++i) {
    replicas.emplace_back();
    for (int g = 0; g < n / per; ++g) replicas.back().push_back(g * per + i);
  }
  auto shard = c->split(nodes);
  auto repl = c->split(replicas);
  WCHECK(shard && repl, "every rank is in a group");
  WCHECK(shard->size() == per && shard->rank() == r % per, "shard group rank");
  WCHECK(repl->size() == n / per && repl->rank() == r / per, "replicate group rank");
  WCHECK(shard->members()[shard->rank()] == r, "members map back to global rank");
  at::Tensor t = at::full({3}, r, at::kFloat);
  shard->all_reduce(t, ReduceOp::Sum);
  const int node = r / per;
  float want = 0;
  for (int i = 0; i < per; ++i) want += node * per + i;
  WCHECK(at::equal(t, at::full({3}, want)), "shard group all_reduce");
  at::Tensor u = at::full({2}, r, at::kFloat);
  repl->all_reduce(u, ReduceOp::Sum);
  float want2 = 0;
  for (int g = 0; g < n / per; ++g) want2 += g * per + r % per;
  WCHECK(at::equal(u, at::full({2}, want2)), "replicate group all_reduce");
  // Uneven reduce-scatter inside a subgroup.
  std::vector<int64_t> sizes(per);
  for (int i = 0; i < per; ++i) sizes[i] = i;  // 0, 1, ...
  int64_t total = per * (per - 1) / 2;
  at::Tensor full = at::ones({total, 2}, at::kFloat);
  at::Tensor piece = shard->reduce_scatter(full, sizes, ReduceOp::Sum);
  WCHECK(piece.size(0) == shard->rank() && (piece.numel() == 0 || piece.min().item<float>() == per),
         "subgroup reduce_scatter");
  // A nested split of a subgroup works too.
  auto solo = shard->split({{shard->rank()}} );
  (void)solo;
  c->barrier();
  std::cout << "subgroups ok rank " << r << "\n";
  return 0;
}

// Prints its rank and exits with `code` on rank `bad` (after `delay_ms`); the others
// wait (bounded) to be stopped by the launcher.
SCENARIO("exit_code") {
  const int bad = static_cast<int>(args.int_arg(0, 1));
  const int code = static_cast<int>(args.int_arg(1, 3));
  const int rank = std::stoi(std::getenv("RANK"));
  const int world = std::stoi(std::getenv("WORLD_SIZE"));
  const bool spawn = args.arg(3) == "spawn";
  // With "deaf", the other ranks ignore SIGTERM (the launcher's TERM leaves them to its KILL a
  // grace period later), and the failing rank waits for their markers as with "spawn".
  const bool deaf = args.arg(3) == "deaf";
  // With "ready", the other ranks only leave their marker: the failing rank fails after every
  // rank has said hello (a test that reads every rank's pid from the output needs them all).
  const bool ready = args.arg(3) == "ready";
  // With "spawn", the failing rank waits until every other rank has left its grandchild
  // (a marker file per rank, named by this launch's unique MASTER_PORT), so that the test
  // does not depend on how fast the ranks start (ASan builds start slowly).
  auto marker = [](int r) {
    return concat("/tmp/tessera-exit-code-", std::getenv("MASTER_PORT"), "-", r);
  };
  std::cout << "hello from rank " << rank << " pid " << ::getpid() << std::endl;
  if (deaf && rank != bad) {
    ::signal(SIGTERM, SIG_IGN);
    std::cout << "deaf to TERM rank " << rank << std::endl;
    std::ofstream(marker(rank)).put('1');  // the failing rank removes it
  }
  if (ready && rank != bad) std::ofstream(marker(rank)).put('1');  // the failing rank removes it
  if (rank == bad) {
    if (spawn || deaf || ready) {
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
      for (int r = 0; r < world; ++r) {
        if (r == bad) continue;
        while (::access(marker(r).c_str(), F_OK) != 0 && std::chrono::steady_clock::now() < deadline)
          std::this_thread::sleep_for(std::chrono::milliseconds(10));
        ::unlink(marker(r).c_str());
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(args.int_arg(2, 200)));
    if (code < 0) ::raise(-code);  // die by that signal
    return code;
  }
  if (args.arg(3) == "spawn") {
    // Leave a grandchild in the rank's process group; the launcher must reap it too.
    pid_t p = ::fork();
    if (p == 0) {
      ::execlp("sleep", "sleep", "60", nullptr);
      ::_exit(127);
    }
    std::cout << "grandchild " << p << std::endl;
    if (bad < world) std::ofstream(marker(rank)).put('1');  // the failing rank removes it
  }
  if (args.arg(3) == "stop") {
    std::cout << "stopping rank " << rank << std::endl;
    ::raise(SIGSTOP);  // frozen until the launcher continues it (its TERM then ends it)
  }
  for (int i = 0; i < 600; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  return 0;
}

// Rank `victim` dies by SIGKILL (or hangs when args[1] == "hang") before a collective;
// the survivors must raise CommError within the communicator timeout.
SCENARIO("dead_peer") {
  const int victim = static_cast<int>(args.int_arg(0, 1));
  const bool hang = args.arg(1) == "hang";
  ::signal(SIGTERM, SIG_IGN);  // survivors must fail on their own, not by the launcher's TERM
  auto c = comm();
  at::Tensor t = at::ones({1024});
  c->all_reduce(t);  // everyone is connected
  std::cout << "transport " << (c->uses_shared_memory() ? "shm" : "gloo") << std::endl;
  if (c->rank() == victim) {
    if (hang) {
      std::this_thread::sleep_for(std::chrono::seconds(60));
      return 0;
    }
    ::raise(SIGKILL);
  }
  auto t0 = std::chrono::steady_clock::now();
  try {
    for (int i = 0; i < 3; ++i) c->all_reduce(t);
  } catch (const CommError& e) {
    auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count();
    std::cerr << "survivor rank " << c->rank() << " raised after " << ms << " ms: " << e.what() << "\n";
    return 3;
  }
  std::cerr << "survivor rank " << c->rank() << " did not raise\n";
  return 0;
}

// hold_store FILE: meets the other ranks through the rendezvous store (rank 0 hosts it
// unless the launcher does), says "store ready rank R", and exits 0 once FILE exists (at
// most 60 s), so that a test can look at the store while the job runs.
SCENARIO("hold_store") {
  auto c = comm();
  c->barrier();
  std::cout << "store ready rank " << c->rank() << std::endl;
  const std::string file = args.arg(0);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (::access(file.c_str(), F_OK) != 0 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  c->barrier();
  return ::access(file.c_str(), F_OK) == 0 ? 0 : 4;
}

// last_words: closes stderr, prints "pid P", "last words" and "exiting 5" on stdout and
// exits 5: a failing rank whose last output line a test can act on.
SCENARIO("last_words") {
  ::close(2);
  std::cout << "pid " << ::getpid() << "\nlast words\nexiting 5" << std::endl;
  std::_Exit(5);
}

// Prints lines on stdout and stderr, including a final line without a newline.
SCENARIO("echo") {
  const char* rank = std::getenv("RANK");
  std::cout << "out line 1 from " << rank << "\nout line 2 from " << rank << std::endl;
  std::cerr << "err line from " << rank << std::endl;
  std::cout << "omp=" << (std::getenv("OMP_NUM_THREADS") ? std::getenv("OMP_NUM_THREADS") : "unset")
            << " world=" << std::getenv("WORLD_SIZE") << " local=" << std::getenv("LOCAL_RANK")
            << " group=" << std::getenv("GROUP_RANK") << " tail-without-newline";
  return 0;
}

// all_to_all with uneven and empty splits: rank a sends (a + b) % 3 rows to rank b,
// each row tagged 100 * a + b.
SCENARIO("all_to_all") {
  auto c = comm();
  const int n = c->size(), r = c->rank();
  for (at::ScalarType dt : {at::kFloat, at::kBFloat16, at::kLong}) {
    std::vector<int64_t> send_sizes(n), recv_sizes(n);
    std::vector<at::Tensor> parts, want;
    for (int b = 0; b < n; ++b) {
      send_sizes[b] = (r + b) % 3;
      recv_sizes[b] = (b + r) % 3;
      parts.push_back(at::full({send_sizes[b], 2}, 100 * r + b, at::TensorOptions().dtype(dt)));
      want.push_back(at::full({recv_sizes[b], 2}, 100 * b + r, at::TensorOptions().dtype(dt)));
    }
    at::Tensor got = c->all_to_all(at::cat(parts, 0), send_sizes, recv_sizes);
    WCHECK(at::equal(got, at::cat(want, 0)), "all_to_all ", dt, " rank ", r, "\n", got);
  }
  std::cout << "all_to_all ok rank " << r << "\n";
  return 0;
}

// Prints where the environment puts this rank (distributed::World), then checks over the
// communicator that the ranks agree: every node index is counted by exactly
// local_world_size ranks, and the node indices cover [0, num_nodes).
SCENARIO("world_info") {
  const distributed::World w = distributed::World::from_env();
  std::cout << "world " << w.describe() << std::endl;
  auto c = comm();
  const int n = c->size();
  at::Tensor per_node = at::zeros({n}, at::kLong);
  per_node[w.node_rank] = 1;
  c->all_reduce(per_node);
  for (int node = 0; node < n; ++node) {
    const int64_t want = node < w.num_nodes ? w.local_world_size : 0;
    WCHECK(per_node[node].item<int64_t>() == want, "node ", node, " has ", per_node[node].item<int64_t>(),
           " ranks, expected ", want, " (", w.describe(), ")");
  }
  WCHECK(c->all_reduce_int(w.local_rank, ReduceOp::Max) == w.local_world_size - 1, "local ranks");
  std::cout << "world_info ok rank " << w.rank << std::endl;
  return 0;
}

// cpu_allocator: the CPU memory policy the communicator installed (TESSERA_CPU_ALLOCATOR).
SCENARIO("cpu_allocator") {
  auto c = comm();
  c->barrier();
  std::cout << "cpu allocator " << core::to_string(core::cpu_allocator_policy()) << "\n";
  return 0;
}

// restart_then_reduce BAD FAIL_ROUNDS [busy]: under `launch(max_restarts)`: rank BAD exits
// with code 5 in the first FAIL_ROUNDS rounds (TORCHELASTIC_RESTART_COUNT), after the
// ranks have met once in that round (so the store holds that round's keys); the others
// wait to be stopped (with "busy": in barriers, as training ranks would, so that a lost
// peer fails them). In later rounds every rank meets the others through the launcher's
// store, sums its rank and exits 0.
SCENARIO("restart_then_reduce") {
  const int bad = static_cast<int>(args.int_arg(0, 1));
  const int fail_rounds = static_cast<int>(args.int_arg(1, 1));
  const char* count_env = std::getenv("TORCHELASTIC_RESTART_COUNT");
  WCHECK(count_env != nullptr, "TORCHELASTIC_RESTART_COUNT is not set");
  const int count = std::stoi(count_env);
  WCHECK(env::get_int("TESSERA_RESTART_COUNT") == count,
         "TESSERA_RESTART_COUNT differs from TORCHELASTIC_RESTART_COUNT");
  auto c = comm();
  at::Tensor t = at::full({4}, static_cast<double>(c->rank()));
  c->all_reduce(t);
  const double want = c->size() * (c->size() - 1) / 2.0;
  WCHECK(t[0].item<double>() == want, "sum of ranks ", t[0].item<double>(), " != ", want);
  std::cout << "restart count " << count << " rank " << c->rank() << " of " << c->size() << " reduced "
            << t[0].item<double>() << std::endl;
  if (count < fail_rounds && c->rank() == bad) return 5;
  if (count < fail_rounds) {  // wait to be stopped by the launcher
    const bool busy = args.arg(2) == "busy";
    for (int i = 0; i < 600; ++i) {
      if (busy) c->barrier();
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  }
  c->barrier();
  return 0;
}

// fail_after_done BAD FAIL_ROUNDS: one rank per node, under launchers with --max-restarts:
// every rank meets the others (sums its rank); in the first FAIL_ROUNDS rounds the others
// exit 0 at once, and rank BAD exits 5 only once another node's launcher has counted its
// ranks done in the launchers' store (the round's "done" key, distributed/launch/rounds.h): a failure
// that comes after another node finished the round. Later rounds exit 0 after the sum.
SCENARIO("fail_after_done") {
  const int bad = static_cast<int>(args.int_arg(0, 1));
  const int fail_rounds = static_cast<int>(args.int_arg(1, 1));
  const char* count_env = std::getenv("TORCHELASTIC_RESTART_COUNT");
  WCHECK(count_env != nullptr, "TORCHELASTIC_RESTART_COUNT is not set");
  const int count = std::stoi(count_env);
  auto c = comm();
  at::Tensor t = at::full({1}, static_cast<double>(c->rank()));
  c->all_reduce(t);
  std::cout << "restart count " << count << " rank " << c->rank() << " of " << c->size() << " reduced "
            << t[0].item<double>() << std::endl;
  if (count >= fail_rounds || c->rank() != bad) return 0;
  c10d::TCPStoreOptions so;
  so.port = static_cast<uint16_t>(std::stoi(std::getenv("MASTER_PORT")));
  so.isServer = false;
  so.waitWorkers = false;
  so.timeout = std::chrono::seconds(30);
  c10d::TCPStore store(std::getenv("MASTER_ADDR"), so);
  const std::string done = "tessera/launch/" + std::to_string(count) + "/done";
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (store.add(done, 0) < 1) {
    WCHECK(std::chrono::steady_clock::now() < until, "no other node finished round ", count, " within 60 s");
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  std::cout << "failing after another node finished round " << count << std::endl;
  return 5;
}

// flood_on FILE BYTES: every rank meets the others and says so ("met rank R"); the last
// rank then waits for FILE to exist and writes BYTES bytes of output in 1000-byte lines
// (far more than a pipe holds: it gets through only while its launcher reads), says
// "flooded", and every rank waits up to 60 s to be stopped.
SCENARIO("flood_on") {
  const std::string file = args.arg(0);
  const int64_t bytes = args.int_arg(1, 1 << 20);
  auto c = comm();
  c->barrier();
  std::cout << "met rank " << c->rank() << std::endl;
  if (c->rank() == c->size() - 1) {
    for (int i = 0; i < 3000 && !std::ifstream(file).good(); ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    WCHECK(std::ifstream(file).good(), file, " did not appear within 60 s");
    const std::string line(999, 'x');
    for (int64_t n = 0; n < bytes; n += 1000) std::cout << line << '\n';
    std::cout << "flooded " << bytes << " bytes rank " << c->rank() << std::endl;
  }
  std::this_thread::sleep_for(std::chrono::seconds(60));
  return 0;
}
