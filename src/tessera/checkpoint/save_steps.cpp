#include "tessera/checkpoint/save_steps.h"

#include <ATen/ATen.h>

#include <algorithm>

#include "tessera/checkpoint/format/safetensors.h"
#include "tessera/checkpoint/rank_agreement.h"
#include "tessera/checkpoint/storage/commit.h"
#include "tessera/checkpoint/storage/file.h"
#include "tessera/checkpoint/wire.h"
#include "tessera/checkpoint/writer.h"
#include "tessera/core/error.h"

namespace tessera::checkpoint {

// ------------------------------------------------------------------ what both saves share

EntryInfo describe_entry(const std::string& fqn, const state::Value& v) {
  EntryInfo e;
  if (auto t = std::get_if<at::Tensor>(&v)) {
    TESSERA_CHECK(t->defined(), "cannot save key '", fqn, "': undefined tensor");
    e.kind = kTensorKind;
    e.dtype = t->scalar_type();
    e.shape = t->sizes().vec();
    dtype_name(e.dtype);  // throws for unsupported dtypes
  } else if (auto s = std::get_if<sharding::ShardedTensor>(&v)) {
    TESSERA_CHECK(s->defined(), "cannot save key '", fqn, "': undefined sharded tensor");
    e.kind = kShardedKind;
    e.dtype = s->dtype();
    e.shape = s->shape();
    dtype_name(e.dtype);
  } else {
    e.kind = state::kind_name(v);
    e.value = v;
  }
  return e;
}

std::string prepare_target(const CheckedPath& path, bool dir, std::optional<CheckedPath>& tmp) {
  try {
    recover_siblings(path);
    check_replaceable(path);
    tmp = temp_sibling(path);
    if (dir) make_dir(*tmp);
    return "";
  } catch (const std::exception& e) {
    return e.what();
  }
}

TempGuard::~TempGuard() {
  if (committed || !tmp) return;
  try {
    remove_all(*tmp);
  } catch (const std::exception&) {
  }
}

// ------------------------------------------------------------------ layout agreement

std::string SaveLayout::packed() const {
  Packer p;
  p.u64(records.size());
  for (const auto& [k, d] : records) p.str(k).str(d);
  return p.bytes();
}

uint64_t SaveLayout::digest() const { return fnv1a64(packed()); }

SaveLayout structure_of(const CheckpointMetadata& m) {
  SaveLayout out;
  out.records.reserve(m.keys.size());
  for (const auto& k : m.keys) {
    const EntryInfo& e = m.entries.at(k);
    out.records.emplace_back(k, e.is_tensor() ? entry_json(e) : e.kind);
  }
  return out;
}

void check_same_layout(distributed::Communicator& comm, const SaveLayout& mine, const std::vector<uint64_t>& digests,
                       const std::string& path, SaveMode mode) {
  std::vector<size_t> differ;
  for (size_t r = 1; r < digests.size(); ++r)
    if (digests[r] != digests[0]) differ.push_back(r);
  if (differ.empty()) return;
  // Every rank saw the same digests, so every rank takes this exchange.
  const auto all = comm.all_gather_bytes(mine.packed());
  auto records = [&](size_t r) {
    Unpacker in(all[r], concat("rank ", r, "'s list of entries"));
    const uint64_t n = in.u64();
    TESSERA_CHECK(n <= all[r].size() / 16, "internal: rank ", r, "'s list of entries is truncated");
    std::vector<std::pair<std::string, std::string>> out(n);
    for (auto& [k, d] : out) {
      k = in.str();
      d = in.str();
    }
    return out;
  };
  const size_t r = differ[0];
  const auto a = records(0), b = records(r);
  std::string where;
  for (size_t i = 0; i < std::max(a.size(), b.size()) && where.empty(); ++i) {
    if (i < a.size() && i < b.size() && a[i] == b[i]) continue;
    auto show = [&](const std::vector<std::pair<std::string, std::string>>& v) {
      return i < v.size() ? concat("'", escape_path(v[i].first), "' (", v[i].second, ")") : std::string("none");
    };
    where = concat("entry ", i, " is ", show(a), " on rank 0, ", show(b), " on rank ", r);
  }
  if (where.empty()) where = "in the same entries (a digest collision)";
  std::string others;
  for (size_t i = 1; i < differ.size(); ++i) others += concat(i == 1 ? "" : ", ", differ[i]);
  throw Error(concat("saving '", path, "': rank ", r, " differs from rank 0 in what it saves: ", where,
                     others.empty() ? "" : concat(" (", differ.size() == 2 ? "rank " : "ranks ", others,
                                                  differ.size() == 2 ? " differs" : " differ", " too)"),
                     mode == SaveMode::Full
                         ? ". A consolidated save needs the same keys, in the same order, with the same kinds, dtypes, "
                           "shapes and shards on every rank; nothing was written"
                         : ". A sharded save needs the same keys, in the same order, with the same kinds, dtypes, "
                           "shapes and layouts on every rank (plain values may differ: rank 0's are written); "
                           "nothing was written"));
}

}  // namespace tessera::checkpoint
