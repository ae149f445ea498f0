// tessera ckpt import-xla: torch_xla FSDP rank files as a Tessera sharded checkpoint.
// The format, as torch_xla 2.9 writes it (torch_xla/distributed/fsdp) and as checked on
// the fixtures (docs/checkpoint-format.md §7):
//  - a parameter p of an FSDP module M is replaced by one shard, registered on M as
//    "_fsdp_shard.<orig name>" with '.' replaced by "_FSDP_SHARD_SEPARATOR_": p flattened,
//    zero-padded to a multiple of world_size * 128 elements, rank r's 1/world_size of it
//    (shard_param_on_dim_0: dim-0 rows, padded to a multiple of world_size);
//    flatten_parameters=True first concatenates a module's parameters into
//    "_fsdp_wrapped_module.flat_param_<i>" (flatten_info: names, shapes, numels);
//  - shard_metadata.shard_info[M's name][shard name] = {_orig_size, _orig_name}; state dict
//    keys drop the "_fpw_module." levels, the original names keep them, and neither keeps
//    "_fsdp_wrapped_module" once consolidated.
#include "tessera/checkpoint/offline/xla_import.h"

#include <ATen/ATen.h>
#include <stdlib.h>
#include <sys/stat.h>

#include <algorithm>
#include <list>
#include <map>
#include <memory>
#include <set>

#include "tessera/checkpoint/format/checksum.h"
#include "tessera/checkpoint/format/metadata.h"
#include "tessera/checkpoint/format/safetensors.h"
#include "tessera/checkpoint/interop/xla_rank_file.h"
#include "tessera/checkpoint/offline/offline_publish.h"
#include "tessera/checkpoint/storage/file.h"
#include "tessera/checkpoint/writer.h"
#include "tessera/core/error.h"

namespace tessera::checkpoint {
namespace {

using xla::at_key;
using xla::Leaf;
using xla::parse_rank_name;
using xla::RankName;
using xla::RankFile;
using xla::TensorRef;

// torch_xla's XlaFullyShardedDataParallel(_shard_size_multiple=128): a flattened
// parameter is padded to a multiple of world_size times this many elements (its own
// consolidation assumes the same).
constexpr int64_t kXlaShardSizeMultiple = 128;

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  size_t b = 0;
  for (size_t e; (e = s.find('.', b)) != std::string::npos; b = e + 1) out.push_back(s.substr(b, e - b));
  out.push_back(s.substr(b));
  return out;
}

std::string join(const std::vector<std::string>& v, size_t b, size_t e) {
  std::string s;
  for (size_t k = b; k < e; ++k) s += (k > b ? "." : "") + v[k];
  return s;
}

// The name consolidation gives: without the wrappers' levels.
std::string plain_name(const std::string& n) {
  std::vector<std::string> keep;
  for (auto& c : split(n))
    if (c != "_fsdp_wrapped_module" && c != "_fpw_module") keep.push_back(c);
  return join(keep, 0, keep.size());
}

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// The element count of a shape a file declares, refused (naming `where`) when it overflows.
int64_t checked_numel(const std::vector<int64_t>& shape, const std::string& where) {
  int64_t n = 1;
  for (int64_t d : shape)
    TESSERA_CHECK(d >= 0 && !__builtin_mul_overflow(n, d, &n), where, ": the size ",
                  sharding::full_box(shape).to_string(), " overflows");
  return n;
}

// One tensor of the output and where its elements are.
struct Out {
  std::string key;
  at::ScalarType dtype = at::kFloat;   // written
  at::ScalarType stored = at::kFloat;  // as the rank files hold it
  std::vector<int64_t> shape;
  // Sharded: the tensor is elements [offset, offset + numel) of the concatenation of the
  // ranks' shards (refs[r], `per` elements each). Whole: refs[0], in rank `from`'s file.
  bool sharded = false;
  std::vector<const TensorRef*> refs;
  int64_t offset = 0, per = 0, from = 0;
  bool dim0 = false;
  EntryInfo entry;
};

// The rank files, opened when their data is read (at most 64 at once), each checked to be
// the file read before.
class Files {
 public:
  explicit Files(const std::vector<RankFile>& ranks) : ranks_(ranks) {}
  void read(int64_t r, uint64_t offset, void* dst, uint64_t n) {
    auto it = open_.find(r);
    if (it == open_.end()) {
      if (open_.size() >= 64) {
        open_.erase(lru_.back());
        lru_.pop_back();
      }
      const RankFile& rf = ranks_[r];
      File f(rf.path, "r");
      struct stat s;
      TESSERA_CHECK(::fstat(f.fd(), &s) == 0 && s.st_dev == rf.dev && s.st_ino == rf.ino && f.size() == rf.size,
                    "'", rf.path, "' changed while it was imported");
      it = open_.emplace(r, std::move(f)).first;
    } else {
      lru_.remove(r);
    }
    lru_.push_front(r);
    it->second.pread_exact(offset, dst, n);
  }

