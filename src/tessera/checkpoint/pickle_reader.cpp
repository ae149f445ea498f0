#include "tessera/checkpoint/pickle_reader.h"

#include <ATen/ATen.h>
#include <caffe2/serialize/inline_container.h>

#include <cstring>
#include <map>

namespace tessera::checkpoint::pickle {

PyPtr make(Py::Kind k) {
  auto o = std::make_shared<Py>();
  o->kind = k;
  return o;
}

const char* kind_text(const Py& o) {
  static const char* names[] = {"None",  "bool", "int",    "float",  "str",    "bytes",  "tuple",
                                "list",  "dict", "set",    "global", "object", "tensor", "storage"};
  return names[o.kind];
}

namespace {

std::string flatten_at(const Py& v, const std::string& key, const Leaf& leaf,
                       const std::function<void(const std::string&)>& empty, int depth) {
  if (depth > 64) return concat("nesting too deep at '", key, "'");
  auto below = [&](const std::string& k) { return key.empty() ? k : key + "." + k; };
  switch (v.kind) {
    case Py::List:
    case Py::Tuple:
      if (v.items.empty() && empty) empty(key);
      for (size_t k = 0; k < v.items.size(); ++k) {
        std::string why = flatten_at(*v.items[k], below(std::to_string(k)), leaf, empty, depth + 1);
        if (!why.empty()) return why;
      }
      return "";
    case Py::Dict:
      if (v.dict.empty() && empty) empty(key);
      for (const auto& [k, x] : v.dict) {
        std::string name;
        if (k->kind == Py::Str) name = k->s;
        else if (k->kind == Py::Int) name = std::to_string(k->i);
        else return concat("a dict key under '", key, "' is a ", kind_text(*k), ", not a string or integer");
        std::string why = flatten_at(*x, below(name), leaf, empty, depth + 1);
        if (!why.empty()) return why;
      }
      return "";
    default:
      return leaf(key, v);
  }
}

}  // namespace

std::string flatten(const Py& root, const std::string& prefix, const Leaf& leaf,
                    const std::function<void(const std::string&)>& empty) {
  return flatten_at(root, prefix, leaf, empty, 0);
}

namespace {

class Unpickler {
 public:
  using Persistent = std::function<PyPtr(const PyPtr&)>;
  // `where` names the file (and item) in errors.
  Unpickler(std::string where, const std::string& data, const std::set<std::string>& allowed,
            Persistent persistent = nullptr)
      : where_(std::move(where)), d_(data), allowed_(allowed), persistent_(std::move(persistent)) {}

