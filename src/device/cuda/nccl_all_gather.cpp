// NCCL's all-gather behind spillway::AllGather (Note [Device groups], spillway/device/device.hpp):
// one communicator per CUDA device of this process (ncclCommInitAll), each call an
// in-place ncclAllGather on the rank's stream. Compiled with the CUDA backend when NCCL is
// found; it runs only where GPUs are.
#include <cuda_runtime.h>
#include <fmt/format.h>
#include <nccl.h>

#include <memory>
#include <string>
#include <vector>

#include "spillway/core/error.hpp"
#include "spillway/device/device.hpp"

namespace spillway {
namespace {

void nccl_check(ncclResult_t r, const char* call) {
  if (r != ncclSuccess) throw Error(fmt::format("{}: {}", call, ncclGetErrorString(r)));
}

class NcclAllGather final : public AllGather {
 public:
  NcclAllGather(ncclComm_t comm, Device* dev, int rank, int ranks)
      : comm_(comm), dev_(dev), rank_(rank), ranks_(ranks) {}
  ~NcclAllGather() override { ncclCommDestroy(comm_); }
  NcclAllGather(const NcclAllGather&) = delete;
  NcclAllGather& operator=(const NcclAllGather&) = delete;
  int rank() const override { return rank_; }
  int ranks() const override { return ranks_; }

  void all_gather_in_place(void* buffer, size_t bytes, Stream s) override {
    auto* stream = static_cast<cudaStream_t>(dev_->native_stream(s));
    auto* recv = static_cast<std::byte*>(buffer);
    int previous = 0;
    cudaGetDevice(&previous);
    cudaSetDevice(dev_->cuda_ordinal());
    // In place: this rank's part is already at recv + rank * bytes (NCCL's in-place form).
    const ncclResult_t r = ncclAllGather(recv + static_cast<size_t>(rank_) * bytes, recv, bytes,
                                         ncclUint8, comm_, stream);
    cudaSetDevice(previous);
    nccl_check(r, "ncclAllGather");
  }

 private:
  ncclComm_t comm_;
  Device* dev_;
  int rank_;
  int ranks_;
};

}  // namespace

std::vector<std::unique_ptr<AllGather>> make_nccl_all_gather(const std::vector<Device*>& devices,
                                                             std::string* why) {
  std::vector<int> ordinals;
  for (size_t i = 0; i < devices.size(); ++i) {
    const int o = devices[i] != nullptr ? devices[i]->cuda_ordinal() : -1;
    if (o < 0) {
      if (why != nullptr) *why = fmt::format("rank {} is not a CUDA device", i);
      return {};
    }
    ordinals.push_back(o);
  }
  if (ordinals.empty()) {
    if (why != nullptr) *why = "no devices";
    return {};
  }
  std::vector<ncclComm_t> comms(ordinals.size());
  const ncclResult_t r =
      ncclCommInitAll(comms.data(), static_cast<int>(ordinals.size()), ordinals.data());
  if (r != ncclSuccess) {
    if (why != nullptr) *why = fmt::format("ncclCommInitAll: {}", ncclGetErrorString(r));
    return {};
  }
  std::vector<std::unique_ptr<AllGather>> out;
  for (size_t i = 0; i < comms.size(); ++i)
    out.push_back(std::make_unique<NcclAllGather>(comms[i], devices[i], static_cast<int>(i),
                                                  static_cast<int>(comms.size())));
  return out;
}

}  // namespace spillway
