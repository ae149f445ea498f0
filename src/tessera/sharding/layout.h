// Where the pieces of a tensor live, as a rule every rank (and every reader) evaluates
// alone: checkpoint format version 2 (docs/checkpoint-format.md §3) records a Layout per
// tensor instead of a list of every rank's chunk, so its metadata does not grow with the
// world size for regular layouts. The rules:
//  - Whole: the tensor is one piece, in file `file`;
//  - Chunk: torch.chunk's rule along `dim` into `pieces` pieces;
//  - Flat:  FSDP's row-aligned cut: the tensor is elements [offset, offset + numel) of a
//           flat vector of `numel` elements (a unit's parameters one after another) cut
//           into `pieces` stretches at floor(T·k/P), each cut inside the tensor moved to
//           its nearest row boundary (flat_rows);
//  - Tp:    tensor parallelism composed with a data-parallel cut (format version 3): dim
//           `dim` is `stripes` equal stripes (a fused weight: qkv's q, k and v), each cut
//           by torch.chunk's rule into `tp` ranges; TP piece t is the t-th range of every
//           stripe, concatenated in stripe order (parallel::TpCut's rule). Each TP piece is
//           then cut by an inner rule over `pieces` data-parallel ranks: whole, chunk along
//           `inner_dim`, or FSDP's flat cut of its own unit (inner_numel / inner_offset: one
//           value, or one per TP piece when the pieces differ in size). The layout's piece
//           i = ((p·tp + t)·stripes + s) is the part of inner piece p of TP piece t that
//           lies in stripe s: a box of the global tensor, possibly empty. Holder
//           q = p·tp + t (a rank of the (dp, tp) mesh) stores pieces [q·stripes, (q+1)·stripes).
//  - List:  an explicit list of (file, box), for layouts no rule describes.
// Piece i of a Chunk or Flat layout is stored in file files.file(i); of a Tp layout in
// files.file(i / stripes).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "tessera/sharding/chunk.h"

namespace tessera::sharding {

// Piece i -> first + i·step + ((i + shift) mod replicas)·replica_step. replicas > 1
// describes replica groups that each hold every piece: the group (i + shift) mod replicas
// stores piece i. The groups are blocks of consecutive ranks one after another
// (HYBRID_SHARD: replica_step >= pieces·step) or interleave inside each step (the
// data-parallel groups of a (dp, tp) mesh, one per tp rank: step = tp, replica_step = 1).
struct FileMap {
  int64_t first = 0, step = 1, replicas = 1, replica_step = 0, shift = 0;
  int64_t file(int64_t i) const;
  // The groups interleave: replicas > 1, replica_step >= 1, (replicas - 1)·replica_step < step.
  bool interleaved() const {
    return replicas > 1 && replica_step >= 1 && (replicas - 1) * replica_step < step;
  }
  bool operator==(const FileMap& o) const {
    return first == o.first && step == o.step && replicas == o.replicas && replica_step == o.replica_step &&
           shift == o.shift;
  }
};

struct LayoutPiece {
  int64_t file = 0;
  Box box;
  bool operator==(const LayoutPiece& o) const { return file == o.file && box == o.box; }
};

struct Layout {
  enum class Rule { Whole, Chunk, Flat, List, Tp };
  Rule rule = Rule::Whole;
  int64_t file = 0;                 // Whole
  int64_t dim = 0;                  // Chunk; Tp: the tensor-parallel dimension
  int64_t pieces = 1;               // Chunk, Flat; Tp: the inner rule's pieces (1 for whole)
  int64_t flat_numel = 0;           // Flat: T
  int64_t flat_offset = 0;          // Flat: o
  FileMap files;                    // Chunk, Flat, Tp (over holders)
  std::vector<LayoutPiece> list;    // List
  // Tp only.
  int64_t tp = 1, stripes = 1;
  Rule inner = Rule::Whole;           // Whole, Chunk or Flat
  int64_t inner_dim = 0;              // inner Chunk
  std::vector<int64_t> inner_numel;   // inner Flat: one value, or one per TP piece
  std::vector<int64_t> inner_offset;  // inner Flat: likewise