 private:
  const std::vector<RankFile>& ranks_;
  std::map<int64_t, File> open_;
  std::list<int64_t> lru_;
};

// Elements [e0, e1) of `o` (row-major), as stored, into dst.
void read_elements(Files& files, const Out& o, int64_t e0, int64_t e1, char* dst) {
  const uint64_t item = c10::elementSize(o.stored);
  if (!o.sharded) {
    const TensorRef& t = *o.refs[0];
    files.read(o.from, t.data + static_cast<uint64_t>(t.storage_offset + e0) * item, dst,
               static_cast<uint64_t>(e1 - e0) * item);
    return;
  }
  const int64_t a = o.offset + e0, b = o.offset + e1, W = static_cast<int64_t>(o.refs.size());
  for (int64_t k = a / o.per; k < W && k * o.per < b; ++k) {
    const int64_t lo = std::max(a, k * o.per), hi = std::min(b, (k + 1) * o.per);
    const TensorRef& t = *o.refs[k];
    files.read(k, t.data + static_cast<uint64_t>(t.storage_offset + lo - k * o.per) * item,
               dst + static_cast<uint64_t>(lo - a) * item, static_cast<uint64_t>(hi - lo) * item);
  }
}

// The piece `box` of `o` (dim-0 rows, or the whole tensor), in the output dtype.
at::Tensor read_box(Files& files, const Out& o, const sharding::Box& box) {
  at::Tensor t = at::empty(box.sizes, at::TensorOptions().dtype(o.stored));
  if (t.numel() == 0) return o.dtype == o.stored ? t : t.to(o.dtype);
  if (!o.sharded && !o.refs[0]->contiguous) {  // a strided view (a buffer): its storage span, then the view
    const TensorRef& r = *o.refs[0];
    int64_t last = 0;
    for (size_t d = 0; d < r.sizes.size(); ++d) last += (r.sizes[d] - 1) * r.strides[d];
    at::Tensor span = at::empty({last + 1}, at::TensorOptions().dtype(o.stored));
    read_elements(files, o, 0, last + 1, static_cast<char*>(span.data_ptr()));
    t = span.as_strided(r.sizes, r.strides, 0).contiguous();
  } else {
    const int64_t row = o.shape.empty() ? 1 : numel_of(o.shape) / std::max<int64_t>(o.shape[0], 1);
    const int64_t first = box.offsets.empty() ? 0 : box.offsets[0] * row;
    read_elements(files, o, first, first + t.numel(), static_cast<char*>(t.data_ptr()));
  }
  return o.dtype == o.stored ? t : t.to(o.dtype);
}

// Reads every rank file and checks that together they are one checkpoint: one world
// size, every rank once, the same shard_metadata and the same model keys and shard shapes.
std::vector<RankFile> read_ranks(const std::vector<std::string>& files) {
  std::vector<RankFile> ranks;
  std::map<int64_t, size_t> by_rank;
  for (const auto& f : files) {
    RankFile rf = xla::read_rank_file(f);
    RankName n;
    if (parse_rank_name(f, n)) {
      TESSERA_CHECK(n.world == rf.meta.world_size, at_key(f, "shard_metadata.world_size"), ": ", rf.meta.world_size,
                    ", but the file name says ", n.world);
      TESSERA_CHECK(n.rank == rf.meta.rank, at_key(f, "shard_metadata.rank"), ": ", rf.meta.rank,
                    ", but the file name says ", n.rank);
    }
    if (!ranks.empty())
      TESSERA_CHECK(rf.meta.world_size == ranks[0].meta.world_size, at_key(f, "shard_metadata.world_size"), ": ",
                    rf.meta.world_size, ", but '", ranks[0].path, "' says ", ranks[0].meta.world_size);
    auto [it, fresh] = by_rank.emplace(rf.meta.rank, ranks.size());
    TESSERA_CHECK(fresh, at_key(f, "shard_metadata.rank"), ": rank ", rf.meta.rank, " again (also '",
                  ranks[it->second].path, "')");
    ranks.push_back(std::move(rf));
  }
  const int64_t W = ranks[0].meta.world_size;
  if (static_cast<int64_t>(ranks.size()) != W) {
    std::string missing;
    int64_t n = 0;
    for (int64_t r = 0; r < W; ++r)
      if (!by_rank.count(r) && n++ < 10) missing += concat(n > 1 ? ", " : "", r);
    throw Error(concat(at_key(ranks[0].path, "shard_metadata.world_size"), ": ", W, " ranks, but ", ranks.size(),
                       " rank file(s) were given; missing rank(s) ", missing, n > 10 ? " ..." : ""));
  }
  std::vector<RankFile> sorted(W);
  for (auto& rf : ranks) sorted[rf.meta.rank] = std::move(rf);
  const RankFile& r0 = sorted[0];
  const std::string c0 = r0.meta.canonical();
  for (const auto& rf : sorted) {
    TESSERA_CHECK(rf.meta.canonical() == c0, at_key(rf.path, "shard_metadata"), ": differs from rank 0's ('", r0.path,
                  "'): the files are not of one checkpoint");
    TESSERA_CHECK(rf.model.size() == r0.model.size(), at_key(rf.path, "model"), ": ", rf.model.size(),
                  " entries, rank 0's ('", r0.path, "') ", r0.model.size());
    for (size_t j = 0; j < rf.model.size(); ++j) {
      const auto& [k, t] = rf.model[j];
      const auto& [k0, t0] = r0.model[j];
      TESSERA_CHECK(k == k0, at_key(rf.path, "model." + k), ": rank 0's ('", r0.path, "') entry ", j, " is '", k0, "'");
      TESSERA_CHECK(t.sizes == t0.sizes && t.dtype == t0.dtype, at_key(rf.path, "model." + k), ": ",
                    sharding::full_box(t.sizes).to_string(), " ", t.dtype, ", but rank 0's ('", r0.path, "') is ",
                    sharding::full_box(t0.sizes).to_string(), " ", t0.dtype, " (mismatched shard sizes)");
    }
  }
  return sorted;
}

// A sharded parameter: its model key and the outputs (original FQNs) it holds.
struct Param {
  size_t key = 0;
  std::vector<size_t> outs;
};

class Planner {
 public:
  Planner(const std::vector<RankFile>& ranks, const XlaImportOptions& options, XlaImportResult& res)
      : ranks_(ranks), W_(static_cast<int64_t>(ranks.size())), options_(options), res_(res) {}

