#include "tessera/checkpoint/interop.h"

#include <ATen/ATen.h>
#include <caffe2/serialize/inline_container.h>

#include <cstring>
#include <map>
#include <variant>

#include "tessera/checkpoint/file_io.h"
#include "tessera/core/error.h"

namespace tessera::checkpoint {
namespace {

const std::vector<std::pair<const char*, at::ScalarType>>& storage_types() {
  static const std::vector<std::pair<const char*, at::ScalarType>> t = {
      {"FloatStorage", at::kFloat}, {"DoubleStorage", at::kDouble}, {"HalfStorage", at::kHalf},
      {"BFloat16Storage", at::kBFloat16}, {"LongStorage", at::kLong}, {"IntStorage", at::kInt},
      {"ShortStorage", at::kShort}, {"CharStorage", at::kChar}, {"ByteStorage", at::kByte},
      {"BoolStorage", at::kBool}};
  return t;
}

// ------------------------------------------------------------ restricted unpickler

struct Obj;
using ObjPtr = std::shared_ptr<Obj>;
struct Global {
  std::string module, name;
};
struct Mark {};
struct Storage {
  at::Tensor flat;  // 1-D, the storage's elements
};
struct Obj {
  enum Kind { None, Bool, Int, Float, Str, Bytes, Tuple, List, Dict, Glob, Tensor, Stor } kind = None;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::string s;
  std::vector<ObjPtr> items;                         // tuple / list
  std::vector<std::pair<ObjPtr, ObjPtr>> dict;       // dict (ordered)
  Global g;
  at::Tensor t;
};

ObjPtr make(Obj::Kind k) {
  auto o = std::make_shared<Obj>();
  o->kind = k;
  return o;
}

class Unpickler {
 public:
  Unpickler(const std::string& path, const std::string& data, caffe2::serialize::PyTorchStreamReader& zip)
      : path_(path), d_(data), zip_(zip) {}

  ObjPtr run() {
    while (true) {
      const uint8_t op = u8();
      switch (op) {
        case 0x80: u8(); break;                       // PROTO
        case 0x95: bytes(8); break;                   // FRAME
        case '}': push(make(Obj::Dict)); break;
        case ']': push(make(Obj::List)); break;
        case ')': push(make(Obj::Tuple)); break;
        case '(': marks_.push_back(stack_.size()); break;
        case 'X': push_str(bytes(le(4))); break;
        case 0x8c: push_str(bytes(u8())); break;
        case 0x8d: push_str(bytes(le(8))); break;
        case 'B': push_bytes(bytes(le(4))); break;
        case 'C': push_bytes(bytes(u8())); break;
        case 'q': memo_[u8()] = top(); break;
        case 'r': memo_[le(4)] = top(); break;
        case 0x94: memo_[memo_.size()] = top(); break;
        case 'h': push(memo(u8())); break;
        case 'j': push(memo(le(4))); break;
        case 'c': {
          auto o = make(Obj::Glob);
          o->g.module = line();
          o->g.name = line();
          push(o);
          break;
        }
        case 0x93: {
          auto name = pop(), mod = pop();
          auto o = make(Obj::Glob);
          o->g = {as_str(mod), as_str(name)};
          push(o);
          break;
        }
        case 'Q': push(persistent(pop())); break;
        case 't': push(tuple_from(pop_mark())); break;
        case 0x85: { auto a = pop(); push(tuple_from({a})); break; }
        case 0x86: { auto b = pop(), a = pop(); push(tuple_from({a, b})); break; }
        case 0x87: { auto c = pop(), b = pop(), a = pop(); push(tuple_from({a, b, c})); break; }
        case 'J': push_int(static_cast<int32_t>(le(4))); break;
        case 'K': push_int(u8()); break;
        case 'M': push_int(static_cast<int64_t>(le(2))); break;
        case 0x8a: {
          const size_t n = u8();
          TESSERA_CHECK(n <= 8, where(), ": integer of ", n, " bytes is too large");
          std::string b = bytes(n);
          uint64_t v = 0;
          for (size_t k = 0; k < n; ++k) v |= static_cast<uint64_t>(static_cast<uint8_t>(b[k])) << (8 * k);
          if (n > 0 && n < 8 && (static_cast<uint8_t>(b[n - 1]) & 0x80)) v |= ~0ull << (8 * n);
          push_int(static_cast<int64_t>(v));
          break;
        }
        case 0x88: { auto o = make(Obj::Bool); o->b = true; push(o); break; }
        case 0x89: push(make(Obj::Bool)); break;
        case 'N': push(make(Obj::None)); break;
        case 'G': {
          std::string b = bytes(8);
          uint64_t v = 0;
          for (int k = 0; k < 8; ++k) v = (v << 8) | static_cast<uint8_t>(b[k]);
          auto o = make(Obj::Float);
          std::memcpy(&o->f, &v, 8);
          push(o);
          break;
        }
        case 'R': { auto args = pop(), fn = pop(); push(reduce(fn, args)); break; }
        case 's': { auto v = pop(), k = pop(); dict_of(top())->dict.emplace_back(k, v); break; }
        case 'u': {
          auto items = pop_mark();
          TESSERA_CHECK(items.size() % 2 == 0, where(), ": SETITEMS with an odd number of items");
          auto d = dict_of(top());
          for (size_t k = 0; k < items.size(); k += 2) d->dict.emplace_back(items[k], items[k + 1]);
          break;
        }
        case 'a': { auto v = pop(); list_of(top())->items.push_back(v); break; }
        case 'e': {
          auto items = pop_mark();
          auto l = list_of(top());
          for (auto& v : items) l->items.push_back(v);
          break;
        }
        case 'b': pop(); break;  // BUILD: object state (OrderedDict._metadata) is not needed
        case '.': return pop();
        default:
          throw Error(concat(where(), ": unsupported pickle opcode 0x", std::hex, static_cast<int>(op),
                             " (only plain dicts of tensors are imported)"));
      }
    }
  }

