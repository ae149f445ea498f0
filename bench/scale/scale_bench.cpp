// Checkpoints at scale (issue 33 item 5; 2-D: issue 47 item 5): the real planning code of
// a sharded save and load (docs/checkpoint-format.md §3) run for N virtual ranks in one
// process, with no tensor data. For each model, sharding and world size it measures what
// every rank computes alone: the metadata text (to_json, identical on every rank), a
// sampled rank's save planning (its CheckpointMetadata, plan_saved_layout of every tensor,
// the pieces it stores, to_json and the digest RankAgreement::agree compares) and its load
// planning for a resume at the same N (open_checkpoint: read, parse_metadata, checksum;
// then ChunkReader::chunks for each of the rank's target boxes, which finds the
// overlapping pieces with Layout::overlapping and reads the headers of the data files
// holding them, real sparse files whose headers are exactly what write_data_file writes),
// plus the bytes of the save's coordination, computed from its protocol (save.cpp
// save_sharded). The 1-D cases are FSDP's FULL and HYBRID sharding (format 2); the 2-D
// ones (format 3) tensor parallelism over a model's TP plan (models.h) composed with FSDP
// over the data-parallel ranks ("DPxTP" meshes) or with HSDP ("RxSxTP": R replica groups of
// S shard ranks, whose sharded saves Tessera refuses: the harness plans what the format can
// record, hsdp_tp_whole_param), and reshards between meshes. bench/scale/run.sh runs
// it with the DCP side (dcp_scale.py) and writes bench/results/scale.json;
// docs/benchmarks.md explains the figures.
//
//   scale_bench [--ranks 8,64,...] [--models gpt2-124m,...] [--shardings full,hybrid]
//               [--reshard 16384:1024,1024:16384] [--models-2d llama3-70b]
//               [--meshes 128x8,2048x8,128x16x8,...] [--reshard-2d 2048x8:1024x16]
//               [--repeats 3] [--out FILE] [--work DIR]
//   scale_bench --predict --model tiny-gpt [--n-layer L --n-head H --d-model D --seq-len T
//               --tie] --ranks N [--tp T] [--sharding full|hybrid --shard-group S]
//               [--strategy fsdp|ddp] [--metadata DIR/tessera-checkpoint.json]
//
// --predict prints the metadata a `gpt train` run of examples/gpt saves (model + AdamW
// state under the Trainer's names; with --tp T, on the (N / T, T) mesh of `gpt train --tp
// T`). With --metadata (a real save's metadata), it rebuilds that file's text with every
// tensor entry recomputed by the planner from the model's shapes (keys, plain values and
// save id taken from the file, which no planner can know) and compares it byte for byte:
// exit 0 and "match" when equal.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <nlohmann/json.hpp>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>
#include <numeric>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "alloc_count.h"
#include "models.h"
#include "tessera/checkpoint/format/checksum.h"
#include "tessera/checkpoint/format/metadata.h"
#include "tessera/checkpoint/format/safetensors.h"
#include "tessera/checkpoint/reader.h"
#include "tessera/checkpoint/save_plan.h"
#include "tessera/checkpoint/save_steps.h"
#include "tessera/checkpoint/wire.h"
#include "tessera/checkpoint/storage/commit.h"
#include "tessera/checkpoint/storage/file.h"
#include "tessera/checkpoint/writer.h"
#include "tessera/sharding/layout.h"
#include "tessera/state/state_dict.h"

namespace ck = tessera::checkpoint;
namespace sh = tessera::sharding;
using tessera::state::Value;
using json = nlohmann::ordered_json;
using scale::Model;
using scale::Param;

