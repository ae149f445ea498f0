// Reading one rank file of a torch_xla FSDP checkpoint: a torch.save zip (data.pkl, one
// data/<key> record per storage, byteorder) of {"model": state dict, "shard_metadata":
// get_shard_metadata(), optimizer state dict(s), other values}. The storages are never
// read here: each persistent id becomes a storage of the right dtype and element count
// on the meta device (no memory), so the tensors the unpickler rebuilds on them carry
// their geometry, and the storage they view says which record holds their bytes. Also:
// which rank files an import INPUT names (xla_rank_files, xla_rank_file.h).
#include "tessera/checkpoint/interop/xla_rank_file.h"

#include <ATen/ATen.h>
#include <glob.h>
#include <sys/stat.h>

#include <algorithm>
#include <regex>

#include <sstream>
#include <unordered_map>

#include "tessera/checkpoint/format/metadata.h"
#include "tessera/checkpoint/interop/pickle_reader.h"
#include "tessera/checkpoint/interop/torch_file.h"
#include "tessera/checkpoint/interop/zip_index.h"
#include "tessera/checkpoint/storage/file.h"
#include "tessera/core/error.h"

namespace tessera::checkpoint {
namespace xla {
namespace {

using pickle::kind_text;
using pickle::Py;
using pickle::PyPtr;

const std::vector<std::pair<const char*, at::ScalarType>>& dtype_globals() {
  static const std::vector<std::pair<const char*, at::ScalarType>> t = {
      {"torch.float32", at::kFloat}, {"torch.float64", at::kDouble}, {"torch.float16", at::kHalf},
      {"torch.bfloat16", at::kBFloat16}, {"torch.int64", at::kLong}, {"torch.int32", at::kInt},
      {"torch.int16", at::kShort}, {"torch.int8", at::kChar}, {"torch.uint8", at::kByte}, {"torch.bool", at::kBool}};
  return t;
}

// What a rank file may name: torch.save's tensor and container globals, and the dtypes
// buffer_info records (_orig_dtype).
const std::set<std::string>& globals() {
  static const std::set<std::string> g = [] {
    std::set<std::string> s = pickle::torch_save_globals();
    for (const auto& [n, t] : dtype_globals()) s.insert(n);
    return s;
  }();
  return g;
}

// The pickle of one rank file is at most this large (the unpickler may use 128 bytes of
// memory per byte of it).
constexpr uint64_t kMaxPickle = 256ull << 20;

const char* what(const Py& o) { return o.kind == Py::Object ? o.s.c_str() : kind_text(o); }

PyPtr get(const Py& d, const std::string& name) {
  for (const auto& [k, v] : d.dict)
    if (k->kind == Py::Str && k->s == name) return v;
  return nullptr;
}

struct Ctx {
  std::string path;
  std::string at(const std::string& key) const { return at_key(path, key); }
  const Py& need(const Py& d, const std::string& name, const std::string& key) const {
    PyPtr v = get(d, name);
    TESSERA_CHECK(v, at(key), ": '", name, "' is missing");
    return *v;
  }
  const Py& dict(const Py& v, const std::string& key) const {
    TESSERA_CHECK(v.kind == Py::Dict, at(key), ": expected a dict, found a ", what(v));
    return v;
  }
  const Py& seq(const Py& v, const std::string& key) const {
    TESSERA_CHECK(v.kind == Py::List || v.kind == Py::Tuple, at(key), ": expected a list, found a ", what(v));
    return v;
  }
  int64_t integer(const Py& v, const std::string& key) const {
    TESSERA_CHECK(v.kind == Py::Int, at(key), ": expected an int, found a ", what(v));
    return v.i;
  }
  const std::string& str(const Py& v, const std::string& key) const {
    TESSERA_CHECK(v.kind == Py::Str, at(key), ": expected a str, found a ", what(v));
    return v.s;
  }
  std::vector<int64_t> ints(const Py& v, const std::string& key) const {
    std::vector<int64_t> out;
    for (size_t i = 0; i < seq(v, key).items.size(); ++i) {
      out.push_back(integer(*v.items[i], concat(key, ".", i)));
      TESSERA_CHECK(out.back() >= 0, at(concat(key, ".", i)), ": negative size ", out.back());
    }
    return out;
  }
};

ShardMetadata parse_meta(const Ctx& c, const Py& md) {
  ShardMetadata m;
  const std::string k = "shard_metadata";
  c.dict(md, k);
  m.world_size = c.integer(c.need(md, "world_size", k), k + ".world_size");
  TESSERA_CHECK(m.world_size >= 1 && m.world_size <= kMaxWorldSize, c.at(k + ".world_size"), ": ", m.world_size,
                " is not a world size (1 to ", kMaxWorldSize, ")");
  m.rank = c.integer(c.need(md, "rank", k), k + ".rank");
  TESSERA_CHECK(m.rank >= 0 && m.rank < m.world_size, c.at(k + ".rank"), ": rank ", m.rank, " outside [0, ",
                m.world_size, ")");
  const std::string si = k + ".shard_info";
  for (const auto& [mod, params] : c.dict(c.need(md, "shard_info", k), si).dict) {
    const std::string mk = concat(si, "['", c.str(*mod, si), "']");
    auto& out = m.shard_info[mod->s];
    for (const auto& [name, info] : c.dict(*params, mk).dict) {
      const std::string pk = concat(mk, "['", c.str(*name, mk), "']");
      ShardInfo s;
      s.orig_size = c.ints(c.need(c.dict(*info, pk), "_orig_size", pk), pk + "._orig_size");
      s.orig_name = c.str(c.need(*info, "_orig_name", pk), pk + "._orig_name");
      out[name->s] = std::move(s);
    }
  }
  if (PyPtr fi = get(md, "flatten_info")) {
    const std::string fk = k + ".flatten_info";
    for (const auto& [name, v] : c.dict(*fi, fk).dict) {
      const std::string ek = concat(fk, "['", c.str(*name, fk), "']");
      const Py& t = c.seq(*v, ek);
      TESSERA_CHECK(t.items.size() == 3, c.at(ek), ": expected (names, shapes, numels), found ", t.items.size(),
                    " items");
      FlattenInfo f;
      for (const auto& n : c.seq(*t.items[0], ek + ".0").items) f.names.push_back(c.str(*n, ek + ".0"));
      for (const auto& s : c.seq(*t.items[1], ek + ".1").items) f.shapes.push_back(c.ints(*s, ek + ".1"));
      f.numels = c.ints(*t.items[2], ek + ".2");
      TESSERA_CHECK(f.names.size() == f.shapes.size() && f.names.size() == f.numels.size(), c.at(ek), ": ",
                    f.names.size(), " names, ", f.shapes.size(), " shapes and ", f.numels.size(), " numels");
      m.flatten_info[name->s] = std::move(f);
    }
  }
  if (PyPtr bi = get(md, "buffer_info")) {
    const std::string bk = k + ".buffer_info";
    for (const auto& [name, v] : c.dict(*bi, bk).dict) {
      const std::string ek = concat(bk, "['", c.str(*name, bk), "']");
      const Py& d = c.need(c.dict(*v, ek), "_orig_dtype", ek);
      bool known = false;
      for (const auto& [n, t] : dtype_globals())
        if (d.kind == Py::Global && d.s == n) m.buffer_info[name->s] = t, known = true;
      TESSERA_CHECK(known, c.at(ek + "._orig_dtype"), ": ", d.kind == Py::Global ? d.s : what(d),
                    " is not a dtype Tessera holds");
    }
  }
  return m;
}

struct Storages {
  std::unordered_map<const void*, uint64_t> data;  // meta StorageImpl -> file offset of its record
};

TensorRef ref_of(const Ctx& c, const Storages& st, const Py& v, const std::string& key) {
  TESSERA_CHECK(v.kind == Py::Tensor, c.at(key), ": expected a tensor, found a ", what(v));
  TensorRef r;
  const at::Tensor& t = v.t;
  r.dtype = t.scalar_type();
  r.sizes = t.sizes().vec();
  r.strides = t.strides().vec();
  r.storage_offset = t.storage_offset();
  r.contiguous = t.is_contiguous();
  if (t.numel() > 0) {
    auto it = st.data.find(t.storage().unsafeGetStorageImpl());
    TESSERA_CHECK(it != st.data.end(), c.at(key), ": a tensor without a storage record");
    r.data = it->second;
  }
  return r;
}

// The leaves of `v` below `key` (see Leaf); None is left out.
void leaves(const Ctx& c, const Storages& st, const Py& v, const std::string& key, std::vector<Leaf>& out) {
  const std::string why = pickle::flatten(
      v, key,
      [&](const std::string& k, const Py& x) -> std::string {
        Leaf l;
        l.key = k;
        switch (x.kind) {
          case Py::None: return "";
          case Py::Tensor: l.kind = Leaf::Tensor; l.tensor = ref_of(c, st, x, k); break;
          case Py::Bool: l.value = x.b; break;
          case Py::Int: l.value = x.i; break;
          case Py::Float: l.value = x.f; break;
          case Py::Str: l.value = x.s; break;
          case Py::Bytes: l.value = state::Bytes{x.s}; break;
          default: l.kind = Leaf::Foreign; l.what = concat("a ", what(x), x.kind == Py::Object ? " object" : "");
        }
        out.push_back(std::move(l));
        return "";
      },
      [&](const std::string& k) {
        Leaf l;
        l.key = k;
        l.value = std::make_shared<state::StateDict>();
        out.push_back(std::move(l));
      });
  TESSERA_CHECK(why.empty(), "'", c.path, "': ", why);
}

bool is_optimizer(const Py& v) {
  if (v.kind != Py::Dict) return false;
  PyPtr s = get(v, "state"), g = get(v, "param_groups");
  return s && g && s->kind == Py::Dict && (g->kind == Py::List || g->kind == Py::Tuple);
}

OptimizerState parse_optimizer(const Ctx& c, const Storages& st, const Py& v, const std::string& key) {
  OptimizerState o;
  o.key = key;
  const std::string sk = concat(key, ".state");
  for (const auto& [id, s] : get(v, "state")->dict) {
    const int64_t i = c.integer(*id, sk + " key");
    const std::string ik = concat(sk, ".", i);
    std::vector<Leaf> values;
    leaves(c, st, c.dict(*s, ik), "", values);
    TESSERA_CHECK(o.state.emplace(i, std::move(values)).second, c.at(ik), ": parameter id ", i, " appears twice");
  }
  const Py& groups = *get(v, "param_groups");
  for (size_t g = 0; g < groups.items.size(); ++g) {
    const std::string gk = concat(key, ".param_groups.", g);
    const Py& grp = c.dict(*groups.items[g], gk);
    std::vector<int64_t> ids;
    for (const auto& p : c.seq(c.need(grp, "params", gk), gk + ".params").items)
      ids.push_back(c.integer(*p, gk + ".params"));
    o.group_params.push_back(std::move(ids));
    std::vector<std::string> names;
    if (PyPtr pn = get(grp, "param_names"))
      for (const auto& p : c.seq(*pn, gk + ".param_names").items) names.push_back(c.str(*p, gk + ".param_names"));
    o.group_names.push_back(std::move(names));
    for (const auto& [n, x] : grp.dict) {
      if (n->kind == Py::Str && (n->s == "params" || n->s == "param_names")) continue;
      auto one = pickle::make(Py::Dict);
      one->dict.emplace_back(n, x);
      leaves(c, st, *one, std::to_string(g), o.groups);
    }
  }
  return o;
}

}  // namespace

std::string at_key(const std::string& path, const std::string& key) { return concat("'", path, "' key '", key, "'"); }

int64_t TensorRef::numel() const {
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  return n;
}

std::string ShardMetadata::canonical() const {
  std::ostringstream os;
  os << "world_size " << world_size << "\n";
  for (const auto& [mod, params] : shard_info)
    for (const auto& [n, s] : params) {
      os << "shard '" << mod << "' '" << n << "' '" << s.orig_name << "'";
      for (int64_t d : s.orig_size) os << " " << d;
      os << "\n";
    }
  for (const auto& [n, f] : flatten_info) {
    os << "flatten '" << n << "'";
    for (size_t i = 0; i < f.names.size(); ++i) {
      os << " '" << f.names[i] << "' " << f.numels[i] << " [";
      for (int64_t d : f.shapes[i]) os << d << ",";
      os << "]";
    }
    os << "\n";
  }
  for (const auto& [n, t] : buffer_info) os << "buffer '" << n << "' " << t << "\n";
  return os.str();
}

RankFile read_rank_file(const std::string& path) {
  RankFile rf;
  rf.path = path;
  const std::string pickled = pickle_file_reason(path);
  TESSERA_CHECK(pickled.empty(), pickled);
  File f(path, "r");
  struct stat s;
  TESSERA_CHECK(::fstat(f.fd(), &s) == 0, "cannot stat '", path, "'");
  rf.dev = s.st_dev;
  rf.ino = s.st_ino;
  rf.size = f.size();
  const Ctx c{path};
  const std::string where = concat("'", path, "'");
  const ZipIndex zip(f, where);
  // torch.save names every record "<archive>/<name>": the archive is the one holding data.pkl.
  std::string prefix;
  for (const auto& [name, r] : zip.records()) {
    const size_t slash = name.find('/');
    if (slash == std::string::npos || name.compare(slash, std::string::npos, "/data.pkl") != 0) continue;
    TESSERA_CHECK(prefix.empty(), where, ": more than one data.pkl record");
    prefix = name.substr(0, slash + 1);
  }
  TESSERA_CHECK(!prefix.empty(), where, " is not a torch.save file: its zip archive has no data.pkl record");
  if (zip.find(prefix + "byteorder")) {
    const std::string order = zip.read(prefix + "byteorder", 16);
    TESSERA_CHECK(order == "little", where, ": byte order '", order, "' (only little-endian data is read)");
  }
  const std::string pkl = zip.read(prefix + "data.pkl", kMaxPickle);
  Storages st;
  std::map<std::string, PyPtr> by_key;
  const PyPtr root = pickle::unpickle(where, pkl, globals(), [&](const PyPtr& pid) -> PyPtr {
    const pickle::StorageId id = pickle::storage_id(where, pid);
    const at::ScalarType dt = id.dtype;
    const std::string& key = id.key;
    if (auto it = by_key.find(key); it != by_key.end()) {
      TESSERA_CHECK(it->second->t.scalar_type() == dt, where, ": storage '", key, "' is named with two dtypes");
      return it->second;
    }
    const int64_t numel = id.numel;
    const std::string rec = prefix + "data/" + key;
    const ZipRecord* r = zip.find(rec);
    TESSERA_CHECK(r, where, ": storage record '", rec, "' is missing");
    TESSERA_CHECK(r->method == 0, where, ": storage record '", rec, "' is compressed (method ", r->method,
                  "); torch.save stores its records uncompressed");
    const uint64_t item = c10::elementSize(dt);
    TESSERA_CHECK(static_cast<uint64_t>(numel) <= r->size / item, where, ": storage record '", rec,
                  "' holds ", r->size, " bytes, too few for the ", numel, " elements of ", item,
                  " bytes its id declares");
    auto o = pickle::make(Py::Storage);
    o->t = at::empty({numel}, at::TensorOptions().dtype(dt).device(at::kMeta));
    st.data[o->t.storage().unsafeGetStorageImpl()] = r->offset;
    return by_key.emplace(key, o).first->second;
  });
  TESSERA_CHECK(root->kind == Py::Dict, where, " does not hold a dict at the top level (it holds a ", what(*root),
                "): not a torch_xla FSDP checkpoint");
  std::string keys;
  for (const auto& [k, v] : root->dict) keys += concat(keys.empty() ? "" : ", ", k->kind == Py::Str ? k->s : "?");
  for (const char* need : {"model", "shard_metadata"})
    TESSERA_CHECK(get(*root, need), where, " is not a torch_xla FSDP checkpoint: it has no '", need,
                  "' key (its top-level keys: ", keys.empty() ? "none" : keys,
                  "); torch_xla's examples and Lightning save {'model': model.state_dict(), 'shard_metadata': "
                  "model.get_shard_metadata(), ...}");
  for (const auto& [k, v] : root->dict) {
    const std::string& key = c.str(*k, "(top level)");
    if (key == "shard_metadata") {
      rf.meta = parse_meta(c, *v);
    } else if (key == "model") {
      for (const auto& [n, t] : c.dict(*v, key).dict) {
        const std::string& name = c.str(*n, "model key");
        rf.model.emplace_back(name, ref_of(c, st, *t, "model." + name));
      }
    } else if (is_optimizer(*v)) {
      rf.optimizers.push_back(parse_optimizer(c, st, *v, key));
    } else if ((v->kind == Py::List || v->kind == Py::Tuple) && !v->items.empty() &&
               std::all_of(v->items.begin(), v->items.end(), [](const PyPtr& x) { return is_optimizer(*x); })) {
      for (size_t i = 0; i < v->items.size(); ++i)  // Lightning's Trainer: "optimizer": [state dict, ...]
        rf.optimizers.push_back(parse_optimizer(c, st, *v->items[i], concat(key, ".", i)));
    } else {
      auto one = pickle::make(Py::Dict);
      one->dict.emplace_back(k, v);
      leaves(c, st, *one, "", rf.others);
    }
  }
  return rf;
}

bool parse_rank_name(const std::string& path, RankName& n) {
  static const std::regex re(R"(^(.*)_rank-([0-9]{8,12})-of-([0-9]{8,12})\.pth$)");
  std::smatch m;
  const std::string base = base_name(path);
  if (!std::regex_match(base, m, re)) return false;
  n.prefix = m[1];
  n.rank = std::stoll(m[2]);
  n.world = std::stoll(m[3]);
  return true;
}

namespace {

// The file name of `rank` (-1: "*") of a set.
std::string rank_file_name(const std::string& prefix, int64_t rank, int64_t world) {
  char r[32], w[32];
  std::snprintf(r, sizeof r, "%08lld", static_cast<long long>(rank));
  std::snprintf(w, sizeof w, "%08lld", static_cast<long long>(world));
  return concat(prefix, "_rank-", rank < 0 ? "*" : r, "-of-", w, ".pth");
}

}  // namespace

}  // namespace xla

std::vector<std::string> xla_rank_files(const std::string& input) {
  std::vector<std::string> files;
  if (input.find_first_of("*?[") != std::string::npos) {
    glob_t g{};
    const int rc = ::glob(input.c_str(), 0, nullptr, &g);
    for (size_t i = 0; rc == 0 && i < g.gl_pathc; ++i) files.push_back(g.gl_pathv[i]);
    ::globfree(&g);
    TESSERA_CHECK(!files.empty(), "no file matches '", input, "'");
  } else if (is_directory(input)) {
    std::map<std::pair<std::string, int64_t>, std::vector<std::string>> sets;
    for (const auto& n : list_dir(input)) {
      xla::RankName rn;
      if (xla::parse_rank_name(n, rn)) sets[{rn.prefix, rn.world}].push_back(join_path(input, n));
    }
    TESSERA_CHECK(!sets.empty(), "'", input,
                  "' holds no torch_xla FSDP rank files (NAME_rank-XXXXXXXX-of-YYYYYYYY.pth, "
                  "as torch_xla's examples and Lightning's XLAFSDPStrategy name them); give a glob for other names");
    if (sets.size() > 1) {
      std::string list;
      std::string example;
      for (const auto& [k, v] : sets) {
        const std::string pattern = xla::rank_file_name(k.first, -1, k.second);
        list += concat(list.empty() ? "" : ", ", "'", pattern, "'");
        if (example.empty()) example = join_path(input, pattern);
      }
      throw Error(concat("'", input, "' holds ", sets.size(), " sets of rank files (", list,
                         "); name one with a quoted glob, e.g. '", example, "'"));
    }
    files = sets.begin()->second;
  } else {
    TESSERA_CHECK(path_exists(input), "'", input, "' does not exist");
    files = {input};
  }
  std::sort(files.begin(), files.end());
  for (const auto& f : files) {
    const std::string why = not_regular_file_reason(f);
    TESSERA_CHECK(why.empty(), "rank file '", f, "' ", why);
  }
  // Named as torch_xla and Lightning name them: every rank of the set must be there.
  xla::RankName first;
  if (!xla::parse_rank_name(files[0], first)) return files;
  std::map<int64_t, std::string> by_rank;
  for (const auto& f : files) {
    xla::RankName n;
    if (!xla::parse_rank_name(f, n)) return files;
    TESSERA_CHECK(n.world == first.world, "'", files[0], "' and '", f, "' are rank files of world sizes ", first.world,
                  " and ", n.world, ": not one checkpoint");
    TESSERA_CHECK(n.rank < n.world, "'", f, "': rank ", n.rank, " of ", n.world, " in its name");
    TESSERA_CHECK(by_rank.emplace(n.rank, f).second, "'", by_rank[n.rank], "' and '", f, "' are both rank ", n.rank);
  }
  std::string missing;
  int64_t count = 0;
  for (int64_t r = 0; r < first.world; ++r)
    if (!by_rank.count(r) && count++ < 5)
      missing += concat(count > 1 ? ", " : "", "'",
                        join_path(parent_dir(files[0]), xla::rank_file_name(first.prefix, r, first.world)), "'");
  TESSERA_CHECK(count == 0, "missing ", count, " of the ", first.world, " rank files of '", input, "': ", missing,
                count > 5 ? " ..." : "");
  files.clear();
  for (auto& [r, f] : by_rank) files.push_back(f);
  return files;
}

}  // namespace tessera::checkpoint
