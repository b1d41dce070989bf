#include <numeric>
#include <utility>

#include <mgpu/core/error.hpp>
#include <mgpu/parallel/mesh.hpp>
#include <mgpu/sched/live.hpp>
#include <mgpu/sched/planning.hpp>

namespace mgpu::parallel {

namespace {

// An executor's handle on a communicator the mesh keeps: every call forwards to it.
class View final : public comm::Communicator {
 public:
  explicit View(std::shared_ptr<comm::Communicator> inner) : inner_(std::move(inner)) {}
  int size() const noexcept override { return inner_->size(); }
  comm::Backend backend() const noexcept override { return inner_->backend(); }
  std::chrono::milliseconds timeout() const noexcept override { return inner_->timeout(); }
  int first_rank() const noexcept override { return inner_->first_rank(); }
  void all_reduce(int rank, Tensor const& send, Tensor const& recv, ReduceOp op, Stream& stream) override {
    inner_->all_reduce(rank, send, recv, op, stream);
  }
  void reduce_scatter(int rank, Tensor const& send, Tensor const& recv, ReduceOp op, Stream& stream) override {
    inner_->reduce_scatter(rank, send, recv, op, stream);
  }
  void all_gather(int rank, Tensor const& send, Tensor const& recv, Stream& stream) override {
    inner_->all_gather(rank, send, recv, stream);
  }
  void broadcast(int rank, Tensor const& buffer, int root, Stream& stream) override {
    inner_->broadcast(rank, buffer, root, stream);
  }
  void reduce(int rank, Tensor const& send, Tensor const& recv, ReduceOp op, int root, Stream& stream) override {
    inner_->reduce(rank, send, recv, op, root, stream);
  }
  void send(int rank, Tensor const& send, int peer, Stream& stream) override { inner_->send(rank, send, peer, stream); }
  void recv(int rank, Tensor const& recv, int peer, Stream& stream) override { inner_->recv(rank, recv, peer, stream); }
  void barrier(int rank, Stream& stream) override { inner_->barrier(rank, stream); }
  void group_start(int rank) override { inner_->group_start(rank); }
  void group_end(int rank) override { inner_->group_end(rank); }
  void abort(std::string_view reason) noexcept override { inner_->abort(reason); }
  bool aborted() const noexcept override { return inner_->aborted(); }
  void finalize() override { inner_->finalize(); }