  std::vector<Out> outs;
  CheckpointMetadata meta;

  void model() {
    const RankFile& r0 = ranks_[0];
    std::map<std::string, at::ScalarType> buffer_dtype;
    for (const auto& [n, t] : r0.meta.buffer_info) buffer_dtype[plain_name(n)] = t;
    for (size_t j = 0; j < r0.model.size(); ++j) {
      const auto& [key, ref] = r0.model[j];
      const std::vector<std::string> parts = split(key);
      size_t at = 0;
      while (at < parts.size() && parts[at].compare(0, 11, "_fsdp_shard") != 0) ++at;
      const std::string where = at_key(r0.path, "model." + key);
      if (at == parts.size()) {  // a buffer: rank 0's, in its original dtype where buffer_info has one
        Out o = whole(concat("model.", plain_name(key)), &ref, 0);
        if (auto it = buffer_dtype.find(plain_name(key)); it != buffer_dtype.end()) o.dtype = it->second;
        add(std::move(o));
        ++res_.buffers;
        continue;
      }
      const std::string prefix = join(parts, 0, at), suffix = join(parts, at, parts.size());
      auto m = r0.meta.shard_info.find(prefix);
      const xla::ShardInfo* info = nullptr;
      if (m != r0.meta.shard_info.end())
        if (auto s = m->second.find(suffix); s != m->second.end()) info = &s->second;
      TESSERA_CHECK(info, where, ": no shard_metadata.shard_info['", prefix, "']['", suffix, "'] for this shard");
      Out base;
      base.sharded = true;
      base.stored = base.dtype = ref.dtype;
      for (const auto& rf : ranks_) {
        base.refs.push_back(&rf.model[j].second);
        TESSERA_CHECK(rf.model[j].second.contiguous, at_key(rf.path, "model." + key), ": a non-contiguous shard");
      }
      base.per = ref.numel();
      base.dim0 = ref.sizes.size() != 1;
      const int64_t orig = checked_numel(info->orig_size, where);
      // torch_xla shards a parameter flat (1-d) or along dim 0 (at least 1-d): never 0-d.
      TESSERA_CHECK(!ref.sizes.empty(), where, ": a 0-d shard (torch_xla writes flat or dim-0 shards)");
      if (base.dim0) {  // shard_param_on_dim_0: rows [r·R, (r+1)·R) of the padded parameter
        const int64_t rows = info->orig_size.empty() ? 1 : info->orig_size[0];
        TESSERA_CHECK(info->orig_size.size() == ref.sizes.size() &&
                          std::equal(ref.sizes.begin() + 1, ref.sizes.end(), info->orig_size.begin() + 1) &&
                          ref.sizes[0] == (rows + W_ - 1) / W_,
                      where, ": a dim-0 shard of ", sharding::full_box(ref.sizes).to_string(),
                      " does not fit _orig_size ", sharding::full_box(info->orig_size).to_string(), " over ", W_,
                      " ranks");
      }
      const std::string raw = prefix.empty() ? info->orig_name : prefix + "." + info->orig_name;
      if (!base.dim0) {
        TESSERA_CHECK(base.per * W_ >= orig, where, ": ", W_, " shards of ", base.per, " elements hold fewer than the ",
                      orig, " elements of _orig_size ", sharding::full_box(info->orig_size).to_string(),
                      " (mismatched shard sizes)");
        // torch_xla pads the flattened parameter with zeros to the next multiple of
        // world_size * 128 elements, so the shards are exactly that size (a 1-d parameter
        // under shard_param_on_dim_0: ceil(d0 / world_size) elements). Larger shards mean
        // an _orig_size smaller than the parameter was: taking its first elements would drop
        // the rest without a word (torch_xla's own consolidation does).
        const int64_t unit = W_ * kXlaShardSizeMultiple;
        const int64_t want = (orig / unit + (orig % unit != 0 ? 1 : 0)) * kXlaShardSizeMultiple;
        const bool one_d = info->orig_size.size() == 1;
        const int64_t rows = orig / W_ + (orig % W_ != 0 ? 1 : 0);
        std::string dims;
        for (int64_t d : info->orig_size) dims += (dims.empty() ? "" : ", ") + std::to_string(d);
        TESSERA_CHECK(base.per == want || (one_d && base.per == rows), where, ": parameter '", plain_name(raw),
                      "': its shards hold ", base.per, " elements each, but shard_metadata.shard_info['", prefix,
                      "']['", suffix, "']._orig_size [", dims, "] (", orig, " elements) padded as torch_xla pads (to a ",
                      "multiple of ", W_, " ranks x ", kXlaShardSizeMultiple, " elements) gives shards of ", want,
                      one_d ? concat(" (", rows, " with shard_param_on_dim_0)") : std::string(),
                      ": _orig_size does not match the shards, and importing it would drop elements");
      }
      const std::vector<std::string> rp = split(raw);
      Param p;
      p.key = j;
      if (rp.back().compare(0, 11, "flat_param_") == 0) {  // flatten_parameters=True
        auto f = r0.meta.flatten_info.find(raw);
        TESSERA_CHECK(f != r0.meta.flatten_info.end(), where, ": flattened parameter '", raw,
                      "' has no shard_metadata.flatten_info entry");
        const std::string dir = join(rp, 0, rp.size() - 1);
        int64_t offset = 0;
        for (size_t i = 0; i < f->second.names.size(); ++i) {
          TESSERA_CHECK(checked_numel(f->second.shapes[i], where) == f->second.numels[i] &&
                            f->second.numels[i] <= orig - offset,
                        where, ": flatten_info of '", f->second.names[i], "' (shape ",
                        sharding::full_box(f->second.shapes[i]).to_string(), ", ", f->second.numels[i],
                        " elements at offset ", offset, ") does not fit the flat parameter's ", orig, " elements");
          Out o = base;
          o.key = concat("model.", plain_name(dir.empty() ? f->second.names[i] : dir + "." + f->second.names[i]));
          o.shape = f->second.shapes[i];
          o.offset = offset;
          offset += f->second.numels[i];
          p.outs.push_back(add(std::move(o)));
        }
        TESSERA_CHECK(offset == orig, where, ": flatten_info's parameters hold ", offset,
                      " elements, _orig_size says ", orig);
      } else {
        Out o = base;
        o.key = concat("model.", plain_name(raw));
        o.shape = info->orig_size;
        p.outs.push_back(add(std::move(o)));
      }
      res_.params += static_cast<int64_t>(p.outs.size());
      params_.push_back(std::move(p));
    }
  }

