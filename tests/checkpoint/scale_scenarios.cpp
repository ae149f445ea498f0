// Rank program for the many-rank checkpoint test (tests/checkpoint/test_scale.cpp).
#include <ATen/ATen.h>
#include <torch/optim/adam.h>

#include <cstdio>

#include "strategy/state_as_dict.h"
#include "strategy/strategy_scenario_util.h"
#include "support/scenario.h"
#include "tessera/checkpoint/checkpoint.h"

using namespace tessera;
using namespace tessera::testing;
using namespace tessera::testing::strategy_util;

// ckpt_scale save DIR REF | load DIR OUT: FSDP FULL_SHARD of the strategy tests' model
// (445 parameters a block: at 64 ranks most pieces are a few rows or empty) with Adam
// state. "save": one Adam step from gradients that differ per rank and element, then a
// sharded save to DIR and a consolidated one of the same state to REF. "load": a fresh
// model at this world size, Adam state materialized, DIR loaded into its sharded state,
// which is then saved consolidated to OUT (the test compares OUT with REF bit for bit).
SCENARIO("ckpt_scale") {
  at::set_num_threads(1);
  auto c = comm();
  const std::string phase = args.arg(0), dir = args.arg(1), out = args.arg(2);
  auto strat = make_strategy("full", c);
  auto m = strat->setup(make_model());
  auto opt = std::make_shared<torch::optim::Adam>(strat->module()->parameters(), torch::optim::AdamOptions(1e-2));
  strat->add_optimizer(opt);
  int i = 0;
  for (auto& p : strat->module()->parameters()) {
    at::Tensor g = at::zeros_like(p);
    if (phase == "save" && p.numel() > 0)
      g = at::sin(at::arange(p.numel(), p.options()).reshape(p.sizes()) * 0.37 + (c->rank() * 31 + i)) * 1e-2;
    p.mutable_grad() = g;
    ++i;
  }
  opt->step();
  opt->zero_grad();
  state::StateDict sd = as_dict(strat->state(strategy::StateDictType::Sharded));
  if (phase == "save") {
    checkpoint::save(sd, dir, *c, {checkpoint::SaveMode::Sharded});
    // FSDP's parameters and their Adam moments hold their shards as the unit's rule: the
    // training step, the state dicts and the sharded save built no list of every rank's
    // shard (O(ranks) per tensor).
    int rule_only = 0, sharded = 0;
    for (const auto& [k, v] : sd.flatten())
      if (auto s = std::get_if<sharding::ShardedTensor>(v)) {
        ++sharded;
        rule_only += s->metadata_is_rule_only();
      }
    WCHECK(sharded > 0 && rule_only == sharded, rule_only, " of ", sharded, " sharded tensors hold only their rule");
    checkpoint::save(sd, out, *c, {checkpoint::SaveMode::Full});
    std::printf("saved rank %d rule-only %d of %d\n", c->rank(), rule_only, sharded);
    return 0;
  }
  auto res = checkpoint::load(sd, dir, *c);
  WCHECK(res.missing.empty() && res.unexpected.empty() && res.mismatched.empty(), "load: ", res.missing.size(),
         " missing, ", res.unexpected.size(), " unexpected, ", res.mismatched.size(), " mismatched");
  checkpoint::save(sd, out, *c, {checkpoint::SaveMode::Full});
  std::printf("loaded rank %d\n", c->rank());
  return 0;
}