 private:
  std::string where() const { return concat("'", path_, "' (data.pkl byte ", pos_, ")"); }
  uint8_t u8() {
    TESSERA_CHECK(pos_ < d_.size(), where(), ": truncated pickle");
    return static_cast<uint8_t>(d_[pos_++]);
  }
  uint64_t le(int n) {
    uint64_t v = 0;
    for (int k = 0; k < n; ++k) v |= static_cast<uint64_t>(u8()) << (8 * k);
    return v;
  }
  std::string bytes(uint64_t n) {
    TESSERA_CHECK(n <= d_.size() - pos_, where(), ": truncated pickle");
    std::string s = d_.substr(pos_, n);
    pos_ += n;
    return s;
  }
  std::string line() {
    auto e = d_.find('\n', pos_);
    TESSERA_CHECK(e != std::string::npos, where(), ": truncated GLOBAL");
    std::string s = d_.substr(pos_, e - pos_);
    pos_ = e + 1;
    return s;
  }
  void push(ObjPtr o) { stack_.push_back(std::move(o)); }
  void push_str(std::string s) { auto o = make(Obj::Str); o->s = std::move(s); push(o); }
  void push_bytes(std::string s) { auto o = make(Obj::Bytes); o->s = std::move(s); push(o); }
  void push_int(int64_t v) { auto o = make(Obj::Int); o->i = v; push(o); }
  ObjPtr top() {
    TESSERA_CHECK(!stack_.empty(), where(), ": pickle stack underflow");
    return stack_.back();
  }
  ObjPtr pop() {
    TESSERA_CHECK(stack_.size() > (marks_.empty() ? 0 : marks_.back()), where(), ": pickle stack underflow");
    auto o = stack_.back();
    stack_.pop_back();
    return o;
  }
  std::vector<ObjPtr> pop_mark() {
    TESSERA_CHECK(!marks_.empty(), where(), ": pickle MARK missing");
    const size_t m = marks_.back();
    marks_.pop_back();
    std::vector<ObjPtr> v(stack_.begin() + static_cast<std::ptrdiff_t>(m), stack_.end());
    stack_.resize(m);
    return v;
  }
  ObjPtr memo(uint64_t k) {
    auto it = memo_.find(k);
    TESSERA_CHECK(it != memo_.end(), where(), ": pickle memo ", k, " missing");
    return it->second;
  }
  ObjPtr tuple_from(std::vector<ObjPtr> v) { auto o = make(Obj::Tuple); o->items = std::move(v); return o; }
  ObjPtr dict_of(const ObjPtr& o) {
    TESSERA_CHECK(o->kind == Obj::Dict, where(), ": SETITEM on a non-dict");
    return o;
  }
  ObjPtr list_of(const ObjPtr& o) {
    TESSERA_CHECK(o->kind == Obj::List, where(), ": APPEND on a non-list");
    return o;
  }
  std::string as_str(const ObjPtr& o) {
    TESSERA_CHECK(o->kind == Obj::Str, where(), ": expected a string");
    return o->s;
  }
  int64_t as_int(const ObjPtr& o) {
    TESSERA_CHECK(o->kind == Obj::Int, where(), ": expected an integer");
    return o->i;
  }
  std::vector<int64_t> as_ints(const ObjPtr& o) {
    TESSERA_CHECK(o->kind == Obj::Tuple || o->kind == Obj::List, where(), ": expected a tuple of integers");
    std::vector<int64_t> v;
    for (auto& x : o->items) v.push_back(as_int(x));
    return v;
  }