  void optimizers() {
    const RankFile& r0 = ranks_[0];
    for (size_t oi = 0; oi < r0.optimizers.size(); ++oi) {
      const xla::OptimizerState& o0 = r0.optimizers[oi];
      const std::string& K = o0.key;
      for (const auto& rf : ranks_)
        TESSERA_CHECK(rf.optimizers.size() == r0.optimizers.size() && rf.optimizers[oi].key == K &&
                          rf.optimizers[oi].group_params == o0.group_params,
                      at_key(rf.path, K), ": not the optimizer state rank 0 ('", r0.path, "') has");
      const std::vector<size_t> param_of = match_ids(o0);
      for (const auto& [id, leaves] : o0.state) {
        auto pid = id_index_.find(id);
        TESSERA_CHECK(pid != id_index_.end(), at_key(r0.path, concat(K, ".state.", id)),
                      ": state for parameter id ", id, ", which no param group lists");
        const Param& p = params_[param_of[pid->second]];
        for (size_t li = 0; li < leaves.size(); ++li) {
          const Leaf& l = leaves[li];
          if (l.key.empty()) continue;
          const std::string where = at_key(r0.path, concat(K, ".state.", id, ".", l.key));
          for (size_t oj : p.outs) {
            const std::string key = concat(K, ".state.", outs[oj].key.substr(6), ".", l.key);
            if (l.kind != Leaf::Tensor) {
              value(key, l, where);
              continue;
            }
            const TensorRef& pref = ranks_[0].model[p.key].second;
            if (l.tensor.sizes == pref.sizes) {  // a moment: cut like its parameter
              Out o = outs[oj];
              o.key = key;
              o.stored = o.dtype = l.tensor.dtype;
              o.entry = EntryInfo();
              o.refs.clear();
              for (const auto& rf : ranks_) {
                auto s = rf.optimizers[oi].state.find(id);
                TESSERA_CHECK(s != rf.optimizers[oi].state.end() && s->second.size() == leaves.size() &&
                                  s->second[li].key == l.key && s->second[li].kind == Leaf::Tensor &&
                                  s->second[li].tensor.sizes == pref.sizes && s->second[li].tensor.dtype == o.stored &&
                                  s->second[li].tensor.contiguous,
                              at_key(rf.path, concat(K, ".state.", id, ".", l.key)),
                              ": not a shard of the shape and dtype rank 0's ('", r0.path, "') has");
                o.refs.push_back(&s->second[li].tensor);
              }
              add(std::move(o));
            } else {
              TESSERA_CHECK(l.tensor.numel() <= 1, where, ": shape ", sharding::full_box(l.tensor.sizes).to_string(),
                            " is neither the parameter's shard shape ", sharding::full_box(pref.sizes).to_string(),
                            " nor a scalar");
              add(whole(key, &l.tensor, 0));  // step: rank 0's
            }
            ++res_.optimizer_tensors;
          }
        }
      }
      for (const Leaf& l : o0.groups)
        value(concat(K, ".param_groups.", l.key), l, at_key(r0.path, K + ".param_groups"));
      for (size_t g = 0; g < o0.group_params.size(); ++g) {
        int64_t n = 0;
        for (int64_t id : o0.group_params[g])
          for (size_t oj : params_[param_of[id_index_.at(id)]].outs)
            plain(concat(K, ".param_groups.", g, ".params.", n++), outs[oj].key.substr(6));
      }
    }
  }

