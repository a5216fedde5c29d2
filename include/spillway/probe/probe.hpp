// The link probe: host<->device copy bandwidth of the backend at hand, per transfer size,
// from pinned and from pageable host memory, in each direction (the health check to run
// before a job), beside what a hardware profile expects of the link.
//
// A sample is a few back-to-back copies timed from enqueue to stream synchronize (enough
// to last about 2 ms), so that small sizes measure the link rather than the round trip of
// one synchronize.
//
// Invariants: every size is verified (a pattern round-trips host -> device -> host bit
// for bit) before it is timed, and a mismatch throws spillway::Error; a size that does
// not fit the device is skipped and recorded, never thrown; everything allocated is
// freed on every path; the timing stays within about seconds_budget (large sizes get
// fewer repeats), though the verification and one sample per point are always done.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "spillway/catalog/hardware.hpp"
#include "spillway/device/device.hpp"

namespace spillway {

struct ProbeOptions {
  std::vector<size_t> sizes = {size_t{64} << 10, size_t{1} << 20, size_t{16} << 20,
                               size_t{256} << 20};  // bytes per copy
  int repeats = 5;             // timed samples per point (fewer when the budget is short)
  bool pageable = true;        // also measure pageable host memory (pinned always)
  double seconds_budget = 10;  // rough bound on the whole run's wall time
};

struct ProbePoint {
  std::string direction;     // "H2D" or "D2H"
  std::string host_memory;   // "pinned" or "pageable"
  size_t bytes = 0;          // per copy
  double gbps_median = 0.0;  // 1 GB/s = 1e9 bytes/s, over samples of back-to-back copies
  double gbps_best = 0.0;
  int repeats = 0;            // timed samples (median and best are over these)
  int copies_per_sample = 1;  // back-to-back copies in one sample (see probe.cpp)
};

// A size (or one host memory kind of it) that could not be measured.
struct ProbeSkip {
  size_t bytes = 0;
  std::string host_memory;  // "pinned" / "pageable", or "" when the device buffer failed
  std::string reason;       // the allocator's reason
};

struct ProbeResult {
  std::string backend;  // Device::name()
  bool emulated = false;
  std::vector<ProbePoint> points;  // by size, then host memory, then direction
  std::vector<ProbeSkip> skipped;
  std::vector<std::string> notes;  // e.g. a pinned request served by pageable memory
};

// Measures `dev`. Throws spillway::Error on bad options or when copied bytes differ.
ProbeResult run_probe(Device& dev, const ProbeOptions& options);

// A table per size and direction: pinned and pageable GB/s (median, best), and when
// `expected` is given its typical and nominal figures and measured/typical.
std::string format_probe_report(const ProbeResult& result, const HardwareProfile* expected);

// JSON, schema "spillway.probe/1".
std::string probe_json(const ProbeResult& result);

// Note [The machine is the limit]: an emulated link (the host backend's copy engine, a
// thread doing memmove then waiting out the throttle's schedule) can never run faster than
// this machine's memcpy. What the emulated link's runs report (bench stream's bandwidth and
// overhead, train's stalls and step ratios) therefore measures the machine, not the link,
// when the link asks for more than the machine copies. This measures that ceiling in the
// caller's run: the probe on an unthrottled host device of `bytes` per copy, pinned host
// memory, the lower of the H2D and D2H medians, GB/s (1e9 bytes/s), within about
// seconds_budget.
double measure_host_copy_gbps(size_t bytes, double seconds_budget = 0.5);

// The sentence to print when an emulated link of link_gbps asks for more than this
// machine's memcpy measured (memcpy_gbps, from measure_host_copy_gbps): "" when it does not
// (link_gbps <= memcpy_gbps, or memcpy unmeasured: <= 0). `what` names the figures the
// machine limits ("the overhead and the copy stream's bandwidth").
std::string machine_limit_note(double link_gbps, double memcpy_gbps, const std::string& what);

// Which GPUs share a host link, read from the PCI device tree (Linux sysfs): each NVIDIA
// display or 3D controller under <sysfs_root>/bus/pci/devices, grouped by the root port
// it hangs under (the first bridge below its root complex), since the GPUs behind one
// root port share its link to the host. No GPU is an answer, not an error (`note` says
// why); a GPU directly on a root complex has a link of its own.
struct PciGpu {
  std::string address;    // "0000:41:00.0"
  std::string root_port;  // the bridge whose link it uses ("0000:40:01.1"), or itself
};
struct HostTopology {
  std::vector<PciGpu> gpus;
  std::vector<std::vector<int>> link_groups;  // indices into gpus, one group per root port
  int max_gpus_per_link = 0;
  std::string note;
};
HostTopology detect_host_topology(const std::string& sysfs_root = "/sys");

}  // namespace spillway