  PyPtr run() {
    for (;;) {
      const uint8_t op = u8();
      switch (op) {
        case 0x80: u8(); break;      // PROTO
        case 0x95: le(8); break;     // FRAME (frames are only a read-ahead hint)
        case '.': {                  // STOP
          PyPtr r = pop();
          TESSERA_CHECK(stack_.empty() && marks_.empty(), at(), ": values left on the stack at STOP");
          return r;
        }
        case '(': marks_.push_back(stack_.size()); break;
        case '0': pop(); break;
        case '1': pop_mark(); break;
        case '2': push(top()); break;
        case 'N': push(make(Py::None)); break;
        case 0x88: push_bool(true); break;
        case 0x89: push_bool(false); break;
        case 'J': push_int(static_cast<int32_t>(le(4))); break;
        case 'K': push_int(u8()); break;
        case 'M': push_int(static_cast<int64_t>(le(2))); break;
        case 0x8a: push_int(long_int(u8())); break;
        case 0x8b: push_int(long_int(le(4))); break;
        case 'G': {
          uint64_t v = 0;
          for (int k = 0; k < 8; ++k) v = (v << 8) | u8();  // big-endian
          auto o = make(Py::Float);
          std::memcpy(&o->f, &v, 8);
          push(o);
          break;
        }
        case 'X': push_str(Py::Str, bytes(le(4))); break;
        case 0x8c: push_str(Py::Str, bytes(u8())); break;
        case 0x8d: push_str(Py::Str, bytes(le(8))); break;
        case 'B': push_str(Py::Bytes, bytes(le(4))); break;
        case 'C': push_str(Py::Bytes, bytes(u8())); break;
        case 0x8e: push_str(Py::Bytes, bytes(le(8))); break;
        case 0x96: push_str(Py::Bytes, bytes(le(8))); break;  // BYTEARRAY8
        case ')': push(make(Py::Tuple)); break;
        case 't': push(tuple_of(pop_mark())); break;
        case 0x85: { auto a = pop(); push(tuple_of({a})); break; }
        case 0x86: { auto b = pop(), a = pop(); push(tuple_of({a, b})); break; }
        case 0x87: { auto c = pop(), b = pop(), a = pop(); push(tuple_of({a, b, c})); break; }
        case ']': push(make(Py::List)); break;
        case 'l': { auto l = make(Py::List); l->items = pop_mark(); push(l); break; }
        case 'a': { auto v = pop(); want(top(), Py::List, "APPEND")->items.push_back(v); break; }
        case 'e': {
          auto v = pop_mark();
          auto l = want(top(), Py::List, "APPENDS");
          l->items.insert(l->items.end(), v.begin(), v.end());
          break;
        }
        case '}': push(make(Py::Dict)); break;
        case 'd': { auto d = make(Py::Dict); add_pairs(d, pop_mark()); push(d); break; }
        case 's': { auto v = pop(), k = pop(); want(top(), Py::Dict, "SETITEM")->dict.emplace_back(k, v); break; }
        case 'u': { auto v = pop_mark(); add_pairs(want(top(), Py::Dict, "SETITEMS"), v); break; }
        case 0x8f: push(make(Py::Set)); break;
        case 0x90: {
          auto v = pop_mark();
          auto s = want(top(), Py::Set, "ADDITEMS");
          s->items.insert(s->items.end(), v.begin(), v.end());
          break;
        }
        case 0x91: { auto s = make(Py::Set); s->items = pop_mark(); push(s); break; }
        case 'c': {
          std::string mod = line(), name = line();
          push(global(mod, name));
          break;
        }
        case 0x93: {
          auto name = pop(), mod = pop();
          push(global(str_of(mod), str_of(name)));
          break;
        }
        case 'R': { auto args = pop(), fn = pop(); push(reduce(fn, args)); break; }
        case 0x81: { auto args = pop(), cls = pop(); push(object(cls, args)); break; }
        case 0x92: { pop(); auto args = pop(), cls = pop(); push(object(cls, args)); break; }  // NEWOBJ_EX
        case 'b': {
          auto st = pop();
          auto o = top();
          if (o->kind == Py::Object) o->state = st;
          else TESSERA_CHECK(o->kind == Py::Dict || o->kind == Py::Tensor, at(), ": BUILD of a ", kind_text(*o));
          break;  // an OrderedDict's or a tensor's attributes carry nothing needed
        }
        case 'Q': {
          auto pid = pop();
          TESSERA_CHECK(persistent_ != nullptr, at(), ": a persistent id where none may appear");
          push(persistent_(pid));
          break;
        }
        case 'q': memo_[u8()] = top(); break;
        case 'r': memo_[le(4)] = top(); break;
        case 0x94: memo_[memo_.size()] = top(); break;
        case 'h': push(memo(u8())); break;
        case 'j': push(memo(le(4))); break;
        default:
          throw Error(concat(at(), ": unsupported pickle opcode 0x", std::hex, static_cast<int>(op)));
      }
    }
  }

  std::string at() const { return concat(where_, " (byte ", pos_, ")"); }

