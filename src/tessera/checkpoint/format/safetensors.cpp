#include "tessera/checkpoint/format/safetensors.h"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <string_view>
#include <unordered_set>

#include "tessera/checkpoint/format/checksum.h"
#include "tessera/checkpoint/format/metadata.h"
#include "tessera/core/error.h"

namespace tessera::checkpoint {
namespace {

const std::vector<std::pair<const char*, at::ScalarType>>& dtype_table() {
  static const std::vector<std::pair<const char*, at::ScalarType>> t = {
      {"F64", at::kDouble}, {"F32", at::kFloat}, {"F16", at::kHalf}, {"BF16", at::kBFloat16},
      {"I64", at::kLong},   {"I32", at::kInt},   {"I16", at::kShort}, {"I8", at::kChar},
      {"U8", at::kByte},    {"BOOL", at::kBool}};
  return t;
}

void check_little_endian() {
  const uint16_t one = 1;
  TESSERA_CHECK(*reinterpret_cast<const uint8_t*>(&one) == 1, "Tessera checkpoints need a little-endian host");
}

// tessera.header_crc32c as the writer prints it (compact JSON). Inside any JSON string a
// quote is escaped, so this byte sequence can only be the key itself.
constexpr const char* kHeaderCrcMarker = "\"tessera.header_crc32c\":\"";

// CRC32C of the 8-byte length and the header text, the header checksum's own 8 hex
// digits (at `pos` in `text`) read as "00000000".
uint32_t header_crc(const unsigned char* lenbuf, std::string text, size_t pos) {
  text.replace(pos, 8, "00000000");
  return crc32c_extend(crc32c(lenbuf, 8), text.data(), text.size());
}

}  // namespace

std::string dtype_name(at::ScalarType t) {
  for (auto& [n, s] : dtype_table())
    if (s == t) return n;
  throw Error(concat("dtype ", t, " cannot be stored in a safetensors file"));
}

at::ScalarType parse_dtype(const std::string& name, const std::string& what) {
  for (auto& [n, s] : dtype_table())
    if (name == n) return s;
  throw Error(concat(what, ": unknown dtype '", name, "'"));
}

size_t itemsize(at::ScalarType t) { return c10::elementSize(t); }

uint64_t byte_size(const std::vector<int64_t>& shape, at::ScalarType t, const std::string& what) {
  uint64_t n = itemsize(t);
  for (int64_t d : shape) {
    TESSERA_CHECK(d >= 0, what, ": negative dimension ", d);
    if (d == 0) return 0;
    TESSERA_CHECK(n <= std::numeric_limits<uint64_t>::max() / static_cast<uint64_t>(d) &&
                      n * static_cast<uint64_t>(d) <= (1ull << 62),
                  what, ": shape too large (more than 2^62 bytes)");
    n *= static_cast<uint64_t>(d);
  }
  return n;
}

// ---------------------------------------------------------------- reader

File open_for_reading(const std::string& path) {
  // Opened without blocking (a FIFO put in the file's place would wait for a writer
  // forever); only a regular file is read, in the ordinary blocking mode.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd >= 0) {
    File f = File::adopt(fd, path);
    struct stat st;
    TESSERA_CHECK(::fstat(fd, &st) == 0, "cannot stat '", path, "': ", std::strerror(errno));
    TESSERA_CHECK(S_ISREG(st.st_mode), "cannot open '", path, "' for reading: it is not a regular file",
                  S_ISFIFO(st.st_mode) ? " (a FIFO)" : S_ISDIR(st.st_mode) ? " (a directory)" : "");
    TESSERA_CHECK(::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK) == 0, "cannot read '", path,
                  "': ", std::strerror(errno));
    return f;
  }
  const int e = errno;
  if (e == EMFILE || e == ENFILE) {
    struct rlimit rl {};
    const bool known = ::getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY;
    throw ResourceError(concat(
        "cannot open '", path, "' for reading: ", std::strerror(e),
        e == ENFILE ? std::string(" (the system's open-file table is full: fs.file-max)")
                    : concat(" (this process's open-file limit RLIMIT_NOFILE",
                             known ? concat(" is ", rl.rlim_cur) : std::string(), "; raise it with `ulimit -n`)"),
        " -- a resource limit of this machine, not a fault of the checkpoint"));
  }
  throw Error(concat("cannot open '", path, "' for reading: ", std::strerror(e)));
}