  static Layout whole(int64_t file);
  static Layout chunk(int64_t dim, int64_t pieces, FileMap files = {});
  static Layout flat(int64_t unit_numel, int64_t offset, int64_t pieces, FileMap files = {});
  // A Tp layout; `inner` is a Whole, Chunk or Flat layout (its files are ignored) cutting
  // every TP piece, its Flat numel / offset those of TP piece 0 unless `numel` / `offset`
  // (one per TP piece) are given.
  static Layout tensor_parallel(int64_t dim, int64_t stripes, int64_t tp, const Layout& inner, FileMap files = {},
                                std::vector<int64_t> numel = {}, std::vector<int64_t> offset = {});

  // Pieces, empty ones included.
  int64_t count() const;
  // The box of piece i of a tensor of `shape` (valid layouts only: validate first).
  Box box(const std::vector<int64_t>& shape, int64_t i) const;
  int64_t file_of(int64_t i) const;
  // The pieces (empty ones included) that file `f` stores, ascending: the inverse of
  // file_of, in O(1) for Whole, Chunk and Flat (valid layouts: validate first) and one pass
  // over the list for List.
  std::vector<int64_t> pieces_in_file(int64_t f) const;
  // The non-empty pieces that overlap `region` (a box inside `shape`), ascending. Chunk
  // and Flat find them by binary search: O(log P + k), not O(P).
  std::vector<int64_t> overlapping(const std::vector<int64_t>& shape, const Box& region) const;
  // Throws tessera::Error starting with `what` unless the layout is well formed for
  // `shape` and files in [0, world_size): parameters in range, no two pieces in one file
  // (rules), and a List's boxes inside the shape tiling it exactly.
  void validate(const std::vector<int64_t>& shape, int64_t world_size, const std::string& what) const;
  std::string rule_name() const;  // "whole", "chunk", "flat", "list", "tp"
  // Tp: the number of pieces each holder stores (stripes; 1 for the other rules), the
  // holders (pieces of the files map), the shape of TP piece t of a tensor of `shape`, and
  // the inner rule that cuts it.
  int64_t pieces_per_holder() const { return rule == Rule::Tp ? stripes : 1; }
  int64_t holders() const { return rule == Rule::Tp ? pieces * tp : count(); }
  std::vector<int64_t> tp_local_shape(const std::vector<int64_t>& shape, int64_t t) const;
  Layout tp_inner(int64_t t) const;
  bool operator==(const Layout& o) const;
  bool operator!=(const Layout& o) const { return !(*this == o); }

 private:
  void validate_tp(const std::vector<int64_t>& shape, int64_t world_size, const std::string& what) const;
  // The files map of `holders` holders in [0, world_size) (Chunk, Flat and Tp).
  void validate_files(int64_t holders, const char* holders_are, int64_t world_size, const std::string& what) const;
};

// The largest piece count a layout may have (the launcher's limit on ranks).
constexpr int64_t kMaxPieces = 1 << 20;
// The most stripes a Tp layout may cut its dimension into (fused weights have 2 or 3).
constexpr int64_t kMaxStripes = 64;

// Dim-0 rows [begin, begin + size) of piece i of a tensor of `shape` (dim >= 1) laid out
// by FSDP's row-aligned cut: the tensor is elements [offset, offset + numel(shape)) of a
// flat vector of `unit_numel` elements cut into `pieces` stretches (docs/checkpoint-format.md §3).
// FSDP shards its units with it, so both agree by construction.
Range flat_rows(int64_t unit_numel, int64_t offset, const std::vector<int64_t>& shape, int64_t pieces, int64_t i);

}  // namespace tessera::sharding
