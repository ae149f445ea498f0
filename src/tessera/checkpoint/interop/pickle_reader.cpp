// The unpickler itself (pickle_reader.h): a stack machine over the opcodes of protocols 2-5.
// The values it builds, their destruction and flatten(): pickle_value.cpp.
#include "tessera/checkpoint/interop/pickle_reader.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <unordered_map>
#include <unordered_set>

namespace tessera::checkpoint::pickle {

namespace {

// Checked int64 arithmetic for the tensor geometry of untrusted files.
bool mul_ok(int64_t a, int64_t b, int64_t& r) { return !__builtin_mul_overflow(a, b, &r); }
bool add_ok(int64_t a, int64_t b, int64_t& r) { return !__builtin_add_overflow(a, b, &r); }

class Unpickler {
 public:
  using Persistent = std::function<PyPtr(const PyPtr&)>;
  // `where` names the file (and item) in errors.
  Unpickler(std::string where, const std::string& data, const std::set<std::string>& allowed,
            Persistent persistent = nullptr)
      : where_(std::move(where)), d_(data), allowed_(allowed), persistent_(std::move(persistent)),
        budget_(std::min<uint64_t>(kBudgetMax, kBudgetBase + kBudgetPerByte * static_cast<uint64_t>(data.size()))) {}

  // After an error the objects built so far may form cycles (the memo lets a list hold
  // itself): every container gives up its children first, so that all of them are freed.
  // While containers_ holds them all, dropping a child frees at most a childless value.
  ~Unpickler() {
    if (done_) return;
    for (const auto& o : containers_) {
      o->items.clear();
      o->dict.clear();
      o->state.reset();
    }
    stack_.clear();
    memo_.clear();
    sparse_memo_.clear();
    containers_.clear();
  }

  PyPtr run() {
    for (;;) {
      const uint8_t op = u8();
      switch (op) {
        case 0x80: u8(); break;      // PROTO
        case 0x95: le(8); break;     // FRAME (frames are only a read-ahead hint)
        case '.': {                  // STOP
          PyPtr r = pop();
          TESSERA_CHECK(stack_.empty() && marks_.empty(), at(), ": values left on the stack at STOP");
          check_graph();
          done_ = true;
          return r;
        }
        case '(': marks_.push_back(stack_.size()); break;
        case '0': pop(); break;
        case '1': pop_mark(); break;
        case '2': push(top()); break;
        case 'N': push(none_); break;
        case 0x88: push(true_); break;
        case 0x89: push(false_); break;
        case 'J': push_int(static_cast<int32_t>(le(4))); break;
        case 'K': push_int(u8()); break;
        case 'M': push_int(static_cast<int64_t>(le(2))); break;
        case 0x8a: push_int(long_int(u8())); break;
        case 0x8b: push_int(long_int(le(4))); break;
        case 'G': {
          uint64_t v = 0;
          for (int k = 0; k < 8; ++k) v = (v << 8) | u8();  // big-endian
          auto o = node(Py::Float);
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
        case ')': push(empty_tuple_); break;  // tuples never change: one empty tuple serves all
        case 't': push(tuple_of(pop_mark())); break;
        case 0x85: { auto a = pop(); push(tuple_of({a})); break; }
        case 0x86: { auto b = pop(), a = pop(); push(tuple_of({a, b})); break; }
        case 0x87: { auto c = pop(), b = pop(), a = pop(); push(tuple_of({a, b, c})); break; }
        case ']': push(container(Py::List)); break;
        case 'l': { auto l = container(Py::List); add_items(l, pop_mark()); push(l); break; }
        case 'a': { auto v = pop(); add_items(want(top(), Py::List, "APPEND"), {v}); break; }
        case 'e': { auto v = pop_mark(); add_items(want(top(), Py::List, "APPENDS"), v); break; }
        case '}': push(container(Py::Dict)); break;
        case 'd': { auto d = container(Py::Dict); add_pairs(d, pop_mark()); push(d); break; }
        case 's': { auto v = pop(), k = pop(); add_pairs(want(top(), Py::Dict, "SETITEM"), {k, v}); break; }
        case 'u': { auto v = pop_mark(); add_pairs(want(top(), Py::Dict, "SETITEMS"), v); break; }
        case 0x8f: push(container(Py::Set)); break;
        case 0x90: { auto v = pop_mark(); add_items(want(top(), Py::Set, "ADDITEMS"), v); break; }
        case 0x91: { auto s = container(Py::Set); add_items(s, pop_mark()); push(s); break; }
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
          if (o->kind == Py::Object) {
            o->state = st;
            deepen(*o, *st);
          } else {
            TESSERA_CHECK(o->kind == Py::Dict || o->kind == Py::Tensor, at(), ": BUILD of a ", kind_text(*o));
          }
          break;  // an OrderedDict's or a tensor's attributes carry nothing needed
        }
        case 'Q': {
          auto pid = pop();
          TESSERA_CHECK(persistent_ != nullptr, at(), ": a persistent id where none may appear");
          PyPtr v = persistent_(pid);
          TESSERA_CHECK(v != nullptr, at(), ": a persistent id that names nothing");
          push(std::move(v));
          break;
        }
        case 'q': put_memo(u8()); break;
        case 'r': put_memo(le(4)); break;
        case 0x94: put_memo(memo_.size() + sparse_memo_.size()); break;
        case 'h': push(memo(u8())); break;
        case 'j': push(memo(le(4))); break;
        default:
          throw Error(concat(at(), ": unsupported pickle opcode 0x", std::hex, static_cast<int>(op)));
      }
    }
  }