const File& SafetensorsReader::file() const {
  if (!file_.is_open()) {
    File f = open_for_reading(path_);
    struct stat st;
    TESSERA_CHECK(::fstat(f.fd(), &st) == 0, "cannot stat '", path_, "': ", std::strerror(errno));
    TESSERA_CHECK(static_cast<uint64_t>(st.st_dev) == dev_ && static_cast<uint64_t>(st.st_ino) == ino_, "'", path_,
                  "' was replaced by another file after its header was read (a checkpoint committed over this one ",
                  "while it was being read?): read the checkpoint again");
    file_ = std::move(f);
  }
  return file_;
}

namespace {

// The header's JSON text, after its 8-byte length (kept in `lenbuf` for the header checksum).
std::string read_header_text(const File& f, uint64_t size, const std::string& path, unsigned char lenbuf[8]) {
  TESSERA_CHECK(size >= 8, "'", path, "' is not a safetensors file: ", size, " bytes, shorter than the 8-byte header length");
  f.pread_exact(0, lenbuf, 8);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | lenbuf[i];
  TESSERA_CHECK(n <= kMaxHeaderBytes, "'", path, "': safetensors header length ", n, " exceeds the limit of ",
                kMaxHeaderBytes, " bytes");
  TESSERA_CHECK(n >= 2 && 8 + n <= size, "'", path, "': safetensors header length ", n,
                " does not fit in the file of ", size, " bytes (truncated?)");
  std::string text(n, '\0');
  f.pread_exact(8, text.data(), n);
  return text;
}

// __metadata__: an object of strings (or null).
void parse_user_metadata(const nlohmann::json& v, const std::string& path, std::map<std::string, std::string>& out) {
  TESSERA_CHECK(v.is_object() || v.is_null(), "'", path, "': __metadata__ is not an object");
  if (!v.is_object()) return;
  for (auto m = v.begin(); m != v.end(); ++m) {
    TESSERA_CHECK(m.value().is_string(), "'", path, "': __metadata__ value '", m.key(), "' is not a string");
    out[m.key()] = m.value().get<std::string>();
  }
}

// One tensor's entry: dtype, shape, and data offsets inside the data section
// [data_start, data_start + data_len) that hold exactly its bytes.
TensorEntry parse_entry(const std::string& name, const nlohmann::json& v, const std::string& path, uint64_t data_start,
                        uint64_t data_len) {
  const std::string what = concat("'", path, "' tensor '", name, "'");
  TESSERA_CHECK(v.is_object() && v.contains("dtype") && v.contains("shape") && v.contains("data_offsets"), what,
                ": entry needs dtype, shape and data_offsets");
  TESSERA_CHECK(v["dtype"].is_string(), what, ": dtype is not a string");
  TensorEntry e;
  e.name = name;
  e.dtype = parse_dtype(v["dtype"].get<std::string>(), what);
  TESSERA_CHECK(v["shape"].is_array(), what, ": shape is not an array");
  for (const auto& d : v["shape"]) {
    TESSERA_CHECK(d.is_number_integer() && d.get<int64_t>() >= 0, what, ": shape has a bad dimension ", d.dump());
    e.shape.push_back(d.get<int64_t>());
  }
  const auto& off = v["data_offsets"];
  TESSERA_CHECK(off.is_array() && off.size() == 2 && off[0].is_number_unsigned() && off[1].is_number_unsigned(),
                what, ": data_offsets must be two non-negative integers");
  const uint64_t b = off[0].get<uint64_t>(), en = off[1].get<uint64_t>();
  TESSERA_CHECK(b <= en && en <= data_len, what, ": data_offsets [", b, ", ", en, "] outside the data section of ",
                data_len, " bytes (truncated file?)");
  TESSERA_CHECK(en - b == byte_size(e.shape, e.dtype, what), what, ": data_offsets cover ", en - b,
                " bytes but the shape and dtype need ", byte_size(e.shape, e.dtype, what));
  e.begin = data_start + b;
  e.end = data_start + en;
  return e;
}

// The entries in data order, checked to cover [data_start, size) contiguously, without overlap.
std::vector<const TensorEntry*> check_coverage(const std::vector<TensorEntry>& entries, uint64_t data_start,
                                               uint64_t size, const std::string& path) {
  std::vector<const TensorEntry*> sorted;
  for (auto& e : entries) sorted.push_back(&e);
  std::sort(sorted.begin(), sorted.end(), [](auto* a, auto* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  uint64_t pos = data_start;
  for (auto* e : sorted) {
    TESSERA_CHECK(e->begin == pos, "'", path, "' tensor '", e->name, "': data starts at byte ", e->begin,
                  e->begin < pos ? " and overlaps the previous tensor" : " leaving a gap", " (expected ", pos, ")");
    pos = e->end;
  }
  TESSERA_CHECK(pos == size, "'", path, "': ", size - pos, " bytes after the last tensor are not covered by the header");
  return sorted;
}

// Tessera block checksums (tessera.crc32c, one per block of tessera.crc32c_block bytes of
// each tensor, in data order): the block size (0 without them) and each tensor's list.
uint64_t read_block_crcs(const std::map<std::string, std::string>& metadata,
                         const std::vector<const TensorEntry*>& sorted, const std::string& path,
                         std::map<std::string, std::vector<uint32_t>>& crcs) {
  auto c = metadata.find("tessera.crc32c");
  if (c == metadata.end()) return 0;
  auto bi = metadata.find("tessera.crc32c_block");
  const std::string bs = bi == metadata.end() ? "" : bi->second;
  TESSERA_CHECK(!bs.empty() && bs.find_first_not_of("0123456789") == std::string::npos && bs.size() < 12,
                "'", path, "': bad tessera.crc32c_block '", bs, "'");
  const uint64_t block = std::stoull(bs);
  check_crc_block(block, concat("'", path, "': tessera.crc32c_block"));
  uint64_t total = 0;
  for (auto* e : sorted) total += num_blocks(e->nbytes(), block);
  TESSERA_CHECK(c->second.size() == 8 * total, "'", path, "': tessera.crc32c holds ", c->second.size() / 8,
                " checksums for ", total, " blocks");
  size_t k = 0;
  for (auto* e : sorted) {
    auto& v = crcs[e->name];
    for (uint64_t i = 0; i < num_blocks(e->nbytes(), block); ++i, ++k)
      v.push_back(parse_crc_hex(c->second.substr(8 * k, 8), concat("'", path, "' tensor '", e->name, "'")));
  }
  return block;
}

// Header checksum: every byte of a Tessera header (names, shapes, offsets, plain values,
// padding) is covered, so a flipped header byte cannot load as a different checkpoint.
void check_header_crc(const std::map<std::string, std::string>& metadata, const unsigned char lenbuf[8],
                      const std::string& text, const std::string& path) {
  bool tessera_meta = false;
  for (const auto& [k, v] : metadata) tessera_meta |= k.rfind("tessera.", 0) == 0;
  if (!tessera_meta) return;
  auto hc = metadata.find("tessera.header_crc32c");
  TESSERA_CHECK(hc != metadata.end(), "'", path, "': Tessera header without tessera.header_crc32c — the header is ",
                "corrupt (or the file predates header checksums)");
  const std::string marker = kHeaderCrcMarker;
  const size_t at = text.find(marker);
  TESSERA_CHECK(at != std::string::npos && text.find(marker, at + 1) == std::string::npos &&
                    at + marker.size() + 8 <= text.size() && text.compare(at + marker.size(), 8, hc->second) == 0,
                "'", path, "': tessera.header_crc32c is not where the writer puts it — the header is corrupt");
  const uint32_t want = parse_crc_hex(hc->second, concat("'", path, "' tessera.header_crc32c"));
  const uint32_t got = header_crc(lenbuf, text, at + marker.size());
  TESSERA_CHECK(got == want, "'", path, "': header checksum mismatch (tessera.header_crc32c ", hc->second,
                ", computed ", crc_hex(got), ") — the header is corrupt");
}

}  // namespace

// The header read and checked in full: its length, its JSON, every entry, the entries'
// coverage of the data section, the block checksums, then the header checksum (last, so
// that structural errors keep their specific messages).
SafetensorsReader::SafetensorsReader(const std::string& path) : path_(path), file_(open_for_reading(path)) {
  check_little_endian();
  {
    struct stat st;
    TESSERA_CHECK(::fstat(file_.fd(), &st) == 0, "cannot stat '", path, "': ", std::strerror(errno));
    dev_ = static_cast<uint64_t>(st.st_dev);
    ino_ = static_cast<uint64_t>(st.st_ino);
    size_ = static_cast<uint64_t>(st.st_size);
  }
  unsigned char lenbuf[8];
  const std::string text = read_header_text(file_, size_, path, lenbuf);
  nlohmann::json h = parse_json_strict(text, concat("'", path, "': safetensors header"));
  TESSERA_CHECK(h.is_object(), "'", path, "': safetensors header is not a JSON object");
  const uint64_t data_start = 8 + text.size();
  for (auto it = h.begin(); it != h.end(); ++it) {
    if (it.key() == "__metadata__") {
      parse_user_metadata(it.value(), path, metadata_);
      continue;
    }
    index_[it.key()] = entries_.size();
    entries_.push_back(parse_entry(it.key(), it.value(), path, data_start, size_ - data_start));
  }
  const auto sorted = check_coverage(entries_, data_start, size_, path);
  crc_block_ = read_block_crcs(metadata_, sorted, path, crcs_);
  check_header_crc(metadata_, lenbuf, text, path);
}

const TensorEntry* SafetensorsReader::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &entries_[it->second];
}

std::string SafetensorsReader::meta(const std::string& key) const {
  auto it = metadata_.find(key);
  return it == metadata_.end() ? "" : it->second;
}

const std::vector<uint32_t>* SafetensorsReader::crcs(const std::string& name) const {
  auto it = crcs_.find(name);
  return it == crcs_.end() ? nullptr : &it->second;
}

at::Tensor SafetensorsReader::read(const std::string& name) const {
  const TensorEntry* e = find(name);
  TESSERA_CHECK(e != nullptr, "'", path(), "' has no tensor '", name, "'");
  at::Tensor t = at::empty(e->shape, at::TensorOptions().dtype(e->dtype));
  auto* p = static_cast<char*>(t.data_ptr());
  file().pread_exact(e->begin, p, e->nbytes());
  if (const auto* c = crcs(name)) {
    for (size_t i = 0; i < c->size(); ++i) {
      const uint64_t off = i * crc_block_;
      const uint64_t len = std::min<uint64_t>(crc_block_, e->nbytes() - off);
      TESSERA_CHECK(crc32c(p + off, len) == (*c)[i], "'", path(), "' tensor '", name, "': checksum mismatch in block ",
                    i, " (bytes ", e->begin + off, "..", e->begin + off + len, ") — the file is corrupt");
    }
  }
  return t;
}

// ---------------------------------------------------------------- writer

void append_json_string(std::string& out, std::string_view s) {
  bool plain = true;
  for (unsigned char ch : s) plain = plain && ch >= 0x20 && ch < 0x80;
  if (!plain) {  // control characters and UTF-8: nlohmann::json's own escaping (and its UTF-8 check)
    out += nlohmann::json(std::string(s)).dump();
    return;
  }
  out.push_back('"');
  for (char ch : s) {
    if (ch == '"' || ch == '\\') out.push_back('\\');
    out.push_back(ch);
  }
  out.push_back('"');
}

namespace {
void append_ints(std::string& out, const std::vector<int64_t>& v) {
  out.push_back('[');
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) out.push_back(',');
    out += std::to_string(v[i]);
  }
  out.push_back(']');
}
}  // namespace

