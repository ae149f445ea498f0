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
//  - List:  an explicit list of (file, box), for layouts no rule describes.
// Piece i of a Chunk or Flat layout is stored in file files.file(i).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "tessera/sharding/chunk.h"

namespace tessera::sharding {

// Piece i -> first + i·step + ((i + shift) mod replicas)·replica_step. replicas > 1
// describes replica groups of consecutive ranks that each hold every piece (HYBRID_SHARD):
// the group (i + shift) mod replicas stores piece i.
struct FileMap {
  int64_t first = 0, step = 1, replicas = 1, replica_step = 0, shift = 0;
  int64_t file(int64_t i) const;
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
  enum class Rule { Whole, Chunk, Flat, List };
  Rule rule = Rule::Whole;
  int64_t file = 0;                 // Whole
  int64_t dim = 0;                  // Chunk
  int64_t pieces = 1;               // Chunk, Flat
  int64_t flat_numel = 0;           // Flat: T
  int64_t flat_offset = 0;          // Flat: o
  FileMap files;                    // Chunk, Flat
  std::vector<LayoutPiece> list;    // List

  static Layout whole(int64_t file);
  static Layout chunk(int64_t dim, int64_t pieces, FileMap files = {});
  static Layout flat(int64_t unit_numel, int64_t offset, int64_t pieces, FileMap files = {});

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
  std::string rule_name() const;  // "whole", "chunk", "flat", "list"
  bool operator==(const Layout& o) const;
  bool operator!=(const Layout& o) const { return !(*this == o); }
};

// The largest piece count a layout may have (the launcher's limit on ranks).
constexpr int64_t kMaxPieces = 1 << 20;

// Dim-0 rows [begin, begin + size) of piece i of a tensor of `shape` (dim >= 1) laid out
// by FSDP's row-aligned cut: the tensor is elements [offset, offset + numel(shape)) of a
// flat vector of `unit_numel` elements cut into `pieces` stretches (docs/checkpoint-format.md §3).
// FSDP shards its units with it, so both agree by construction.
Range flat_rows(int64_t unit_numel, int64_t offset, const std::vector<int64_t>& shape, int64_t pieces, int64_t i);

}  // namespace tessera::sharding
