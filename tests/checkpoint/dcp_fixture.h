// PyTorch Distributed Checkpoint directories laid out as torch 2.x's FileSystemWriter lays
// them out (DIR/.metadata + DIR/__<rank>_<i>.distcp), written without torch 2.x for the
// tests of untrusted DCP input (tests/checkpoint/test_dcp_import_bounds.cpp): .metadata is
// pickled here opcode by opcode (protocol 2: the Metadata, TensorStorageMetadata,
// ChunkStorageMetadata, MetadataIndex and _StorageInfo objects with their attribute dicts,
// as `pickle` writes dataclasses), and each item of a .distcp file is a torch.save zip of
// one tensor (data.pkl calling torch._utils._rebuild_tensor_v2 on a persistent storage, and
// data/0) written by caffe2's PyTorchStreamWriter. The real dcp.save round trip is in
// test_dcp_import.cpp (torch 2.x builds only).
#pragma once
#include <ATen/ATen.h>
#include <caffe2/serialize/inline_container.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <map>
#include <string>
#include <vector>

namespace tessera::testing::dcp {

// Pickle opcodes, appended in order.
class Pickle {
 public:
  Pickle() { s_ = std::string("\x80\x02", 2); }
  Pickle& global(const std::string& mod, const std::string& name) {
    s_ += "c" + mod + "\n" + name + "\n";
    return *this;
  }
  Pickle& str(const std::string& v) {
    s_ += 'X';
    le(v.size(), 4);
    s_ += v;
    return *this;
  }
  Pickle& integer(int64_t v) {
    if (v >= 0 && v < 256) {
      s_ += 'K';
      s_ += static_cast<char>(v);
    } else {
      s_ += '\x8a';
      s_ += '\x08';
      le(static_cast<uint64_t>(v), 8);
    }
    return *this;
  }
  Pickle& none() { return op('N'); }
  Pickle& boolean(bool b) { return op(b ? '\x88' : '\x89'); }
  Pickle& mark() { return op('('); }
  Pickle& tuple() { return op('t'); }  // from the mark
  Pickle& ints(const std::vector<int64_t>& v) {
    mark();
    for (int64_t x : v) integer(x);
    return tuple();
  }
  Pickle& dict() { return op('}'); }
  Pickle& setitems() { return op('u'); }  // from the mark, into the dict below it
  Pickle& list() { return op(']'); }
  Pickle& appends() { return op('e'); }
  Pickle& reduce() { return op('R'); }
  Pickle& build() { return op('b'); }
  Pickle& persid() { return op('Q'); }
  // An object of class mod.name made with no arguments (NEWOBJ), whose attribute dict
  // the caller pushes next, inside mark() ... setitems() after dict(), then build().
  Pickle& object(const std::string& mod, const std::string& name) {
    global(mod, name);
    s_ += ")\x81";
    return *this;
  }
  // torch.Size(v)
  Pickle& size(const std::vector<int64_t>& v) {
    global("torch", "Size");
    mark();
    ints(v);
    tuple();
    return reduce();
  }
  std::string finish() {
    s_ += '.';
    return s_;
  }

