// A restricted Python unpickler (pickle protocols 2-5) for files Tessera reads but never
// trusts: torch.save files (torch_file.cpp, through pickle_archive.cpp), torch_xla's rank files
// (xla_rank_file.cpp), PyTorch DCP metadata and the torch.save archives inside .distcp files
// (dcp_import.cpp). It builds a tree of Python values; classes are only recorded (name,
// constructor arguments, BUILD state), never called. A global outside the caller's
// allow-list is refused where it appears (ForbiddenGlobal, naming it). For allowed
// globals it knows what torch's pickles mean: torch.Size(tuple) -> a tuple,
// collections.OrderedDict / builtins.set -> dict / set, _codecs.encode(str, 'latin1') ->
// bytes (protocol 2), torch._utils._rebuild_tensor_v2(storage, ...) -> a tensor view of
// the storage the persistent-id callback returned, torch.serialization._get_layout(name)
// and builtins.getattr(global, name) -> the named constant (a Global).
//
// The input is untrusted, so what it may build is bounded (see unpickle()): objects nest
// at most kMaxDepth levels, the memory the objects take is bounded by the input's size,
// objects that refer to themselves (a cycle through the memo) are refused, and tensor
// views are checked against their storage with overflow-safe arithmetic. Trees are
// destroyed without recursion, and flatten() refuses a walk that shared parts (memo
// references) would multiply.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "tessera/core/error.h"

namespace caffe2::serialize {
class PyTorchStreamReader;
}

namespace tessera::checkpoint::pickle {

struct Py;
using PyPtr = std::shared_ptr<Py>;
struct Py {
  Py() = default;
  Py(const Py&) = default;
  Py(Py&&) = default;
  Py& operator=(const Py&) = default;
  Py& operator=(Py&&) = default;
  ~Py();  // iterative: a deep tree does not recurse through its destructors

  enum Kind { None, Bool, Int, Float, Str, Bytes, Tuple, List, Dict, Set, Global, Object, Tensor, Storage };
  Kind kind = None;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::string s;                              // Str, Bytes; Global and Object: "module.name"
  std::vector<PyPtr> items;                   // Tuple, List, Set; Object: constructor arguments
  std::vector<std::pair<PyPtr, PyPtr>> dict;  // Dict, in order
  PyPtr state;                                // Object: what BUILD gave it
  at::Tensor t;                               // Tensor; Storage: its elements, 1-D
  uint32_t below = 0;                         // levels of containers below it (set by unpickle)
};

// Nothing unpickled nests deeper than this (Python's own pickler cannot write deeper).
inline constexpr uint32_t kMaxDepth = 1000;
// The memory an unpickle may use for its objects: kBudgetPerByte bytes per byte of
// input plus kBudgetBase, at most kBudgetMax. Pickles that Python and torch write take
// about 20-30 (torch.save state dicts ~22, DCP .metadata ~27); one of `]` (a new list per
// byte) would take 200.
inline constexpr uint64_t kBudgetPerByte = 128;
inline constexpr uint64_t kBudgetBase = 32ull << 20;
inline constexpr uint64_t kBudgetMax = 4ull << 30;

PyPtr make(Py::Kind k);
// "None", "int", "dict", ... for messages.
const char* kind_text(const Py& o);

// Walks a pickled container tree below `prefix`: dict entries under their str or int key,
// list and tuple items under their index, joined with '.'. Calls `leaf(key, value)` for every
// other value (None included) and `empty(key)`, when given, for an empty dict, list or tuple.
// A leaf returns "" to go on, or why it cannot take the value, which ends the walk. Returns
// "" or that reason; also a dict key of another kind or nesting deeper than 64 levels end it,
// each reason naming the key, and so does a walk that shared parts (a value the memo puts
// in several places) make visit more than 8 values per edge of the distinct containers
// plus 65536: a few hundred bytes can otherwise describe 2^60 leaves.
using Leaf = std::function<std::string(const std::string& key, const Py& value)>;
std::string flatten(const Py& root, const std::string& prefix, const Leaf& leaf,
                    const std::function<void(const std::string& key)>& empty = nullptr);

// A global outside the allow-list (apart from other errors, so that a caller can skip a
// value that needs one, never a damaged file).
struct ForbiddenGlobal : Error {
  using Error::Error;
};

// Turns a persistent id (torch.save: ('storage', storage type, key, location, numel)) into
// a Storage object.
using Persistent = std::function<PyPtr(const PyPtr&)>;

// Unpickles `data`. `where` names it in errors (with the byte offset); `allowed` holds the
// "module.name" globals that may appear; without `persistent` a persistent id is an error.
// Refused with an error naming `where` and the limit: nesting deeper than kMaxDepth;
// objects that would take more memory than the budget above (a pickle can build far more
// than its size: every `]` is a new list); objects that contain themselves; a tensor view
// that does not lie inside its storage (negative or overflowing offset, size or stride).
PyPtr unpickle(const std::string& where, const std::string& data, const std::set<std::string>& allowed,
               const Persistent& persistent = nullptr);

// ---- torch.save archives (pickle_archive.cpp): a zip of data.pkl, one data/<key> record per storage and a
// byteorder record; torch.save writes one per file (import_torch_file) and DCP one per
// item of a .distcp file (dcp_import.cpp).

// torch's storage classes (module "torch": "FloatStorage", ...) and their dtypes.
const std::vector<std::pair<const char*, at::ScalarType>>& torch_storage_classes();
// What a torch.save persistent id ('storage', storage class, key, location, numel) names:
// the record data/<key> holding `numel` elements of `dtype`. Refuses (naming `where`)
// another shape of id, an unknown storage class and a negative size.
struct StorageId {
  at::ScalarType dtype = at::kFloat;
  std::string key;
  int64_t numel = 0;
};
StorageId storage_id(const std::string& where, const PyPtr& pid);
// What a torch.save'd state dict may name: tensor and parameter rebuilding, the storage
// classes, plain containers (OrderedDict, set, torch.Size) and protocol 2's bytes.
const std::set<std::string>& torch_save_globals();
// Unpickles the archive's data.pkl with `allowed`; tensors view the archive's storage
// records (held, not copied). A big-endian archive is refused. `where` names it in errors.
PyPtr read_torch_archive(caffe2::serialize::PyTorchStreamReader& zip, const std::string& where,
                         const std::set<std::string>& allowed = torch_save_globals());

}  // namespace tessera::checkpoint::pickle
