// The bytes the ranks of a collective checkpoint operation send each other: strings and
// integers packed with explicit lengths (paths and messages may hold any byte, so nothing
// is sent as ad-hoc text with separators). Internal to the checkpoint layer.
#pragma once
#include <cstdint>
#include <string>
#include <utility>

namespace tessera::checkpoint {

class Packer {
 public:
  Packer& u64(uint64_t v);
  Packer& str(const std::string& v);
  const std::string& bytes() const { return s_; }

 private:
  std::string s_;
};
class Unpacker {
 public:
  // `what` names the bytes in errors ("rank 2's status").
  Unpacker(const std::string& bytes, std::string what) : s_(bytes), what_(std::move(what)) {}
  Unpacker(std::string&& bytes, std::string what) = delete;  // reads `bytes` in place: keep it alive
  uint64_t u64();
  std::string str();
  bool done() const { return pos_ == s_.size(); }

 private:
  void need(uint64_t n) const;
  const std::string& s_;
  std::string what_;
  size_t pos_ = 0;
};

}  // namespace tessera::checkpoint
