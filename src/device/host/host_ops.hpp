// The host backend's device operations (Note [Device operations], device.hpp): the
// arithmetic of spillway/device/device_math.hpp as plain loops over the emulated device memory,
// run by a stream's worker in stream order. The CPU twin of src/device/cuda/adamw_kernels.cu,
// with the same operations and arguments.
#pragma once

#include "spillway/device/device.hpp"

namespace spillway::host_ops {

// Throw spillway::Error when the arguments do not fit their n (on the caller's thread,
// before anything is enqueued, so that a worker never throws).
void check(const DeviceAdamW& a);
void check(const DeviceNormLanes& a);
void check(const DeviceWidenBf16& a);

// Run the operation now, on the calling thread.
void run(const DeviceAdamW& a);
void run(const DeviceNormLanes& a);
void run(const DeviceWidenBf16& a);

}  // namespace spillway::host_ops
