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

Layout Layout::tensor_parallel(int64_t dim, int64_t stripes, int64_t tp, const Layout& inner, FileMap files,
                               std::vector<int64_t> numel, std::vector<int64_t> offset) {
  TESSERA_CHECK(inner.rule == Rule::Whole || inner.rule == Rule::Chunk || inner.rule == Rule::Flat,
                "Layout::tensor_parallel: the inner rule is ", inner.rule_name(), " (whole, chunk or flat)");
  Layout L;
  L.rule = Rule::Tp;
  L.dim = dim;
  L.stripes = stripes;
  L.tp = tp;
  L.inner = inner.rule;
  L.pieces = inner.rule == Rule::Whole ? 1 : inner.pieces;
  L.inner_dim = inner.rule == Rule::Chunk ? inner.dim : 0;
  if (inner.rule == Rule::Flat) {
    L.inner_numel = numel.empty() ? std::vector<int64_t>{inner.flat_numel} : std::move(numel);
    L.inner_offset = offset.empty() ? std::vector<int64_t>{inner.flat_offset} : std::move(offset);
    // One value when every TP piece has the same (the metadata then does not grow with tp).
    auto squeeze = [](std::vector<int64_t>& v) {
      if (std::all_of(v.begin(), v.end(), [&](int64_t x) { return x == v[0]; })) v.resize(1);
    };
    squeeze(L.inner_numel);
    squeeze(L.inner_offset);
  }
  L.files = files;
  return L;
}

namespace {

// The tensor-parallel range of stripe s of TP piece t along the cut dimension (global).
Range tp_range(int64_t n, int64_t stripes, int64_t tp, int64_t t, int64_t s) {
  const int64_t per = n / stripes;
  const Range r = chunk_range(per, static_cast<int>(tp), static_cast<int>(t));
  return {s * per + r.begin, r.size};
}

int64_t at_or_first(const std::vector<int64_t>& v, int64_t t) {
  return v.size() == 1 ? v[0] : v.at(static_cast<size_t>(t));
}

}  // namespace

std::vector<int64_t> Layout::tp_local_shape(const std::vector<int64_t>& shape, int64_t t) const {
  std::vector<int64_t> out = shape;
  const size_t d = static_cast<size_t>(dim);
  out[d] = stripes * tp_range(shape[d], stripes, tp, t, 0).size;
  return out;
}

Layout Layout::tp_inner(int64_t t) const {
  switch (inner) {
    case Rule::Chunk: return chunk(inner_dim, pieces);
    case Rule::Flat: return flat(at_or_first(inner_numel, t), at_or_first(inner_offset, t), pieces);
    default: return whole(0);
  }
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
    case Rule::Tp: return pieces * tp * stripes;
    default: return pieces;
  }
}

