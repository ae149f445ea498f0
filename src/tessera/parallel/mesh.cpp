#include "tessera/parallel/mesh.h"

#include <set>
#include <sstream>

#include "tessera/core/error.h"

namespace tessera::parallel {

namespace {

std::string sizes_text(const std::vector<MeshDim>& dims) {
  std::ostringstream s;
  s << "(";
  for (size_t i = 0; i < dims.size(); ++i) s << (i ? ", " : "") << dims[i].name << "=" << dims[i].size;
  s << ")";
  return s.str();
}

}  // namespace

DeviceMesh::DeviceMesh(std::shared_ptr<distributed::Communicator> world, std::vector<MeshDim> dims)
    : world_(std::move(world)), dims_(std::move(dims)) {
  single_ = distributed::Communicator::create(distributed::World{});
  if (!world_) world_ = single_;
  TESSERA_CHECK(!dims_.empty(), "DeviceMesh: no dimensions (give at least one, e.g. {\"dp\", ", world_->size(), "})");
  std::set<std::string> seen;
  int64_t product = 1;
  for (const auto& d : dims_) {
    TESSERA_CHECK(!d.name.empty(), "DeviceMesh ", sizes_text(dims_), ": a dimension has no name");
    TESSERA_CHECK(seen.insert(d.name).second, "DeviceMesh ", sizes_text(dims_), ": dimension '", d.name,
                  "' appears twice");
    TESSERA_CHECK(d.size >= 1, "DeviceMesh ", sizes_text(dims_), ": dimension '", d.name, "' has size ", d.size,
                  " (must be at least 1)");
    product *= d.size;
    TESSERA_CHECK(product <= world_->size(), "DeviceMesh ", sizes_text(dims_), ": the sizes multiply to more than the ",
                  world_->size(), " ranks of the world");
  }
  TESSERA_CHECK(product == world_->size(), "DeviceMesh ", sizes_text(dims_), ": the sizes multiply to ", product,
                " but the world has ", world_->size(), " ranks");
  int rest = world_->rank();
  coords_.assign(dims_.size(), 0);
  for (int i = ndim() - 1; i >= 0; --i) {
    coords_[i] = rest % dims_[i].size;
    rest /= dims_[i].size;
  }
  for (int i = 0; i < ndim(); ++i) comms_.push_back(make_group({i}));
}

int DeviceMesh::index(const std::string& name) const {
  for (int i = 0; i < ndim(); ++i)
    if (dims_[i].name == name) return i;
  throw Error(concat("DeviceMesh ", sizes_text(dims_), ": no dimension '", name, "'"));
}

bool DeviceMesh::has(const std::string& name) const {
  for (const auto& d : dims_)
    if (d.name == name) return true;
  return false;
}

int DeviceMesh::size(const std::string& name) const { return dims_[index(name)].size; }
int DeviceMesh::coordinate(const std::string& name) const { return coords_[index(name)]; }
const std::shared_ptr<distributed::Communicator>& DeviceMesh::comm(const std::string& name) const {
  return comms_[index(name)];
}

int DeviceMesh::rank_of(const std::vector<int>& coords) const {
  TESSERA_CHECK(coords.size() == dims_.size(), "DeviceMesh ", sizes_text(dims_), ": ", coords.size(),
                " coordinates for ", dims_.size(), " dimensions");
  int r = 0;
  for (int i = 0; i < ndim(); ++i) {
    TESSERA_CHECK(coords[i] >= 0 && coords[i] < dims_[i].size, "DeviceMesh ", sizes_text(dims_), ": coordinate ",
                  coords[i], " outside dimension '", dims_[i].name, "'");
    r = r * dims_[i].size + coords[i];
  }
  return r;
}

std::shared_ptr<distributed::Communicator> DeviceMesh::make_group(const std::vector<int>& in_group) const {
  int group_size = 1;
  for (int i : in_group) group_size *= dims_[i].size;
  if (group_size == 1) return single_;
  if (group_size == world_->size()) return world_;
  // One group per assignment of the other coordinates; members row-major over the group's.
  std::vector<bool> inside(dims_.size(), false);
  for (int i : in_group) inside[i] = true;
  std::map<std::vector<int>, std::vector<int>> groups;  // other coordinates -> members
  for (int r = 0; r < world_->size(); ++r) {
    std::vector<int> c(dims_.size());
    int rest = r;
    for (int i = ndim() - 1; i >= 0; --i) {
      c[i] = rest % dims_[i].size;
      rest /= dims_[i].size;
    }
    std::vector<int> key;
    for (int i = 0; i < ndim(); ++i)
      if (!inside[i]) key.push_back(c[i]);
    groups[key].push_back(r);  // r ascends, and so does the row-major order over the group's dims
  }
  std::vector<std::vector<int>> partition;
  for (auto& [key, members] : groups) partition.push_back(std::move(members));
  return world_->split(partition);
}

std::shared_ptr<distributed::Communicator> DeviceMesh::flatten(const std::vector<std::string>& names) {
  std::vector<int> idx;
  for (const auto& n : names) idx.push_back(index(n));
  std::set<int> unique(idx.begin(), idx.end());
  TESSERA_CHECK(unique.size() == idx.size(), "DeviceMesh ", sizes_text(dims_), "::flatten: a dimension is named twice");
  std::vector<int> ordered(unique.begin(), unique.end());  // the mesh's order
  if (ordered.size() == 1) return comms_[ordered[0]];
  auto it = flattened_.find(ordered);
  if (it != flattened_.end()) return it->second;
  auto group = make_group(ordered);
  flattened_[ordered] = group;
  return group;
}

std::string DeviceMesh::describe() const { return sizes_text(dims_); }

}  // namespace tessera::parallel
