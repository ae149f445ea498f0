// Byte-level data for the GPT example: text files read as bytes, the last `val_fraction`
// of the bytes held out for validation, each part cut into windows of seq_len + 1 bytes
// (stride seq_len): inputs are the first seq_len bytes, targets the last seq_len.
#pragma once
#include <ATen/ATen.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

namespace gpt {

// Text that exists offline on any Debian system: the license texts of base-files.
inline const char* kDefaultDataDir = "/usr/share/common-licenses";

// The regular files (symlinks skipped: GPL -> GPL-3 and the like) of `dir`, by name.
inline std::vector<std::string> default_data_files(const std::string& dir = kDefaultDataDir) {
  namespace fs = std::filesystem;
  std::vector<std::string> files;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec))
    if (!it->is_symlink() && it->is_regular_file()) files.push_back(it->path().string());
  if (ec) throw std::runtime_error("cannot list the default data directory " + dir + ": " + ec.message() +
                                   " (pass --data FILE)");
  std::sort(files.begin(), files.end());
  if (files.empty()) throw std::runtime_error("no text files in the default data directory " + dir + " (pass --data FILE)");
  return files;
}

inline std::string read_text(const std::vector<std::string>& files) {
  std::string all;
  for (const auto& f : files) {
    std::ifstream in(f, std::ios::binary);
    if (!in) throw std::runtime_error("--data: cannot read '" + f + "'");
    all.append(std::istreambuf_iterator<char>(in), {});
    if (!in.eof() && in.fail()) throw std::runtime_error("--data: error while reading '" + f + "'");
  }
  return all;
}

inline at::Tensor bytes_to_tensor(const std::string& s) {
  at::Tensor t = at::empty({static_cast<int64_t>(s.size())}, at::kLong);
  auto* p = t.data_ptr<int64_t>();
  for (size_t i = 0; i < s.size(); ++i) p[i] = static_cast<unsigned char>(s[i]);
  return t;
}

struct Windows {
  at::Tensor inputs, targets;  // [N, seq_len] int64 each
  int64_t size() const { return inputs.defined() ? inputs.size(0) : 0; }
};

// Non-overlapping windows of seq_len + 1 bytes (consecutive windows share one byte).
inline Windows make_windows(const at::Tensor& bytes, int64_t seq_len) {
  const int64_t n = (bytes.numel() - 1) / seq_len;
  Windows w;
  if (n <= 0) return w;
  at::Tensor starts = at::arange(n, at::kLong) * seq_len;
  at::Tensor idx = starts.unsqueeze(1) + at::arange(seq_len + 1, at::kLong).unsqueeze(0);
  at::Tensor win = bytes.index_select(0, idx.reshape({-1})).view({n, seq_len + 1});
  w.inputs = win.narrow(1, 0, seq_len).contiguous();
  w.targets = win.narrow(1, 1, seq_len).contiguous();
  return w;
}

struct Dataset {
  Windows train, val;
  int64_t total_bytes = 0, train_bytes = 0, val_bytes = 0;
};

// Splits `text` into train (first 1 - val_fraction) and validation (the rest).
inline Dataset make_dataset(const std::string& text, int64_t seq_len, double val_fraction) {
  Dataset d;
  d.total_bytes = static_cast<int64_t>(text.size());
  d.val_bytes = static_cast<int64_t>(static_cast<double>(d.total_bytes) * val_fraction);
  d.train_bytes = d.total_bytes - d.val_bytes;
  at::Tensor all = bytes_to_tensor(text);
  d.train = make_windows(all.narrow(0, 0, d.train_bytes), seq_len);
  if (d.val_bytes > 0) d.val = make_windows(all.narrow(0, d.train_bytes, d.val_bytes), seq_len);
  if (d.train.size() == 0)
    throw std::runtime_error("--data: " + std::to_string(d.train_bytes) + " training bytes make no window of --seq-len " +
                             std::to_string(seq_len) + " + 1 bytes");
  if (val_fraction > 0 && d.val.size() == 0)
    throw std::runtime_error("--val-fraction: the " + std::to_string(d.val_bytes) +
                             " held-out bytes make no window of --seq-len " + std::to_string(seq_len) +
                             " + 1 bytes (use more data or a larger fraction)");
  return d;
}

}  // namespace gpt
