#include "tessera/checkpoint/offline/reshard_plan.h"

#include <map>
#include <optional>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "tessera/checkpoint/save_plan.h"
#include "tessera/core/error.h"
#include "tessera/core/strings.h"

namespace tessera::checkpoint {

namespace {

using sharding::Layout;
using Rule = sharding::Layout::Rule;

int64_t numel(const std::vector<int64_t>& shape) { return sharding::full_box(shape).numel(); }

// The dimension a saved tensor was split along (where its chunks start at different
// offsets); 0 when it is in one piece.
int64_t split_dim(const EntryInfo& e) {
  if (e.layout) {
    switch (e.layout->rule) {
      case Rule::Chunk: return e.layout->dim;
      case Rule::Tp: return e.layout->dim;
      case Rule::List:
        for (size_t d = 0; d < e.shape.size(); ++d)
          for (const auto& p : e.layout->list)
            if (p.box.offsets[d] != 0) return static_cast<int64_t>(d);
        return 0;
      default: return 0;
    }
  }
  for (size_t d = 0; d < e.shape.size(); ++d)
    for (const auto& c : e.chunks)
      if (c.box.offsets[d] != 0) return static_cast<int64_t>(d);
  return 0;
}

// A tensor in an FSDP unit, as saved: the unit's flat size, its offset in it and its own
// (TP-local) size; and its size in the unit at the target tp.
struct Member {
  int64_t unit = 0, offset = 0, size = 0;
  int64_t new_unit = 0, new_offset = 0, new_size = 0;
};

// The shape of TP piece 0 of `e` cut over `tp` ranks, refused unless every piece has it
// (FSDP over TP saves only even cuts sharded).
std::vector<int64_t> target_local_shape(const std::string& k, const EntryInfo& e, int64_t tp) {
  const Layout& L = *e.layout;
  const Layout cut = Layout::tensor_parallel(L.dim, L.stripes, tp, Layout::whole(0));
  const std::vector<int64_t> local = cut.tp_local_shape(e.shape, 0);
  for (int64_t t = 1; t < tp; ++t)
    TESSERA_CHECK(cut.tp_local_shape(e.shape, t) == local, "reshard --tp ", tp, ": key '", k, "' (dim ", L.dim,
                  " of size ", e.shape[static_cast<size_t>(L.dim)], " in ", L.stripes, " stripe(s)) does not cut into ",
                  tp, " equal pieces; an FSDP job at that mesh saves it only as a full checkpoint");
  return local;
}

// A unit under construction: where its next member starts, before and after the reshard.
struct OpenUnit {
  int64_t unit_numel = 0, end = 0, new_end = 0;
  std::vector<size_t> members;  // indices into the plan's members
};

}  // namespace

CheckpointMetadata plan_reshard(const CheckpointMetadata& src, const ReshardTarget& target) {
  const int64_t N = target.world_size, T = target.tp;
  TESSERA_CHECK(T >= 1 && N >= 1 && N % T == 0, "reshard: --tp ", T, " does not divide --world-size ", N,
                " (the mesh is world size / tp data-parallel ranks x tp)");
  const int64_t D = N / T;
  bool any_cut = false;
  for (const auto& k : src.keys) {
    const EntryInfo& e = src.entries.at(k);
    any_cut = any_cut || (e.layout && e.layout->rule == Rule::Tp);
  }
  TESSERA_CHECK(T == 1 || any_cut, "reshard --tp ", T, ": '", src.location,
                "' records no tensor-parallel cut (it was saved without tensor parallelism), so which tensors a ",
                "tp-way job cuts, and along which dimension, is not known here; load it into the tensor-parallel ",
                "job directly (each rank reads the rows of its pieces), or reshard it without --tp");

  CheckpointMetadata out;
  out.world_size = static_cast<int>(N);
  out.keys = src.keys;
  // The FSDP units, rebuilt from the flat rules (reshard_plan.h). Each flat-ruled tensor
  // continues the first open unit of its size that ends where it starts, or opens one at
  // offset 0. A tensor whose unit never closes (an optimizer state of a unit with a frozen
  // parameter has gaps) takes the place of a tensor of a closed unit with the same size,
  // offset and extent; failing that it gets a torch.chunk cut. Any of these is a valid
  // layout: the rule decides which file holds which rows, never what is read.
  std::vector<Member> members;
  std::vector<bool> closed;
  std::unordered_map<std::string, size_t> member_of;
  std::vector<OpenUnit> open;
  for (const auto& k : src.keys) {
    const EntryInfo& e = src.entries.at(k);
    if (e.kind != kShardedKind || !e.layout || e.shape.empty()) continue;
    const Layout& L = *e.layout;
    const bool flat = L.rule == Rule::Flat, tp_flat = L.rule == Rule::Tp && L.inner == Rule::Flat;
    if (!flat && !tp_flat) continue;
    Member m;
    m.unit = flat ? L.flat_numel : L.inner_numel.at(0);
    m.offset = flat ? L.flat_offset : L.inner_offset.at(0);
    m.size = flat ? numel(e.shape) : numel(L.tp_local_shape(e.shape, 0));
    m.new_size = L.rule == Rule::Tp && T > 1 && D > 1 ? numel(target_local_shape(k, e, T)) : numel(e.shape);
    size_t u = open.size();
    for (size_t i = 0; i < open.size(); ++i)
      if (open[i].unit_numel == m.unit && open[i].end == m.offset) {
        u = i;
        break;
      }
    if (u == open.size()) {
      if (m.offset != 0 || m.size > m.unit) {  // no unit to continue: resolved below
        member_of[k] = members.size();
        members.push_back(m);
        closed.push_back(false);
        continue;
      }
      open.push_back({m.unit, 0, 0, {}});
    }
    OpenUnit& ou = open[u];
    member_of[k] = members.size();
    ou.members.push_back(members.size());
    closed.push_back(false);
    m.new_offset = ou.new_end;
    ou.end += m.size;
    ou.new_end += m.new_size;
    members.push_back(m);
    if (ou.end >= ou.unit_numel) {
      if (ou.end == ou.unit_numel)
        for (size_t i : ou.members) {
          members[i].new_unit = ou.new_end;
          closed[i] = true;
        }
      open.erase(open.begin() + static_cast<std::ptrdiff_t>(u));
    }
  }
  // The places of the closed units' tensors, for the tensors left over.
  std::map<std::tuple<int64_t, int64_t, int64_t>, size_t> place;
  for (size_t i = 0; i < members.size(); ++i)
    if (closed[i]) place.emplace(std::make_tuple(members[i].unit, members[i].offset, members[i].size), i);
  for (size_t i = 0; i < members.size(); ++i) {
    if (closed[i]) continue;
    auto it = place.find(std::make_tuple(members[i].unit, members[i].offset, members[i].size));
    if (it == place.end() || members[it->second].new_size != members[i].new_size) continue;
    members[i].new_unit = members[it->second].new_unit;
    members[i].new_offset = members[it->second].new_offset;
    closed[i] = true;
  }
  for (auto it = member_of.begin(); it != member_of.end();)
    it = closed[it->second] ? std::next(it) : member_of.erase(it);

  for (size_t ki = 0; ki < src.keys.size(); ++ki) {
    const std::string& k = src.keys[ki];
    const EntryInfo& saved = src.entries.at(k);
    EntryInfo e = saved;
    e.chunks.clear();
    e.layout.reset();
    if (e.kind == kShardedKind && e.shape.empty()) e.kind = kTensorKind;
    const auto m = member_of.find(k);
    const bool cut = saved.layout && saved.layout->rule == Rule::Tp;
    if (e.kind == kTensorKind) {
      e.layout = Layout::whole(0);
    } else if (e.kind != kShardedKind) {
      // a plain value
    } else if (cut && T > 1) {
      const Layout& L = *saved.layout;
      // A TP rank's piece: whole on one data-parallel rank, else FSDP's flat cut of its
      // unit over the data-parallel ranks (torch.chunk's when no unit is known).
      Layout inner = D == 1                 ? Layout::whole(0)
                     : m != member_of.end() ? Layout::flat(members[m->second].new_unit, members[m->second].new_offset, D)
                                            : Layout::chunk(0, D);
      e.layout = Layout::tensor_parallel(L.dim, L.stripes, T, inner);
    } else if (m != member_of.end() && T > 1 && D == 1) {
      // FSDP over one rank keeps a replicated parameter whole: rank 0 writes it.
      e.kind = kTensorKind;
      e.layout = Layout::whole(0);
    } else if (m != member_of.end()) {
      Layout L = Layout::flat(members[m->second].new_unit, members[m->second].new_offset, D);
      if (T > 1) {
        // The tp data-parallel groups (one per tp rank) each hold every piece; group
        // (i + shift) mod tp stores piece i, as a save spreads them (save_plan.h).
        GroupPlacement g;
        g.size = D;
        g.replicas = T;
        g.interleaved = true;
        L.files.replicas = T;
        L.files.step = T;
        L.files.replica_step = 1;
        L.files.shift = hybrid_shift(static_cast<int64_t>(ki), g);
      }
      e.layout = std::move(L);
    } else {
      e.layout = Layout::chunk(split_dim(saved), N);
    }
    if (e.layout) e.layout->validate(e.shape, N, concat("reshard: key '", k, "'"));
    out.entries.emplace(k, std::move(e));
  }
  out.version = format_version_for(out);
  return out;
}

}  // namespace tessera::checkpoint