int64_t Layout::file_of(int64_t i) const {
  switch (rule) {
    case Rule::Whole: return file;
    case Rule::List: return list.at(static_cast<size_t>(i)).file;
    case Rule::Tp: return files.file(i / stripes);
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
  // when replicas > 1 and the groups follow each other (validate): the group
  // of file f is (f - first) / replica_step, and within it the piece is the step's quotient.
  // Over holders: a Tp layout's holder q stores pieces [q·stripes, (q+1)·stripes).
  const int64_t H = holders(), per = pieces_per_holder();
  auto add = [&](int64_t q) {
    for (int64_t s = 0; s < per; ++s) out.push_back(q * per + s);
  };
  if (f < files.first || files.step < 1) return out;
  int64_t rel = f - files.first, group = 0;
  if (files.replicas > 1) {
    if (files.replica_step < 1) {
      for (int64_t q = 0; q < H; ++q)  // not a valid layout: the plain inverse
        if (files.file(q) == f) add(q);
      return out;
    }
    if (files.interleaved()) {
      // The groups' files interleave inside each step (a group per offset: the data-parallel
      // groups of a (dp, tp) mesh, one per tp rank).
      const int64_t within = rel % files.step;
      if (within % files.replica_step != 0) return out;
      group = within / files.replica_step;
      if (group >= files.replicas) return out;
      rel -= within;
    } else {
      group = rel / files.replica_step;
      if (group >= files.replicas) return out;
      rel -= group * files.replica_step;
    }
  }
  if (rel % files.step != 0) return out;
  const int64_t q = rel / files.step;
  if (q < H && files.file(q) == f) add(q);
  return out;
}

Box Layout::box(const std::vector<int64_t>& shape, int64_t i) const {
  switch (rule) {
    case Rule::Whole: return full_box(shape);
    case Rule::List: return list.at(static_cast<size_t>(i)).box;
    case Rule::Tp: {
      const int64_t s = i % stripes, q = i / stripes, t = q % tp, p = q / tp;
      const size_t d = static_cast<size_t>(dim);
      Box b = tp_inner(t).box(tp_local_shape(shape, t), p);
      // The inner piece's range along the cut dimension, in TP piece t's coordinates,
      // clipped to stripe s and moved to the global tensor.
      const Range g = tp_range(shape[d], stripes, tp, t, s);
      const int64_t lo = std::max(b.offsets[d], s * g.size), hi = std::min(b.offsets[d] + b.sizes[d], (s + 1) * g.size);
      b.offsets[d] = g.begin + std::max<int64_t>(0, lo - s * g.size);
      b.sizes[d] = std::max<int64_t>(0, hi - lo);
      return b;
    }
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
    case Rule::Tp: {
      // Per TP piece and stripe (tp·stripes of them, small): the region's part inside it,
      // in the TP piece's coordinates, and the inner rule's pieces overlapping that.
      const size_t dd = static_cast<size_t>(dim);
      for (int64_t t = 0; t < tp; ++t) {
        const std::vector<int64_t> local = tp_local_shape(shape, t);
        const Layout in = tp_inner(t);
        for (int64_t s = 0; s < stripes; ++s) {
          const Range g = tp_range(shape[dd], stripes, tp, t, s);
          const int64_t a = std::max(g.begin, region.offsets[dd]);
          const int64_t b = std::min(g.begin + g.size, region.offsets[dd] + region.sizes[dd]);
          if (b <= a) continue;
          Box r = region;
          r.offsets[dd] = s * g.size + (a - g.begin);
          r.sizes[dd] = b - a;
          for (int64_t p : in.overlapping(local, r)) out.push_back((p * tp + t) * stripes + s);
        }
      }
      std::sort(out.begin(), out.end());
      return out;
    }
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
    case Rule::Tp: validate_tp(shape, world_size, what); return;
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
  validate_files(pieces, "layout.pieces", world_size, what);
}

void Layout::validate_files(int64_t holders, const char* holders_are, int64_t world_size,
                            const std::string& what) const {
  const int64_t pieces = holders;
  const FileMap& f = files;
  TESSERA_CHECK(f.first >= 0 && f.step >= 1 && f.replicas >= 1 && f.replicas <= kMaxPieces && f.replica_step >= 0 &&
                    f.shift >= 0,
                what, ": files {first ", f.first, ", step ", f.step, ", replicas ", f.replicas, ", replica_step ",
                f.replica_step, ", shift ", f.shift, "} out of range");
  // Replica groups either follow each other (replica_step >= pieces * step) or interleave
  // inside each step ((replicas - 1) * replica_step < step, replica_step >= 1).
  TESSERA_CHECK(f.replicas == 1 || static_cast<Wide>(f.replica_step) >= static_cast<Wide>(pieces) * f.step ||
                    f.interleaved(),
                what, ": layout.files.replica_step ", f.replica_step, " is below ", holders_are,
                " * layout.files.step = ", static_cast<int64_t>(std::min<Wide>(static_cast<Wide>(pieces) * f.step, INT64_MAX)),
                " (two pieces would share a file)");
  const Wide last = static_cast<Wide>(f.first) + static_cast<Wide>(pieces - 1) * f.step +
                    static_cast<Wide>(f.replicas - 1) * f.replica_step;
  TESSERA_CHECK(last < world_size, what, ": layout.files reach data file ",
                static_cast<int64_t>(std::min<Wide>(last, INT64_MAX)), ", outside [0, ", world_size - 1, "]");
}

// The words of the metadata reader and python/tessera_ckpt (layout.stripes, layout.inner.numel[t]).
void Layout::validate_tp(const std::vector<int64_t>& shape, int64_t world_size, const std::string& what) const {
  const int64_t rank = static_cast<int64_t>(shape.size());
  TESSERA_CHECK(rank > 0, what, ": a tp layout needs a tensor of at least one dimension");
  TESSERA_CHECK(dim >= 0 && dim < rank, what, ": layout.dim ", dim, " is outside [0, ", rank - 1, "]");
  TESSERA_CHECK(stripes >= 1 && stripes <= kMaxStripes, what, ": layout.stripes ", stripes, " is outside [1, ",
                kMaxStripes, "]");
  TESSERA_CHECK(shape[static_cast<size_t>(dim)] % stripes == 0, what, ": layout.stripes ", stripes,
                " does not divide dimension ", dim, " of shape ", core::shape_string(shape), " (",
                shape[static_cast<size_t>(dim)], ")");
  TESSERA_CHECK(tp >= 1 && tp <= world_size, what, ": layout.tp ", tp, " is outside [1, ", world_size, "]");
  TESSERA_CHECK(inner == Rule::Whole || inner == Rule::Chunk || inner == Rule::Flat, what,
                ": layout.inner.rule is not whole, chunk or flat");
  TESSERA_CHECK(pieces >= 1 && pieces <= world_size && (inner != Rule::Whole || pieces == 1), what,
                ": layout.inner.pieces ", pieces, " is outside [1, ", inner == Rule::Whole ? 1 : world_size, "]");
  TESSERA_CHECK(static_cast<Wide>(pieces) * tp <= world_size, what, ": layout.inner.pieces ", pieces, " x layout.tp ",
                tp, " holders exceed world_size ", world_size);
  if (inner == Rule::Chunk)
    TESSERA_CHECK(inner_dim >= 0 && inner_dim < rank, what, ": layout.inner.dim ", inner_dim, " is outside [0, ",
                  rank - 1, "]");
  if (inner == Rule::Flat) {
    for (const auto* v : {&inner_numel, &inner_offset})
      TESSERA_CHECK(v->size() == 1 || static_cast<int64_t>(v->size()) == tp, what, ": layout.inner.",
                    v == &inner_numel ? "numel" : "offset", " holds ", v->size(), " values (1, or layout.tp = ", tp,
                    ")");
    for (int64_t t = 0; t < tp; ++t) {
      const int64_t n = numel_of(tp_local_shape(shape, t));
      const int64_t T = at_or_first(inner_numel, t), o = at_or_first(inner_offset, t);
      TESSERA_CHECK(o >= 0 && T >= 0 && static_cast<Wide>(o) + n <= T, what, ": layout.inner.offset ", o,
                    " + the ", n, " elements of tensor-parallel piece ", t, " exceed layout.inner.numel ", T);
    }
  }
  validate_files(pieces * tp, "layout.inner.pieces * layout.tp", world_size, what);
}

std::string Layout::rule_name() const {
  switch (rule) {
    case Rule::Whole: return "whole";
    case Rule::Chunk: return "chunk";
    case Rule::Flat: return "flat";
    case Rule::List: return "list";
    case Rule::Tp: return "tp";
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
    case Rule::Tp:
      return dim == o.dim && stripes == o.stripes && tp == o.tp && inner == o.inner && pieces == o.pieces &&
             inner_dim == o.inner_dim && inner_numel == o.inner_numel && inner_offset == o.inner_offset &&
             files == o.files;
  }
  return false;
}

}  // namespace tessera::sharding
