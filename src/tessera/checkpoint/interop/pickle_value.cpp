// The values the unpickler builds (pickle_reader.h): their destruction without recursion,
// their names in messages, and flatten(), which walks a tree of them into dotted keys.
#include "tessera/checkpoint/interop/pickle_reader.h"

#include <algorithm>
#include <unordered_set>

namespace tessera::checkpoint::pickle {

namespace {

// Moves the children of `o` to `out`, leaving it without any.
void take_children(Py& o, std::vector<PyPtr>& out) {
  for (auto& x : o.items) out.push_back(std::move(x));
  for (auto& [k, v] : o.dict) {
    out.push_back(std::move(k));
    out.push_back(std::move(v));
  }
  if (o.state) out.push_back(std::move(o.state));
  o.items.clear();
  o.dict.clear();
  o.state.reset();
}

}  // namespace

// A child whose last owner this is gives up its own children before it dies, so that every
// destructor below this one finds nothing to destroy: no recursion, however deep the tree.
Py::~Py() {
  if (items.empty() && dict.empty() && !state) return;
  std::vector<PyPtr> pending;
  take_children(*this, pending);
  while (!pending.empty()) {
    PyPtr p = std::move(pending.back());
    pending.pop_back();
    if (p && p.use_count() == 1) take_children(*p, pending);
  }
}

PyPtr make(Py::Kind k) {
  auto o = std::make_shared<Py>();
  o->kind = k;
  return o;
}

const char* kind_text(const Py& o) {
  static const char* names[] = {"None",  "bool", "int",    "float",  "str",    "bytes",  "tuple",
                                "list",  "dict", "set",    "global", "object", "tensor", "storage"};
  return o.kind >= Py::None && o.kind <= Py::Storage ? names[o.kind] : "unknown value";
}

namespace {

struct Walk {
  const Leaf& leaf;
  const std::function<void(const std::string&)>& empty;
  uint64_t visits = 0;  // values visited
  uint64_t edges = 0;   // children of the distinct containers visited
  std::unordered_set<const Py*> seen;
};

std::string flatten_at(Walk& w, const Py& v, const std::string& key, int depth) {
  if (depth > 64) return concat("nesting too deep at '", key, "'");
  if (++w.visits > 8 * w.edges + 65536)
    return concat("the value at '", key, "' is reached again and again through shared parts (pickle memo "
                  "references): the walk passed ", w.visits, " values for ", w.edges,
                  " distinct container entries; refused as an amplification");
  auto below = [&](const std::string& k) { return key.empty() ? k : key + "." + k; };
  const bool container = v.kind == Py::List || v.kind == Py::Tuple || v.kind == Py::Dict;
  if (container && w.seen.insert(&v).second) w.edges += v.items.size() + v.dict.size();
  switch (v.kind) {
    case Py::List:
    case Py::Tuple:
      if (v.items.empty() && w.empty) w.empty(key);
      for (size_t k = 0; k < v.items.size(); ++k) {
        std::string why = flatten_at(w, *v.items[k], below(std::to_string(k)), depth + 1);
        if (!why.empty()) return why;
      }
      return "";
    case Py::Dict:
      if (v.dict.empty() && w.empty) w.empty(key);
      for (const auto& [k, x] : v.dict) {
        std::string name;
        if (k->kind == Py::Str) name = k->s;
        else if (k->kind == Py::Int) name = std::to_string(k->i);
        else return concat("a dict key under '", key, "' is a ", kind_text(*k), ", not a string or integer");
        std::string why = flatten_at(w, *x, below(name), depth + 1);
        if (!why.empty()) return why;
      }
      return "";
    default:
      return w.leaf(key, v);
  }
}

}  // namespace

std::string flatten(const Py& root, const std::string& prefix, const Leaf& leaf,
                    const std::function<void(const std::string&)>& empty) {
  Walk w{leaf, empty, 0, 0, {}};
  return flatten_at(w, root, prefix, 0);
}

}  // namespace tessera::checkpoint::pickle
