// Rank programs for ShardedTensor, module/optimizer state dicts and the sharded
// embedding bag (tests/sharding/test_sharded_tensor.cpp, test_state.cpp, test_embedding.cpp).
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <iostream>

#include "support/scenario.h"
#include "tessera/nn/sharded_embedding_bag.h"
#include "tessera/sharding/sharded_tensor.h"
#include "tessera/state/module_state.h"
#include "tessera/state/optimizer_state.h"

using namespace tessera;
using namespace tessera::testing;
using namespace tessera::sharding;

namespace {

// Bit-level equality (distinguishes -0.0 from 0.0, compares NaN payloads).
bool bits_equal(const at::Tensor& a, const at::Tensor& b) {
  if (!a.defined() || !b.defined() || a.sizes() != b.sizes() || a.scalar_type() != b.scalar_type()) return false;
  if (a.numel() == 0) return true;
  at::ScalarType as = c10::elementSize(a.scalar_type()) == 2 ? at::kShort : c10::elementSize(a.scalar_type()) == 4 ? at::kInt : at::kLong;
  return at::equal(a.contiguous().view(as), b.contiguous().view(as));
}

// A reference tensor with awkward bits: random values plus -0.0 and a denormal.
at::Tensor reference(const std::vector<int64_t>& shape, at::ScalarType dt, uint64_t seed) {
  at::Generator g = at::detail::createCPUGenerator(seed);
  at::Tensor t = (at::rand(shape, g, at::kFloat) * 2 - 1).to(dt);
  if (t.numel() > 1) {
    t.view({-1})[0] = -0.0;
    t.view({-1})[t.numel() - 1] = dt == at::kFloat ? 1e-40 : 1e-39;
  }
  return t;
}

std::vector<Placement> cycle_ranks(int pieces, int world, int shift) {
  std::vector<Placement> p;
  for (int i = 0; i < pieces; ++i) p.push_back(Placement{(i + shift) % world});
  return p;
}

// Specs for a 2-D shape on `world` ranks: row- and column-wise chunks, N -> M pieces,
// everything on one rank, and an enumerable grid with several shards per rank and
// ranks holding nothing.
std::vector<std::pair<std::string, ShardingSpec>> specs(const std::vector<int64_t>& shape, int world) {
  std::vector<std::pair<std::string, ShardingSpec>> s;
  s.emplace_back("rows", ChunkSpec::over_ranks(0, world));
  s.emplace_back("cols", ChunkSpec::over_ranks(1, world));
  s.emplace_back("rows 2W+1 pieces", ChunkSpec{0, cycle_ranks(2 * world + 1, world, 1)});
  s.emplace_back("cols 3 pieces reversed", ChunkSpec{-1, cycle_ranks(3, world, world - 1)});
  s.emplace_back("one piece on the last rank", ChunkSpec{0, {Placement{world - 1}}});
  // 2 x 3 grid (row split at 1, column splits at 1 and 3), shards to ranks 0 and last.
  EnumerableSpec e;
  const int64_t r0 = std::min<int64_t>(1, shape[0]);
  const int64_t c0 = std::min<int64_t>(1, shape[1]), c1 = std::min<int64_t>(3, shape[1]);
  int k = 0;
  for (auto [ro, rs] : {std::pair<int64_t, int64_t>{0, r0}, {r0, shape[0] - r0}})
    for (auto [co, cs] : {std::pair<int64_t, int64_t>{0, c0}, {c0, c1 - c0}, {c1, shape[1] - c1}})
      e.shards.push_back(ShardMetadata{Box{{ro, co}, {rs, cs}}, Placement{(k++ % 2) ? world - 1 : 0}});
  s.emplace_back("grid on first and last rank", e);
  return s;
}

}  // namespace