  ObjPtr persistent(const ObjPtr& pid) {
    TESSERA_CHECK(pid->kind == Obj::Tuple && pid->items.size() == 5 && pid->items[0]->kind == Obj::Str &&
                      pid->items[0]->s == "storage" && pid->items[1]->kind == Obj::Glob,
                  where(), ": unsupported persistent id");
    const Global& g = pid->items[1]->g;
    at::ScalarType dt = at::kFloat;
    bool found = false;
    for (auto& [n, s] : storage_types())
      if (g.module == "torch" && g.name == n) dt = s, found = true;
    TESSERA_CHECK(found, where(), ": unsupported storage type ", g.module, ".", g.name);
    const std::string key = as_str(pid->items[2]);
    const int64_t numel = as_int(pid->items[4]);
    auto it = storages_.find(key);
    if (it == storages_.end()) {
      TESSERA_CHECK(numel >= 0, where(), ": negative storage size");
      const std::string rec = "data/" + key;
      TESSERA_CHECK(zip_.hasRecord(rec), "'", path_, "': storage record '", rec, "' is missing");
      at::DataPtr ptr;
      size_t size = 0;
      std::tie(ptr, size) = zip_.getRecord(rec);
      const uint64_t want = static_cast<uint64_t>(numel) * c10::elementSize(dt);
      TESSERA_CHECK(size >= want, "'", path_, "': storage record '", rec, "' holds ", size, " bytes, needs ", want);
      at::Tensor flat = at::empty({numel}, at::TensorOptions().dtype(dt));
      if (want) std::memcpy(flat.data_ptr(), ptr.get(), want);
      it = storages_.emplace(key, flat).first;
    }
    auto o = make(Obj::Stor);
    o->t = it->second;
    return o;
  }

  ObjPtr reduce(const ObjPtr& fn, const ObjPtr& args) {
    TESSERA_CHECK(fn->kind == Obj::Glob, where(), ": REDUCE of a non-global");
    TESSERA_CHECK(args->kind == Obj::Tuple, where(), ": REDUCE arguments are not a tuple");
    const std::string name = fn->g.module + "." + fn->g.name;
    const auto& a = args->items;
    if (name == "collections.OrderedDict") return make(Obj::Dict);
    if (name == "torch._utils._rebuild_tensor_v2" || name == "torch._utils._rebuild_tensor") {
      TESSERA_CHECK(a.size() >= 4 && a[0]->kind == Obj::Stor, where(), ": bad _rebuild_tensor arguments");
      const at::Tensor& flat = a[0]->t;
      const int64_t offset = as_int(a[1]);
      auto size = as_ints(a[2]), stride = as_ints(a[3]);
      TESSERA_CHECK(size.size() == stride.size() && offset >= 0, where(), ": bad tensor geometry");
      int64_t extent = 0;
      bool empty = false;
      for (size_t d = 0; d < size.size(); ++d) {
        TESSERA_CHECK(size[d] >= 0 && stride[d] >= 0, where(), ": negative size or stride");
        empty |= size[d] == 0;
        extent += (size[d] - 1) * stride[d];
      }
      TESSERA_CHECK(empty || offset + extent < flat.numel(), where(), ": tensor reaches past its storage");
      auto o = make(Obj::Tensor);
      o->t = empty ? at::empty(size, flat.options()) : flat.as_strided(size, stride, offset);
      return o;
    }
    if (name == "torch._utils._rebuild_parameter" || name == "torch._utils._rebuild_parameter_with_state") {
      TESSERA_CHECK(!a.empty() && a[0]->kind == Obj::Tensor, where(), ": bad _rebuild_parameter arguments");
      return a[0];
    }
    throw Error(concat(where(), ": refusing to call '", name,
                       "' (only tensors, dicts and lists are imported; loading never runs code)"));
  }

