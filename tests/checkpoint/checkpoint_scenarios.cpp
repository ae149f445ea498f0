// Rank programs for the checkpoint tests: save a known state at one world size, load it
// at another and compare bit for bit; a save loop for the kill -9 test; async saves.
#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <future>
#include <iostream>
#include <thread>

#include "support/scenario.h"
#include "tessera/checkpoint/checkpoint.h"
#include "tessera/checkpoint/reader.h"
#include "tessera/checkpoint/test_hooks.h"  // set_async_save_hook_for_tests
#include "tessera/sharding/sharded_tensor.h"
#include "tessera/state/state_dict.h"

using namespace tessera;
using namespace tessera::testing;
namespace ck = tessera::checkpoint;

namespace {

struct KeySpec {
  std::string fqn;
  std::vector<int64_t> shape;
  at::ScalarType dtype;
  int64_t dim;  // sharding dim, -1: replicated plain tensor
};

// Uneven shapes, bf16 and f32, zero-size tensors, a 0-dim scalar.
const std::vector<KeySpec>& key_specs() {
  static const std::vector<KeySpec> k = {
      {"model.w", {7, 5}, at::kFloat, 0},     {"model.v", {3, 10}, at::kBFloat16, 1},
      {"model.e", {0, 4}, at::kFloat, 0},     {"model.b", {5}, at::kFloat, -1},
      {"model.s", {}, at::kDouble, -1},       {"model.z", {0}, at::kLong, -1},
      {"opt.m", {9}, at::kBFloat16, 0},       {"opt.big", {6, 3, 2}, at::kFloat, 1}};
  return k;
}

// The full value of a key: multiples of 1/4 in [-11, 11] (exact in bf16), shifted by `iter`.
at::Tensor full_value(const KeySpec& k, int64_t iter) {
  int64_t h = 0;
  for (char c : k.fqn) h = (h * 31 + c) % 23;
  at::Tensor t = (at::arange(sharding::full_box(k.shape).numel(), at::kDouble) * 7 + h + iter).remainder(23) - 11;
  return (t * 0.25).reshape(k.shape).to(k.dtype);
}

state::StateDict make_state(const std::shared_ptr<distributed::Communicator>& c, bool sharded, bool zeros, int64_t iter) {
  auto model = std::make_shared<state::StateDict>();
  auto opt = std::make_shared<state::StateDict>();
  for (const auto& k : key_specs()) {
    at::Tensor full = zeros ? at::zeros(k.shape, at::TensorOptions().dtype(k.dtype)) : full_value(k, iter);
    auto& sd = k.fqn.rfind("model.", 0) == 0 ? *model : *opt;
    const std::string name = k.fqn.substr(k.fqn.find('.') + 1);
    if (k.dim < 0 || !sharded) {
      sd.set(name, full);
      continue;
    }
    auto shards = sharding::build_shards(sharding::ChunkSpec::over_ranks(k.dim, c->size()), k.shape);
    std::vector<sharding::Shard> local;
    for (const auto& s : shards)
      if (s.placement.rank == c->rank())
        local.push_back({sharding::narrow_to(full, sharding::full_box(k.shape), s.box).clone(), s});
    sd.set(name, sharding::ShardedTensor::from_parts(local, shards, k.shape, k.dtype, c));
  }
  state::StateDict sd;
  sd.set("model", model);
  opt->set("step", zeros ? int64_t(0) : int64_t(7 + iter));
  opt->set("lr", zeros ? 0.0 : 0.125);
  sd.set("opt", opt);
  sd.set("name", zeros ? std::string() : std::string("tessera"));
  sd.set("blob", state::Bytes{zeros ? std::string() : std::string("a\0b", 3)});
  return sd;
}

// The 2-D keys of the save loop's "2d" form, on a (dp 2, tp 2) mesh of 4 ranks, rank =
// p·2 + t (tp innermost), laid out as FSDP over TP saves them (strategy/tp_state.cpp): one
// FSDP unit of each TP rank holds qkv's TP piece ([6, 4]: rows 2t, 2t+1 of each of its 3
// stripes) then the norm ([4], replicated over tp), 28 elements cut over dp by FSDP's flat
// rule. "tp.qkv" is one tp rule over the world; "tp.norm" FSDP's flat cut over each tp rank's
// dp group (ranks t and t + 2), whose two replica groups interleave in the world.
const std::vector<KeySpec>& tp_specs() {
  static const std::vector<KeySpec> k = {{"tp.qkv", {12, 4}, at::kFloat, 0}, {"tp.norm", {4}, at::kFloat, -1}};
  return k;
}
constexpr int64_t kTpUnit = 28;

void add_2d_state(state::StateDict& sd, const std::shared_ptr<distributed::Communicator>& world,
                  const std::shared_ptr<distributed::Communicator>& dp, int64_t iter) {
  WCHECK(world->size() == 4 && dp->size() == 2, "the 2-D save loop runs on 4 ranks (dp 2 x tp 2)");
  auto tp = std::make_shared<state::StateDict>();
  const KeySpec& q = tp_specs()[0];
  const KeySpec& n = tp_specs()[1];
  const sharding::Layout L = sharding::Layout::tensor_parallel(0, 3, 2, sharding::Layout::flat(kTpUnit, 0, 2));
  std::vector<sharding::Shard> mine;
  const at::Tensor qf = full_value(q, iter);
  for (int64_t s = 0; s < 3; ++s) {
    const sharding::Box b = L.box(q.shape, world->rank() * 3 + s);
    mine.push_back({sharding::narrow_to(qf, sharding::full_box(q.shape), b).clone(),
                    sharding::ShardMetadata{b, {world->rank(), at::kCPU}}});
  }
  tp->set("qkv", sharding::ShardedTensor::from_rule(mine, L, q.shape, q.dtype, world));
  const sharding::Layout F = sharding::Layout::flat(kTpUnit, 24, 2);
  const sharding::Box b = F.box(n.shape, dp->rank());
  tp->set("norm", sharding::ShardedTensor::from_rule(
                      sharding::Shard{sharding::narrow_to(full_value(n, iter), sharding::full_box(n.shape), b).clone(),
                                      sharding::ShardMetadata{b, {dp->rank(), at::kCPU}}},
                      F, n.shape, n.dtype, dp));
  sd.set("tp", tp);
}

void check_state(state::StateDict& sd, int64_t iter, const std::string& tag) {
  for (const auto& k : key_specs()) {
    const auto& part = sd.dict(k.fqn.substr(0, k.fqn.find('.')));
    const std::string name = k.fqn.substr(k.fqn.find('.') + 1);
    at::Tensor full = full_value(k, iter);
    const auto& v = part.at(name);
    if (auto t = std::get_if<at::Tensor>(&v)) {
      WCHECK(t->scalar_type() == k.dtype && at::equal(*t, full), tag, ": key ", k.fqn, " differs: ", *t, " vs ", full);
    } else {
      const auto& s = std::get<sharding::ShardedTensor>(v);
      for (const auto& sh : s.local_shards()) {
        at::Tensor want = sharding::narrow_to(full, sharding::full_box(k.shape), sh.meta.box);
        WCHECK(at::equal(sh.tensor, want), tag, ": key ", k.fqn, " shard ", sh.meta.box.to_string(), " differs");
      }
    }
  }
  if (sd.contains("tp"))
    for (const auto& k : tp_specs()) {
      const at::Tensor& t = sd.dict("tp").tensor(k.fqn.substr(3));
      WCHECK(at::equal(t, full_value(k, iter)), tag, ": key ", k.fqn, " differs: ", t, " vs ", full_value(k, iter));
    }
  WCHECK(sd.dict("opt").integer("step") == 7 + iter, tag, ": step");
  WCHECK(sd.dict("opt").number("lr") == 0.125, tag, ": lr");
  WCHECK(sd.string("name") == "tessera", tag, ": name");
  WCHECK(sd.bytes("blob").data == std::string("a\0b", 3), tag, ": blob");
}

}  // namespace

