#include "tessera/state/state_dict.h"

#include "tessera/core/error.h"

namespace tessera::state {

const char* kind_name(const Value& v) {
  static const char* names[] = {"tensor", "sharded", "int", "float", "bool", "string", "bytes", "dict"};
  return names[v.index()];
}

void StateDict::set(const std::string& key, Value v) {
  auto it = index_.find(key);
  if (it != index_.end()) {
    values_[it->second] = std::move(v);
    return;
  }
  index_[key] = values_.size();
  keys_.push_back(key);
  values_.push_back(std::move(v));
}

const Value& StateDict::at(const std::string& key) const {
  auto it = index_.find(key);
  TESSERA_CHECK(it != index_.end(), "state dict has no key '", key, "'");
  return values_[it->second];
}

Value& StateDict::at(const std::string& key) {
  auto it = index_.find(key);
  TESSERA_CHECK(it != index_.end(), "state dict has no key '", key, "'");
  return values_[it->second];
}

bool StateDict::erase(const std::string& key) {
  auto it = index_.find(key);
  if (it == index_.end()) return false;
  const size_t pos = it->second;
  index_.erase(it);
  keys_.erase(keys_.begin() + static_cast<std::ptrdiff_t>(pos));
  values_.erase(values_.begin() + static_cast<std::ptrdiff_t>(pos));
  for (auto& [k, i] : index_)
    if (i > pos) --i;
  return true;
}

namespace {
template <typename T>
const T& typed(const StateDict& sd, const std::string& key, const char* want) {
  const Value& v = sd.at(key);
  const T* p = std::get_if<T>(&v);
  TESSERA_CHECK(p != nullptr, "state dict key '", key, "' holds a ", kind_name(v), ", not a ", want);
  return *p;
}
}  // namespace

const at::Tensor& StateDict::tensor(const std::string& key) const { return typed<at::Tensor>(*this, key, "tensor"); }
const sharding::ShardedTensor& StateDict::sharded(const std::string& key) const {
  return typed<sharding::ShardedTensor>(*this, key, "sharded tensor");
}
int64_t StateDict::integer(const std::string& key) const { return typed<int64_t>(*this, key, "int"); }
double StateDict::number(const std::string& key) const {
  const Value& v = at(key);
  if (auto i = std::get_if<int64_t>(&v)) return static_cast<double>(*i);
  return typed<double>(*this, key, "float");
}
bool StateDict::boolean(const std::string& key) const { return typed<bool>(*this, key, "bool"); }
const std::string& StateDict::string(const std::string& key) const { return typed<std::string>(*this, key, "string"); }
const Bytes& StateDict::bytes(const std::string& key) const { return typed<Bytes>(*this, key, "bytes"); }
const StateDict& StateDict::dict(const std::string& key) const {
  const auto& p = typed<std::shared_ptr<StateDict>>(*this, key, "dict");
  TESSERA_CHECK(p != nullptr, "state dict key '", key, "' holds a null dict");
  return *p;
}
StateDict& StateDict::dict(const std::string& key) {
  return const_cast<StateDict&>(static_cast<const StateDict&>(*this).dict(key));
}

namespace {

template <typename SD, typename V>
void flatten_into(SD& sd, const std::string& prefix, std::vector<std::pair<std::string, V*>>& out) {
  for (const auto& k : sd.keys()) {
    auto& v = sd.at(k);
    const std::string fqn = prefix.empty() ? k : prefix + "." + k;
    if (auto d = std::get_if<std::shared_ptr<StateDict>>(&v); d && *d && !(*d)->empty()) {
      flatten_into<SD, V>(**d, fqn, out);
    } else {
      out.emplace_back(fqn, &v);
    }
  }
}

}  // namespace

std::vector<std::pair<std::string, const Value*>> StateDict::flatten() const {
  std::vector<std::pair<std::string, const Value*>> out;
  flatten_into<const StateDict, const Value>(*this, "", out);
  return out;
}

std::vector<std::pair<std::string, Value*>> StateDict::flatten() {
  std::vector<std::pair<std::string, Value*>> out;
  flatten_into<StateDict, Value>(*this, "", out);
  return out;
}

}  // namespace tessera::state