SafetensorsLayout layout_safetensors(const std::string& path, const std::vector<TensorSpec>& specs,
                                     std::map<std::string, std::string> metadata) {
  check_little_endian();
  SafetensorsLayout L;
  L.tensors.reserve(specs.size());
  uint64_t off = 0, blocks = 0;
  std::unordered_set<std::string_view> seen;
  seen.reserve(specs.size());
  for (const auto& s : specs) {
    TESSERA_CHECK(!s.name.empty() && s.name != "__metadata__", "'", path, "': bad tensor name '", s.name, "'");
    TESSERA_CHECK(seen.insert(s.name).second, "'", path, "': tensor name '", s.name, "' given twice");
    const uint64_t nb = byte_size(s.shape, s.dtype, concat("'", path, "' tensor '", s.name, "'"));
    L.tensors.push_back({s.name, s.dtype, s.shape, off, off + nb});
    off += nb;
    blocks += num_blocks(nb);
  }
  metadata["format"] = metadata.count("format") ? metadata["format"] : "pt";
  if (!metadata.count("tessera.version")) metadata["tessera.version"] = "1";  // data files of format 2 say "2"
  metadata["tessera.crc32c_block"] = std::to_string(kCrcBlock);
  metadata["tessera.crc32c"] = std::string(8 * blocks, '0');
  metadata["tessera.header_crc32c"] = "00000000";  // patched once the data is written
  // The header is the compact JSON text nlohmann::ordered_json's dump() gives (the form
  // every earlier writer produced, byte for byte: tests/checkpoint/test_safetensors.cpp),
  // written directly: __metadata__ (keys sorted), then each tensor in spec order.
  std::string text;
  text.reserve(256 + 8 * blocks + specs.size() * 96);
  text += "{\"__metadata__\":{";
  size_t crc_at = std::string::npos, header_crc_at = std::string::npos;
  bool first = true;
  for (const auto& [k, v] : metadata) {
    if (!first) text.push_back(',');
    first = false;
    append_json_string(text, k);
    text.push_back(':');
    if (k == "tessera.crc32c") crc_at = text.size() + 1;
    if (k == "tessera.header_crc32c") header_crc_at = text.size() + 1;
    append_json_string(text, v);
  }
  text.push_back('}');
  for (const auto& t : L.tensors) {
    text.push_back(',');
    append_json_string(text, t.name);
    text += ":{\"dtype\":\"";
    text += dtype_name(t.dtype);
    text += "\",\"shape\":";
    append_ints(text, t.shape);
    text += ",\"data_offsets\":[";
    text += std::to_string(t.begin);
    text.push_back(',');
    text += std::to_string(t.end);
    text += "]}";
  }
  text.push_back('}');
  TESSERA_CHECK(crc_at != std::string::npos && header_crc_at != std::string::npos,
                "internal: checksum placeholder not found");
  while (text.size() % 8) text.push_back(' ');
  TESSERA_CHECK(text.size() <= kMaxHeaderBytes, "'", path, "': the safetensors header would be ", text.size(),
                " bytes, more than the ", kMaxHeaderBytes, "-byte (", kMaxHeaderBytes >> 20,
                " MiB) limit every reader enforces (", L.tensors.size(), " tensors): nothing is committed");
  L.crc_pos = 8 + crc_at;
  L.header_crc_pos = 8 + header_crc_at;
  L.prefix.reserve(8 + text.size());
  L.prefix.resize(8);
  uint64_t n = text.size();
  for (int i = 0; i < 8; ++i, n >>= 8) L.prefix[i] = static_cast<char>(n & 0xff);
  L.prefix += text;
  for (auto& t : L.tensors) {
    t.begin += L.data_start();
    t.end += L.data_start();
  }
  return L;
}