SCENARIO("sharded_roundtrip") {
  auto c = comm();
  const int n = c->size(), r = c->rank();
  int checks = 0;
  for (at::ScalarType dt : {at::kFloat, at::kBFloat16}) {
    for (std::vector<int64_t> shape : {std::vector<int64_t>{7, 5}, {3, 4}, {0, 3}, {2, 1}}) {
      const at::Tensor full = reference(shape, dt, 42);
      auto all_specs = specs(shape, n);
      for (size_t i = 0; i < all_specs.size(); ++i) {
        const auto& [name, spec] = all_specs[i];
        const std::string tag = concat(name, " ", dt, " ", full_box(shape).to_string(), " rank ", r, "/", n);
        ShardedTensor st = ShardedTensor::scatter(full, spec, n - 1, c);
        WCHECK(st.shape() == shape && st.dtype() == dt, tag);
        for (auto& s : st.local_shards())
          WCHECK(bits_equal(s.tensor, narrow_to(full, full_box(shape), s.meta.box)), "scatter ", tag);
        WCHECK(bits_equal(st.full_tensor(), full), "full_tensor ", tag);
        for (int dst = 0; dst < n; ++dst) {
          at::Tensor g = st.gather(dst);
          WCHECK(r == dst ? bits_equal(g, full) : !g.defined(), "gather to ", dst, " ", tag);
        }
        // Regions: runs of rows (what a consolidated save gathers) and an inner box.
        std::vector<Box> regions = {full_box(shape)};
        for (int64_t r0 = 0; r0 < shape[0]; r0 += 2)
          regions.push_back({{r0, 0}, {std::min<int64_t>(2, shape[0] - r0), shape[1]}});
        if (shape[0] > 2 && shape[1] > 2) regions.push_back({{1, 1}, {shape[0] - 2, shape[1] - 2}});
        for (const Box& region : regions) {
          const int dst = static_cast<int>(region.offsets[0] % n);
          at::Tensor g = st.gather_region(region, dst);
          WCHECK(r == dst ? bits_equal(g, narrow_to(full, full_box(shape), region).contiguous()) : !g.defined(),
                 "gather_region ", region.to_string(), " to ", dst, " ", tag);
        }
        // To every other layout and back.
        for (size_t j = 0; j < all_specs.size(); ++j) {
          ShardedTensor other = st.reshard(all_specs[j].second);
          WCHECK(bits_equal(other.full_tensor(), full), "reshard ", tag, " -> ", all_specs[j].first);
          ShardedTensor back = ShardedTensor::zeros(spec, shape, at::TensorOptions().dtype(dt), c);
          back.copy_from(other);
          for (size_t k = 0; k < back.local_shards().size(); ++k)
            WCHECK(bits_equal(back.local_shards()[k].tensor, st.local_shards()[k].tensor), "round trip ", tag,
                   " via ", all_specs[j].first);
          ++checks;
        }
        // rand: the same numbers whatever the layout.
        ShardedTensor rnd = ShardedTensor::rand(spec, shape, 7, at::TensorOptions().dtype(dt), c);
        at::Generator g = at::detail::createCPUGenerator(7);
        WCHECK(bits_equal(rnd.full_tensor(), at::rand(shape, g, at::TensorOptions().dtype(dt))), "rand ", tag);
      }
    }
  }
  std::cout << "sharded roundtrip ok rank " << r << " checks " << checks << "\n";
  return 0;
}

// from_rule: FSDP's row-aligned cut (and torch.chunk's) as the only metadata: no list is
// built by making the tensor, aliasing it (with_local), comparing it with another made
// from the same rule, cloning it or converting its dtype; the list is built on first use
// (here by a gather), equals the rule's pieces, and the data round-trips bit-exact.
SCENARIO("from_rule") {
  auto c = comm();
  const int n = c->size(), r = c->rank();
  const std::vector<int64_t> shape{7, 3};
  const at::Tensor full = reference(shape, at::kFloat, 5);
  for (const Layout& rule : {Layout::flat(40, 6, n), Layout::chunk(0, n)}) {
    const std::string tag = concat(rule.rule_name(), " rank ", r, "/", n);
    const Box mine = rule.box(shape, r);
    auto make = [&](const at::Tensor& data) {
      return ShardedTensor::from_rule(Shard{data, ShardMetadata{mine, Placement{r}}}, rule, shape, data.scalar_type(), c);
    };
    ShardedTensor st = make(narrow_to(full, full_box(shape), mine).clone());
    WCHECK(st.metadata_is_rule_only(), "made: ", tag);
    ShardedTensor alias = st.with_local({Shard{st.local_tensor().to(at::kDouble), st.local_shards()[0].meta}}, at::kDouble);
    ShardedTensor twin = make(at::zeros(mine.sizes));
    WCHECK(alias.same_shards(st) && twin.same_layout(st) && !alias.same_layout(st), "compared: ", tag);
    ShardedTensor cl = st.clone(), half = st.to(at::kBFloat16);
    WCHECK(st.metadata_is_rule_only() && alias.metadata_is_rule_only() && twin.metadata_is_rule_only() &&
               cl.metadata_is_rule_only() && half.metadata_is_rule_only(),
           "a list was built without being asked for: ", tag);
    WCHECK(st.describe().find(rule.rule_name() + " rule of " + std::to_string(n) + " pieces") != std::string::npos,
           st.describe());
    WCHECK(bits_equal(st.full_tensor(), full), "full_tensor ", tag);
    const auto& all = st.shards_metadata();
    WCHECK(!st.metadata_is_rule_only() && !alias.metadata_is_rule_only() && all.size() == static_cast<size_t>(n),
           "listed: ", tag);  // copies share the built list
    for (int i = 0; i < n; ++i)
      WCHECK(all[i].box == rule.box(shape, i) && all[i].placement.rank == i, "shard ", i, " ", tag);
    WCHECK(bits_equal(alias.full_tensor(), full.to(at::kDouble)), "alias ", tag);
    WCHECK(twin.same_layout(st), "compared after the list was built: ", tag);
    // Another rank's piece, or a piece count that is not the world size, is refused.
    bool refused = false;
    try {
      ShardedTensor::from_rule(Shard{at::zeros(mine.sizes), ShardMetadata{mine, Placement{r}}},
                               rule.rule == Layout::Rule::Flat ? Layout::flat(40, 6, n + 1) : Layout::chunk(0, n + 1),
                               shape, at::kFloat, c);
    } catch (const std::exception& e) {
      refused = std::string(e.what()).find("for a communicator of " + std::to_string(n) + " ranks") != std::string::npos;
    }
    WCHECK(refused, "a rule of n + 1 pieces was taken: ", tag);
  }
  std::cout << "from_rule ok rank " << r << "\n";
  return 0;
}