namespace {

constexpr const char* kSaveId = "5c0e2d9a11f03b77";  // a save id is 16 random hex digits
constexpr int64_t kHybridGroup = 8;

// ------------------------------------------------------------------ the saved state

// One key of the state a Trainer saves: a tensor (sharded or whole) or a plain value.
struct Key {
  enum Kind { Sharded, Tensor, Plain } kind = Plain;
  std::string fqn;
  const Param* param = nullptr;  // tensors: shape, unit, flat offset
  Value value;                   // plain values
};

// A state on `world` ranks laid out as a (replicate R, shard S, tp T) mesh, rank
// (r·S + s)·T + t (dp-major, as Fabric's mesh): tensor parallelism cuts the parameters a
// TP plan names over the T ranks of a tp group, then FSDP cuts each unit's flat vector (at
// TP-local sizes) over the S ranks of a shard group, and the R replica groups hold the same
// state. T = 1 is the 1-D case: FULL_SHARD (S = world), HYBRID_SHARD (S = 8, R = world / 8),
// one process per group (S = 1: DDP, every parameter whole). T > 1: FSDP x TP (R = 1, S =
// dp), HSDP x TP (R > 1), DDP x TP (S = 1).
struct Setup {
  const Model* model = nullptr;
  int64_t world = 1, shard = 1, tp = 1;
  scale::TpLocal local;  // the units at TP-local sizes (the model's own when tp = 1)
  std::vector<Key> keys;
  std::string sharding;  // the 1-D cases' label ("full", "hybrid"); sharding_of() otherwise
  int64_t replicas() const { return world / (shard * tp); }
  bool two_d() const { return tp > 1; }
  size_t index_of(const Param& p) const { return static_cast<size_t>(&p - model->params.data()); }
  // The mesh as text: "N" (1-D), "DPxTP", "RxSxTP".
  std::string mesh() const {
    if (!two_d()) return std::to_string(world);
    return (replicas() > 1 ? std::to_string(replicas()) + "x" : std::string()) + std::to_string(shard) + "x" +
           std::to_string(tp);
  }
};

// The keys in the order a Trainer's state flattens: "model.<fqn>" for every parameter,
// then the optimizer state as state::optimizer_state_dict names it (a one-group AdamW:
// per parameter a plain int "step" and the exp_avg / exp_avg_sq tensors, laid out like
// the parameter), then the group's options and parameter names. A parameter's tensors
// are sharded when FSDP shards them (a shard group of more than one rank; with one, FSDP
// keeps them whole) or tensor parallelism cuts them.
std::vector<Key> trainer_keys(const Model& m, int64_t shard, int64_t tp) {
  std::vector<Key> keys;
  auto kind = [&](const Param& p) { return shard > 1 || (tp > 1 && p.tp_cut()) ? Key::Sharded : Key::Tensor; };
  for (const auto& p : m.params) keys.push_back({kind(p), "model." + p.fqn, &p, {}});
  keys.push_back({Key::Plain, "optimizer_0.optimizer", nullptr, std::string("adamw")});
  for (const auto& p : m.params) {
    const std::string s = "optimizer_0.state." + p.fqn + ".";
    keys.push_back({Key::Plain, s + "step", nullptr, int64_t{100000}});
    keys.push_back({kind(p), s + "exp_avg", &p, {}});
    keys.push_back({kind(p), s + "exp_avg_sq", &p, {}});
  }
  const std::string g = "optimizer_0.param_groups.0.";
  keys.push_back({Key::Plain, g + "lr", nullptr, 3e-4});
  keys.push_back({Key::Plain, g + "beta1", nullptr, 0.9});
  keys.push_back({Key::Plain, g + "beta2", nullptr, 0.95});
  keys.push_back({Key::Plain, g + "eps", nullptr, 1e-8});
  keys.push_back({Key::Plain, g + "weight_decay", nullptr, 0.1});
  keys.push_back({Key::Plain, g + "amsgrad", nullptr, false});
  for (size_t i = 0; i < m.params.size(); ++i)
    keys.push_back({Key::Plain, g + "params." + std::to_string(i), nullptr, m.params[i].fqn});
  return keys;
}

Setup make_setup(const Model& m, int64_t world, int64_t shard, int64_t tp = 1) {
  if (shard < 1 || tp < 1 || world % (shard * tp) != 0)
    throw std::runtime_error("a mesh of shard " + std::to_string(shard) + " x tp " + std::to_string(tp) +
                             " does not divide " + std::to_string(world) + " ranks");
  Setup s;
  s.model = &m;
  s.world = world;
  s.shard = shard;
  s.tp = tp;
  s.local = scale::tp_local(m, tp);
  s.keys = trainer_keys(m, shard, tp);
  return s;
}

// "DPxTP" or "RxSxTP" (2-D meshes), for `model`.
Setup make_mesh_setup(const Model& m, const std::string& mesh) {
  std::vector<int64_t> d;
  std::stringstream ss(mesh);
  std::string item;
  while (std::getline(ss, item, 'x')) d.push_back(std::stoll(item));
  if (d.size() == 2) return make_setup(m, d[0] * d[1], d[0], d[1]);
  if (d.size() == 3) return make_setup(m, d[0] * d[1] * d[2], d[1], d[2]);
  throw std::runtime_error("a 2-D mesh is DPxTP or RxSxTP, not '" + mesh + "'");
}

// FSDP's layout of a parameter (fsdp.cpp register_sharded_params): the unit's flat
// vector cut over the shard group, at TP-local sizes.
sh::Layout fsdp_layout(const Setup& s, const Param& p) {
  const size_t i = s.index_of(p);
  return sh::Layout::flat(s.local.unit_numel[static_cast<size_t>(p.unit)], s.local.offset[i], s.shard);
}

// The rule a sharded key's ShardedTensor carries (ShardedTensor::layout()): FSDP's, or for
// a parameter tensor parallelism cuts, TpView::to_2d's (strategy/tp_state.cpp): a tp rule
// whose inner rule is FSDP's cut of the TP piece's unit (whole when FSDP keeps it whole).
sh::Layout rule_of(const Setup& s, const Param& p) {
  if (s.two_d() && p.tp_cut())
    return sh::Layout::tensor_parallel(p.tp_dim, p.tp_stripes, s.tp,
                                       s.shard > 1 ? fsdp_layout(s, p) : sh::Layout::whole(0));
  return fsdp_layout(s, p);
}

// A rank's place in the mesh, and the holder of a sharded key it is: q = s·T + t for a
// tensor on a replica group's block of S·T ranks (1-D: its shard group; 2-D: a tensor
// parallelism cuts), s for one FSDP alone shards over the strided dp group (2-D).
struct MeshRank {
  int64_t r, s, t;
};
MeshRank mesh_rank(const Setup& s, int64_t rank) {
  return {rank / (s.shard * s.tp), rank / s.tp % s.shard, rank % s.tp};
}
bool on_block(const Setup& s, const Key& k) { return !s.two_d() || k.param->tp_cut(); }
int64_t holder_of(const Setup& s, const Key& k, int64_t rank) {
  const MeshRank m = mesh_rank(s, rank);
  return on_block(s, k) ? m.s * s.tp + m.t : m.s;
}

// The boxes rank `rank` holds of key `k` (its local shards: one for FSDP, one per stripe
// for a tp rule), empty ones left out.
std::vector<sh::Box> target_boxes(const Setup& s, const Key& k, int64_t rank) {
  if (k.kind == Key::Tensor) return {sh::full_box(k.param->shape)};
  const sh::Layout L = rule_of(s, *k.param);
  const int64_t q = holder_of(s, k, rank), per = L.pieces_per_holder();
  std::vector<sh::Box> out;
  for (int64_t i = q * per; i < (q + 1) * per; ++i) {
    sh::Box b = L.box(k.param->shape, i);
    if (!b.empty()) out.push_back(std::move(b));
  }
  return out;
}

// Where a rank's sharded tensors live among the saving ranks, as save.cpp's plan_sharded
// finds it from the tensor's communicator (group_placement, once per communicator):
// `block`, the replica group's block of S·T consecutive ranks (1-D: the shard group; 2-D:
// the world's ShardedTensor of a cut parameter, or the tp group when S = 1), and
// `strided`, FSDP's dp group {(r·S + s)·T + t : s} of a parameter TP keeps whole (2-D),
// interleaved over the T tp ranks when R = 1.
struct Placements {
  ck::GroupPlacement block, strided;
};
Placements placements(const Setup& s, int64_t rank, const std::string& fqn) {
  const MeshRank m = mesh_rank(s, rank);
  const int64_t B = s.shard * s.tp;
  std::vector<int64_t> members(static_cast<size_t>(B));
  std::iota(members.begin(), members.end(), m.r * B);
  Placements g;
  g.block = ck::group_placement(members, s.world, fqn);
  if (s.two_d() && s.shard > 1 && s.replicas() == 1) {
    members.resize(static_cast<size_t>(s.shard));
    for (int64_t p = 0; p < s.shard; ++p) members[static_cast<size_t>(p)] = p * s.tp + m.t;
    g.strided = ck::group_placement(members, s.world, fqn);
  }
  return g;
}

// HSDP x TP: what the format records for a parameter TP keeps whole. Its FSDP shard group
// {(r·S + s)·T + t : s} is one of R·T groups holding it (every replica group's, every tp
// rank's), which one files map cannot describe: save.cpp's group_placement refuses it, and
// a sharded state dict of HYBRID_SHARD with tensor parallelism is refused before that
// (TpView; such meshes checkpoint consolidated, docs/tensor-parallel.md). The harness
// records what a writer could: replica group 0's T interleaved groups write it, laid out as
// FSDP x TP lays out such a parameter on an (S, T) mesh (first 0, step T, replicas T,
// replica_step 1, shift = key index mod min(64, T)), so a resuming rank reads these pieces
// from at most T files whatever R. (HYBRID's rule over the R replica groups instead, a file
// map of step T and replica_step S·T, would send it to up to 64 more files.)
ck::SavedLayout hsdp_tp_whole_param(const Setup& s, const Key& k, int64_t rank, int64_t key_index) {
  static const std::vector<sh::ShardMetadata> kNoShards;
  std::vector<int64_t> members(static_cast<size_t>(s.shard));
  for (int64_t p = 0; p < s.shard; ++p) members[static_cast<size_t>(p)] = p * s.tp + mesh_rank(s, rank).t;
  const ck::GroupPlacement g = ck::group_placement(members, s.shard * s.tp, k.fqn);
  return ck::plan_saved_layout(k.fqn, k.param->shape, kNoShards, fsdp_layout(s, *k.param), g, s.world, rank,
                               key_index);
}

// The entry of a sharded key and the pieces rank `rank` stores: plan_saved_layout with the
// tensor's rule as the hint, on its communicator's placement.
ck::SavedLayout plan_sharded(const Setup& s, const Key& k, const Placements& g, int64_t rank, int64_t key_index) {
  static const std::vector<sh::ShardMetadata> kNoShards;  // the hint makes the list unused
  if (!on_block(s, k) && s.replicas() > 1) return hsdp_tp_whole_param(s, k, rank, key_index);
  return ck::plan_saved_layout(k.fqn, k.param->shape, kNoShards, rule_of(s, *k.param),
                               on_block(s, k) ? g.block : g.strided, s.world, rank, key_index);
}

// ------------------------------------------------------------------ save planning

struct SaveOut {
  size_t bytes = 0;
  uint64_t digest = 0;
  int64_t pieces = 0;
};

// What save_sharded computes on rank `rank` before anything is written (save.cpp), in
// the same steps: the saving rank of every world rank, the tensors' communicator
// placement (group_placement), every entry with its layout (plan_saved_layout, FSDP's
// rule as the hint, as ShardedTensor::layout() gives it), the pieces this rank stores,
// the metadata text and the digest of its structure (structure_of) the ranks compare.
SaveOut plan_save(const Setup& s, int64_t rank, std::string* text_out = nullptr) {
  SaveOut out;
  ck::CheckpointMetadata m;
  m.version = ck::kFormatVersion;
  m.world_size = static_cast<int>(s.world);
  m.crc_block = ck::kCrcBlock;
  m.save_id = kSaveId;
  const Placements g = placements(s, rank, s.keys.front().fqn);
  struct PieceDesc {
    const std::string* fqn;
    sh::Box box;
  };
  std::vector<PieceDesc> pieces;
  int64_t key_index = 0;
  for (const Key& k : s.keys) {
    ck::EntryInfo e;
    if (k.kind == Key::Plain) {
      e.kind = tessera::state::kind_name(k.value);
      e.value = k.value;
    } else {
      e.dtype = at::kFloat;
      e.shape = k.param->shape;
      if (k.kind == Key::Tensor) {
        e.kind = "tensor";
        e.layout = sh::Layout::whole(0);
        if (rank == 0 && k.param->numel() > 0) pieces.push_back({&k.fqn, sh::full_box(e.shape)});
      } else {
        e.kind = "sharded";
        ck::SavedLayout plan = plan_sharded(s, k, g, rank, key_index);
        for (int64_t i : plan.mine) pieces.push_back({&k.fqn, plan.layout.box(e.shape, i)});
        e.layout = std::move(plan.layout);
      }
    }
    m.keys.push_back(k.fqn);
    m.entries.emplace(k.fqn, std::move(e));
    ++key_index;
  }
  std::string text = ck::to_json(m);
  out.digest = ck::structure_of(m).digest();
  out.bytes = text.size();
  out.pieces = static_cast<int64_t>(pieces.size());
  if (text_out) *text_out = std::move(text);
  return out;
}

// ------------------------------------------------------------------ data files

// Writes data file `f` of the checkpoint `meta` describes as a sparse file: the header
// write_data_file writes for the pieces its layouts place there (identity, names, shapes,
// offsets, a block checksum per 4 MiB, the header checksum), the data a hole of the right
// size. SafetensorsReader checks all of it as for a real file. Returns the header bytes.
uint64_t write_data_file_header(const std::string& dir, const ck::CheckpointMetadata& meta, int64_t f) {
  std::vector<ck::TensorSpec> specs;
  for (const auto& k : meta.keys) {
    const ck::EntryInfo& e = meta.entries.at(k);
    if (!e.is_tensor()) continue;
    for (int64_t i : e.layout->pieces_in_file(f)) {
      const sh::Box b = e.layout->box(e.shape, i);
      if (!b.empty()) specs.push_back({ck::piece_name(k, *e.layout, e.shape, i), e.dtype, b.sizes});
    }
  }
  auto identity = ck::data_file_identity(static_cast<int>(f), meta.save_id);
  identity["tessera.format"] = "tessera-data";
  const std::string path = ck::join_path(dir, ck::data_file_name(static_cast<int>(f)));
  const ck::SafetensorsLayout L = ck::layout_safetensors(path, specs, identity);
  std::vector<std::vector<uint32_t>> crcs;
  for (const auto& t : L.tensors) crcs.emplace_back(ck::num_blocks(t.nbytes()), 0u);
  const std::string prefix = L.final_prefix(crcs);
  ck::File out(path, "w");
  out.pwrite_exact(0, prefix.data(), prefix.size());
  out.resize(L.file_size());
  out.close();
  return prefix.size();
}

// The data files rank `rank` of `tgt` opens to load from `meta` (Layout::overlapping).
// Checks on the way that the saved pieces overlapping each target box cover it exactly
// (the pieces of a layout do not overlap), so that a reshard's targets are what it reads.
std::set<int64_t> files_needed(const ck::CheckpointMetadata& meta, const Setup& tgt, int64_t rank) {
  std::set<int64_t> files;
  for (const Key& k : tgt.keys) {
    if (k.kind == Key::Plain) continue;
    const ck::EntryInfo& e = meta.entries.at(k.fqn);
    for (const sh::Box& box : target_boxes(tgt, k, rank)) {
      int64_t covered = 0;
      for (int64_t i : e.layout->overlapping(e.shape, box)) {
        files.insert(e.layout->file_of(i));
        if (auto x = sh::intersect(e.layout->box(e.shape, i), box)) covered += x->numel();
      }
      if (covered != box.numel())
        throw std::runtime_error("rank " + std::to_string(rank) + " of " + tgt.mesh() + ": the saved pieces cover " +
                                 std::to_string(covered) + " of the " + std::to_string(box.numel()) +
                                 " elements of its box of " + k.fqn);
    }
  }
  return files;
}

// ------------------------------------------------------------------ load planning

struct LoadOut {
  int64_t files = 0, pieces = 0;
  double open_ms = 0;  // open_checkpoint alone (read, parse, checksum of the metadata)
};

// What load_local does on rank `rank` of `tgt` before it reads any tensor byte
// (load.cpp): open_checkpoint (read, parse_metadata, metadata checksum), match every
// wanted key with its entry (kind, shape, dtype), and locate the saved pieces under each
// local shard (ChunkReader::chunks: Layout::overlapping, then the headers of the data
// files holding them, each checked against its save id and rank). The located chunks are
// kept, as load_local keeps them until it has read them.
LoadOut plan_load(const std::string& dir, const Setup& tgt, int64_t rank) {
  LoadOut out;
  const auto t0 = std::chrono::steady_clock::now();
  ck::CheckpointMetadata meta = ck::open_checkpoint(dir);
  out.open_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  ck::ChunkReader reader(meta);
  std::vector<std::vector<ck::ChunkInfo>> located;
  std::vector<Value> values;
  std::set<std::string> files;
  for (const Key& k : tgt.keys) {
    auto it = meta.entries.find(k.fqn);
    if (it == meta.entries.end()) throw std::runtime_error("missing key " + k.fqn);
    const ck::EntryInfo& e = it->second;
    if (k.kind == Key::Plain) {
      if (e.is_tensor()) throw std::runtime_error("kind mismatch " + k.fqn);
      values.push_back(e.value);
      continue;
    }
    if (!e.is_tensor() || e.shape != k.param->shape || e.dtype != at::kFloat)
      throw std::runtime_error("mismatch " + k.fqn);
    for (const sh::Box& box : target_boxes(tgt, k, rank)) {
      located.push_back(reader.chunks(k.fqn, e, box));
      for (const auto& c : located.back()) files.insert(c.file);
      out.pieces += static_cast<int64_t>(located.back().size());
    }
  }
  out.files = static_cast<int64_t>(files.size());
  return out;
}

// ------------------------------------------------------------------ measuring

using Clock = std::chrono::steady_clock;

struct Measured {
  double ms = 0;        // median over the repeats
  int64_t peak = 0;     // heap bytes above those live at the start (max over repeats)
};

template <class F>
Measured measure(int repeats, F&& f) {
  std::vector<double> t;
  Measured m;
  for (int r = 0; r < repeats; ++r) {
    const int64_t base = scale::alloc::reset_peak();
    const auto t0 = Clock::now();
    f();
    t.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
    m.peak = std::max(m.peak, scale::alloc::peak() - base);
  }
  std::sort(t.begin(), t.end());
  m.ms = t[t.size() / 2];
  return m;
}

std::vector<int64_t> sample_ranks(int64_t n) {
  std::set<int64_t> s{0, n / 2, n - 1};
  return {s.begin(), s.end()};
}

int64_t ceil_log2(int64_t n) {
  int64_t k = 0;
  while ((int64_t{1} << k) < n) ++k;
  return k;
}

// Bytes a rank sends + receives in a successful save_sharded (save.cpp): one
// RankAgreement::from_rank0_or_throw of rank 0's temporary path and save id (broadcast_bytes: an 8-byte
// length, then the packed message), then three RankAgreement::agree calls (after planning, after
// writing, after the commit), each an all-reduce of 3 int64 (24 bytes). A load adds one
// agree. Two models of the collectives: "pipelined" (a ring all-reduce: each rank
// sends and receives 2(N-1)/N of the buffer; a chain broadcast: each rank receives the
// message once and forwards it once) and "tree" (what small messages get: recursive
// doubling, log2 N exchanges of the whole buffer each way; a binomial-tree broadcast
// whose root sends the message log2 N times, the busiest rank).
json coordination(int64_t n, const std::string& ckpt_path) {
  const std::string dir = ckpt_path.substr(0, ckpt_path.rfind('/'));
  const std::string base = ckpt_path.substr(ckpt_path.rfind('/') + 1);
  const std::string tmp = dir + "/." + base + ".tessera-tmp-4194304-0";  // temp_sibling, 7-digit pid
  const std::string message = ck::Packer().str("").str(ck::Packer().str(tmp).str(kSaveId).bytes()).bytes();
  const double bcast = 8.0 + static_cast<double>(message.size());  // length, then the message
  const double ar = 24.0;
  const int64_t lg = ceil_log2(n);
  const double ring_ar = n > 1 ? 2.0 * 2.0 * static_cast<double>(n - 1) / static_cast<double>(n) * ar : 0;
  const double tree_ar = n > 1 ? 2.0 * static_cast<double>(lg) * ar : 0;
  const double chain_bc = n > 1 ? 2.0 * bcast : 0;
  const double tree_bc = n > 1 ? static_cast<double>(lg) * bcast : 0;
  json j;
  j["path"] = ckpt_path;
  j["temporary"] = tmp;
  j["broadcast_message_bytes"] = message.size() + 8;
  j["all_reduces"] = 3;
  j["all_reduce_bytes"] = 24;
  j["pipelined_bytes_per_rank"] = chain_bc + 3 * ring_ar;
  j["tree_bytes_busiest_rank"] = tree_bc + 3 * tree_ar;
  j["bytes_per_rank"] = std::max(chain_bc + 3 * ring_ar, tree_bc + 3 * tree_ar);
  j["load_bytes_per_rank"] = std::max(ring_ar, tree_ar);
  return j;
}

// Heap bytes the shard lists of the ShardedTensors handed to a save would take if each
// held every rank's ShardMetadata, as FSDP's did until they became rule-made
// (ShardedTensor::from_rule: the list is not built by training, the state dicts or a
// sharded save; CheckpointScale.SixtyFourRanks... checks that on a real 64-rank save).
// The figure stays as the cost a list-based tensor would add (explicit EnumerableSpec
// tensors still carry one).
int64_t shard_list_bytes(const Setup& s) {
  int64_t total = 0;
  for (const Key& k : s.keys) {
    if (k.kind != Key::Sharded) continue;
    const int64_t before = scale::alloc::live();
    {
      std::vector<sh::ShardMetadata> v;
      v.reserve(static_cast<size_t>(s.shard));
      for (int64_t r = 0; r < s.shard; ++r) {
        sh::ShardMetadata m;
        m.box.offsets.assign(k.param->shape.size(), 0);
        m.box.sizes = k.param->shape;
        m.placement.rank = static_cast<int>(r);
        v.push_back(std::move(m));
      }
      total += scale::alloc::live() - before;
    }
  }
  return total;
}

// Metadata bytes the Trainer's RNG state adds (trainer/rng_state.cpp: every rank's CPU
// generator state as row r of one uint8 ShardedTensor rng.cpu [ranks, state bytes], a
// chunk layout; and rng.world_size). One entry whatever the world size.
int64_t trainer_rng_bytes(int64_t n) {
  at::Tensor st = at::detail::getDefaultCPUGenerator().get_state();
  ck::EntryInfo e;
  e.kind = "sharded";
  e.dtype = at::kByte;
  e.shape = {n, st.numel()};
  e.layout = sh::Layout::chunk(0, n);
  const int64_t key = static_cast<int64_t>(std::string("\"rng.cpu\"").size());
  return (key + 1) + (key + 1 + static_cast<int64_t>(ck::entry_json(e).size()) + 1);
}

// ------------------------------------------------------------------ one configuration

struct Options {
  std::vector<int64_t> ranks{8, 64, 512, 1024, 4096, 16384};
  std::vector<std::string> models{"gpt2-124m", "llama3-8b", "llama3-70b"};
  std::vector<std::string> shardings{"full", "hybrid"};
  std::vector<std::pair<int64_t, int64_t>> reshard{{16384, 1024}, {1024, 16384}};
  // 2-D: FSDP x TP ("DPxTP") and HSDP x TP ("RxSxTP") meshes of the 2-D models, and
  // reshards between meshes (a rank of the second planning its load from the first's save).
  std::vector<std::string> models_2d{"llama3-70b"};
  std::vector<std::string> meshes{"2x8", "8x8", "16x8", "128x8", "512x8", "2048x8", "8x16x8", "32x16x8", "128x16x8"};
  std::vector<std::pair<std::string, std::string>> reshard_2d{{"2048x8", "1024x16"}};
  int repeats = 3;
  std::string out, work, path = "/checkpoints/llama-3-70b/step-00100000";
};

int64_t group_of(const std::string& sharding, int64_t n) { return sharding == "hybrid" ? std::min(kHybridGroup, n) : n; }

// The label of a setup's sharding: "full", "hybrid" (1-D), "fsdp+tp", "hsdp+tp" (2-D).
std::string sharding_of(const Setup& s) {
  if (!s.sharding.empty()) return s.sharding;
  if (s.two_d()) return s.replicas() > 1 ? "hsdp+tp" : "fsdp+tp";
  return s.shard == s.world ? "full" : "hybrid";
}

// Saves `s` "to" dir: the metadata rank 0 writes (every rank computes the same; checked).
ck::CheckpointMetadata write_checkpoint(const Setup& s, const std::string& dir, std::string& text) {
  ck::make_dir(dir);
  plan_save(s, 0, &text);
  ck::write_metadata_text(dir, text);
  return ck::parse_metadata(text, dir);
}

json load_rank(const std::string& dir, const ck::CheckpointMetadata& meta, const Setup& tgt, int64_t rank,
               std::set<int64_t>& written, int repeats) {
  const std::set<int64_t> need = files_needed(meta, tgt, rank);
  uint64_t header_bytes = 0;
  for (int64_t f : need) {
    const uint64_t h = write_data_file_header(dir, meta, f);
    header_bytes += h;
    written.insert(f);
  }
  LoadOut lo;
  std::vector<double> open_ms;
  const Measured m = measure(repeats, [&] {
    lo = plan_load(dir, tgt, rank);
    open_ms.push_back(lo.open_ms);
  });
  std::sort(open_ms.begin(), open_ms.end());
  if (lo.files != static_cast<int64_t>(need.size()))
    throw std::runtime_error("load opened " + std::to_string(lo.files) + " files, overlapping() says " +
                             std::to_string(need.size()));
  json r;
  r["rank"] = rank;
  r["ms"] = m.ms;
  r["metadata_ms"] = open_ms[open_ms.size() / 2];
  r["peak_bytes"] = m.peak;
  r["files"] = lo.files;
  r["pieces"] = lo.pieces;
  r["header_bytes"] = header_bytes;
  return r;
}

void clear_data_files(const std::string& dir, std::set<int64_t>& written) {
  for (int64_t f : written) ::unlink(ck::join_path(dir, ck::data_file_name(static_cast<int>(f))).c_str());
  written.clear();
}

json max_of(const json& rows, const char* field) {
  json best = rows[0][field];
  for (const auto& r : rows)
    if (r[field].get<double>() > best.get<double>()) best = r[field];
  return best;
}

json run_config(const Setup& s, const Options& o, const std::string& work) {
  const Model& model = *s.model;
  const int64_t n = s.world;
  const std::string sharding = sharding_of(s);
  json row;
  row["model"] = model.name;
  row["sharding"] = sharding;
  row["ranks"] = n;
  row["shard_group"] = s.shard;
  if (s.two_d()) row["mesh"] = {{"replicate", s.replicas()}, {"shard", s.shard}, {"tp", s.tp}, {"text", s.mesh()}};
  int64_t tensors = 0;
  for (const auto& k : s.keys) tensors += k.kind != Key::Plain;
  row["keys"] = s.keys.size();
  row["tensor_keys"] = tensors;
  // Save planning on the sampled ranks; every rank must produce the same text.
  json save = json::array();
  uint64_t digest = 0;
  size_t bytes = 0;
  for (int64_t r : sample_ranks(n)) {
    SaveOut so;
    const Measured m = measure(o.repeats, [&] { so = plan_save(s, r); });
    if (digest == 0) {
      digest = so.digest;
      bytes = so.bytes;
    } else if (digest != so.digest) {
      throw std::runtime_error("ranks computed different metadata (" + model.name + ", N=" + std::to_string(n) + ")");
    }
    save.push_back({{"rank", r}, {"ms", m.ms}, {"peak_bytes", m.peak}, {"pieces", so.pieces}});
  }
  row["metadata_bytes"] = bytes;
  row["save"] = {{"ms_max", max_of(save, "ms")}, {"peak_bytes_max", max_of(save, "peak_bytes")}, {"ranks", save}};
  row["coordination"] = coordination(n, o.path);
  // Load planning of a resume (the same layout at the same N).
  const std::string dir = ck::join_path(work, model.name + "-" + sharding + "-" + s.mesh());
  std::string text;
  const ck::CheckpointMetadata meta = write_checkpoint(s, dir, text);
  json load = json::array();
  std::set<int64_t> written;
  for (int64_t r : sample_ranks(n)) {
    load.push_back(load_rank(dir, meta, s, r, written, o.repeats));
    clear_data_files(dir, written);
  }
  row["load"] = {{"ms_max", max_of(load, "ms")},
                 {"peak_bytes_max", max_of(load, "peak_bytes")},
                 {"files_max", max_of(load, "files")},
                 {"ranks", load}};
  // Where a load's metadata time goes: JSON parsing as nlohmann parses (no checks), the
  // strict parse (duplicate keys refused), parse_metadata (strict parse + every entry and
  // layout validated), the checksum.
  {
    json parse;
    parse["plain_json_ms"] = measure(o.repeats, [&] { (void)nlohmann::json::parse(text); }).ms;
    parse["parse_json_strict_ms"] = measure(o.repeats, [&] { (void)ck::parse_json_strict(text, "m"); }).ms;
    parse["parse_metadata_ms"] = measure(o.repeats, [&] { (void)ck::parse_metadata(text, dir); }).ms;
    parse["checksum_ms"] = measure(o.repeats, [&] { ck::check_metadata_checksum(text, "m"); }).ms;
    row["metadata_parse"] = parse;
  }
  if (!s.two_d()) row["state_shard_lists_bytes"] = shard_list_bytes(s);
  row["trainer_rng_metadata_bytes"] = trainer_rng_bytes(n);
  ck::remove_all(dir);
  return row;
}

json run_reshard(const Setup& src, const Setup& tgt, const Options& o, const std::string& work) {
  const Model& model = *src.model;
  const std::string sharding = sharding_of(src);
  const int64_t n = src.world, m_ranks = tgt.world;
  if (!src.two_d() && (src.shard > 1) != (tgt.shard > 1))
    throw std::runtime_error("reshard between sharded and whole states");
  const std::string dir = ck::join_path(work, model.name + "-" + sharding + "-" + src.mesh() + "-to-" + tgt.mesh());
  std::string text;
  const ck::CheckpointMetadata meta = write_checkpoint(src, dir, text);
  json rows = json::array();
  std::set<int64_t> written;
  for (int64_t r : sample_ranks(m_ranks)) {
    rows.push_back(load_rank(dir, meta, tgt, r, written, o.repeats));
    clear_data_files(dir, written);
  }
  ck::remove_all(dir);
  json r = {{"model", model.name},
            {"sharding", sharding},
            {"from_ranks", n},
            {"to_ranks", m_ranks},
            {"metadata_bytes", text.size()},
            {"ms_max", max_of(rows, "ms")},
            {"peak_bytes_max", max_of(rows, "peak_bytes")},
            {"files_max", max_of(rows, "files")},
            {"ranks", rows}};
  if (src.two_d() || tgt.two_d()) {
    r["from_mesh"] = src.mesh();
    r["to_mesh"] = tgt.mesh();
  }
  return r;
}

// ------------------------------------------------------------------ --predict

struct PredictOptions {
  int64_t n_layer = 4, n_head = 4, d_model = 128, seq_len = 64;
  bool tie = false;
  int64_t ranks = 1, group = 0;  // group 0: FULL (the dp ranks)
  int64_t tp = 1;                 // tensor-parallel ranks (gpt train --tp)
  std::string strategy = "fsdp", metadata;
};

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read '" + path + "'");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

int predict(const PredictOptions& p) {
  const Model model = scale::gpt("tiny-gpt", 256, p.n_layer, p.d_model, p.seq_len, p.tie);  // examples/gpt: byte vocab
  if (p.tp < 1 || p.ranks % p.tp != 0) throw std::runtime_error("--tp must divide --ranks");
  const int64_t dp = p.ranks / p.tp;
  const int64_t group = p.strategy == "ddp" ? 1 : (p.group > 0 ? p.group : dp);
  if (dp % group != 0) throw std::runtime_error("--shard-group must divide the data-parallel ranks");
  const Setup s = make_setup(model, p.ranks, group, p.tp);
  std::cout << "model: examples/gpt, " << p.n_layer << " layers, d_model " << p.d_model << ", seq_len " << p.seq_len
            << (p.tie ? ", tied head" : ", untied head") << ": " << model.numel() << " parameters in "
            << model.params.size() << " tensors\n";
  std::cout << "layout: " << p.strategy << ", " << p.ranks << " ranks, shard groups of " << group;
  if (s.two_d()) std::cout << ", tp " << s.tp << " (mesh " << s.mesh() << ")";
  std::cout << "\n";
  if (p.metadata.empty()) {
    // The model and AdamW state alone, with placeholder plain values (a Trainer adds its
    // own: loop, sampler, scheduler, callbacks, RNG states, hparams).
    std::string text;
    plan_save(s, 0, &text);
    const ck::CheckpointMetadata m = ck::parse_metadata(text, "predicted");
    int64_t tensor_bytes = 0;
    for (const auto& k : m.keys) {
      const ck::EntryInfo& e = m.entries.at(k);
      if (!e.is_tensor()) continue;
      const int64_t key = static_cast<int64_t>(json(k).dump().size());
      tensor_bytes += (key + 1) + (key + 1 + static_cast<int64_t>(ck::entry_json(e).size()) + 1);
    }
    std::cout << "predicted_metadata_bytes " << text.size() << " (model + AdamW state, placeholder plain values)\n";
    std::cout << "tensor_entry_bytes " << tensor_bytes << " (each tensor's key in \"keys\" and its entry, with separators)\n";
    return 0;
  }
  // A real save's metadata: keep what the planner cannot know (keys and their order,
  // plain values, save id, world size), recompute every tensor entry, compare the texts.
  const std::string real = read_file(p.metadata);
  const ck::CheckpointMetadata got = ck::parse_metadata(real, p.metadata);
  std::map<std::string, const Key*> tensors;
  for (const Key& k : s.keys)
    if (k.kind != Key::Plain) tensors[k.fqn] = &k;
  ck::CheckpointMetadata m;
  m.version = got.version;
  m.world_size = got.world_size;
  m.crc_block = got.crc_block;
  m.save_id = got.save_id;
  m.keys = got.keys;
  if (got.world_size != p.ranks)
    throw std::runtime_error("the metadata's world_size is " + std::to_string(got.world_size) + ", --ranks " +
                             std::to_string(p.ranks));
  std::vector<std::string> problems;
  std::set<std::string> seen;
  const Placements g = placements(s, 0, got.keys.empty() ? std::string() : got.keys.front());
  int64_t key_index = 0, predicted = 0;
  for (const auto& k : got.keys) {
    const ck::EntryInfo& real_e = got.entries.at(k);
    auto it = tensors.find(k);
    if (!real_e.is_tensor()) {
      if (it != tensors.end()) problems.push_back("'" + k + "' is a tensor in the model, a plain value in the file");
      m.entries.emplace(k, real_e);
    } else if ((k == "rng.cpu" || k == "rng.cuda") && real_e.shape.size() == 2 && real_e.shape[0] == p.ranks) {
      // The Trainer's generator states: row r from rank r, over the whole world.
      ck::EntryInfo e;
      e.kind = "sharded";
      e.dtype = at::kByte;
      e.shape = real_e.shape;
      std::vector<int64_t> world(static_cast<size_t>(p.ranks));
      std::iota(world.begin(), world.end(), int64_t{0});
      const ck::GroupPlacement g = ck::group_placement(world, p.ranks, k);
      e.layout = ck::plan_saved_layout(k, e.shape, {}, sh::Layout::chunk(0, p.ranks), g, p.ranks, 0, key_index).layout;
      m.entries.emplace(k, std::move(e));
      ++predicted;
    } else if (it == tensors.end()) {
      problems.push_back("'" + k + "' is a tensor in the file but not in the model");
      m.entries.emplace(k, real_e);
    } else {
      seen.insert(k);
      const Key& key = *it->second;
      ck::EntryInfo e;
      e.dtype = at::kFloat;
      e.shape = key.param->shape;
      if (key.kind == Key::Tensor) {
        e.kind = "tensor";
        e.layout = sh::Layout::whole(0);
      } else {
        e.kind = "sharded";
        e.layout = plan_sharded(s, key, g, 0, key_index).layout;
      }
      if (got.version == 1) {
        // Version 1 lists every chunk: compare boxes (and files, which FULL_SHARD's
        // ranks write themselves; HYBRID's writers were chosen at save time).
        std::set<std::pair<std::string, std::vector<int64_t>>> want, have;
        for (int64_t i = 0; i < e.layout->count(); ++i) {
          const sh::Box b = e.layout->box(e.shape, i);
          if (b.empty()) continue;
          std::vector<int64_t> v = b.offsets;
          v.insert(v.end(), b.sizes.begin(), b.sizes.end());
          want.insert({group == dp ? ck::data_file_name(static_cast<int>(e.layout->file_of(i))) : "", v});
        }
        for (const auto& c : real_e.chunks) {
          if (c.box.empty()) continue;
          std::vector<int64_t> v = c.box.offsets;
          v.insert(v.end(), c.box.sizes.begin(), c.box.sizes.end());
          have.insert({group == dp ? c.file : "", v});
        }
        if (want != have || real_e.shape != e.shape || real_e.dtype != e.dtype)
          problems.push_back("'" + k + "': chunks differ from the predicted layout");
      }
      m.entries.emplace(k, std::move(e));
      ++predicted;
    }
    ++key_index;
  }
  for (const auto& [k, key] : tensors)
    if (!seen.count(k)) problems.push_back("'" + k + "' is in the model but not in the file");
  std::cout << "tensor entries predicted: " << predicted << " of " << got.keys.size() << " keys (version "
            << got.version << ")\n";
  if (got.version >= 2) {
    const std::string text = ck::to_json(m);
    std::cout << "predicted_metadata_bytes " << text.size() << "\nreal_metadata_bytes " << real.size() << "\n";
    if (text != real) {
      size_t at = 0;
      while (at < text.size() && at < real.size() && text[at] == real[at]) ++at;
      const size_t from = at > 60 ? at - 60 : 0;
      problems.push_back("texts differ at byte " + std::to_string(at) + ": predicted ..." + text.substr(from, 120) +
                         "... real ..." + real.substr(from, 120) + "...");
    }
  } else {
    std::cout << "real_metadata_bytes " << real.size() << " (version 1: chunk lists compared, not text)\n";
  }
  for (const auto& q : problems) std::cout << "DIFF " << q << "\n";
  std::cout << (problems.empty() ? "match" : "MISMATCH") << "\n";
  return problems.empty() ? 0 : 1;
}

// ------------------------------------------------------------------ main

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, sep))
    if (!item.empty()) out.push_back(item);
  return out;
}