std::string SafetensorsLayout::final_prefix(const std::vector<std::vector<uint32_t>>& crcs) const {
  std::string out = prefix;
  std::string hex;
  // Checksums in data-offset order (== spec order).
  for (const auto& c : crcs)
    for (uint32_t x : c) hex += crc_hex(x);
  TESSERA_CHECK(crc_pos + hex.size() <= out.size() && out.compare(crc_pos, hex.size(), std::string(hex.size(), '0')) == 0,
                "internal: ", hex.size() / 8, " block checksums do not fit the header's placeholder");
  out.replace(crc_pos, hex.size(), hex);
  // The header checksum covers the final header: length, text, block checksums included.
  const auto* len = reinterpret_cast<const unsigned char*>(out.data());
  const std::string hc = crc_hex(header_crc(len, out.substr(8), header_crc_pos - 8));
  out.replace(header_crc_pos, 8, hc);
  return out;
}

SafetensorsWriter::SafetensorsWriter(const std::string& path, std::vector<Spec> specs,
                                     std::map<std::string, std::string> metadata)
    : path_(path), specs_(std::move(specs)), layout_(layout_safetensors(path, specs_, std::move(metadata))) {
  written_.reserve(layout_.tensors.size());
  for (const auto& t : layout_.tensors) written_.push_back({t.name, t.begin, t.end, {}});
  // Staging buffers of the stream's default size (16 MiB each), or of the file's size and a
  // page when it is smaller: a reshard to 1,024 ranks writes 1,024 files of under a MB, each
  // of which otherwise allocated (and faulted in, and freed) 32 MiB. The bytes written are
  // the same either way.
  constexpr uint64_t kStreamBuffer = 16u << 20;
  out_ = std::make_unique<StreamWriter>(path, std::min<uint64_t>(kStreamBuffer, layout_.file_size() + (64u << 10)));
  out_->append(layout_.prefix.data(), layout_.prefix.size());
}