  void others() {
    for (const Leaf& l : ranks_[0].others) value(l.key, l, at_key(ranks_[0].path, l.key));
  }

  // Layouts and the metadata.
  void finish() {
    meta.world_size = static_cast<int>(W_);
    meta.crc_block = kCrcBlock;
    meta.save_id = new_save_id();
    for (auto& o : outs) {
      EntryInfo& e = o.entry;
      e.dtype = o.dtype;
      e.shape = o.shape;
      e.kind = kTensorKind;
      if (!o.sharded || W_ == 1 || o.shape.empty() || numel_of(o.shape) == 0) {
        // one piece: a buffer in rank 0's file, a parameter in the file of the rank holding its first element
        const int64_t holder = o.sharded ? std::min(W_ - 1, o.offset / std::max<int64_t>(o.per, 1)) : o.from;
        e.layout = sharding::Layout::whole(holder);
      } else {
        e.kind = kShardedKind;
        e.layout = o.dim0 ? sharding::Layout::chunk(0, W_) : sharding::Layout::flat(o.per * W_, o.offset, W_);
      }
      e.layout->validate(e.shape, W_, concat("key '", o.key, "'"));
      meta.keys.push_back(o.key);
      meta.entries.emplace(o.key, e);
      res_.bytes += byte_size(o.shape, o.dtype, o.key);
    }
    for (const auto& [k, v] : values_) {
      EntryInfo e;
      e.kind = state::kind_name(v);
      e.value = v;
      meta.keys.push_back(k);
      meta.entries.emplace(k, std::move(e));
      ++res_.values;
    }
  }
 private:
  Out whole(const std::string& key, const TensorRef* ref, int64_t rank) {
    Out o;
    o.key = key;
    o.stored = o.dtype = ref->dtype;
    o.shape = ref->sizes;
    o.refs = {ref};
    o.from = rank;
    return o;
  }
  size_t add(Out o) {
    TESSERA_CHECK(keys_.insert(o.key).second, "'", ranks_[0].path, "': two tensors named '", o.key, "' in the output");
    outs.push_back(std::move(o));
    return outs.size() - 1;
  }
  void plain(const std::string& key, state::Value v) {
    TESSERA_CHECK(keys_.insert(key).second, "'", ranks_[0].path, "': two values named '", key, "' in the output");
    values_.emplace_back(key, std::move(v));
  }
  void value(const std::string& key, const Leaf& l, const std::string& where) {
    if (l.kind == Leaf::Tensor) {
      add(whole(key, &l.tensor, 0));
      return;
    }
    if (l.kind == Leaf::Foreign) {
      TESSERA_CHECK(options_.skip_non_tensors, where, ": '", key, "' is not a plain Python value (", l.what,
                    "); pass --skip-non-tensors to import the checkpoint without it");
      res_.skipped.emplace_back(key, l.what);
      return;
    }
    plain(key, l.value);
  }
  // For each position in the optimizer's id list, the sharded parameter it is.
  std::vector<size_t> match_ids(const xla::OptimizerState& o) {
    const RankFile& r0 = ranks_[0];
    std::vector<int64_t> ids;
    std::vector<std::string> names;
    bool named = true;
    for (size_t g = 0; g < o.group_params.size(); ++g) {
      ids.insert(ids.end(), o.group_params[g].begin(), o.group_params[g].end());
      named &= o.group_names[g].size() == o.group_params[g].size();
      names.insert(names.end(), o.group_names[g].begin(), o.group_names[g].end());
    }
    id_index_.clear();
    for (size_t i = 0; i < ids.size(); ++i)
      TESSERA_CHECK(id_index_.emplace(ids[i], i).second, at_key(r0.path, o.key + ".param_groups"), ": parameter id ",
                    ids[i], " appears twice");
    std::vector<size_t> out(ids.size());
    if (named && !ids.empty()) {  // param_names: named_parameters() names (with the _fpw_module levels)
      std::map<std::string, size_t> by_key;
      for (size_t i = 0; i < params_.size(); ++i) by_key[plain_name(r0.model[params_[i].key].first)] = i;
      for (size_t i = 0; i < ids.size(); ++i) {
        auto it = by_key.find(plain_name(names[i]));
        TESSERA_CHECK(it != by_key.end(), at_key(r0.path, o.key + ".param_groups"), ": param_names names '", names[i],
                      "', which is no sharded parameter of the model");
        out[i] = it->second;
      }
      return out;
    }
    // torch.optim numbers the parameters of its groups 0, 1, ... in order: with an optimizer
    // over model.parameters() (torch_xla's examples, Lightning), id i is the i-th shard of
    // the state dict (parameters() and state_dict() walk the modules alike).
    bool in_order = ids.size() == params_.size();
    for (size_t i = 0; i < ids.size() && in_order; ++i) in_order = ids[i] == static_cast<int64_t>(i);
    TESSERA_CHECK(in_order, at_key(r0.path, o.key + ".param_groups"), ": the optimizer holds ", ids.size(),
                  " parameter ids, the model ", params_.size(),
                  " sharded parameters: without param_names (an optimizer made from named_parameters() records them) "
                  "the ids cannot be matched to parameters; build the optimizer over model.parameters()");
    for (size_t i = 0; i < ids.size(); ++i) out[i] = i;
    return out;
  }

