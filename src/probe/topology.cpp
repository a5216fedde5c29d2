// Which GPUs share a host link: see detect_host_topology in spillway/probe/probe.hpp.
#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>

#include "spillway/probe/probe.hpp"

namespace spillway {

namespace {

std::string read_word(const std::filesystem::path& p) {
  std::ifstream f(p);
  std::string w;
  f >> w;
  return w;
}

}  // namespace

HostTopology detect_host_topology(const std::string& sysfs_root) {
  namespace fs = std::filesystem;
  HostTopology t;
  const fs::path devices = fs::path(sysfs_root) / "bus" / "pci" / "devices";
  std::error_code ec;
  if (!fs::is_directory(devices, ec)) {
    t.note = fmt::format("no PCI device tree at {}", devices.string());
    return t;
  }
  std::vector<fs::path> entries;
  for (const fs::directory_entry& e : fs::directory_iterator(devices, ec))
    entries.push_back(e.path());
  std::sort(entries.begin(), entries.end());
  std::map<std::string, std::vector<int>> groups;
  for (const fs::path& e : entries) {
    // NVIDIA (0x10de), class 0x0300xx (VGA) or 0x0302xx (3D controller).
    if (read_word(e / "vendor") != "0x10de") continue;
    const std::string cls = read_word(e / "class");
    if (cls.rfind("0x0300", 0) != 0 && cls.rfind("0x0302", 0) != 0) continue;
    // The device's place in the tree: .../pci<domain:bus>/<root port>/.../<device>.
    const fs::path real = fs::canonical(e, ec);
    if (ec) continue;
    std::vector<std::string> chain;
    bool below_root = false;
    for (const fs::path& part : real) {
      const std::string s = part.string();
      if (s.rfind("pci", 0) == 0 && s.find(':') != std::string::npos) {
        below_root = true;
        chain.clear();
        continue;
      }
      if (below_root) chain.push_back(s);
    }
    if (chain.empty()) continue;
    PciGpu g;
    g.address = chain.back();
    g.root_port = chain.front();
    groups[g.root_port].push_back(static_cast<int>(t.gpus.size()));
    t.gpus.push_back(g);
  }
  for (auto& [port, members] : groups) {
    t.max_gpus_per_link = std::max(t.max_gpus_per_link, static_cast<int>(members.size()));
    t.link_groups.push_back(members);
  }
  if (t.gpus.empty()) t.note = fmt::format("no NVIDIA GPU under {}", devices.string());
  return t;
}

}  // namespace spillway