SafetensorsWriter::~SafetensorsWriter() = default;

at::Tensor dense_cpu(const at::Tensor& t) {
  at::Tensor c = t.device().is_cpu() ? t : t.cpu();
  c = c.is_contiguous() && !c.is_conj() && !c.is_neg() ? c : c.contiguous().resolve_conj().resolve_neg();
  if (c.layout() != at::kStrided) c = c.to_dense();
  return c;
}

void SafetensorsWriter::write(const at::Tensor& t) {
  TESSERA_CHECK(!finished_ && next_ < specs_.size(), "'", path_, "': more tensors written than declared");
  const Spec& s = specs_[next_];
  TESSERA_CHECK(part_bytes_ == 0, "'", path_, "' tensor '", s.name, "': write() after write_part()");
  TESSERA_CHECK(t.scalar_type() == s.dtype && t.sizes().vec() == s.shape, "'", path_, "' tensor '", s.name,
                "': got ", t.scalar_type(), t.sizes(), " but declared ", s.dtype, " ", at::IntArrayRef(s.shape));
  at::Tensor c = dense_cpu(t);
  append(c.data_ptr(), written_[next_].end - written_[next_].begin);
}

void SafetensorsWriter::write_part(const at::Tensor& rows) {
  TESSERA_CHECK(!finished_ && next_ < specs_.size(), "'", path_, "': more tensors written than declared");
  const Spec& s = specs_[next_];
  const bool rows_match = !s.shape.empty() && rows.dim() == static_cast<int64_t>(s.shape.size()) &&
                          std::equal(s.shape.begin() + 1, s.shape.end(), rows.sizes().begin() + 1);
  TESSERA_CHECK(rows.scalar_type() == s.dtype && rows_match, "'", path_, "' tensor '", s.name, "': part ",
                rows.scalar_type(), rows.sizes(), " is not a run of rows of ", s.dtype, " ",
                at::IntArrayRef(s.shape));
  at::Tensor c = dense_cpu(rows);
  append(c.data_ptr(), static_cast<uint64_t>(c.numel()) * c.element_size());
}

