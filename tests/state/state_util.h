// Scenario helpers on StateDicts: a zeroed copy with the same layout (a load target)
// and a bit-for-bit comparison of two of them (plain tensors, this rank's shards and
// plain values).
#pragma once
#include <ATen/ATen.h>

#include <cstring>
#include <memory>
#include <string>

#include "support/scenario.h"
#include "tessera/state/state_dict.h"

namespace tessera::testing {

// Same keys, kinds, shapes, dtypes and sharding as `sd`; tensors zero, plain values kept.
inline state::StateDict zeroed_copy(const state::StateDict& sd) {
  state::StateDict out;
  for (const auto& k : sd.keys()) {
    const state::Value& v = sd.at(k);
    if (auto t = std::get_if<at::Tensor>(&v)) {
      out.set(k, at::zeros_like(*t));
    } else if (auto s = std::get_if<sharding::ShardedTensor>(&v)) {
      sharding::ShardedTensor z = s->clone();
      for (const auto& sh : z.local_shards()) sh.tensor.zero_();
      out.set(k, z);
    } else if (auto d = std::get_if<std::shared_ptr<state::StateDict>>(&v); d && *d) {
      out.set(k, std::make_shared<state::StateDict>(zeroed_copy(**d)));
    } else {
      out.set(k, v);
    }
  }
  return out;
}

// Throws naming the first key where `got` and `want` differ in any bit.
inline void check_bit_equal(const state::StateDict& got, const state::StateDict& want, const std::string& what) {
  auto fg = got.flatten(), fw = want.flatten();
  WCHECK(fg.size() == fw.size(), what, ": ", fg.size(), " keys vs ", fw.size());
  for (size_t i = 0; i < fw.size(); ++i) {
    const std::string& k = fw[i].first;
    const state::Value& a = *fg[i].second;
    const state::Value& b = *fw[i].second;
    WCHECK(fg[i].first == k && a.index() == b.index(), what, ": key ", k, " differs in name or kind");
    auto same = [](const at::Tensor& x, const at::Tensor& y) {
      return x.scalar_type() == y.scalar_type() && x.sizes() == y.sizes() &&
             (x.numel() == 0 || std::memcmp(x.contiguous().data_ptr(), y.contiguous().data_ptr(), x.nbytes()) == 0);
    };
    if (auto t = std::get_if<at::Tensor>(&a)) {
      WCHECK(same(*t, std::get<at::Tensor>(b)), what, ": tensor ", k, " differs");
    } else if (auto s = std::get_if<sharding::ShardedTensor>(&a)) {
      const auto& u = std::get<sharding::ShardedTensor>(b);
      WCHECK(s->local_shards().size() == u.local_shards().size(), what, ": ", k, " local shard count");
      for (size_t j = 0; j < u.local_shards().size(); ++j)
        WCHECK(s->local_shards()[j].meta.box == u.local_shards()[j].meta.box &&
                   same(s->local_shards()[j].tensor, u.local_shards()[j].tensor),
               what, ": sharded ", k, " shard ", u.local_shards()[j].meta.box.to_string(), " differs");
    } else if (auto x = std::get_if<int64_t>(&a)) {
      WCHECK(*x == std::get<int64_t>(b), what, ": int ", k);
    } else if (auto d = std::get_if<double>(&a)) {
      WCHECK(std::memcmp(d, &std::get<double>(b), sizeof(double)) == 0, what, ": float ", k);
    }
  }
}

}  // namespace tessera::testing