// ckpt_save DIR MODE(sharded|full) LAYOUT(sharded|plain)
SCENARIO("ckpt_save") {
  auto c = comm();
  auto sd = make_state(c, args.arg(2, "sharded") == "sharded", false, 0);
  ck::save(sd, args.arg(0), *c, {args.arg(1, "sharded") == "full" ? ck::SaveMode::Full : ck::SaveMode::Sharded});
  std::cout << "saved rank " << c->rank() << std::endl;
  return 0;
}

// ckpt_full_big FILE: a consolidated save of tensors larger than the save's gather slice
// (so they are gathered and written as several runs of rows), uneven over the ranks,
// then loaded back sharded and checked element for element. {3072, 1024} splits at
// 3 ranks on checksum-block boundaries (4 MiB), so each rank's rows are read straight
// into its shard; the uneven ones need blocks widened and go through a buffer.
SCENARIO("ckpt_full_big") {
  auto c = comm();
  const std::vector<std::vector<int64_t>> shapes = {{3500001, 3}, {7, 1000003}, {5}, {3072, 1024}};
  auto make = [&](bool zeros) {
    state::StateDict sd;
    for (size_t i = 0; i < shapes.size(); ++i) {
      auto spec = sharding::ChunkSpec::over_ranks(0, c->size());
      at::Tensor full = at::arange(0, c10::multiply_integers(shapes[i]), at::kFloat).reshape(shapes[i]) + float(i);
      sd.set(concat("t", i), zeros ? sharding::ShardedTensor::zeros(spec, shapes[i], at::TensorOptions(), c)
                                   : sharding::ShardedTensor::scatter(full, spec, 0, c));
    }
    return sd;
  };
  ck::save(make(false), args.arg(0), *c, {ck::SaveMode::Full});
  auto back = make(true);
  ck::load(back, args.arg(0), *c, {true});
  for (size_t i = 0; i < shapes.size(); ++i) {
    at::Tensor want = at::arange(0, c10::multiply_integers(shapes[i]), at::kFloat).reshape(shapes[i]) + float(i);
    WCHECK(at::equal(back.sharded(concat("t", i)).full_tensor(), want), "tensor t", i, " after full save + load");
  }
  std::cout << "full big ok rank " << c->rank() << std::endl;
  return 0;
}

