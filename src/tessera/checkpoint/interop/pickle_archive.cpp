// torch.save archives through the restricted unpickler (pickle_reader.h): the zip's
// byte order, its data.pkl and one storage record per persistent id, checked against the
// element count the id declares.
#include <ATen/ATen.h>
#include <caffe2/serialize/inline_container.h>

#include <map>
#include <string>
#include <tuple>

#include "tessera/checkpoint/interop/pickle_reader.h"

namespace tessera::checkpoint::pickle {

const std::vector<std::pair<const char*, at::ScalarType>>& torch_storage_classes() {
  static const std::vector<std::pair<const char*, at::ScalarType>> t = {
      {"FloatStorage", at::kFloat}, {"DoubleStorage", at::kDouble}, {"HalfStorage", at::kHalf},
      {"BFloat16Storage", at::kBFloat16}, {"LongStorage", at::kLong}, {"IntStorage", at::kInt},
      {"ShortStorage", at::kShort}, {"CharStorage", at::kChar}, {"ByteStorage", at::kByte},
      {"BoolStorage", at::kBool}};
  return t;
}

const std::set<std::string>& torch_save_globals() {
  static const std::set<std::string> g = [] {
    std::set<std::string> s = {"torch._utils._rebuild_tensor_v2", "torch._utils._rebuild_tensor",
                               "torch._utils._rebuild_parameter", "torch._utils._rebuild_parameter_with_state",
                               "collections.OrderedDict", "builtins.set", "builtins.frozenset", "_codecs.encode",
                               "torch.Size"};
    for (const auto& [n, t] : torch_storage_classes()) s.insert(std::string("torch.") + n);
    return s;
  }();
  return g;
}

namespace {

// A persistent id of torch.save, ('storage', storage class, key, location, numel), as
// the 1-D tensor of record data/<key>: the record's own buffer, no copy.
PyPtr storage(caffe2::serialize::PyTorchStreamReader& zip, const std::string& where, const PyPtr& pid,
              std::map<std::string, PyPtr>& cache) {
  const StorageId id = storage_id(where, pid);
  const at::ScalarType dt = id.dtype;
  const std::string& key = id.key;
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  const int64_t numel = id.numel;
  const std::string rec = "data/" + key;
  TESSERA_CHECK(zip.hasRecord(rec), where, ": storage record '", rec, "' is missing");
  at::DataPtr ptr;
  size_t size = 0;
  std::tie(ptr, size) = zip.getRecord(rec);
  // numel * element size can overflow: compare element counts instead.
  const uint64_t fits = size / c10::elementSize(dt);
  TESSERA_CHECK(static_cast<uint64_t>(numel) <= fits, where, ": storage record '", rec, "' holds ", size,
                " bytes, too few for the ", numel, " elements of ", c10::elementSize(dt), " bytes its id declares");
  auto o = make(Py::Storage);
  if (numel == 0) {
    o->t = at::empty({0}, at::TensorOptions().dtype(dt));
  } else {
    auto holder = std::make_shared<at::DataPtr>(std::move(ptr));
    o->t = at::from_blob(holder->get(), {numel}, [holder](void*) {}, at::TensorOptions().dtype(dt));
  }
  return cache.emplace(key, o).first->second;
}

}  // namespace

StorageId storage_id(const std::string& where, const PyPtr& pid) {
  TESSERA_CHECK(pid->kind == Py::Tuple && pid->items.size() == 5 && pid->items[0]->kind == Py::Str &&
                    pid->items[0]->s == "storage" && pid->items[1]->kind == Py::Global &&
                    pid->items[2]->kind == Py::Str && pid->items[4]->kind == Py::Int,
                where, ": unsupported persistent id");
  StorageId id;
  bool found = false;
  for (const auto& [n, t] : torch_storage_classes())
    if (pid->items[1]->s == std::string("torch.") + n) id.dtype = t, found = true;
  TESSERA_CHECK(found, where, ": unsupported storage type ", pid->items[1]->s);
  id.key = pid->items[2]->s;
  id.numel = pid->items[4]->i;
  TESSERA_CHECK(id.numel >= 0, where, ": negative storage size");
  return id;
}

PyPtr read_torch_archive(caffe2::serialize::PyTorchStreamReader& zip, const std::string& where,
                         const std::set<std::string>& allowed) {
  if (zip.hasRecord("byteorder")) {
    at::DataPtr p;
    size_t n = 0;
    std::tie(p, n) = zip.getRecord("byteorder");
    const std::string order(static_cast<const char*>(p.get()), n);
    TESSERA_CHECK(order == "little", where, ": byte order '", order, "' (only little-endian data is read)");
  }
  TESSERA_CHECK(zip.hasRecord("data.pkl"), where, ": no data.pkl record");
  at::DataPtr p;
  size_t n = 0;
  std::tie(p, n) = zip.getRecord("data.pkl");
  const std::string pkl(static_cast<const char*>(p.get()), n);
  std::map<std::string, PyPtr> storages;
  return unpickle(where, pkl, allowed, [&](const PyPtr& pid) { return storage(zip, where, pid, storages); });
}

}  // namespace tessera::checkpoint::pickle
