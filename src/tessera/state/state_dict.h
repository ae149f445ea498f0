// StateDict: an ordered map from fully-qualified name to a value: a plain tensor
// (replicated: every rank holds the same), a ShardedTensor, or a plain value
// (integer, float, bool, string, bytes, nested StateDict). What modules,
// optimizers, strategies and checkpoints exchange.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <variant>
#include <vector>

#include "tessera/sharding/sharded_tensor.h"

namespace tessera::state {

struct Bytes {
  std::string data;
  bool operator==(const Bytes& o) const { return data == o.data; }
};

class StateDict;
using Value = std::variant<at::Tensor, sharding::ShardedTensor, int64_t, double, bool, std::string, Bytes,
                           std::shared_ptr<StateDict>>;

// "tensor", "sharded", "int", "float", "bool", "string", "bytes", "dict".
const char* kind_name(const Value& v);

class StateDict {
 public:
  StateDict() = default;

  bool contains(const std::string& key) const { return index_.count(key) != 0; }
  size_t size() const { return keys_.size(); }
  bool empty() const { return keys_.empty(); }
  // Keys in insertion order.
  const std::vector<std::string>& keys() const { return keys_; }

  // Inserts or replaces (a replaced key keeps its position).
  void set(const std::string& key, Value v);
  // Throws tessera::Error naming the key when it is missing.
  const Value& at(const std::string& key) const;
  Value& at(const std::string& key);
  bool erase(const std::string& key);

  // Typed access; throws naming the key and the kind actually stored.
  const at::Tensor& tensor(const std::string& key) const;
  const sharding::ShardedTensor& sharded(const std::string& key) const;
  int64_t integer(const std::string& key) const;
  double number(const std::string& key) const;  // int or float
  bool boolean(const std::string& key) const;
  const std::string& string(const std::string& key) const;
  const Bytes& bytes(const std::string& key) const;
  const StateDict& dict(const std::string& key) const;
  StateDict& dict(const std::string& key);

  // Every (key, value) in order, nested dicts flattened to "outer.inner" keys; an empty
  // nested dict stays an entry of its own (a checkpoint saves it, a load target asks for
  // it). What the checkpoint layer saves and loads by.
  std::vector<std::pair<std::string, const Value*>> flatten() const;
  // The same, with the values mutable (a load's target).
  std::vector<std::pair<std::string, Value*>> flatten();

  // Range-for over (key, value) in order.
  template <typename F>
  void for_each(F&& f) {
    for (const auto& k : keys_) f(k, values_[index_.at(k)]);
  }
  template <typename F>
  void for_each(F&& f) const {
    for (const auto& k : keys_) f(k, values_[index_.at(k)]);
  }

 private:
  std::vector<std::string> keys_;
  std::vector<Value> values_;  // parallel to keys_ (erase compacts)
  std::unordered_map<std::string, size_t> index_;
};

}  // namespace tessera::state