// ckpt_load DIR LAYOUT(sharded|plain)
SCENARIO("ckpt_load") {
  auto c = comm();
  auto sd = make_state(c, args.arg(1, "sharded") == "sharded", true, 0);
  ck::LoadResult r = ck::load(sd, args.arg(0), *c, {true});
  WCHECK(r.missing.empty() && r.unexpected.empty() && r.mismatched.empty(), "clean load");
  check_state(sd, 0, concat("rank ", c->rank(), "/", c->size()));
  std::cout << "loaded ok rank " << c->rank() << " keys " << r.loaded.size() << std::endl;
  return 0;
}

// ckpt_load_error DIR: a load that must fail; each rank prints the error it got as one
// line ("load error rank R: ..."), and all wait for each other before exiting, so no rank
// is stopped by the launcher before it has printed (a rank that loads prints "no error").
SCENARIO("ckpt_load_error") {
  auto c = comm();
  auto sd = make_state(c, true, true, 0);
  std::string line = "no error";
  try {
    ck::load(sd, args.arg(0), *c, {true});
  } catch (const std::exception& e) {
    line = e.what();
    std::replace(line.begin(), line.end(), '\n', ' ');
  }
  std::cout << "load error rank " << c->rank() << ": " << line << std::endl;
  c->barrier();
  return 0;
}

// ckpt_save_loop DIR MODE [async|sync] [2d]: saves iterations 1, 2, ... until killed
// (bounded: 60 s), printing "saved I" once iteration I is committed. async: each iteration
// is a save_async, and the next one is prepared while it is written (save_async waits for
// the previous one, so its return means that one is committed). 2d: on 4 ranks, the state
// also holds the 2-D keys (tp_specs), a format-3 checkpoint when sharded.
SCENARIO("ckpt_save_loop") {
  auto c = comm();
  const auto mode = args.arg(1, "sharded") == "full" ? ck::SaveMode::Full : ck::SaveMode::Sharded;
  const bool async = args.arg(2) == "async";
  std::shared_ptr<distributed::Communicator> dp;
  if (args.arg(3) == "2d") dp = c->split({{0, 2}, {1, 3}});
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 1; std::chrono::steady_clock::now() - t0 < std::chrono::seconds(60); ++i) {
    auto sd = make_state(c, true, false, i);
    if (dp) add_2d_state(sd, c, dp, i);
    if (!async) {
      ck::save(sd, args.arg(0), *c, {mode});
      std::cout << "saved " << i << std::endl;
      continue;
    }
    ck::AsyncSave h = ck::save_async(sd, args.arg(0), c, {mode});
    if (i == 1) h.wait();  // the first commit starts the test's clock
    std::cout << "saved " << (i == 1 ? 1 : i - 1) << std::endl;
  }
  return 0;
}

// ckpt_async_full_2d DIR: on 4 ranks, a consolidated background save of the 2-D state
// (tp.norm lives on a data-parallel group of 2) must fail naming the key; prints the error.
SCENARIO("ckpt_async_full_2d") {
  auto c = comm();
  auto dp = c->split({{0, 2}, {1, 3}});
  auto sd = make_state(c, true, false, 1);
  add_2d_state(sd, c, dp, 1);
  std::string error = "no error";
  try {
    ck::save_async(sd, args.arg(0), c, {ck::SaveMode::Full}).wait();
  } catch (const std::exception& e) {
    error = e.what();
  }
  std::cout << "error: " << error << std::endl;
  c->barrier();
  return 0;
}