// from_local_shards: a consistent set builds; a bad shard on one rank raises on every
// rank with a message naming it.
SCENARIO("from_local_shards") {
  auto c = comm();
  const int n = c->size(), r = c->rank();
  const std::vector<int64_t> shape{2 * n + 1, 3};
  const at::Tensor full = reference(shape, at::kFloat, 5);
  auto local_for = [&](int rank, int64_t shift) {
    // Rank k owns rows [2k, 2k+2), the last rank also the final row.
    int64_t begin = 2 * rank + shift, size = rank == n - 1 ? 3 : 2;
    Box b{{begin, 0}, {size, 3}};
    return Shard{narrow_to(full, full_box(shape), Box{{2 * rank, 0}, {size, 3}}).clone(), ShardMetadata{b, Placement{rank}}};
  };
  ShardedTensor ok = ShardedTensor::from_local_shards({local_for(r, 0)}, shape, c);
  WCHECK(at::equal(ok.full_tensor(), full), "from_local_shards values");
  WCHECK(ok.shards_metadata().size() == static_cast<size_t>(n), "metadata of every rank");
  const std::string mode = args.arg(0, "overlap");
  std::vector<Shard> bad{local_for(r, 0)};
  if (mode == "overlap" && r == n - 1) bad = {local_for(r, -1)};  // overlaps rank n-2 (or leaves row 0 out at n=1)
  if (mode == "shape" && r == n - 1) bad[0].tensor = at::zeros({1, 3});
  if (mode == "dtype" && r == n - 1) bad[0].tensor = bad[0].tensor.to(at::kDouble);
  try {
    ShardedTensor::from_local_shards(bad, shape, c);
  } catch (const Error& e) {
    std::cout << "from_local_shards error: " << e.what() << "\n";
    return 0;
  }
  WCHECK(false, "from_local_shards accepted bad shards (mode ", mode, ")");
  return 1;
}

// ------------------------------------------------------------- module state dicts
namespace {

struct Inner : torch::nn::Module, state::ConfigurableModel {
  Inner() { scale = register_buffer("scale", torch::ones({2})); }
  void configure_model(const std::shared_ptr<distributed::Communicator>& c) override {
    const int n = c->size();
    table = state::register_sharded_parameter(
        *this, "table", ShardedTensor::rand(ChunkSpec::over_ranks(0, n), {5, 3}, 11, at::kFloat, c));
    state::register_sharded_tensor(*this, "stats",
                                   ShardedTensor::rand(ChunkSpec::over_ranks(1, n), {4, 2 * n + 1}, 12, at::kFloat, c));
    ++calls;
  }
  at::Tensor table, scale;
  int calls = 0;
};

struct Outer : torch::nn::Module {
  Outer() {
    fc = register_module("fc", torch::nn::Linear(3, 2));
    inner = register_module("inner", std::make_shared<Inner>());
  }
  torch::nn::Linear fc{nullptr};
  std::shared_ptr<Inner> inner;
};

// Every value of a module state dict as full tensors (collective).
std::map<std::string, at::Tensor> snapshot(const state::StateDict& sd) {
  std::map<std::string, at::Tensor> m;
  sd.for_each([&](const std::string& k, const state::Value& v) {
    if (auto* t = std::get_if<at::Tensor>(&v)) m[k] = t->clone();
    if (auto* st = std::get_if<ShardedTensor>(&v)) m[k] = st->full_tensor();
  });
  return m;
}

void check_same(const std::map<std::string, at::Tensor>& a, const std::map<std::string, at::Tensor>& b,
                const std::string& what) {
  WCHECK(a.size() == b.size(), what, ": ", a.size(), " vs ", b.size(), " entries");
  for (auto& [k, t] : a) WCHECK(b.count(k) && bits_equal(t, b.at(k)), what, ": '", k, "' differs");
}

}  // namespace