// "A:B,C:D" as {(A, B), (C, D)}; `what` when an item has no ':'.
std::vector<std::pair<std::string, std::string>> pairs(const std::string& s, const char* what) {
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& x : split(s, ',')) {
    const auto c = x.find(':');
    if (c == std::string::npos) throw std::runtime_error(what);
    out.emplace_back(x.substr(0, c), x.substr(c + 1));
  }
  return out;
}

int64_t peak_rss_kib() {
  struct rusage ru {};
  ::getrusage(RUSAGE_SELF, &ru);
  return ru.ru_maxrss;
}

std::string fmt_bytes(double b) {
  char buf[64];
  if (b >= 1 << 20) std::snprintf(buf, sizeof buf, "%.2f MiB", b / (1 << 20));
  else if (b >= 1 << 10) std::snprintf(buf, sizeof buf, "%.1f KiB", b / (1 << 10));
  else std::snprintf(buf, sizeof buf, "%.0f B", b);
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    Options o;
    PredictOptions p;
    bool predict_mode = false;
    std::string model_name;
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      auto next = [&]() -> std::string {
        if (i + 1 >= argc) throw std::runtime_error(a + " needs a value");
        return argv[++i];
      };
      if (a == "--ranks") {
        o.ranks.clear();
        for (const auto& x : split(next(), ',')) o.ranks.push_back(std::stoll(x));
        p.ranks = o.ranks.empty() ? 1 : o.ranks.front();
      } else if (a == "--models") {
        o.models = split(next(), ',');
      } else if (a == "--shardings") {
        o.shardings = split(next(), ',');
      } else if (a == "--reshard") {
        o.reshard.clear();
        for (const auto& [n, m] : pairs(next(), "--reshard takes N:M pairs"))
          o.reshard.emplace_back(std::stoll(n), std::stoll(m));
      } else if (a == "--models-2d") {
        o.models_2d = split(next(), ',');
      } else if (a == "--meshes") {
        o.meshes = split(next(), ',');
      } else if (a == "--reshard-2d") {
        o.reshard_2d = pairs(next(), "--reshard-2d takes MESH:MESH pairs");
      } else if (a == "--tp") {
        p.tp = std::stoll(next());
      } else if (a == "--repeats") {
        o.repeats = std::max(1, std::stoi(next()));
      } else if (a == "--out") {
        o.out = next();
      } else if (a == "--work") {
        o.work = next();
      } else if (a == "--path") {
        o.path = next();
      } else if (a == "--predict") {
        predict_mode = true;
      } else if (a == "--model") {
        model_name = next();
      } else if (a == "--n-layer") {
        p.n_layer = std::stoll(next());
      } else if (a == "--n-head") {
        p.n_head = std::stoll(next());  // shapes do not depend on it
      } else if (a == "--d-model") {
        p.d_model = std::stoll(next());
      } else if (a == "--seq-len") {
        p.seq_len = std::stoll(next());
      } else if (a == "--tie") {
        p.tie = true;
      } else if (a == "--sharding") {
        const std::string v = next();
        if (v == "hybrid" && p.group == 0) p.group = kHybridGroup;
        else if (v != "full" && v != "hybrid") throw std::runtime_error("--sharding full|hybrid");
      } else if (a == "--shard-group") {
        p.group = std::stoll(next());
      } else if (a == "--strategy") {
        p.strategy = next();
        if (p.strategy != "fsdp" && p.strategy != "ddp") throw std::runtime_error("--strategy fsdp|ddp");
      } else if (a == "--metadata") {
        p.metadata = next();
      } else if (a == "-h" || a == "--help") {
        std::cout << "see the comment at the top of bench/scale/scale_bench.cpp\n";
        return 0;
      } else {
        throw std::runtime_error("unknown argument '" + a + "'");
      }
    }
    if (predict_mode) {
      if (model_name != "tiny-gpt") throw std::runtime_error("--predict supports --model tiny-gpt");
      return predict(p);
    }
    std::string work = o.work;
    bool own_work = false;
    if (work.empty()) {
      char tmpl[] = "/tmp/tessera-scale-XXXXXX";
      if (::mkdtemp(tmpl) == nullptr) throw std::runtime_error("mkdtemp failed");
      work = tmpl;
      own_work = true;
    } else {
      ck::make_dir(work);
    }
    json result;
    result["benchmark"] = "scale-tessera";
    result["method"] = {
        {"save", "per sampled rank: CheckpointMetadata + plan_saved_layout of every tensor + its pieces + to_json + "
                 "structure_of(...).digest(), as save_sharded; median of the repeats"},
        {"load", "per sampled rank: open_checkpoint (read, parse_metadata, checksum) + ChunkReader::chunks for every "
                 "local shard (Layout::overlapping, then the headers of the data files holding the pieces: sparse "
                 "files whose headers are what write_data_file writes)"},
        {"memory", "peak of live heap bytes above those live at the start, counted by replaced global operator "
                   "new/delete (malloc_usable_size of every block)"},
        {"repeats", o.repeats}};
    json rows = json::array(), reshards = json::array(), models = json::array();
    const auto t_start = Clock::now();
    auto print_row = [](const json& row, double s) {
      const std::string label = row.contains("mesh") ? row["mesh"]["text"].get<std::string>()
                                                      : std::to_string(row["ranks"].get<int64_t>());
      std::printf("%-11s %-7s N=%-6lld %-10s metadata %-11s save %7.2f ms %-10s load %7.2f ms %-10s files %-5lld (%.1f s)\n",
                  row["model"].get<std::string>().c_str(), row["sharding"].get<std::string>().c_str(),
                  static_cast<long long>(row["ranks"].get<int64_t>()), label.c_str(),
                  fmt_bytes(row["metadata_bytes"].get<double>()).c_str(), row["save"]["ms_max"].get<double>(),
                  fmt_bytes(row["save"]["peak_bytes_max"].get<double>()).c_str(), row["load"]["ms_max"].get<double>(),
                  fmt_bytes(row["load"]["peak_bytes_max"].get<double>()).c_str(),
                  static_cast<long long>(row["load"]["files_max"].get<int64_t>()), s);
      std::fflush(stdout);
    };
    auto print_reshard = [](const json& r, const std::string& from, const std::string& to) {
      std::printf("%-11s %-7s reshard %s -> %s: load %7.2f ms %-10s files %lld\n", r["model"].get<std::string>().c_str(),
                  r["sharding"].get<std::string>().c_str(), from.c_str(), to.c_str(), r["ms_max"].get<double>(),
                  fmt_bytes(r["peak_bytes_max"].get<double>()).c_str(),
                  static_cast<long long>(r["files_max"].get<int64_t>()));
      std::fflush(stdout);
    };
    std::vector<std::string> all_models = o.models;
    if (o.meshes.empty() && o.reshard_2d.empty()) o.models_2d.clear();
    for (const auto& m : o.models_2d)
      if (std::find(all_models.begin(), all_models.end(), m) == all_models.end()) all_models.push_back(m);
    for (const auto& name : all_models) {
      const Model model = scale::model_by_name(name);
      models.push_back({{"name", name}, {"note", model.note}, {"parameters", model.numel()},
                        {"parameter_tensors", model.params.size()}, {"fsdp_units", model.unit_numel.size()}});
      if (std::find(o.models.begin(), o.models.end(), name) == o.models.end()) continue;
      for (const auto& sharding : o.shardings) {
        for (int64_t n : o.ranks) {
          const auto t0 = Clock::now();
          Setup setup = make_setup(model, n, group_of(sharding, n));
          setup.sharding = sharding;
          json row = run_config(setup, o, work);
          print_row(row, std::chrono::duration<double>(Clock::now() - t0).count());
          rows.push_back(std::move(row));
        }
        for (const auto& [n, m] : o.reshard) {
          Setup src = make_setup(model, n, group_of(sharding, n)), tgt = make_setup(model, m, group_of(sharding, m));
          src.sharding = tgt.sharding = sharding;
          json r = run_reshard(src, tgt, o, work);
          print_reshard(r, std::to_string(n), std::to_string(m));
          reshards.push_back(std::move(r));
        }
      }
    }
    // 2-D: the meshes and their reshards (tensor parallelism over the model's TP plan).
    for (const auto& name : o.models_2d) {
      const Model model = scale::model_by_name(name);
      for (const auto& mesh : o.meshes) {
        const auto t0 = Clock::now();
        json row = run_config(make_mesh_setup(model, mesh), o, work);
        print_row(row, std::chrono::duration<double>(Clock::now() - t0).count());
        rows.push_back(std::move(row));
      }
      for (const auto& [from, to] : o.reshard_2d) {
        json r = run_reshard(make_mesh_setup(model, from), make_mesh_setup(model, to), o, work);
        print_reshard(r, from, to);
        reshards.push_back(std::move(r));
      }
    }
    result["models"] = models;
    result["configs"] = rows;
    result["reshard"] = reshards;
    result["wall_s"] = std::chrono::duration<double>(Clock::now() - t_start).count();
    result["peak_rss_kib"] = peak_rss_kib();
    if (own_work) ck::remove_all(work);
    const std::string text = result.dump(1);
    if (o.out.empty()) {
      std::cout << text << "\n";
    } else {
      std::ofstream(o.out) << text << "\n";
    }
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "scale_bench: " << e.what() << "\n";
    return 2;
  }
}