  std::string at() const { return concat(where_, " (byte ", pos_, ")"); }

 private:
  // Memory the objects take, against the budget (the estimate counts each object, each
  // reference a container or the stack holds, each memo entry and each string byte).
  void charge(uint64_t bytes) {
    used_ += bytes;
    if (used_ > budget_)
      throw Error(concat(at(), ": the pickle builds more objects than its size allows (over ", budget_ >> 20,
                         " MiB for ", d_.size(), " bytes: ", kBudgetPerByte, " bytes per byte of input plus ",
                         kBudgetBase >> 20, " MiB, at most ", kBudgetMax >> 20, " MiB); refused"));
  }
  static constexpr uint64_t kObject = sizeof(Py) + 32;  // with make_shared's control block and malloc's own
  static constexpr uint64_t kRef = sizeof(PyPtr);

  PyPtr node(Py::Kind k) {
    charge(kObject);
    return make(k);
  }
  // A value that holds others: kept until the end, so that cycles can be found and broken.
  PyPtr container(Py::Kind k) {
    auto o = node(k);
    charge(kRef);
    containers_.push_back(o);
    return o;
  }
  // `o` now holds `child`: it lies at least one level above it.
  void deepen(Py& o, const Py& child) {
    const uint32_t b = child.below + 1;
    if (b <= o.below) return;
    o.below = b;
    TESSERA_CHECK(b <= kMaxDepth, at(), ": objects nest deeper than ", kMaxDepth, " levels; refused");
  }
  void add_items(const PyPtr& o, const std::vector<PyPtr>& v) {
    charge(kRef * v.size());
    o->items.reserve(o->items.size() + v.size());
    for (const auto& x : v) {
      o->items.push_back(x);
      deepen(*o, *x);
    }
  }

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
    charge(n);
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
  void push(PyPtr o) {
    charge(kRef);
    stack_.push_back(std::move(o));
  }
  // Integers never change once made: each value is made once.
  PyPtr int_node(int64_t v) {
    auto it = ints_.find(v);
    if (it != ints_.end()) return it->second;
    charge(48);
    auto o = node(Py::Int);
    o->i = v;
    ints_.emplace(v, o);
    return o;
  }
  void push_int(int64_t v) { push(int_node(v)); }
  void push_str(Py::Kind k, std::string s) { auto o = node(k); o->s = std::move(s); push(o); }
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
  // The memo: Python numbers its entries 0, 1, 2...: a vector for those, a map for others.
  void put_memo(uint64_t k) {
    PyPtr v = top();
    if (k < memo_.size()) {
      memo_[k] = std::move(v);
    } else if (k == memo_.size()) {
      charge(kRef);
      memo_.push_back(std::move(v));
      sparse_memo_.erase(k);
    } else {
      auto [it, fresh] = sparse_memo_.emplace(k, v);
      if (fresh) charge(64);
      else it->second = std::move(v);
    }
  }
  PyPtr memo(uint64_t k) {
    if (k < memo_.size() && memo_[k]) return memo_[k];
    auto it = sparse_memo_.find(k);
    TESSERA_CHECK(it != sparse_memo_.end(), at(), ": pickle memo ", k, " missing");
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
  PyPtr tuple_of(const std::vector<PyPtr>& v) {
    auto o = container(Py::Tuple);
    add_items(o, v);
    return o;
  }
  void add_pairs(const PyPtr& d, const std::vector<PyPtr>& v) {
    TESSERA_CHECK(v.size() % 2 == 0, at(), ": dict items of odd length");
    charge(kRef * v.size());
    for (size_t k = 0; k < v.size(); k += 2) {
      d->dict.emplace_back(v[k], v[k + 1]);
      deepen(*d, *v[k]);
      deepen(*d, *v[k + 1]);
    }
  }
  PyPtr global(const std::string& mod, const std::string& name) {
    const std::string full = mod + "." + name;
    if (!allowed_.count(full))
      throw ForbiddenGlobal(concat(where_, ": refusing the global '", full,
                                   "' (not one of the types this file may hold; nothing in it is run)"));
    charge(full.size());
    auto o = node(Py::Global);
    o->s = full;
    return o;
  }
  PyPtr object(const PyPtr& cls, const PyPtr& args) {
    TESSERA_CHECK(cls->kind == Py::Global, at(), ": NEWOBJ of a ", kind_text(*cls));
    TESSERA_CHECK(args->kind == Py::Tuple, at(), ": NEWOBJ arguments are a ", kind_text(*args));
    auto o = container(Py::Object);
    o->s = cls->s;
    add_items(o, args->items);
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
  PyPtr rebuild_tensor(const std::string& name, const std::vector<PyPtr>& a);
  PyPtr reduce(const PyPtr& fn, const PyPtr& args);
  void check_graph();

  std::string where_;
  const std::string& d_;
  const std::set<std::string>& allowed_;
  Persistent persistent_;
  uint64_t budget_, used_ = 0;
  bool done_ = false;
  size_t pos_ = 0;
  std::vector<PyPtr> stack_;
  std::vector<size_t> marks_;
  std::vector<PyPtr> memo_;
  std::map<uint64_t, PyPtr> sparse_memo_;
  std::vector<PyPtr> containers_;  // every value that can hold others, made here
  const PyPtr none_ = make(Py::None);
  const PyPtr true_ = [] { auto o = make(Py::Bool); o->b = true; return o; }();
  const PyPtr false_ = make(Py::Bool);
  const PyPtr empty_tuple_ = make(Py::Tuple);
  std::unordered_map<int64_t, PyPtr> ints_;
};

// The tensor `name` (_rebuild_tensor_v2 or _rebuild_tensor) makes of (storage, storage
// offset, size, stride, ...): a view that must lie inside the storage, every step of its
// arithmetic checked, since the view reads memory wherever the numbers point.
PyPtr Unpickler::rebuild_tensor(const std::string& name, const std::vector<PyPtr>& a) {
  TESSERA_CHECK(a.size() >= 4 && a[0]->kind == Py::Storage, at(), ": bad ", name, " arguments");
  const at::Tensor& flat = a[0]->t;
  const int64_t offset = int_of(a[1]);
  const auto size = ints_of(a[2]), stride = ints_of(a[3]);
  TESSERA_CHECK(size.size() == stride.size() && size.size() <= 64, at(), ": a tensor of ", size.size(),
                " sizes and ", stride.size(), " strides");
  const std::string geometry =
      concat("storage offset ", offset, ", size ", c10::IntArrayRef(size), ", stride ", c10::IntArrayRef(stride),
             " over a storage of ", flat.numel(), " elements");
  TESSERA_CHECK(offset >= 0, at(), ": negative storage offset (", geometry, ")");
  bool empty = false;
  int64_t numel = 1;
  for (size_t d = 0; d < size.size(); ++d) {
    TESSERA_CHECK(size[d] >= 0 && stride[d] >= 0, at(), ": negative size or stride (", geometry, ")");
    empty |= size[d] == 0;
    TESSERA_CHECK(mul_ok(numel, std::max<int64_t>(size[d], 1), numel), at(),
                  ": the tensor's element count overflows (", geometry, ")");
  }
  auto o = node(Py::Tensor);
  if (empty) {
    o->t = at::empty(size, flat.options());
    return o;
  }
  // The last element lies at offset + sum (size - 1) * stride: inside the storage.
  int64_t last = offset;
  for (size_t d = 0; d < size.size(); ++d) {
    int64_t step = 0;
    TESSERA_CHECK(mul_ok(size[d] - 1, stride[d], step) && add_ok(last, step, last), at(),
                  ": the tensor's extent overflows (", geometry, ")");
  }
  TESSERA_CHECK(last < flat.numel(), at(), ": the tensor reaches past its storage (", geometry, ")");
  o->t = flat.as_strided(size, stride, offset);
  return o;
}

PyPtr Unpickler::reduce(const PyPtr& fn, const PyPtr& args) {
  TESSERA_CHECK(fn->kind == Py::Global, at(), ": REDUCE of a ", kind_text(*fn));
  TESSERA_CHECK(args->kind == Py::Tuple, at(), ": REDUCE arguments are a ", kind_text(*args));
  const std::string& name = fn->s;
  const auto& a = args->items;
  if (name == "torch.Size") {  // a tuple of integers
    if (a.empty()) return empty_tuple_;
    ints_of(a[0]);
    if (a[0]->kind == Py::Tuple) return a[0];
    auto o = container(Py::Tuple);
    add_items(o, a[0]->items);
    return o;
  }
  if (name == "collections.OrderedDict") {
    auto d = container(Py::Dict);
    if (!a.empty()) {
      TESSERA_CHECK(a[0]->kind == Py::List || a[0]->kind == Py::Tuple, at(), ": OrderedDict of a ", kind_text(*a[0]));
      std::vector<PyPtr> kv;
      for (const auto& p : a[0]->items) {
        TESSERA_CHECK(p->kind == Py::Tuple && p->items.size() == 2, at(), ": OrderedDict item is not a pair");
        kv.push_back(p->items[0]);
        kv.push_back(p->items[1]);
      }
      add_pairs(d, kv);
    }
    return d;
  }
  if (name == "builtins.set" || name == "builtins.frozenset") {
    auto s = container(Py::Set);
    if (!a.empty()) {
      TESSERA_CHECK(a[0]->kind == Py::List || a[0]->kind == Py::Tuple, at(), ": set of a ", kind_text(*a[0]));
      add_items(s, a[0]->items);
    }
    return s;
  }
  if (name == "_codecs.encode") {  // bytes under pickle protocol 2: encode(str, 'latin1')
    TESSERA_CHECK(a.size() == 2 && a[0]->kind == Py::Str && a[1]->kind == Py::Str &&
                      (a[1]->s == "latin1" || a[1]->s == "latin-1"),
                  at(), ": _codecs.encode other than of a str to latin1");
    auto o = node(Py::Bytes);
    const std::string& u = a[0]->s;  // UTF-8 of code points 0-255
    charge(u.size());
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
  if (name == "torch._utils._rebuild_tensor_v2" || name == "torch._utils._rebuild_tensor")
    return rebuild_tensor(name, a);
  if (name == "torch.serialization._get_layout") {
    TESSERA_CHECK(a.size() == 1 && a[0]->kind == Py::Str && allowed_.count(a[0]->s), at(),
                  ": _get_layout of an unknown layout");
    auto o = node(Py::Global);
    o->s = a[0]->s;
    return o;
  }
  if (name == "builtins.getattr") {  // a class attribute by name (an enum member): its name
    TESSERA_CHECK(a.size() == 2 && a[0]->kind == Py::Global && a[1]->kind == Py::Str, at(),
                  ": getattr other than of an allowed global by name");
    auto o = node(Py::Global);
    charge(a[0]->s.size() + a[1]->s.size());
    o->s = a[0]->s + "." + a[1]->s;
    return o;
  }
  if (name == "torch._utils._rebuild_parameter" || name == "torch._utils._rebuild_parameter_with_state") {
    TESSERA_CHECK(!a.empty() && a[0]->kind == Py::Tensor, at(), ": bad _rebuild_parameter arguments");
    return a[0];
  }
  return object(fn, args);  // an allowed class (an enum member, a path): recorded
}

// At STOP: no object contains itself (the memo can make a list hold itself, which no state
// dict does and which would never be freed), and none nests deeper than kMaxDepth (the
// levels counted while building miss a container filled after it was put somewhere).
// Depth-first over every container made, without recursion; `below` becomes exact.
void Unpickler::check_graph() {
  enum : uint8_t { kOpen = 1, kDone = 2 };
  std::unordered_map<const Py*, uint8_t> state;
  state.reserve(containers_.size());
  auto child = [](const Py& o, size_t k) -> const Py* {
    if (k < o.items.size()) return o.items[k].get();
    k -= o.items.size();
    if (k < 2 * o.dict.size()) return (k % 2 ? o.dict[k / 2].second : o.dict[k / 2].first).get();
    k -= 2 * o.dict.size();
    return k == 0 && o.state ? o.state.get() : nullptr;
  };
  std::vector<std::pair<Py*, size_t>> path;
  for (const auto& start : containers_) {
    if (state[start.get()] == kDone) continue;
    state[start.get()] = kOpen;
    start->below = 0;
    path.emplace_back(start.get(), 0);
    while (!path.empty()) {
      auto& [o, next] = path.back();
      const Py* c = child(*o, next++);
      if (!c) {  // all children seen
        state[o] = kDone;
        const uint32_t b = o->below;
        path.pop_back();
        if (!path.empty() && b + 1 > path.back().first->below) {
          path.back().first->below = b + 1;
          TESSERA_CHECK(b + 1 <= kMaxDepth, at(), ": objects nest deeper than ", kMaxDepth, " levels; refused");
        }
        continue;
      }
      const bool holder = !c->items.empty() || !c->dict.empty() || c->state;
      uint8_t* s = holder ? &state[c] : nullptr;
      if (s && *s == kOpen) throw Error(concat(at(), ": an object contains itself (a cycle through the pickle memo), "
                                               "which no checkpoint holds; refused"));
      if (!s || *s == kDone) {
        const uint32_t b = (s ? c->below : 0) + 1;
        if (b > o->below) {
          o->below = b;
          TESSERA_CHECK(b <= kMaxDepth, at(), ": objects nest deeper than ", kMaxDepth, " levels; refused");
        }
        continue;
      }
      *s = kOpen;
      const_cast<Py*>(c)->below = 0;
      path.emplace_back(const_cast<Py*>(c), 0);
    }
  }
}

}  // namespace

PyPtr unpickle(const std::string& where, const std::string& data, const std::set<std::string>& allowed,
               const Persistent& persistent) {
  return Unpickler(where, data, allowed, persistent).run();
}

}  // namespace tessera::checkpoint::pickle