SCENARIO("module_state") {
  auto c = comm();
  const int n = c->size(), r = c->rank();
  torch::manual_seed(1);
  auto m = std::make_shared<Outer>();
  WCHECK(state::configure_model(*m, c) == 1, "configure_model configures Inner once");
  WCHECK(state::configure_model(*m, c) == 0 && m->inner->calls == 1, "configure_model is idempotent");

  state::StateDict sd = state::state_dict(*m);
  const std::vector<std::string> want{"fc.weight", "fc.bias", "inner.scale", "inner.table", "inner.stats"};
  WCHECK(sd.keys() == want, "state_dict keys: ", [&] { std::string s; for (auto& k : sd.keys()) s += k + " "; return s; }());
  WCHECK(sd.sharded("inner.table").shape() == (std::vector<int64_t>{5, 3}), "table shape");
  WCHECK(sd.sharded("inner.table").local_tensor().unsafeGetTensorImpl() != m->inner->table.unsafeGetTensorImpl() &&
             sd.sharded("inner.table").local_tensor().data_ptr() == m->inner->table.data_ptr(),
         "state dict aliases the parameter's storage (detached)");
  at::Generator g = at::detail::createCPUGenerator(11);
  WCHECK(at::equal(sd.sharded("inner.table").full_tensor(), at::rand({5, 3}, g)), "table values");
  const auto original = snapshot(sd);
  const state::StateDict saved = state::clone_state_dict(sd);

  // Scramble everything, then strict load restores every entry bit for bit.
  {
    at::NoGradGuard ng;
    for (auto& p : m->parameters()) p.fill_(3.0);
    for (auto& b : m->buffers()) b.fill_(4.0);
    auto stats = *state::find_sharded_tensor(*m->inner, "stats");
    stats.apply_([](at::Tensor& t) { t.fill_(5.0); });
  }
  WCHECK(!bits_equal(snapshot(state::state_dict(*m))["inner.stats"], original.at("inner.stats")), "scrambled");
  auto rep = state::load_state_dict(*m, saved, true);
  WCHECK(rep.ok() && rep.loaded.size() == 5, "strict load report: ", rep.to_string());
  check_same(snapshot(state::state_dict(*m)), original, "after strict load");

  // A bad state dict: strict loading names every problem and changes nothing.
  state::StateDict bad = state::clone_state_dict(saved);
  bad.erase("fc.bias");
  bad.set("extra.step", int64_t{3});
  bad.set("inner.scale", torch::zeros({3}));
  bad.set("inner.stats", ShardedTensor::zeros(ChunkSpec::over_ranks(0, n), {4, 2 * n + 1}, at::kFloat, c));
  bad.set("fc.weight", torch::full({2, 3}, 7.0));
  try {
    state::load_state_dict(*m, bad, true);
    WCHECK(false, "strict load of a bad state dict succeeded");
  } catch (const Error& e) {
    const std::string msg = e.what();
    for (const char* part : {"missing key(s): fc.bias", "unexpected key(s): extra.step", "inner.scale: shape [3]",
                             n > 1 ? "inner.stats: sharding differs" : "nothing was loaded"})
      WCHECK(msg.find(part) != std::string::npos, "strict error lacks '", part, "': ", msg);
  }
  check_same(snapshot(state::state_dict(*m)), original, "failed strict load changed the module");

  // Non-strict: the lists, and everything loadable loaded.
  rep = state::load_state_dict(*m, bad, false);
  WCHECK(rep.missing == std::vector<std::string>{"fc.bias"}, "missing: ", rep.to_string());
  WCHECK(rep.unexpected == std::vector<std::string>{"extra.step"}, "unexpected: ", rep.to_string());
  WCHECK(rep.mismatched.size() == (n > 1 ? 2u : 1u), "mismatched: ", rep.to_string());
  WCHECK(at::equal(m->fc->weight, torch::full({2, 3}, 7.0)), "non-strict load loaded fc.weight");

  // Resharding on request, and a plain (full) tensor into a sharded one.
  state::LoadOptions lo;
  lo.strict = false;
  lo.allow_reshard = true;
  state::StateDict other;
  ShardedTensor rows = ShardedTensor::scatter(original.at("inner.stats"), ChunkSpec::over_ranks(0, n), 0, c);
  other.set("inner.stats", rows);
  other.set("inner.table", original.at("inner.table"));
  rep = state::load_state_dict(*m, other, lo);
  WCHECK(rep.loaded == (std::vector<std::string>{"inner.table", "inner.stats"}), "reshard load: ", rep.to_string());
  auto now = snapshot(state::state_dict(*m));
  WCHECK(bits_equal(now["inner.stats"], original.at("inner.stats")), "resharded stats");
  WCHECK(bits_equal(now["inner.table"], original.at("inner.table")), "table from a full tensor");
  std::cout << "module state ok rank " << r << "\n";
  return 0;
}

