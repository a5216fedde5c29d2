// `spillway probe`: host<->device copy bandwidth of the backend at hand, per transfer size,
// pinned vs pageable, beside a hardware profile's expectation (the health check to run
// before a job). Without a GPU it measures the host backend and says so.
#include <fmt/format.h>

#include <cctype>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <memory>
#include <optional>
#include <vector>

#include "cli/commands.hpp"
#include "spillway/catalog/hardware.hpp"
#include "spillway/core/error.hpp"
#include "spillway/device/device.hpp"
#include "spillway/probe/probe.hpp"

namespace spillway::cli {

namespace {

// "64K", "1M", "2G" (KiB, MiB, GiB; "KiB" etc. also accepted), or plain bytes.
size_t parse_size(const std::string& text) {
  const auto bad = [&]() {
    SPILLWAY_INPUT_ERROR(
        "--sizes: '{}' is not a transfer size; expected a whole number > 0 with an optional K, M "
        "or G suffix (KiB, MiB, GiB), e.g. --sizes 64K,1M,16M,256M",
        text);
  };
  size_t i = 0;
  uint64_t value = 0;
  while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i])) != 0) {
    const auto digit = static_cast<uint64_t>(text[i] - '0');
    if (value > (std::numeric_limits<uint64_t>::max() - digit) / 10) bad();
    value = value * 10 + digit;
    ++i;
  }
  if (i == 0) bad();
  std::string suffix = text.substr(i);
  for (char& c : suffix) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  int shift = 0;
  if (suffix.empty() || suffix == "B") {
    shift = 0;
  } else if (suffix == "K" || suffix == "KIB") {
    shift = 10;
  } else if (suffix == "M" || suffix == "MIB") {
    shift = 20;
  } else if (suffix == "G" || suffix == "GIB") {
    shift = 30;
  } else {
    bad();
  }
  if (value == 0 || value > (std::numeric_limits<uint64_t>::max() >> shift)) bad();
  const uint64_t bytes = value << shift;
  if (bytes > (uint64_t{1} << 40)) {
    SPILLWAY_INPUT_ERROR("--sizes: '{}' is more than 1024G; a transfer size is 1 byte to 1024G",
                         text);
  }
  return static_cast<size_t>(bytes);
}

}  // namespace

void add_probe_command(CLI::App& app) {
  overview_line("probe", Group::kTools, "host<->device copy bandwidth, pinned and pageable");
  struct State {
    std::string device = "auto";
    double device_memory_mb = 1024.0;
    std::string hardware;
    std::vector<std::string> sizes;
    int repeats = ProbeOptions{}.repeats;
    bool no_pageable = false;
    double budget_s = ProbeOptions{}.seconds_budget;
    std::string json_path;
  };
  auto st = std::make_shared<State>();
  CLI::App* cmd = app.add_subcommand(
      "probe",
      "Measure host-to-device (H2D) and device-to-host (D2H) copy bandwidth per transfer size, "
      "from pinned and from pageable host memory, on the backend at hand: the health check to "
      "run before a job. Every size is verified bit for bit before it is timed. With "
      "--hardware, each figure is printed beside the profile's typical and nominal link "
      "bandwidth. Without a GPU the host backend (an emulated device) is measured, and the "
      "report says so: its figures are this machine's memcpy bandwidth, not a GPU link.\n\n"
      "Examples:\n"
      "  spillway probe --hardware gh200\n"
      "  spillway probe --sizes 4K,64K,1M,16M,256M,1G --repeats 10 --json probe.json\n"
      "  spillway probe --device host --device-memory-mb 512 --no-pageable");
  cmd->add_option("--device", st->device,
                  "Backend to measure: cuda (device 0), host (the emulated device), or auto "
                  "(cuda when a device is available, else host)")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "cuda", "host"}));
  in_range(cmd->add_option("--device-memory-mb", st->device_memory_mb,
                           "Host backend only: capacity of the emulated device memory in MiB "
                           "(2^20 bytes); sizes that do not fit are skipped")
               ->capture_default_str(),
           closed(1, kMaxHostMiB));
  cmd->add_option("--hardware", st->hardware,
                  "Compare against this hardware profile: a catalog name (see `spillway "
                  "hardware`) or a profile JSON file");
  cmd->add_option("--sizes", st->sizes,
                  "Transfer sizes, comma-separated, K/M/G = KiB/MiB/GiB, each from 1 byte to "
                  "1024G (default 64K,1M,16M,256M)")
      ->delimiter(',');
  in_range(cmd->add_option("--repeats", st->repeats,
                           "Timed samples per point, after warm-up (fewer for large sizes when "
                           "the time budget is short)")
               ->capture_default_str(),
           closed(1, kMaxRepeats));
  cmd->add_flag("--no-pageable", st->no_pageable, "Measure pinned host memory only");
  in_range(
      cmd->add_option("--budget-s", st->budget_s, "Rough bound on the run's wall time in seconds")
          ->capture_default_str(),
      closed(0.01, 86400));
  cmd->add_option("--json", st->json_path, "Write the results as JSON to FILE ('-' for stdout)");
  cmd->callback([st]() {
    ProbeOptions options;
    if (!st->sizes.empty()) {
      options.sizes.clear();
      for (const std::string& s : st->sizes) options.sizes.push_back(parse_size(s));
    }
    options.repeats = st->repeats;
    options.pageable = !st->no_pageable;
    options.seconds_budget = st->budget_s;

    std::optional<HardwareProfile> expected;
    if (!st->hardware.empty()) expected = load_hardware(st->hardware);

    // Human-readable lines go to stdout, unless the JSON does.
    const bool json_on_stdout = st->json_path == "-";
    const auto say = [&](const std::string& line) {
      if (json_on_stdout) {
        std::fprintf(stderr, "%s", line.c_str());
      } else {
        write_output("-", line);
      }
    };

    std::unique_ptr<Device> dev;
    if (st->device != "host") {
      std::string why;
      dev = make_cuda_device(0, &why);
      if (!dev && st->device == "cuda") SPILLWAY_INPUT_ERROR("--device cuda: {}", why);
      if (!dev) say(fmt::format("{}; measuring the host backend\n", why));
    }
    if (!dev) {
      const double bytes = st->device_memory_mb * kMiB;
      HostDeviceOptions ho;
      ho.device_bytes = static_cast<int64_t>(bytes);
      dev = make_host_device(ho);
    }

    const ProbeResult result = run_probe(*dev, options);
    // Nothing measured is no result: every size was skipped (larger than the device, or
    // the host could not provide it), so say so and fail rather than print an empty table.
    if (result.points.empty())
      SPILLWAY_INPUT_ERROR(
          "probe: no size could be measured: {} of {} skipped (the first: {}); give smaller "
          "--sizes or a larger --device-memory-mb",
          result.skipped.size(), options.sizes.size(),
          result.skipped.empty() ? std::string("none") : result.skipped.front().reason);
    if (!json_on_stdout) {
      write_output("-", format_probe_report(result, expected ? &*expected : nullptr));
    }
    if (!st->json_path.empty()) write_output(st->json_path, probe_json(result));
  });
}

}  // namespace spillway::cli