  const std::vector<RankFile>& ranks_;
  const int64_t W_;
  const XlaImportOptions& options_;
  XlaImportResult& res_;
  std::vector<Param> params_;
  std::map<int64_t, size_t> id_index_;
  std::set<std::string> keys_;
  std::vector<std::pair<std::string, state::Value>> values_;
};

}  // namespace

XlaImportResult import_xla(const std::string& input, const std::string& out, bool force,
                           const XlaImportOptions& options) {
  const std::vector<std::string> files = xla_rank_files(input);
  if (is_directory(input)) {  // as import-dcp: not the directory, nor inside it, nor holding it
    CheckpointMetadata src;
    src.location = input;
    offline_check_not_source(input, src, out);
  } else if (path_exists(out)) {  // a glob or a file: the output may neither be nor hold a rank file
    char* o = ::realpath(out.c_str(), nullptr);
    const std::string real_out = o ? o : out;
    ::free(o);
    for (const auto& f : files) {
      char* r = ::realpath(f.c_str(), nullptr);
      const std::string real = r ? r : f;
      ::free(r);
      TESSERA_CHECK(real != real_out && real.compare(0, real_out.size() + 1, real_out + "/") != 0,
                    "refusing to write '", out, "': it ", real == real_out ? "is" : "holds", " the rank file '", f,
                    "' (--force does not change this). Choose another output");
    }
  }
  if (check_output_path(out, force, OutputKind::Directory, "import-xla")) check_replaceable(out);
  const std::vector<RankFile> ranks = read_ranks(files);
  XlaImportResult res;
  res.world_size = static_cast<int>(ranks.size());
  for (const auto& r : ranks) res.files.push_back(r.path);
  Planner plan(ranks, options, res);
  plan.model();
  plan.optimizers();
  plan.others();
  plan.finish();
  const std::string text = to_json(plan.meta);  // refused before anything is written if a reader would refuse it
  Files data(ranks);
  offline_publish(out, true, [&](const std::string& tmp) {
    for (int64_t r = 0; r < res.world_size; ++r) {
      std::vector<Piece> pieces;
      for (const Out& o : plan.outs) {
        const EntryInfo& e = o.entry;
        sharding::Box box;
        if (e.kind == kShardedKind) {
          box = e.layout->box(e.shape, r);
        } else if (e.layout->file == r) {
          box = sharding::full_box(e.shape);
        } else {
          continue;
        }
        if (box.empty()) continue;
        pieces.push_back({o.key, o.dtype, box, [&data, &o, box] { return read_box(data, o, box); }});
      }
      write_data_file(tmp, data_file_name(static_cast<int>(r)), pieces,
                      data_file_identity(static_cast<int>(r), plan.meta.save_id));
    }
    write_metadata_text(tmp, text);
  });
  return res;
}

}  // namespace tessera::checkpoint