// ------------------------------------------------ sharded embedding: parity, optimizer
namespace {

constexpr int64_t kRows = 9, kDim = 4, kBatch = 10, kBag = 3;

struct ParityModel : torch::nn::Module {
  ParityModel(nn::BagMode mode, uint64_t emb_seed, uint64_t fc_seed) {
    nn::ShardedEmbeddingBagOptions o;
    o.num_embeddings = kRows;
    o.embedding_dim = kDim;
    o.mode = mode;
    o.seed = emb_seed;
    emb = register_module("emb", std::make_shared<nn::ShardedEmbeddingBag>(o));
    torch::manual_seed(fc_seed);
    fc = register_module("fc", torch::nn::Linear(kDim, 1));
  }
  std::shared_ptr<nn::ShardedEmbeddingBag> emb;
  torch::nn::Linear fc{nullptr};
};

struct Batch {
  at::Tensor bags, y;
};
// Two alternating batches.
Batch global_batch(int step) {
  at::Generator g = at::detail::createCPUGenerator(1000 + step % 2);
  return {at::randint(kRows, {kBatch, kBag}, g, at::kLong), at::rand({kBatch, 1}, g)};
}

std::unique_ptr<torch::optim::Optimizer> make_opt(const std::string& kind, std::vector<at::Tensor> params, double lr) {
  if (kind == "sgd") return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(lr).momentum(0.9));
  if (kind == "adamw") return std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(lr));
  return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(lr));
}

// One step on this rank's slice of the global batch; returns the global loss.
double train_step(ParityModel& m, torch::optim::Optimizer& opt, distributed::Communicator& c, int step) {
  Batch b = global_batch(step);
  Range mine = chunk_range(kBatch, c.size(), c.rank());
  at::Tensor bags = b.bags.narrow(0, mine.begin, mine.size), y = b.y.narrow(0, mine.begin, mine.size);
  opt.zero_grad();
  at::Tensor loss = (m.fc->forward(m.emb->forward(bags)) - y).pow(2).sum() / kBatch;
  loss.backward();
  for (auto& p : m.fc->parameters()) c.all_reduce(p.mutable_grad());  // replicated: sum of the ranks' parts
  opt.step();
  return c.all_reduce_double(loss.item<double>());
}

}  // namespace

