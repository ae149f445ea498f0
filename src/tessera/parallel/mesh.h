// A device mesh: the world's ranks arranged as a named N-D grid, e.g. (dp_replicate,
// dp_shard, tp), row-major with the last dimension innermost, so that consecutive ranks
// (the ranks of one host, as the launcher numbers them) share every coordinate but the
// last: put tensor parallelism last and its collectives stay inside a host, on the
// shared-memory channel where the communicator has one (communicator.h).
//
// Each dimension has its communicator: the ranks that differ only in that coordinate,
// made once at construction by Communicator::split (a collective over the world). A
// dimension of size 1 makes no group: its communicator is a one-process one whose
// collectives are local no-ops. flatten() makes the group of several dimensions at once
// (the data-parallel group of a (dp_replicate, dp_shard, tp) mesh is the first two).
#pragma once
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "tessera/distributed/communicator.h"

namespace tessera::parallel {

struct MeshDim {
  std::string name;
  int size = 1;
};

class DeviceMesh {
 public:
  // Collective over `world` (null: a one-process world): every rank passes the same
  // dimensions. Throws tessera::Error naming the sizes when they do not multiply to the
  // world size, or naming the dimension when a name repeats or a size is below 1.
  DeviceMesh(std::shared_ptr<distributed::Communicator> world, std::vector<MeshDim> dims);

  const std::vector<MeshDim>& dims() const { return dims_; }
  int ndim() const { return static_cast<int>(dims_.size()); }
  // Whether the mesh has a dimension of that name.
  bool has(const std::string& name) const;
  // The size of a dimension (throws naming the dimension and the mesh's when unknown).
  int size(const std::string& name) const;
  // This rank's coordinate along a dimension (its rank in that dimension's group).
  int coordinate(const std::string& name) const;
  // This rank's coordinates, one per dimension.
  const std::vector<int>& coordinates() const { return coords_; }
  // The group of a dimension (one-process for size 1).
  const std::shared_ptr<distributed::Communicator>& comm(const std::string& name) const;
  // Collective over the world (every rank calls it with the same names, in the same
  // order): the group of the ranks that differ only in the named dimensions, ranked
  // row-major over them in the mesh's order. Made once per set of names and kept.
  std::shared_ptr<distributed::Communicator> flatten(const std::vector<std::string>& names);
  const std::shared_ptr<distributed::Communicator>& world() const { return world_; }
  // Global rank of the mesh point `coords` (one per dimension).
  int rank_of(const std::vector<int>& coords) const;
  // "(dp_shard=2, tp=2)".
  std::string describe() const;

 private:
  int index(const std::string& name) const;
  std::shared_ptr<distributed::Communicator> make_group(const std::vector<int>& dims_in_group) const;
  std::shared_ptr<distributed::Communicator> world_, single_;
  std::vector<MeshDim> dims_;
  std::vector<int> coords_;
  std::vector<std::shared_ptr<distributed::Communicator>> comms_;
  std::map<std::vector<int>, std::shared_ptr<distributed::Communicator>> flattened_;
};

}  // namespace tessera::parallel
