#include "tessera/sharding/layout.h"

#include <algorithm>
#include <limits>

#include "tessera/core/error.h"
#include "tessera/core/strings.h"
#include "tessera/sharding/spec.h"

namespace tessera::sharding {

namespace {

using Wide = __int128;

// A list layout names at most this many pieces per data file (world_size times this in all),
// each non-empty: real saves store one piece per shard, and a rank holds a few shards of a
// tensor (issue 44 item 3: millions of empty pieces cost gigabytes to parse). The metadata
// reader (metadata.cpp) and python/tessera_ckpt (MAX_LIST_PIECES_PER_FILE) use the same bound.
constexpr int64_t kMaxListPiecesPerFile = 64;

int64_t numel_of(const std::vector<int64_t>& shape) {
  Wide n = 1;
  for (auto s : shape) {
    if (s == 0) return 0;
    n *= s;
    if (n > std::numeric_limits<int64_t>::max()) return -1;
  }
  return static_cast<int64_t>(n);
}

// Position of cut k of the flat vector, clamped to the tensor [o, o + n] and, inside it,
// moved to the nearest row boundary (r elements per row; r > 0).
int64_t flat_cut(int64_t T, int64_t o, int64_t n, int64_t r, int64_t P, int64_t k) {
  if (k <= 0) return o;
  if (k >= P) return o + n;
  const Wide c = static_cast<Wide>(T) * k / P;
  if (c <= o) return o;
  if (c >= static_cast<Wide>(o) + n) return o + n;
  const int64_t into = static_cast<int64_t>(c) - o;
  return o + (into + r / 2) / r * r;
}

// Dim-d range of piece i of a Chunk or Flat layout.
Range rule_range(const Layout& L, const std::vector<int64_t>& shape, int64_t i) {
  if (L.rule == Layout::Rule::Chunk) return chunk_range(shape[static_cast<size_t>(L.dim)], static_cast<int>(L.pieces), static_cast<int>(i));
  return flat_rows(L.flat_numel, L.flat_offset, shape, L.pieces, i);
}

}  // namespace

int64_t FileMap::file(int64_t i) const {
  const int64_t group = replicas > 1 ? (i % replicas + shift % replicas) % replicas : 0;
  return first + i * step + group * replica_step;
}

Layout Layout::whole(int64_t file) {
  Layout L;
  L.rule = Rule::Whole;
  L.file = file;
  return L;
}

Layout Layout::chunk(int64_t dim, int64_t pieces, FileMap files) {
  Layout L;
  L.rule = Rule::Chunk;
  L.dim = dim;
  L.pieces = pieces;
  L.files = files;
  return L;
}

Layout Layout::flat(int64_t unit_numel, int64_t offset, int64_t pieces, FileMap files) {
  Layout L;
  L.rule = Rule::Flat;
  L.flat_numel = unit_numel;
  L.flat_offset = offset;
  L.pieces = pieces;
  L.files = files;
  return L;
}

Range flat_rows(int64_t unit_numel, int64_t offset, const std::vector<int64_t>& shape, int64_t pieces, int64_t i) {
  TESSERA_CHECK(!shape.empty(), "flat layout: a 0-dimensional tensor has no rows");
  TESSERA_CHECK(i >= 0 && i < pieces, "flat layout: piece ", i, " is outside [0, ", pieces, ")");
  const int64_t rows = shape[0];
  const int64_t n = numel_of(shape);
  TESSERA_CHECK(n >= 0, "flat layout: shape ", core::shape_string(shape), " has more than 2^63 - 1 elements");
  if (rows == 0) return {0, 0};
  const int64_t r = n / rows;
  if (r == 0) return i == 0 ? Range{0, rows} : Range{rows, 0};  // empty rows: all on the first piece
  const int64_t b = (flat_cut(unit_numel, offset, n, r, pieces, i) - offset) / r;
  const int64_t e = (flat_cut(unit_numel, offset, n, r, pieces, i + 1) - offset) / r;
  return {b, e - b};
}

int64_t Layout::count() const {
  switch (rule) {
    case Rule::Whole: return 1;
    case Rule::List: return static_cast<int64_t>(list.size());
    default: return pieces;
  }
}

int64_t Layout::file_of(int64_t i) const {
  switch (rule) {
    case Rule::Whole: return file;
    case Rule::List: return list.at(static_cast<size_t>(i)).file;
    default: return files.file(i);
  }
}

std::vector<int64_t> Layout::pieces_in_file(int64_t f) const {
  std::vector<int64_t> out;
  switch (rule) {
    case Rule::Whole:
      if (file == f) out.push_back(0);
      return out;
    case Rule::List:
      for (size_t i = 0; i < list.size(); ++i)
        if (list[i].file == f) out.push_back(static_cast<int64_t>(i));
      return out;
    default: break;
  }
  // files.file(i) = first + i·step + group(i)·replica_step, with replica_step >= pieces·step
  // when replicas > 1 (validate): the replica groups' files do not interleave, so the group
  // of file f is (f - first) / replica_step, and within it the piece is the step's quotient.
  if (f < files.first || files.step < 1) return out;
  int64_t rel = f - files.first, group = 0;
  if (files.replicas > 1) {
    if (files.replica_step < 1) {
      for (int64_t i = 0; i < pieces; ++i)  // not a valid layout: the plain inverse
        if (files.file(i) == f) out.push_back(i);
      return out;
    }
    group = rel / files.replica_step;
    if (group >= files.replicas) return out;
    rel -= group * files.replica_step;
  }
  if (rel % files.step != 0) return out;
  const int64_t i = rel / files.step;
  if (i < pieces && files.file(i) == f) out.push_back(i);
  return out;
}

Box Layout::box(const std::vector<int64_t>& shape, int64_t i) const {
  switch (rule) {
    case Rule::Whole: return full_box(shape);
    case Rule::List: return list.at(static_cast<size_t>(i)).box;
    default: {
      const size_t d = rule == Rule::Chunk ? static_cast<size_t>(dim) : 0;
      Box b = full_box(shape);
      const Range rg = rule_range(*this, shape, i);
      b.offsets[d] = rg.begin;
      b.sizes[d] = rg.size;
      return b;
    }
  }
}

std::vector<int64_t> Layout::overlapping(const std::vector<int64_t>& shape, const Box& region) const {
  std::vector<int64_t> out;
  if (region.empty() || numel_of(shape) == 0) return out;
  switch (rule) {
    case Rule::Whole:
      out.push_back(0);
      return out;
    case Rule::List:
      for (size_t i = 0; i < list.size(); ++i)
        if (!list[i].box.empty() && intersect(list[i].box, region)) out.push_back(static_cast<int64_t>(i));
      return out;
    default: break;
  }
  const size_t d = rule == Rule::Chunk ? static_cast<size_t>(dim) : 0;
  const int64_t a = region.offsets[d], b = region.offsets[d] + region.sizes[d];
  // Pieces are consecutive ranges in piece order (ends never decrease): the first piece
  // whose end passes `at`, by bisection over [from, pieces).
  auto first_ending_after = [&](int64_t from, int64_t at) {
    int64_t lo = from, hi = pieces;
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo) / 2;
      const Range rg = rule_range(*this, shape, mid);
      if (rg.begin + rg.size > at) hi = mid;
      else lo = mid + 1;
    }
    return lo;
  };
  // Each step lands on a non-empty piece (the next one ending past the previous end), so
  // runs of empty pieces (rows wider than a rank's stretch) cost a bisection, not a walk.
  for (int64_t i = first_ending_after(0, a); i < pieces;) {
    const Range rg = rule_range(*this, shape, i);
    if (rg.begin >= b) break;
    out.push_back(i);
    i = first_ending_after(i + 1, rg.begin + rg.size);
  }
  return out;
}