// ckpt_verify_iter DIR: loads DIR (plain layout) and checks it is one whole iteration.
SCENARIO("ckpt_verify_iter") {
  auto c = comm();
  auto sd = make_state(c, false, true, 0);
  if (ck::open_checkpoint(args.arg(0)).entries.count("tp.qkv")) {  // the 2-D form: its keys whole
    auto tp = std::make_shared<state::StateDict>();
    for (const auto& k : tp_specs()) tp->set(k.fqn.substr(3), at::zeros(k.shape, at::TensorOptions().dtype(k.dtype)));
    sd.set("tp", tp);
  }
  ck::load(sd, args.arg(0), *c, {true});
  const int64_t iter = sd.dict("opt").integer("step") - 7;
  check_state(sd, iter, concat("iteration ", iter));
  std::cout << "iteration " << iter << std::endl;
  return 0;
}

// ckpt_async DIR: the background communicator prepared, then two async saves overlapping
// the caller's collectives, then a load.
// DIR must not exist and be the only entry of its parent.
SCENARIO("ckpt_async") {
  namespace fs = std::filesystem;
  auto c = comm();
  const std::string dir = args.arg(0);
  const fs::path parent = fs::path(dir).parent_path();
  WCHECK(!fs::exists(dir) && fs::is_empty(parent), dir, " exists or its parent is not empty");
  auto sd = make_state(c, true, false, 1);
  // The background communicator, created ahead of the first save (what ModelCheckpoint
  // does at fit start) and created once: a second call returns the same one.
  auto bg = ck::prepare_async_save(c);
  WCHECK(bg != nullptr && bg != c && bg->size() == c->size() && bg->rank() == c->rank(),
         "prepare_async_save did not return a communicator of its own over the same ranks");
  WCHECK(ck::prepare_async_save(c) == bg, "a second prepare_async_save created another communicator");
  std::string null_error;
  try {
    ck::prepare_async_save(nullptr);
  } catch (const std::exception& e) {
    null_error = e.what();
  }
  WCHECK(null_error.find("prepare_async_save") != std::string::npos, "prepare_async_save(nullptr): '", null_error, "'");
  // The first save's background thread waits at a gate that this thread opens only after
  // the checks below: save_async must return while the write has not begun. (A save_async
  // that wrote in the calling thread would have committed DIR already, or would run the
  // hook on this thread: that is refused rather than left to deadlock.)
  const auto caller = std::this_thread::get_id();
  std::promise<void> reached, open;
  std::future<void> reached_f = reached.get_future();
  std::shared_future<void> opened = open.get_future().share();
  ck::set_async_save_hook_for_tests([&reached, opened, caller] {
    if (std::this_thread::get_id() == caller) throw Error("save_async ran its write on the calling thread");
    reached.set_value();
    opened.wait();
  });
  ck::AsyncSave h = ck::save_async(sd, dir, c, {ck::SaveMode::Sharded});
  ck::set_async_save_hook_for_tests(nullptr);
  WCHECK(!h.done(), "save_async returned a finished save (it wrote synchronously)");
  WCHECK(!fs::exists(dir), "save_async returned after committing ", dir);
  WCHECK(reached_f.wait_for(std::chrono::seconds(60)) == std::future_status::ready,
         "the background save did not start within 60 s");
  WCHECK(!h.done() && !fs::exists(dir) && fs::is_empty(parent), "the save went on past the gate");
  // Mutating the live state after save_async returns must not change what is saved
  // (the background write has not started: it can only see the snapshot).
  for (const auto& k : sd.dict("model").keys()) {
    auto& v = sd.dict("model").at(k);
    if (auto t = std::get_if<at::Tensor>(&v)) t->fill_(0);
    if (auto s = std::get_if<sharding::ShardedTensor>(&v))
      for (auto& sh : s->local_shards()) sh.tensor.fill_(0);
  }
  c->barrier();  // every rank has checked the directory before any gate opens
  open.set_value();
  for (int i = 0; i < 20; ++i) {  // collectives of the caller keep running meanwhile
    at::Tensor t = at::ones({1000});
    c->all_reduce(t);
    WCHECK(t[0].item<float>() == c->size(), "all_reduce during async save");
  }
  auto sd2 = make_state(c, true, false, 2);
  ck::AsyncSave h2 = ck::save_async(sd2, dir + ".2", c, {ck::SaveMode::Full});  // waits for the first
  WCHECK(h.done(), "second save_async waited for the first");
  h.wait();
  h2.wait();
  WCHECK(fs::exists(dir) && h2.done(), "a save was not committed after wait()");
  auto t1 = make_state(c, true, true, 0);
  ck::load(t1, dir, *c);
  check_state(t1, 1, "async sharded");
  auto t2 = make_state(c, true, true, 0);
  ck::load(t2, dir + ".2", *c);
  check_state(t2, 2, "async full");
  std::cout << "async ok rank " << c->rank() << std::endl;
  return 0;
}
