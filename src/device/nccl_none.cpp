// make_nccl_all_gather in a build without NCCL (CMake compiles this file instead of
// src/device/cuda/nccl_all_gather.cpp): no group, and the reason says why.
#include <memory>
#include <string>
#include <vector>

#include "spillway/device/device.hpp"

namespace spillway {

std::vector<std::unique_ptr<AllGather>> make_nccl_all_gather(
    const std::vector<Device*>& /*devices*/, std::string* why) {
  if (why != nullptr) *why = "built without NCCL (no CUDA backend, or nccl.h / libnccl not found)";
  return {};
}

}  // namespace spillway