void SafetensorsWriter::append(const void* data, uint64_t n) {
  Written& w = written_[next_];
  const uint64_t nb = w.end - w.begin;
  TESSERA_CHECK(part_bytes_ + n <= nb, "'", path_, "' tensor '", w.name, "': ", part_bytes_ + n,
                " bytes written but it has ", nb);
  // Checksummed in blocks of kCrcBlock bytes from the tensor's start (carried across
  // calls, so a tensor may come in parts) and handed to the stream writer, which writes
  // in the background while the next bytes are checksummed.
  const auto* p = static_cast<const unsigned char*>(data);
  for (uint64_t k = 0; k < n;) {
    const uint64_t take = std::min<uint64_t>(n - k, kCrcBlock - block_fill_);
    block_crc_ = crc32c_extend(block_crc_, p + k, static_cast<size_t>(take));
    out_->append(p + k, take);
    block_fill_ += take;
    k += take;
    if (block_fill_ == kCrcBlock) {
      w.crcs.push_back(block_crc_);
      block_crc_ = 0;
      block_fill_ = 0;
    }
  }
  part_bytes_ += n;
  if (part_bytes_ == nb) {  // the tensor is complete
    if (block_fill_ > 0) w.crcs.push_back(block_crc_);
    block_crc_ = 0;
    block_fill_ = 0;
    part_bytes_ = 0;
    ++next_;
  }
}

std::vector<SafetensorsWriter::Written> SafetensorsWriter::finish(File* unsynced) {
  TESSERA_CHECK(!finished_, "'", path_, "': finish() called twice");
  TESSERA_CHECK(next_ == specs_.size(), "'", path_, "': ", specs_.size() - next_, " declared tensors not written");
  std::vector<std::vector<uint32_t>> crcs;
  for (const auto& w : written_) crcs.push_back(w.crcs);
  const std::string header = layout_.final_prefix(crcs);
  out_->patch(0, header.data(), header.size());
  out_->finish(unsynced);
  finished_ = true;
  return written_;
}

}  // namespace tessera::checkpoint
