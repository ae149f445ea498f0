// ShardedTensor. Data movement (gather, full_tensor, reshard, copy_from, scatter) packs
// the pieces that cross ranks into one byte buffer per rank and moves them with ONE
// collective of the Communicator:
//  - full_tensor: all_gather of every rank's non-empty shards (everyone needs all);
//  - gather(dst): all_to_all in which only `dst` receives: the other ranks send their
//    shards and receive nothing, so no rank but dst ever holds the full tensor;
//  - reshard / copy_from: pieces whose source and destination rank are the same are
//    copied locally; every overlap that changes rank is packed by its sender, grouped
//    by destination, and one all_to_all (sizes known from the global metadata, so no
//    size exchange) delivers to each rank exactly the bytes it needs. No collective
//    at all when nothing changes rank;
//  - scatter: one small broadcast (shape, dtype) plus one broadcast of the tensor.
// Bytes are copied, never converted, so every path is bit-exact for every dtype.
#include "tessera/sharding/sharded_tensor.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <nlohmann/json.hpp>

#include <numeric>

#include "tessera/core/error.h"
#include "tessera/core/strings.h"

namespace tessera::sharding {

namespace {

using Json = nlohmann::json;


void check_placements(const std::vector<ShardMetadata>& all, const distributed::Communicator& comm) {
  for (size_t i = 0; i < all.size(); ++i)
    TESSERA_CHECK(all[i].placement.rank < comm.size(), "shard ", i, " ", all[i].box.to_string(), " is placed on ",
                  all[i].placement.to_string(), " but the communicator has ", comm.size(), " ranks");
}

// Position of each global shard among its owner's local shards.
std::vector<int> local_positions(const std::vector<ShardMetadata>& all) {
  std::map<int, int> next;
  std::vector<int> pos(all.size());
  for (size_t i = 0; i < all.size(); ++i) pos[i] = next[all[i].placement.rank]++;
  return pos;
}

// CPU unless every placement involved is on a CUDA device (then the local one).
c10::Device buffer_device(std::initializer_list<const std::vector<ShardMetadata>*> lists, int rank) {
  c10::Device dev = c10::kCPU;
  bool all_cuda = true, any = false;
  for (auto* l : lists)
    for (auto& s : *l) {
      any = true;
      if (!s.placement.device.is_cuda()) all_cuda = false;
      if (s.placement.rank == rank && s.placement.device.is_cuda()) dev = s.placement.device;
    }
  return (any && all_cuda && dev.is_cuda()) ? dev : c10::Device(c10::kCPU);
}

// A typed, contiguous view of `bytes` starting at byte `offset`.
at::Tensor typed_view(const at::Tensor& bytes, int64_t offset, const std::vector<int64_t>& sizes, at::ScalarType dt) {
  return at::from_blob(static_cast<uint8_t*>(bytes.data_ptr()) + offset, sizes, bytes.options().dtype(dt));
}

std::vector<Shard> allocate_local(const std::vector<ShardMetadata>& all, int rank, const at::TensorOptions& options,
                                  const std::function<at::Tensor(const at::Tensor&)>& fill) {
  std::vector<Shard> local;
  for (const auto& m : all) {
    if (m.placement.rank != rank) continue;
    at::Tensor t = at::empty(m.box.sizes, options.device(m.placement.device));
    local.push_back(Shard{fill ? fill(t) : t, m});
  }
  return local;
}

// Moves the overlaps of (src_all, src_local) into (dst_all, dst_local); see the file comment.
void exchange(const std::vector<ShardMetadata>& src_all, const std::vector<Shard>& src_local,
              const std::vector<ShardMetadata>& dst_all, std::vector<Shard>& dst_local, at::ScalarType dt,
              distributed::Communicator& comm) {
  const int me = comm.rank(), n = comm.size();
  const int64_t es = static_cast<int64_t>(c10::elementSize(dt));
  auto spos = local_positions(src_all), dpos = local_positions(dst_all);
  struct Piece {
    size_t i, j;
    Box box;
  };
  std::vector<Piece> pieces;
  for (size_t i = 0; i < src_all.size(); ++i) {
    if (src_all[i].box.empty()) continue;
    const int a = src_all[i].placement.rank;
    for (size_t j = 0; j < dst_all.size(); ++j) {
      if (dst_all[j].box.empty()) continue;
      auto ov = intersect(src_all[i].box, dst_all[j].box);
      if (!ov) continue;
      const int b = dst_all[j].placement.rank;
      if (a == b) {
        if (a == me) {
          at::Tensor& d = dst_local[dpos[j]].tensor;
          copy_overlap(d, dst_all[j].box, src_local[spos[i]].tensor, src_all[i].box);
        }
        continue;
      }
      pieces.push_back(Piece{i, j, *ov});
    }
  }
  if (pieces.empty()) return;
  // Offsets within the sender's buffer follow (destination rank, piece order); the
  // receiver walks (source rank, piece order): the same pieces in the same order.
  std::vector<int64_t> send_sizes(n, 0), recv_sizes(n, 0);
  for (auto& p : pieces) {
    const int a = src_all[p.i].placement.rank, b = dst_all[p.j].placement.rank;
    const int64_t bytes = p.box.numel() * es;
    if (a == me) send_sizes[b] += bytes;
    if (b == me) recv_sizes[a] += bytes;
  }
  const c10::Device dev = buffer_device({&src_all, &dst_all}, me);
  const auto byte_opts = at::TensorOptions().dtype(at::kByte).device(dev);
  at::Tensor out_buf = at::empty({std::accumulate(send_sizes.begin(), send_sizes.end(), int64_t{0})}, byte_opts);
  std::vector<int64_t> cursor(n, 0);
  for (int b = 1; b < n; ++b) cursor[b] = cursor[b - 1] + send_sizes[b - 1];
  for (const auto& p : pieces) {
    if (src_all[p.i].placement.rank != me) continue;
    int64_t& c = cursor[dst_all[p.j].placement.rank];
    typed_view(out_buf, c, p.box.sizes, dt).copy_(narrow_to(src_local[spos[p.i]].tensor, src_all[p.i].box, p.box));
    c += p.box.numel() * es;
  }
  at::Tensor in_buf = comm.all_to_all(out_buf, send_sizes, recv_sizes);
  std::vector<int64_t> start(n, 0);
  for (int a = 1; a < n; ++a) start[a] = start[a - 1] + recv_sizes[a - 1];
  for (const auto& p : pieces) {
    if (dst_all[p.j].placement.rank != me) continue;
    int64_t& c = start[src_all[p.i].placement.rank];
    narrow_to(dst_local[dpos[p.j]].tensor, dst_all[p.j].box, p.box).copy_(typed_view(in_buf, c, p.box.sizes, dt));
    c += p.box.numel() * es;
  }
}

}  // namespace

// ----------------------------------------------------------------- construction
ShardedTensor ShardedTensor::empty(const ShardingSpec& spec, const std::vector<int64_t>& shape,
                                   const at::TensorOptions& options, std::shared_ptr<distributed::Communicator> comm) {
  TESSERA_CHECK(comm != nullptr, "ShardedTensor needs a communicator");
  auto all = build_shards(spec, shape);
  check_placements(all, *comm);
  auto local = allocate_local(all, comm->rank(), options, nullptr);
  return from_parts(std::move(local), std::move(all), shape, c10::typeMetaToScalarType(options.dtype()),
                    std::move(comm));
}

ShardedTensor ShardedTensor::zeros(const ShardingSpec& spec, const std::vector<int64_t>& shape,
                                   const at::TensorOptions& options, std::shared_ptr<distributed::Communicator> comm) {
  return empty(spec, shape, options, std::move(comm)).apply_([](at::Tensor& t) { t.zero_(); });
}

ShardedTensor ShardedTensor::ones(const ShardingSpec& spec, const std::vector<int64_t>& shape,
                                  const at::TensorOptions& options, std::shared_ptr<distributed::Communicator> comm) {
  return empty(spec, shape, options, std::move(comm)).apply_([](at::Tensor& t) { t.fill_(1); });
}

// Draws the whole tensor on the CPU with a generator seeded by `seed` and keeps the
// local boxes: identical values for every sharding, at the cost of generating (not
// storing) the full tensor on every rank.
ShardedTensor ShardedTensor::rand(const ShardingSpec& spec, const std::vector<int64_t>& shape, uint64_t seed,
                                  const at::TensorOptions& options, std::shared_ptr<distributed::Communicator> comm) {
  ShardedTensor st = empty(spec, shape, options, std::move(comm));
  if (st.local_numel() == 0) return st;
  at::Generator gen = at::detail::createCPUGenerator(seed);
  at::Tensor full = at::rand(shape, gen, options.device(c10::kCPU));
  const Box whole = full_box(shape);
  for (auto& s : st.local_) copy_overlap(s.tensor, s.meta.box, full, whole);
  return st;
}

ShardedTensor ShardedTensor::from_parts(std::vector<Shard> local, std::vector<ShardMetadata> all_shards,
                                        const std::vector<int64_t>& shape, at::ScalarType dtype,
                                        std::shared_ptr<distributed::Communicator> comm,
                                        std::optional<Layout> layout) {
  TESSERA_CHECK(comm != nullptr, "ShardedTensor needs a communicator");
  validate_shards(all_shards, shape);
  if (layout) {
    TESSERA_CHECK(layout->rule != Layout::Rule::List && layout->count() == static_cast<int64_t>(all_shards.size()),
                  "ShardedTensor: a ", layout->rule_name(), " layout of ", layout->count(), " pieces given for ",
                  all_shards.size(), " shards");
    for (size_t i = 0; i < all_shards.size(); ++i)
      TESSERA_CHECK(all_shards[i].placement.rank == static_cast<int>(i) &&
                        all_shards[i].box == layout->box(shape, static_cast<int64_t>(i)),
                    "ShardedTensor: shard ", i, " ", all_shards[i].box.to_string(), " on rank ",
                    all_shards[i].placement.rank, " is not piece ", i, " of its ", layout->rule_name(), " layout");
  }
  check_placements(all_shards, *comm);
  size_t k = 0;
  for (size_t i = 0; i < all_shards.size(); ++i) {
    if (all_shards[i].placement.rank != comm->rank()) continue;
    TESSERA_CHECK(k < local.size(), "rank ", comm->rank(), " lacks the data of shard ", i, " ",
                  all_shards[i].box.to_string());
    const Shard& s = local[k++];
    TESSERA_CHECK(s.meta == all_shards[i], "rank ", comm->rank(), " local shard ", k - 1, " ", s.meta.box.to_string(),
                  " does not match shard ", i, " ", all_shards[i].box.to_string(), " of the metadata");
    TESSERA_CHECK(s.tensor.defined() && s.tensor.sizes().vec() == s.meta.box.sizes, "rank ", comm->rank(),
                  " shard ", i, " ", s.meta.box.to_string(), " holds a tensor of shape ",
                  s.tensor.defined() ? core::shape_string(s.tensor.sizes().vec()) : std::string("(undefined)"));
    TESSERA_CHECK(s.tensor.scalar_type() == dtype, "rank ", comm->rank(), " shard ", i, " ",
                  s.meta.box.to_string(), " has dtype ", s.tensor.scalar_type(), ", expected ", dtype);
  }
  TESSERA_CHECK(k == local.size(), "rank ", comm->rank(), " passes ", local.size(),
                " local shards but the metadata places ", k, " on it");
  ShardedTensor st;
  st.shape_ = shape;
  st.dtype_ = dtype;
  st.all_ = std::make_shared<ShardList>();
  st.all_->list = std::move(all_shards);
  std::call_once(st.all_->built, [] {});  // a list: nothing to build
  st.all_->listed = true;
  st.local_ = std::move(local);
  st.comm_ = std::move(comm);
  st.layout_ = std::move(layout);
  return st;
}

ShardedTensor ShardedTensor::from_rule(Shard local, Layout layout, const std::vector<int64_t>& shape,
                                        at::ScalarType dtype, std::shared_ptr<distributed::Communicator> comm) {
  std::vector<Shard> one;
  one.push_back(std::move(local));
  return from_rule(std::move(one), std::move(layout), shape, dtype, std::move(comm));
}

ShardedTensor ShardedTensor::from_rule(std::vector<Shard> local, Layout layout, const std::vector<int64_t>& shape,
                                        at::ScalarType dtype, std::shared_ptr<distributed::Communicator> comm) {
  TESSERA_CHECK(comm != nullptr, "ShardedTensor needs a communicator");
  TESSERA_CHECK(layout.rule == Layout::Rule::Chunk || layout.rule == Layout::Rule::Flat || layout.rule == Layout::Rule::Tp,
                "ShardedTensor::from_rule: a ", layout.rule_name(), " layout is not a rule of pieces per rank");
  TESSERA_CHECK(layout.holders() == comm->size(), "ShardedTensor::from_rule: a ", layout.rule_name(), " layout of ",
                layout.holders(), " holders for a communicator of ", comm->size(), " ranks");
  layout.validate(shape, comm->size(), "ShardedTensor::from_rule");
  const int me = comm->rank();
  const int64_t per = layout.pieces_per_holder();
  TESSERA_CHECK(static_cast<int64_t>(local.size()) == per, "ShardedTensor::from_rule: rank ", me, " passes ",
                local.size(), " shards for the ", per, " pieces of the ", layout.rule_name(), " layout it holds");
  for (int64_t s = 0; s < per; ++s) {
    const Shard& sh = local[static_cast<size_t>(s)];
    const Box mine = layout.box(shape, me * per + s);
    TESSERA_CHECK(sh.meta.box == mine && sh.meta.placement.rank == me, "ShardedTensor::from_rule: rank ", me,
                  " passes shard ", sh.meta.box.to_string(), " on rank ", sh.meta.placement.rank, ", not its piece ",
                  mine.to_string(), " of the ", layout.rule_name(), " layout");
    TESSERA_CHECK(sh.tensor.defined() && sh.tensor.sizes().vec() == mine.sizes && sh.tensor.scalar_type() == dtype,
                  "ShardedTensor::from_rule: rank ", me, " shard ", mine.to_string(), " holds ",
                  sh.tensor.defined() ? concat(core::shape_string(sh.tensor.sizes().vec()), " ", sh.tensor.scalar_type())
                                      : std::string("no tensor"),
                  ", expected its box's shape and dtype ", dtype);
  }
  ShardedTensor st;
  st.shape_ = shape;
  st.dtype_ = dtype;
  st.all_ = std::make_shared<ShardList>();
  st.all_->rule = layout;
  st.all_->device = local.front().meta.placement.device;
  st.local_ = std::move(local);
  st.comm_ = std::move(comm);
  st.layout_ = std::move(layout);
  return st;
}

ShardedTensor ShardedTensor::from_local_shards(std::vector<Shard> local, const std::vector<int64_t>& shape,
                                               std::shared_ptr<distributed::Communicator> comm) {
  TESSERA_CHECK(comm != nullptr, "ShardedTensor needs a communicator");
  const int me = comm->rank();
  // Local problems travel with the metadata so that every rank raises, none hangs.
  std::string err;
  std::optional<at::ScalarType> dt;
  Json shards = Json::array();
  for (size_t k = 0; k < local.size() && err.empty(); ++k) {
    const Shard& s = local[k];
    const std::string name = concat("local shard ", k, " ", s.meta.box.to_string());
    if (!s.tensor.defined()) {
      err = name + " has no data";
    } else if (s.meta.placement.rank != me) {
      err = concat(name, " is placed on ", s.meta.placement.to_string(), " but was passed by rank ", me);
    } else if (s.tensor.sizes().vec() != s.meta.box.sizes) {
      err = concat(name, " holds a tensor of shape ", core::shape_string(s.tensor.sizes().vec()));
    } else if (dt && *dt != s.tensor.scalar_type()) {
      err = concat(name, " has dtype ", s.tensor.scalar_type(), " but an earlier one has ", *dt);
    }
    if (s.tensor.defined()) dt = s.tensor.scalar_type();
    shards.push_back({{"o", s.meta.box.offsets}, {"s", s.meta.box.sizes}, {"d", s.meta.placement.device.str()}});
  }
  Json mine = {{"err", err}, {"shape", shape}, {"dtype", dt ? static_cast<int>(*dt) : -1}, {"shards", shards}};
  auto gathered = comm->all_gather_bytes(mine.dump());
  std::vector<ShardMetadata> all;
  std::optional<at::ScalarType> dtype;
  std::string errors;
  for (int r = 0; r < comm->size(); ++r) {
    Json j = Json::parse(gathered[r]);
    if (!j["err"].get<std::string>().empty()) errors += concat("; rank ", r, ": ", j["err"].get<std::string>());
    auto rs = j["shape"].get<std::vector<int64_t>>();
    if (rs != shape) errors += concat("; rank ", r, " passes global shape ", core::shape_string(rs), " but rank ", me,
                                      " passes ", core::shape_string(shape));
    int d = j["dtype"].get<int>();
    if (d >= 0) {
      auto sd = static_cast<at::ScalarType>(d);
      if (dtype && *dtype != sd) errors += concat("; rank ", r, " holds dtype ", sd, " but an earlier rank ", *dtype);
      if (!dtype) dtype = sd;
    }
    for (auto& s : j["shards"]) {
      all.push_back(ShardMetadata{Box{s["o"].get<std::vector<int64_t>>(), s["s"].get<std::vector<int64_t>>()},
                                  Placement{r, c10::Device(s["d"].get<std::string>())}});
    }
  }
  TESSERA_CHECK(errors.empty(), "from_local_shards: inconsistent shards", errors);
  try {
    validate_shards(all, shape);
  } catch (const Error& e) {
    throw Error(concat("from_local_shards: the shards of all ranks do not tile the tensor: ", e.what()));
  }
  return from_parts(std::move(local), std::move(all), shape, dtype.value_or(at::kFloat), std::move(comm));
}

ShardedTensor ShardedTensor::scatter(const at::Tensor& full, const ShardingSpec& spec, int src,
                                     std::shared_ptr<distributed::Communicator> comm) {
  TESSERA_CHECK(comm != nullptr, "ShardedTensor needs a communicator");
  TESSERA_CHECK(src >= 0 && src < comm->size(), "scatter: source rank ", src, " is outside the group of ",
                comm->size());
  Json head;
  if (comm->rank() == src) {
    head = full.defined() ? Json{{"shape", full.sizes().vec()}, {"dtype", static_cast<int>(full.scalar_type())}}
                          : Json{{"err", "the source tensor is undefined"}};
  }
  head = Json::parse(comm->broadcast_bytes(head.dump(), src));
  TESSERA_CHECK(!head.contains("err"), "scatter from rank ", src, ": ", head.value("err", ""));
  const auto shape = head["shape"].get<std::vector<int64_t>>();
  const auto dt = static_cast<at::ScalarType>(head["dtype"].get<int>());
  ShardedTensor st = empty(spec, shape, at::TensorOptions().dtype(dt), comm);
  const c10::Device dev = buffer_device({&st.shards_metadata()}, comm->rank());
  at::Tensor data = comm->rank() == src ? full.to(dev).contiguous() : at::empty(shape, at::TensorOptions().dtype(dt).device(dev));
  if (comm->size() > 1 && data.numel() > 0) comm->broadcast(data, src);
  const Box whole = full_box(shape);
  for (auto& s : st.local_) copy_overlap(s.tensor, s.meta.box, data, whole);
  return st;
}

// ----------------------------------------------------------------- accessors
int64_t ShardedTensor::numel() const {
  return std::accumulate(shape_.begin(), shape_.end(), int64_t{1}, std::multiplies<int64_t>());
}

const at::Tensor& ShardedTensor::local_tensor() const {
  TESSERA_CHECK(local_.size() == 1, "local_tensor(): rank ", comm_ ? comm_->rank() : -1, " holds ", local_.size(),
                " shards of the sharded tensor of shape ", core::shape_string(shape_), ", not exactly one");
  return local_[0].tensor;
}

int64_t ShardedTensor::local_numel() const {
  int64_t n = 0;
  for (auto& s : local_) n += s.meta.box.numel();
  return n;
}

const std::vector<ShardMetadata>& ShardedTensor::shards_metadata() const {
  static const std::vector<ShardMetadata> kNone;
  if (!all_) return kNone;
  ShardList& a = *all_;
  std::call_once(a.built, [&] {
    const int64_t n = a.rule->count();
    a.list.reserve(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i)
      a.list.push_back(ShardMetadata{a.rule->box(shape_, i),
                                     Placement{static_cast<int>(i / a.rule->pieces_per_holder()), a.device}});
    a.listed = true;
  });
  return a.list;
}

bool ShardedTensor::metadata_is_rule_only() const {
  return all_ && all_->rule && !all_->listed;
}

bool ShardedTensor::same_shards(const ShardedTensor& other) const {
  if (shape_ != other.shape_) return false;
  if (all_ == other.all_) return true;
  if (all_ && other.all_ && all_->rule && other.all_->rule)
    return *all_->rule == *other.all_->rule && all_->device == other.all_->device;
  return shards_metadata() == other.shards_metadata();
}

bool ShardedTensor::same_layout(const ShardedTensor& other) const {
  return dtype_ == other.dtype_ && same_shards(other);
}

ShardedTensor ShardedTensor::with_local(std::vector<Shard> local, at::ScalarType dtype) const {
  TESSERA_CHECK(defined(), "with_local on an undefined ShardedTensor");
  TESSERA_CHECK(local.size() == local_.size(), "with_local: ", local.size(), " local shards for a tensor whose rank ",
                comm_->rank(), " holds ", local_.size());
  for (size_t k = 0; k < local.size(); ++k) {
    TESSERA_CHECK(local[k].meta == local_[k].meta, "with_local: local shard ", k, " ", local[k].meta.box.to_string(),
                  " is not this tensor's ", local_[k].meta.box.to_string());
    TESSERA_CHECK(local[k].tensor.defined() && local[k].tensor.sizes().vec() == local[k].meta.box.sizes &&
                      local[k].tensor.scalar_type() == dtype,
                  "with_local: local shard ", k, " ", local[k].meta.box.to_string(), " holds ",
                  local[k].tensor.defined() ? concat(core::shape_string(local[k].tensor.sizes().vec()), " ",
                                                     local[k].tensor.scalar_type())
                                            : std::string("no tensor"),
                  ", expected its box's shape and dtype ", dtype);
  }
  ShardedTensor st = *this;
  st.dtype_ = dtype;
  st.local_ = std::move(local);
  return st;
}

std::string ShardedTensor::describe() const {
  std::string s = concat("ShardedTensor(shape=", core::shape_string(shape_), ", dtype=", dtype_, ", shards=[");
  if (metadata_is_rule_only())
    return s + concat(all_->rule->rule_name(), " rule of ", all_->rule->count(), " pieces on ", all_->device.str(), "])");
  const auto& all = shards_metadata();
  const size_t shown = std::min<size_t>(all.size(), 16);
  for (size_t i = 0; i < shown; ++i)
    s += concat(i ? ", " : "", all[i].box.to_string(), "@", all[i].placement.to_string());
  if (all.size() > shown) s += concat(", ... (", all.size(), " shards)");
  return s + "])";
}

// ----------------------------------------------------------------- collectives
at::Tensor ShardedTensor::gather(int dst) const {
  TESSERA_CHECK(dst >= 0 && comm_ && dst < comm_->size(), "gather: destination rank ", dst, " is outside the group of ",
                comm_ ? comm_->size() : 0);
  return gather_impl(false, dst, full_box(shape_));
}

at::Tensor ShardedTensor::full_tensor() const { return gather_impl(true, 0, full_box(shape_)); }

at::Tensor ShardedTensor::gather_region(const Box& region, int dst) const {
  TESSERA_CHECK(defined(), "gather_region on an undefined ShardedTensor");
  TESSERA_CHECK(dst >= 0 && dst < comm_->size(), "gather_region: destination rank ", dst,
                " is outside the group of ", comm_->size());
  TESSERA_CHECK(region.dim() == shape_.size() && region.offsets.size() == shape_.size() &&
                    contains(full_box(shape_), region),
                "gather_region: region ", region.to_string(), " is not inside the global shape ", core::shape_string(shape_));
  return gather_impl(false, dst, region);
}

at::Tensor ShardedTensor::gather_impl(bool everywhere, int dst, const Box& region) const {
  TESSERA_CHECK(defined(), "gather on an undefined ShardedTensor");
  TESSERA_CHECK(dst >= 0 && dst < comm_->size(), "gather: destination rank ", dst, " is outside the group of ",
                comm_->size());
  const int me = comm_->rank(), n = comm_->size();
  const std::vector<ShardMetadata>& shards = shards_metadata();
  const c10::Device dev = buffer_device({&shards}, me);
  auto opts = at::TensorOptions().dtype(dtype_).device(dev);
  const int64_t es = static_cast<int64_t>(c10::elementSize(dtype_));
  // Every shard's overlap with the region, in shard order (known to every rank).
  std::vector<std::optional<Box>> part(shards.size());
  std::vector<int64_t> send(n, 0);
  for (size_t i = 0; i < shards.size(); ++i) {
    if (shards[i].box.empty()) continue;
    part[i] = intersect(shards[i].box, region);
    if (part[i]) send[shards[i].placement.rank] += part[i]->numel() * es;
  }
  const int64_t total = std::accumulate(send.begin(), send.end(), int64_t{0});
  if (total == 0 || n == 1) {
    if (!everywhere && me != dst) return at::Tensor();
    at::Tensor out = at::empty(region.sizes, opts);
    for (auto& s : local_) copy_overlap(out, region, s.tensor, s.meta.box);
    return out;
  }
  // A run of whole rows of one contiguous tensor is already laid out as the bytes to send
  // (and to receive), so it moves without packing or unpacking.
  auto whole_rows = [](const Box& sub, const Box& of) {
    return std::equal(sub.sizes.begin() + 1, sub.sizes.end(), of.sizes.begin() + 1);
  };
  // This rank's overlaps, packed in shard order (local_ follows that order per rank).
  std::vector<std::pair<const Shard*, Box>> overlaps;
  for (auto& s : local_) {
    if (s.meta.box.empty()) continue;
    if (std::optional<Box> p = intersect(s.meta.box, region)) overlaps.emplace_back(&s, *p);
  }
  at::Tensor mine;
  if (overlaps.size() == 1 && overlaps[0].first->tensor.is_contiguous() &&
      whole_rows(overlaps[0].second, overlaps[0].first->meta.box)) {
    const Shard& sh = *overlaps[0].first;
    mine = narrow_to(sh.tensor, sh.meta.box, overlaps[0].second).reshape({-1}).view(at::kByte);
  } else {
    mine = at::empty({send[me]}, at::TensorOptions().dtype(at::kByte).device(dev));
    int64_t off = 0;
    for (auto& [sh, p] : overlaps) {
      typed_view(mine, off, p.sizes, dtype_).copy_(narrow_to(sh->tensor, sh->meta.box, p));
      off += p.numel() * es;
    }
  }
  at::Tensor all;
  if (everywhere) {
    all = comm_->all_gather(mine, send);
  } else {
    // Only dst receives; every other rank sends its overlaps to dst and gets nothing.
    std::vector<int64_t> to(n, 0), from(n, 0);
    to[dst] = send[me];
    if (me == dst) from = send;
    all = comm_->all_to_all(mine, to, from);
    if (me != dst) return at::Tensor();
  }
  std::vector<int64_t> cursor(n, 0);
  for (int r = 1; r < n; ++r) cursor[r] = cursor[r - 1] + send[r - 1];
  // One shard covers the whole region: the received bytes are the result.
  for (size_t i = 0; i < shards.size(); ++i)
    if (part[i] && *part[i] == region) {
      auto* p = static_cast<uint8_t*>(all.data_ptr()) + cursor[shards[i].placement.rank];
      return at::from_blob(p, region.sizes, [keep = all](void*) {}, all.options().dtype(dtype_));  // keeps `all` alive
    }
  at::Tensor out = at::empty(region.sizes, opts);
  for (size_t i = 0; i < shards.size(); ++i) {
    if (!part[i]) continue;
    int64_t& c = cursor[shards[i].placement.rank];
    narrow_to(out, region, *part[i]).copy_(typed_view(all, c, part[i]->sizes, dtype_));
    c += part[i]->numel() * es;
  }
  return out;
}

ShardedTensor ShardedTensor::reshard(const ShardingSpec& spec) const {
  TESSERA_CHECK(defined(), "reshard of an undefined ShardedTensor");
  at::TensorOptions opts = at::TensorOptions().dtype(dtype_);
  ShardedTensor out = empty(spec, shape_, opts, comm_);
  out.copy_from(*this);
  return out;
}

void ShardedTensor::copy_from(const ShardedTensor& other) {
  TESSERA_CHECK(defined() && other.defined(), "copy_from with an undefined ShardedTensor");
  TESSERA_CHECK(shape_ == other.shape_, "copy_from: global shape ", core::shape_string(other.shape_), " into ",
                core::shape_string(shape_));
  TESSERA_CHECK(dtype_ == other.dtype_, "copy_from: dtype ", other.dtype_, " into ", dtype_);
  TESSERA_CHECK(comm_->size() == other.comm_->size() && comm_->members() == other.comm_->members(),
                "copy_from: the sharded tensors live on different communicators");
  exchange(other.shards_metadata(), other.local_, shards_metadata(), local_, dtype_, *comm_);
}

// ----------------------------------------------------------------- local helpers
ShardedTensor& ShardedTensor::apply_(const std::function<void(at::Tensor&)>& fn) {
  for (auto& s : local_) {
    fn(s.tensor);
    TESSERA_CHECK(s.tensor.defined() && s.tensor.sizes().vec() == s.meta.box.sizes && s.tensor.scalar_type() == dtype_,
                  "apply_ changed the shape or dtype of shard ", s.meta.box.to_string());
  }
  return *this;
}

ShardedTensor ShardedTensor::clone() const {
  ShardedTensor st = *this;
  for (auto& s : st.local_) s.tensor = s.tensor.clone();
  return st;
}

ShardedTensor ShardedTensor::to(at::ScalarType dtype) const {
  ShardedTensor st = *this;
  st.dtype_ = dtype;
  for (auto& s : st.local_) s.tensor = s.tensor.to(dtype);
  return st;
}

}  // namespace tessera::sharding