 private:
  std::shared_ptr<comm::Communicator> inner_;
};

// Each tensor-parallel group of `layout` on the best links of `group`'s link matrix: the devices
// in their new order, and the groups as text ("" when the order stays).
std::pair<std::vector<Device>, std::string> placed(DeviceGroup const& group, comm::DeviceMesh const& layout) {
  int const tp = layout.size("tp");
  std::vector<int> ranks(static_cast<std::size_t>(group.size()));
  std::iota(ranks.begin(), ranks.end(), 0);
  std::vector<int> const order = sched::tensor_parallel_order(sched::node_state(group), ranks, tp);
  std::vector<int> at(order.size());
  for (std::size_t i = 0; i < order.size(); ++i)
    at[static_cast<std::size_t>(layout.at("tp", static_cast<int>(i) / tp, static_cast<int>(i) % tp))] = order[i];
  if (at == ranks) return {};
  std::vector<Device> devices;
  for (int const r : at) devices.push_back(group.device(r));
  std::string text;
  for (std::size_t i = 0; i < order.size(); ++i)
    text += (i == 0 ? "" : i % static_cast<std::size_t>(tp) == 0 ? " | " : ", ") + group.device(order[i]).to_string();
  return {std::move(devices), std::move(text)};
}

}  // namespace

Mesh::Mesh(DeviceGroup group, comm::DeviceMesh layout, MeshOptions options)
    : group_(std::move(group)), layout_(std::move(layout)), options_(std::move(options)) {
  if (static_cast<bool>(options_.make_communicator) != static_cast<bool>(options_.make_subset_communicator))
    throw Error(Errc::invalid_argument,
                std::string("Mesh: make_communicator ") + (options_.make_communicator ? "set" : "empty") +
                    " and make_subset_communicator " + (options_.make_subset_communicator ? "set" : "empty") +
                    " (expected both, across processes, or neither)");
  if (!options_.make_communicator) {
    if (layout_.size() != group_.size())
      throw Error(Errc::invalid_argument, "Mesh: a mesh of " + std::to_string(layout_.size()) + " ranks (" +
                                              layout_.to_string() + ") over " + std::to_string(group_.size()) +
                                              " devices (expected the device count, " + std::to_string(group_.size()) +
                                              ")");
    if (options_.place_tensor_parallel && layout_.has("tp") && layout_.size("tp") > 1 &&
        layout_.size() > layout_.size("tp")) {
      auto [devices, text] = placed(group_, layout_);
      if (!devices.empty()) {
        group_ = DeviceGroup(std::move(devices));
        placement_ = std::move(text);
      }
    }
    return;
  }
  std::shared_ptr<comm::Communicator> const all = shared({});
  if (all->size() != layout_.size())
    throw Error(Errc::invalid_argument, "Mesh: a mesh of " + std::to_string(layout_.size()) + " ranks (" +
                                            layout_.to_string() + ") over a world of " + std::to_string(all->size()) +
                                            " devices (expected the world's device count, " +
                                            std::to_string(all->size()) + ")");
  first_ = all->first_rank();
  across_ = all->size() != group_.size();
}

Mesh::~Mesh() = default;

int Mesh::size_or_one(std::string_view dim) const { return layout_.has(dim) ? layout_.size(dim) : 1; }

std::shared_ptr<comm::Communicator> Mesh::shared(std::vector<int> const& ranks) {
  std::lock_guard const lock(mutex_);
  std::shared_ptr<comm::Communicator>& slot = made_[ranks];
  if (slot && !slot->aborted()) return slot;
  bool const all = ranks.empty();
  if (!all) {
    for (int const r : ranks)
      if (r < 0 || r >= layout_.size())
        throw Error(Errc::invalid_argument,
                    "Mesh: rank " + std::to_string(r) + " in a communicator's ranks (expected ranks in [0, " +
                        std::to_string(layout_.size()) + ") of the mesh " + layout_.to_string() + ")");
    if (across_ && !comm::drives_any(ranks, first_, group_.size()))
      throw Error(Errc::invalid_argument,
                  "Mesh: a communicator over ranks this process drives none of (expected a group with "
                  "one of its ranks [" +
                      std::to_string(first_) + ", " + std::to_string(first_ + group_.size()) + "))");
  }
  std::unique_ptr<comm::Communicator> made;
  if (options_.make_communicator)
    made = all ? options_.make_communicator(group_, options_.comm)
               : options_.make_subset_communicator(group_, ranks, options_.comm);
  else
    made = all ? comm::make_communicator(group_, options_.comm) : comm::make_communicator(group_, ranks, options_.comm);
  if (!made)
    throw Error(Errc::invalid_argument, "Mesh: a communicator factory returned no communicator (expected one)");
  slot = std::move(made);
  ++count_;
  return slot;
}

// Every group along `dims` that this process drives is made at the first ask, in groups() order:
// across processes the same order on every process, whichever rank asks first.
comm::Communicator& Mesh::communicator(int rank, std::span<std::string_view const> dims) {
  std::vector<int> const mine = layout_.group(rank, dims);
  for (std::vector<int> const& ranks : layout_.groups(dims))
    if (!across_ || comm::drives_any(ranks, first_, group_.size())) (void)shared(ranks);
  return *shared(mine);
}

comm::Communicator& Mesh::communicator(int rank, std::string_view dim) {
  std::string_view const dims[] = {dim};
  return communicator(rank, dims);
}

comm::Communicator& Mesh::whole() { return *shared({}); }

comm::Communicator& Mesh::over(std::vector<int> const& ranks) { return *subset(ranks); }

std::shared_ptr<comm::Communicator> Mesh::subset(std::vector<int> const& ranks) {
  if (ranks.empty()) throw Error(Errc::invalid_argument, "Mesh: a communicator over no rank (expected at least one)");
  return shared(ranks);
}

void Mesh::check_group(DeviceGroup const& group) const {
  if (&group != &group_)
    throw Error(Errc::invalid_argument,
                "Mesh: a communicator for another DeviceGroup than the mesh's (expected mesh->group())");
}

int Mesh::made() const {
  std::lock_guard const lock(mutex_);
  return count_;
}

CommunicatorFactory Mesh::factory(std::shared_ptr<Mesh> mesh) {
  return [mesh = std::move(mesh)](DeviceGroup& group, comm::Options) -> std::unique_ptr<comm::Communicator> {
    mesh->check_group(group);
    return std::make_unique<View>(mesh->shared({}));
  };
}

SubsetCommunicatorFactory Mesh::subset_factory(std::shared_ptr<Mesh> mesh) {
  return [mesh = std::move(mesh)](DeviceGroup& group, std::vector<int> const& ranks,
                                  comm::Options) -> std::unique_ptr<comm::Communicator> {
    mesh->check_group(group);
    return std::make_unique<View>(mesh->subset(ranks));
  };
}

void Mesh::check(DeviceGroup const& group, comm::DeviceMesh const& expected, std::string_view who) const {
  if (&group != &group_)
    throw Error(
        Errc::invalid_argument,
        std::string(who) + ": a mesh over another DeviceGroup (expected the executor's group to be mesh->group())");
  std::string const want = expected.to_string();
  for (comm::MeshDim const& d : layout_.dims())
    if (d.size > 1 && !expected.has(d.name))
      throw Error(Errc::invalid_argument, std::string(who) + ": the mesh " + layout_.to_string() + " has dimension \"" +
                                              d.name + "\" of size " + std::to_string(d.size) + " (expected " + want +
                                              ")");
  bool same = layout_.size() == expected.size();
  for (comm::MeshDim const& d : expected.dims()) same = same && size_or_one(d.name) == d.size;
  for (comm::MeshDim const& d : expected.dims())
    if (same && d.size > 1) same = layout_.groups(d.name) == expected.groups(d.name);
  if (!same)
    throw Error(Errc::invalid_argument, std::string(who) + ": the mesh " + layout_.to_string() + " (expected " + want +
                                            ", its dimensions in that order)");
}

}  // namespace mgpu::parallel