 private:
  uint8_t u8() {
    TESSERA_CHECK(pos_ < d_.size(), where_, ": truncated pickle");
    return static_cast<uint8_t>(d_[pos_++]);
  }
  uint64_t le(int n) {
    uint64_t v = 0;
    for (int k = 0; k < n; ++k) v |= static_cast<uint64_t>(u8()) << (8 * k);
    return v;
  }
  std::string bytes(uint64_t n) {
    TESSERA_CHECK(n <= d_.size() - pos_, where_, ": truncated pickle");
    std::string s = d_.substr(pos_, n);
    pos_ += n;
    return s;
  }
  std::string line() {
    const size_t e = d_.find('\n', pos_);
    TESSERA_CHECK(e != std::string::npos, where_, ": truncated GLOBAL");
    std::string s = d_.substr(pos_, e - pos_);
    pos_ = e + 1;
    return s;
  }
  int64_t long_int(uint64_t n) {
    TESSERA_CHECK(n <= 8, at(), ": an integer of ", n, " bytes does not fit in 64 bits");
    const std::string b = bytes(n);
    uint64_t v = 0;
    for (size_t k = 0; k < n; ++k) v |= static_cast<uint64_t>(static_cast<uint8_t>(b[k])) << (8 * k);
    if (n > 0 && n < 8 && (static_cast<uint8_t>(b[n - 1]) & 0x80)) v |= ~0ull << (8 * n);
    return static_cast<int64_t>(v);
  }
  void push(PyPtr o) { stack_.push_back(std::move(o)); }
  void push_bool(bool v) { auto o = make(Py::Bool); o->b = v; push(o); }
  void push_int(int64_t v) { auto o = make(Py::Int); o->i = v; push(o); }
  void push_str(Py::Kind k, std::string s) { auto o = make(k); o->s = std::move(s); push(o); }
  PyPtr top() {
    TESSERA_CHECK(stack_.size() > (marks_.empty() ? 0 : marks_.back()), at(), ": pickle stack underflow");
    return stack_.back();
  }
  PyPtr pop() {
    PyPtr o = top();
    stack_.pop_back();
    return o;
  }
  std::vector<PyPtr> pop_mark() {
    TESSERA_CHECK(!marks_.empty(), at(), ": pickle MARK missing");
    const size_t m = marks_.back();
    marks_.pop_back();
    std::vector<PyPtr> v(stack_.begin() + static_cast<std::ptrdiff_t>(m), stack_.end());
    stack_.resize(m);
    return v;
  }
  PyPtr memo(uint64_t k) {
    auto it = memo_.find(k);
    TESSERA_CHECK(it != memo_.end(), at(), ": pickle memo ", k, " missing");
    return it->second;
  }
  PyPtr want(const PyPtr& o, Py::Kind k, const char* op) {
    TESSERA_CHECK(o->kind == k, at(), ": ", op, " on a ", kind_text(*o));
    return o;
  }
  std::string str_of(const PyPtr& o) {
    TESSERA_CHECK(o->kind == Py::Str, at(), ": expected a string, got a ", kind_text(*o));
    return o->s;
  }
  static PyPtr tuple_of(std::vector<PyPtr> v) {
    auto o = make(Py::Tuple);
    o->items = std::move(v);
    return o;
  }
  void add_pairs(const PyPtr& d, const std::vector<PyPtr>& v) {
    TESSERA_CHECK(v.size() % 2 == 0, at(), ": dict items of odd length");
    for (size_t k = 0; k < v.size(); k += 2) d->dict.emplace_back(v[k], v[k + 1]);
  }
  PyPtr global(const std::string& mod, const std::string& name) {
    const std::string full = mod + "." + name;
    if (!allowed_.count(full))
      throw ForbiddenGlobal(concat(where_, ": refusing the global '", full,
                                   "' (not one of the types this file may hold; nothing in it is run)"));
    auto o = make(Py::Global);
    o->s = full;
    return o;
  }
  PyPtr object(const PyPtr& cls, const PyPtr& args) {
    TESSERA_CHECK(cls->kind == Py::Global, at(), ": NEWOBJ of a ", kind_text(*cls));
    TESSERA_CHECK(args->kind == Py::Tuple, at(), ": NEWOBJ arguments are a ", kind_text(*args));
    auto o = make(Py::Object);
    o->s = cls->s;
    o->items = args->items;
    return o;
  }
  int64_t int_of(const PyPtr& o) {
    TESSERA_CHECK(o->kind == Py::Int, at(), ": expected an integer, got a ", kind_text(*o));
    return o->i;
  }
  std::vector<int64_t> ints_of(const PyPtr& o) {
    TESSERA_CHECK(o->kind == Py::Tuple || o->kind == Py::List, at(), ": expected a tuple of integers");
    std::vector<int64_t> v;
    for (const auto& x : o->items) v.push_back(int_of(x));
    return v;
  }
  PyPtr reduce(const PyPtr& fn, const PyPtr& args) {
    TESSERA_CHECK(fn->kind == Py::Global, at(), ": REDUCE of a ", kind_text(*fn));
    TESSERA_CHECK(args->kind == Py::Tuple, at(), ": REDUCE arguments are a ", kind_text(*args));
    const std::string& name = fn->s;
    const auto& a = args->items;
    if (name == "torch.Size") {
      auto o = make(Py::Tuple);
      if (!a.empty()) {
        for (int64_t v : ints_of(a[0])) {
          auto x = make(Py::Int);
          x->i = v;
          o->items.push_back(x);
        }
      }
      return o;
    }
    if (name == "collections.OrderedDict") {
      auto d = make(Py::Dict);
      if (!a.empty()) {
        TESSERA_CHECK(a[0]->kind == Py::List || a[0]->kind == Py::Tuple, at(), ": OrderedDict of a ", kind_text(*a[0]));
        for (const auto& p : a[0]->items) {
          TESSERA_CHECK(p->kind == Py::Tuple && p->items.size() == 2, at(), ": OrderedDict item is not a pair");
          d->dict.emplace_back(p->items[0], p->items[1]);
        }
      }
      return d;
    }
    if (name == "builtins.set" || name == "builtins.frozenset") {
      auto s = make(Py::Set);
      if (!a.empty()) {
        TESSERA_CHECK(a[0]->kind == Py::List || a[0]->kind == Py::Tuple, at(), ": set of a ", kind_text(*a[0]));
        s->items = a[0]->items;
      }
      return s;
    }
    if (name == "_codecs.encode") {  // bytes under pickle protocol 2: encode(str, 'latin1')
      TESSERA_CHECK(a.size() == 2 && a[0]->kind == Py::Str && a[1]->kind == Py::Str &&
                        (a[1]->s == "latin1" || a[1]->s == "latin-1"),
                    at(), ": _codecs.encode other than of a str to latin1");
      auto o = make(Py::Bytes);
      const std::string& u = a[0]->s;  // UTF-8 of code points 0-255
      for (size_t k = 0; k < u.size(); ++k) {
        const auto c = static_cast<uint8_t>(u[k]);
        if (c < 0x80) {
          o->s.push_back(static_cast<char>(c));
        } else {
          TESSERA_CHECK((c == 0xc2 || c == 0xc3) && k + 1 < u.size(), at(), ": _codecs.encode of a non-latin1 text");
          o->s.push_back(static_cast<char>(((c & 0x03) << 6) | (static_cast<uint8_t>(u[++k]) & 0x3f)));
        }
      }
      return o;
    }
    if (name == "torch._utils._rebuild_tensor_v2" || name == "torch._utils._rebuild_tensor") {
      TESSERA_CHECK(a.size() >= 4 && a[0]->kind == Py::Storage, at(), ": bad ", name, " arguments");
      const at::Tensor& flat = a[0]->t;
      const int64_t offset = int_of(a[1]);
      const auto size = ints_of(a[2]), stride = ints_of(a[3]);
      TESSERA_CHECK(size.size() == stride.size() && offset >= 0, at(), ": bad tensor geometry");
      int64_t extent = 0;
      bool empty = false;
      for (size_t d = 0; d < size.size(); ++d) {
        TESSERA_CHECK(size[d] >= 0 && stride[d] >= 0, at(), ": negative size or stride");
        empty |= size[d] == 0;
        extent += (size[d] - 1) * stride[d];
      }
      TESSERA_CHECK(empty || offset + extent < flat.numel(), at(), ": the tensor reaches past its storage");
      auto o = make(Py::Tensor);
      o->t = empty ? at::empty(size, flat.options()) : flat.as_strided(size, stride, offset);
      return o;
    }
    if (name == "torch.serialization._get_layout") {
      TESSERA_CHECK(a.size() == 1 && a[0]->kind == Py::Str && allowed_.count(a[0]->s), at(),
                    ": _get_layout of an unknown layout");
      auto o = make(Py::Global);
      o->s = a[0]->s;
      return o;
    }
    if (name == "builtins.getattr") {  // a class attribute by name (an enum member): its name
      TESSERA_CHECK(a.size() == 2 && a[0]->kind == Py::Global && a[1]->kind == Py::Str, at(),
                    ": getattr other than of an allowed global by name");
      auto o = make(Py::Global);
      o->s = a[0]->s + "." + a[1]->s;
      return o;
    }
    if (name == "torch._utils._rebuild_parameter" || name == "torch._utils._rebuild_parameter_with_state") {
      TESSERA_CHECK(!a.empty() && a[0]->kind == Py::Tensor, at(), ": bad _rebuild_parameter arguments");
      return a[0];
    }
    return object(fn, args);  // an allowed class (an enum member, a path): recorded
  }