// The messages are the metadata reader's and python/tessera_ckpt's (issue 44 item 5): fields
// named as in the metadata (`layout.pieces[i]`, `layout.files.step`).
void Layout::validate(const std::vector<int64_t>& shape, int64_t world_size, const std::string& what) const {
  const int64_t n = numel_of(shape);
  TESSERA_CHECK(n >= 0, what, ": shape ", core::shape_string(shape), " has more than 2^63 - 1 elements");
  auto check_file = [&](int64_t f, const std::string& which) {
    TESSERA_CHECK(f >= 0 && f < world_size, what, ": ", which, " is in file ", f, ", outside [0, ", world_size, ")");
  };
  switch (rule) {
    case Rule::Whole:
      check_file(file, "the whole tensor");
      return;
    case Rule::List: {
      TESSERA_CHECK(static_cast<Wide>(list.size()) <= static_cast<Wide>(kMaxListPiecesPerFile) * world_size, what,
                    ": layout.pieces lists ", list.size(), " pieces, more than ", kMaxListPiecesPerFile,
                    " per data file (", kMaxListPiecesPerFile * world_size, " for world_size ", world_size, ")");
      // Piece by piece: its file, its rank, inside the shape, not empty; then no two overlap
      // (first_overlap's sweep, not every pair), then they cover the shape.
      Wide volume = 0;
      for (size_t i = 0; i < list.size(); ++i) {
        const LayoutPiece& p = list[i];
        TESSERA_CHECK(p.file >= 0 && p.file < world_size, what, " layout.pieces[", i, "] file is ", p.file,
                      ", outside [0, ", world_size - 1, "]");
        TESSERA_CHECK(p.box.offsets.size() == shape.size() && p.box.sizes.size() == shape.size(), what,
                      ": layout.pieces[", i, "] has ", p.box.offsets.size(), " offsets and ", p.box.sizes.size(),
                      " sizes for a shape of rank ", shape.size());
        TESSERA_CHECK(inside_shape(shape, p.box), what, ": layout.pieces[", i, "] (offsets ",
                      core::shape_string(p.box.offsets), ", sizes ", core::shape_string(p.box.sizes),
                      ") lies outside the shape ", core::shape_string(shape));
        TESSERA_CHECK(!p.box.empty(), what, ": layout.pieces[", i, "] ", p.box.to_string(),
                      " is empty (a list layout names only the pieces its data files store)");
        volume += p.box.numel();
      }
      const auto o = first_overlap(list.size(), [&](size_t i) -> const Box& { return list[i].box; });
      TESSERA_CHECK(!o, what, ": pieces ", list[o->first].box.to_string(), " and ", list[o->second].box.to_string(),
                    " overlap");
      TESSERA_CHECK(volume == n, what, ": the pieces cover ", static_cast<int64_t>(volume), " of ", n,
                    " elements (incomplete checkpoint)");
      return;
    }
    default: break;
  }
  const char* name = rule == Rule::Chunk ? "chunk" : "flat";
  TESSERA_CHECK(!shape.empty(), what, ": a ", name, " layout needs a tensor of at least one dimension");
  TESSERA_CHECK(pieces >= 1 && pieces <= kMaxPieces, what, ": ", name, " layout of ", pieces, " pieces, outside [1, ",
                kMaxPieces, "]");
  if (rule == Rule::Chunk) {
    TESSERA_CHECK(dim >= 0 && dim < static_cast<int64_t>(shape.size()), what, ": chunk layout along dimension ", dim,
                  " of a tensor of shape ", core::shape_string(shape));
  } else {
    TESSERA_CHECK(flat_offset >= 0 && flat_numel >= 0 && static_cast<Wide>(flat_offset) + n <= flat_numel, what,
                  ": flat layout puts ", n, " elements at offset ", flat_offset, " of a unit of ", flat_numel);
  }
  const FileMap& f = files;
  TESSERA_CHECK(f.first >= 0 && f.step >= 1 && f.replicas >= 1 && f.replicas <= kMaxPieces && f.replica_step >= 0 &&
                    f.shift >= 0,
                what, ": files {first ", f.first, ", step ", f.step, ", replicas ", f.replicas, ", replica_step ",
                f.replica_step, ", shift ", f.shift, "} out of range");
  TESSERA_CHECK(f.replicas == 1 || static_cast<Wide>(f.replica_step) >= static_cast<Wide>(pieces) * f.step, what,
                ": layout.files.replica_step ", f.replica_step, " is below layout.pieces * layout.files.step = ",
                static_cast<int64_t>(std::min<Wide>(static_cast<Wide>(pieces) * f.step, INT64_MAX)),
                " (two pieces would share a file)");
  const Wide last = static_cast<Wide>(f.first) + static_cast<Wide>(pieces - 1) * f.step +
                    static_cast<Wide>(f.replicas - 1) * f.replica_step;
  TESSERA_CHECK(last < world_size, what, ": layout.files reach data file ",
                static_cast<int64_t>(std::min<Wide>(last, INT64_MAX)), ", outside [0, ", world_size - 1, "]");
}

std::string Layout::rule_name() const {
  switch (rule) {
    case Rule::Whole: return "whole";
    case Rule::Chunk: return "chunk";
    case Rule::Flat: return "flat";
    case Rule::List: return "list";
  }
  return "?";
}

bool Layout::operator==(const Layout& o) const {
  if (rule != o.rule) return false;
  switch (rule) {
    case Rule::Whole: return file == o.file;
    case Rule::Chunk: return dim == o.dim && pieces == o.pieces && files == o.files;
    case Rule::Flat:
      return flat_numel == o.flat_numel && flat_offset == o.flat_offset && pieces == o.pieces && files == o.files;
    case Rule::List: return list == o.list;
  }
  return false;
}

}  // namespace tessera::sharding