// Same seed, same loss curve as an unsharded EmbeddingBag + Linear in this process.
SCENARIO("embedding_parity") {
  auto c = comm();
  const std::string mode_name = args.arg(0, "sum"), opt_kind = args.arg(1, "adam");
  const auto mode = mode_name == "mean" ? nn::BagMode::Mean : nn::BagMode::Sum;
  const int steps = 8;
  auto m = std::make_shared<ParityModel>(mode, 5, 6);
  state::configure_model(*m, c);
  WCHECK(m->emb->row_count() == chunk_range(kRows, c->size(), c->rank()).size, "rows owned");
  auto opt = make_opt(opt_kind, m->parameters(), 0.05);

  auto ref_emb = torch::nn::EmbeddingBag(torch::nn::EmbeddingBagOptions(kRows, kDim).mode(
      mode == nn::BagMode::Mean ? torch::nn::EmbeddingBagMode(torch::kMean) : torch::nn::EmbeddingBagMode(torch::kSum)));
  {
    at::Generator g = at::detail::createCPUGenerator(5);
    at::NoGradGuard ng;
    ref_emb->weight.copy_(at::rand({kRows, kDim}, g));
  }
  torch::manual_seed(6);
  auto ref_fc = torch::nn::Linear(kDim, 1);
  std::vector<at::Tensor> ref_params = ref_emb->parameters();
  for (auto& p : ref_fc->parameters()) ref_params.push_back(p);
  auto ref_opt = make_opt(opt_kind, ref_params, 0.05);

  std::vector<double> got, want;
  for (int s = 0; s < steps; ++s) {
    got.push_back(train_step(*m, *opt, *c, s));
    Batch b = global_batch(s);
    ref_opt->zero_grad();
    at::Tensor loss = (ref_fc->forward(ref_emb->forward(b.bags)) - b.y).pow(2).sum() / kBatch;
    loss.backward();
    ref_opt->step();
    want.push_back(loss.item<double>());
  }
  for (int s = 0; s < steps; ++s) {
    std::cout << "step " << s << " loss " << got[s] << " reference " << want[s] << "\n";
    WCHECK(std::abs(got[s] - want[s]) <= 1e-5 * std::abs(want[s]), "step ", s, " loss ", got[s], " vs ", want[s]);
  }
  WCHECK(got[steps - 2] < got[0], "loss did not fall on the same batch: ", got[0], " -> ", got[steps - 2]);
  at::Tensor table = m->emb->table().full_tensor();
  WCHECK(at::allclose(table, ref_emb->weight, 1e-5, 1e-6), "trained tables differ");
  std::cout << "embedding parity ok rank " << c->rank() << "\n";
  return 0;
}

// Continuing after a save/load of model + optimizer state gives the numbers of never stopping.
SCENARIO("optimizer_state") {
  auto c = comm();
  const std::string kind = args.arg(0, "adam");
  auto a = std::make_shared<ParityModel>(nn::BagMode::Sum, 5, 6);
  state::configure_model(*a, c);
  auto opt_a = make_opt(kind, a->parameters(), 0.05);
  for (int s = 0; s < 3; ++s) train_step(*a, *opt_a, *c, s);
  const state::StateDict msd = state::clone_state_dict(state::state_dict(*a));
  const state::StateDict osd = state::clone_state_dict(state::optimizer_state_dict(*opt_a, *a));
  const state::StateDict& emb_state = osd.dict("state").dict("emb.weight");
  if (kind != "sgd") {
    WCHECK(emb_state.integer("step") == 3, "step counter");
    WCHECK(emb_state.sharded("exp_avg").shape() == (std::vector<int64_t>{kRows, kDim}), "sharded exp_avg");
    WCHECK(osd.dict("state").dict("fc.weight").tensor("exp_avg").sizes() == at::IntArrayRef({1, kDim}), "fc state");
  } else {
    WCHECK(emb_state.sharded("momentum_buffer").shards_metadata() == a->emb->table().shards_metadata(),
           "momentum buffer sharded like the table");
  }
  WCHECK(osd.dict("param_groups").dict("0").number("lr") == 0.05, "lr saved");
  std::vector<double> straight;
  for (int s = 3; s < 6; ++s) straight.push_back(train_step(*a, *opt_a, *c, s));

  auto b = std::make_shared<ParityModel>(nn::BagMode::Sum, 77, 78);
  state::configure_model(*b, c);
  auto opt_b = make_opt(kind, b->parameters(), 0.5);
  train_step(*b, *opt_b, *c, 0);  // state to be replaced
  state::load_state_dict(*b, msd, true);
  state::load_optimizer_state_dict(*opt_b, *b, osd);
  WCHECK(opt_b->param_groups()[0].options().get_lr() == 0.05, "lr restored");
  std::vector<double> resumed;
  for (int s = 3; s < 6; ++s) resumed.push_back(train_step(*b, *opt_b, *c, s));
  for (int i = 0; i < 3; ++i) WCHECK(resumed[i] == straight[i], "step ", i + 3, ": resumed ", resumed[i], " vs ", straight[i]);
  WCHECK(bits_equal(b->emb->table().full_tensor(), a->emb->table().full_tensor()), "tables after resume");
  std::cout << "optimizer state ok rank " << c->rank() << "\n";
  return 0;
}