  std::string path_;
  const std::string& d_;
  caffe2::serialize::PyTorchStreamReader& zip_;
  size_t pos_ = 0;
  std::vector<ObjPtr> stack_;
  std::vector<size_t> marks_;
  std::map<uint64_t, ObjPtr> memo_;
  std::map<std::string, at::Tensor> storages_;
};

void flatten_obj(const std::string& path, const std::string& prefix, const ObjPtr& o, CheckpointMetadata& m,
                 int depth) {
  TESSERA_CHECK(depth < 64, "'", path, "': nesting too deep at '", prefix, "'");
  auto add = [&](EntryInfo e) {
    TESSERA_CHECK(!m.entries.count(prefix), "'", path, "': key '", prefix, "' appears twice");
    m.keys.push_back(prefix);
    m.entries.emplace(prefix, std::move(e));
  };
  auto join = [&](const std::string& k) { return prefix.empty() ? k : prefix + "." + k; };
  switch (o->kind) {
    case Obj::Dict:
      for (auto& [k, v] : o->dict) {
        std::string ks;
        if (k->kind == Obj::Str) ks = k->s;
        else if (k->kind == Obj::Int) ks = std::to_string(k->i);
        else throw Error(concat("'", path, "': dict key under '", prefix, "' is not a string or integer"));
        flatten_obj(path, join(ks), v, m, depth + 1);
      }
      return;
    case Obj::List:
    case Obj::Tuple:
      for (size_t k = 0; k < o->items.size(); ++k) flatten_obj(path, join(std::to_string(k)), o->items[k], m, depth + 1);
      return;
    case Obj::Tensor: {
      EntryInfo e;
      e.kind = "tensor";
      e.dtype = o->t.scalar_type();
      e.shape = o->t.sizes().vec();
      if (o->t.numel() > 0) {
        ChunkInfo c;
        c.box = sharding::full_box(e.shape);
        c.file = path;
        c.name = prefix;
        c.memory = o->t;
        e.chunks.push_back(std::move(c));
      }
      add(std::move(e));
      return;
    }
    case Obj::Int: { EntryInfo e; e.kind = "int"; e.value = o->i; add(std::move(e)); return; }
    case Obj::Float: { EntryInfo e; e.kind = "float"; e.value = o->f; add(std::move(e)); return; }
    case Obj::Bool: { EntryInfo e; e.kind = "bool"; e.value = o->b; add(std::move(e)); return; }
    case Obj::Str: { EntryInfo e; e.kind = "string"; e.value = o->s; add(std::move(e)); return; }
    case Obj::Bytes: { EntryInfo e; e.kind = "bytes"; e.value = state::Bytes{o->s}; add(std::move(e)); return; }
    default: return;  // None and the like carry no state
  }
}

// Pickle writing helpers.
void put_str(std::string& p, const std::string& s) {
  p.push_back('X');
  const uint32_t n = static_cast<uint32_t>(s.size());
  for (int k = 0; k < 4; ++k) p.push_back(static_cast<char>((n >> (8 * k)) & 0xff));
  p += s;
}
void put_int(std::string& p, int64_t v) {
  if (v >= INT32_MIN && v <= INT32_MAX) {
    p.push_back('J');
    const uint32_t u = static_cast<uint32_t>(static_cast<int32_t>(v));
    for (int k = 0; k < 4; ++k) p.push_back(static_cast<char>((u >> (8 * k)) & 0xff));
  } else {
    p.push_back(static_cast<char>(0x8a));
    p.push_back(8);
    const uint64_t u = static_cast<uint64_t>(v);
    for (int k = 0; k < 8; ++k) p.push_back(static_cast<char>((u >> (8 * k)) & 0xff));
  }
}
void put_ints(std::string& p, const std::vector<int64_t>& v) {
  if (v.empty()) {
    p.push_back(')');
    return;
  }
  p.push_back('(');
  for (auto x : v) put_int(p, x);
  p.push_back('t');
}

}  // namespace

CheckpointMetadata import_torch_file(const std::string& path) {
  std::unique_ptr<caffe2::serialize::PyTorchStreamReader> zip;
  try {
    zip = std::make_unique<caffe2::serialize::PyTorchStreamReader>(path);
  } catch (const std::exception& e) {
    throw Error(concat("'", path, "' is not a readable torch.save archive: ", e.what()));
  }
  TESSERA_CHECK(zip->hasRecord("data.pkl"), "'", path, "' is not a torch.save file (no data.pkl; a TorchScript "
                "archive written by torch::save / torch.jit.save is not a dict of tensors)");
  at::DataPtr ptr;
  size_t size = 0;
  std::tie(ptr, size) = zip->getRecord("data.pkl");
  const std::string data(static_cast<const char*>(ptr.get()), size);
  Unpickler u(path, data, *zip);
  ObjPtr root;
  try {
    root = u.run();
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw Error(concat("'", path, "': cannot read: ", e.what()));
  }
  TESSERA_CHECK(root->kind == Obj::Dict, "'", path, "' does not hold a dict (a state_dict) at the top level");
  CheckpointMetadata m;
  m.source_kind = "torch";
  m.location = path;
  flatten_obj(path, "", root, m, 0);
  return m;
}

TorchExportWriter::TorchExportWriter(const std::string& path) {
  try {
    zip_ = std::make_unique<caffe2::serialize::PyTorchStreamWriter>(path);
  } catch (const std::exception& e) {
    throw Error(concat("cannot create '", path, "': ", e.what()));
  }
}

TorchExportWriter::~TorchExportWriter() = default;

void TorchExportWriter::add(const std::string& name, const at::Tensor& t) {
  TESSERA_CHECK(!finished_, "export: add after finish");
  at::Tensor c = t.cpu().contiguous();
  bool known = false;
  for (auto& [n, s] : storage_types()) known |= s == c.scalar_type();
  TESSERA_CHECK(known, "export: key '", name, "' has dtype ", c.scalar_type(), " which torch export does not support");
  const std::string rec = "data/" + std::to_string(items_.size());
  zip_->writeRecord(rec, c.data_ptr(), c.numel() * c.element_size());
  items_.push_back({name, c.scalar_type(), c.sizes().vec()});
}

void TorchExportWriter::finish() {
  TESSERA_CHECK(!finished_, "export: finish called twice");
  std::string p = "\x80\x02}(";
  for (size_t i = 0; i < items_.size(); ++i) {
    const Item& it = items_[i];
    put_str(p, it.name);
    p += "ctorch._utils\n_rebuild_tensor_v2\n(";
    p += "(";
    put_str(p, "storage");
    for (auto& [n, s] : storage_types())
      if (s == it.dtype) p += std::string("ctorch\n") + n + "\n";
    put_str(p, std::to_string(i));
    put_str(p, "cpu");
    int64_t numel = 1;
    for (auto d : it.shape) numel *= d;
    put_int(p, numel);
    p += "tQ";
    put_int(p, 0);
    put_ints(p, it.shape);
    std::vector<int64_t> strides(it.shape.size(), 1);
    for (size_t d = it.shape.size(); d-- > 1;) strides[d - 1] = strides[d] * std::max<int64_t>(it.shape[d], 1);
    put_ints(p, strides);
    p += "\x89";
    p += "ccollections\nOrderedDict\n)R";
    p += "tR";
  }
  p += "u.";
  zip_->writeRecord("data.pkl", p.data(), p.size());
  zip_->writeRecord("byteorder", "little", 6);
  zip_->writeEndOfFile();
  zip_.reset();
  finished_ = true;
}

}  // namespace tessera::checkpoint