 private:
  Pickle& op(char c) {
    s_ += c;
    return *this;
  }
  void le(uint64_t v, int n) {
    for (int k = 0; k < n; ++k) s_ += static_cast<char>((v >> (8 * k)) & 0xff);
  }
  std::string s_;
};

// The torch.save archive (zip) of one contiguous float32 tensor.
inline std::string torch_save_tensor(const at::Tensor& t) {
  const at::Tensor c = t.contiguous().to(at::kFloat);
  std::vector<int64_t> strides(c.dim(), 1);
  for (int64_t d = c.dim() - 2; d >= 0; --d) strides[d] = strides[d + 1] * c.size(d + 1);
  Pickle p;
  p.global("torch._utils", "_rebuild_tensor_v2").mark();
  p.mark().str("storage").global("torch", "FloatStorage").str("0").str("cpu").integer(c.numel()).tuple().persid();
  p.integer(0).ints(c.sizes().vec()).ints(strides).boolean(false);
  p.global("collections", "OrderedDict").mark().tuple().reduce();
  p.tuple().reduce();
  const std::string pkl = p.finish();
  std::string zip;
  caffe2::serialize::PyTorchStreamWriter w([&](const void* b, size_t n) {
    zip.append(static_cast<const char*>(b), n);
    return n;
  });
  w.writeRecord("data.pkl", pkl.data(), pkl.size());
  w.writeRecord("byteorder", "little", 6);
  w.writeRecord("data/0", c.data_ptr(), c.numel() * sizeof(float));
  w.writeEndOfFile();
  return zip;
}

// One chunk of a tensor: its box and the .distcp file (a name in the directory) it is in.
struct Chunk {
  std::vector<int64_t> offsets, sizes;
  std::string file;
};
// A float32 tensor saved as `chunks` of `value`.
struct Tensor {
  std::string fqn;
  at::Tensor value;
  std::vector<Chunk> chunks;
};

inline void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// The .metadata of `tensors`, with each chunk's item at `where[fqn, chunk index]` =
// (file, offset, length).
struct Loc {
  std::string file;
  uint64_t offset = 0, length = 0;
};
inline std::string metadata_pickle(const std::vector<Tensor>& tensors, const std::map<std::pair<std::string, size_t>, Loc>& where) {
  const std::string md = "torch.distributed.checkpoint.metadata";
  Pickle p;
  p.object(md, "Metadata").dict().mark();
  p.str("state_dict_metadata").dict().mark();
  for (const auto& t : tensors) {
    p.str(t.fqn).object(md, "TensorStorageMetadata").dict().mark();
    p.str("properties").object(md, "TensorProperties");
    p.mark().global("torch", "float32").global("torch", "strided").boolean(false).none().boolean(false).tuple().build();
    p.str("size").size(t.value.sizes().vec());
    p.str("chunks").list().mark();
    for (const auto& c : t.chunks) {
      p.object(md, "ChunkStorageMetadata").dict().mark();
      p.str("offsets").size(c.offsets).str("sizes").size(c.sizes);
      p.setitems().build();
    }
    p.appends();
    p.setitems().build();
  }
  p.setitems();
  p.str("storage_data").dict().mark();
  for (const auto& t : tensors) {
    for (size_t k = 0; k < t.chunks.size(); ++k) {
      const Loc& l = where.at({t.fqn, k});
      p.object(md, "MetadataIndex").dict().mark();
      p.str("fqn").str(t.fqn).str("offset").size(t.chunks[k].offsets).str("index").none();
      p.setitems().build();
      p.object("torch.distributed.checkpoint.filesystem", "_StorageInfo").dict().mark();
      p.str("relative_path").str(l.file).str("offset").integer(static_cast<int64_t>(l.offset));
      p.str("length").integer(static_cast<int64_t>(l.length));
      p.setitems().build();
    }
  }
  p.setitems();
  p.str("planner_data").none();
  p.setitems().build();
  return p.finish();
}

// Writes `tensors` as a DCP checkpoint into the existing directory `dir`: every chunk's
// item appended to its file, then .metadata.
inline void write_checkpoint(const std::string& dir, const std::vector<Tensor>& tensors) {
  std::map<std::string, std::string> files;
  std::map<std::pair<std::string, size_t>, Loc> where;
  for (const auto& t : tensors) {
    for (size_t k = 0; k < t.chunks.size(); ++k) {
      const Chunk& c = t.chunks[k];
      at::Tensor piece = t.value;
      for (size_t d = 0; d < c.offsets.size(); ++d)
        piece = piece.narrow(static_cast<int64_t>(d), c.offsets[d], c.sizes[d]);
      const std::string item = torch_save_tensor(piece);
      std::string& f = files[c.file];
      where[{t.fqn, k}] = Loc{c.file, f.size(), item.size()};
      f += item;
    }
  }
  for (const auto& [name, bytes] : files) write_file(dir + "/" + name, bytes);
  write_file(dir + "/.metadata", metadata_pickle(tensors, where));
}

}  // namespace tessera::testing::dcp