  std::string where_;
  const std::string& d_;
  const std::set<std::string>& allowed_;
  Persistent persistent_;
  size_t pos_ = 0;
  std::vector<PyPtr> stack_;
  std::vector<size_t> marks_;
  std::map<uint64_t, PyPtr> memo_;
};

}  // namespace

PyPtr unpickle(const std::string& where, const std::string& data, const std::set<std::string>& allowed,
               const Persistent& persistent) {
  return Unpickler(where, data, allowed, persistent).run();
}

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
  TESSERA_CHECK(pid->kind == Py::Tuple && pid->items.size() == 5 && pid->items[0]->kind == Py::Str &&
                    pid->items[0]->s == "storage" && pid->items[1]->kind == Py::Global &&
                    pid->items[2]->kind == Py::Str && pid->items[4]->kind == Py::Int,
                where, ": unsupported persistent id");
  at::ScalarType dt = at::kFloat;
  bool found = false;
  for (const auto& [n, t] : torch_storage_classes())
    if (pid->items[1]->s == std::string("torch.") + n) dt = t, found = true;
  TESSERA_CHECK(found, where, ": unsupported storage type ", pid->items[1]->s);
  const std::string key = pid->items[2]->s;
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  const int64_t numel = pid->items[4]->i;
  TESSERA_CHECK(numel >= 0, where, ": negative storage size");
  const std::string rec = "data/" + key;
  TESSERA_CHECK(zip.hasRecord(rec), where, ": storage record '", rec, "' is missing");
  at::DataPtr ptr;
  size_t size = 0;
  std::tie(ptr, size) = zip.getRecord(rec);
  const uint64_t want = static_cast<uint64_t>(numel) * c10::elementSize(dt);
  TESSERA_CHECK(size >= want, where, ": storage record '", rec, "' holds ", size, " bytes, needs ", want);
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
