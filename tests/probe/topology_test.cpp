// detect_host_topology on a PCI device tree made in a temporary directory, shaped as
// sysfs is: devices/pci<domain:bus>/<root port>/<switch ports>.../<device>, with
// bus/pci/devices/<address> symlinks into it.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "spillway/probe/probe.hpp"

namespace spillway {
namespace {

namespace fs = std::filesystem;

class FakeSysfs {
 public:
  FakeSysfs()
      : root_(fs::temp_directory_path() / ("spillway-sysfs-" + std::to_string(::getpid()))) {
    fs::remove_all(root_);
    fs::create_directories(root_ / "bus" / "pci" / "devices");
  }
  ~FakeSysfs() { fs::remove_all(root_); }
  // A device at `chain` (path below devices/), with its vendor and class.
  void add(const std::string& chain, const std::string& vendor, const std::string& cls) {
    const fs::path dir = root_ / "devices" / chain;
    fs::create_directories(dir);
    std::ofstream(dir / "vendor") << vendor << "\n";
    std::ofstream(dir / "class") << cls << "\n";
    fs::create_symlink(dir, root_ / "bus" / "pci" / "devices" / dir.filename());
  }
  std::string root() const { return root_.string(); }

 private:
  fs::path root_;
};

TEST(HostTopology, GpusBehindOneRootPortShareALink) {
  FakeSysfs s;
  // Two GPUs behind one PCIe switch on root port 0000:00:01.0, a NIC beside them.
  s.add("pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0/0000:03:00.0", "0x10de", "0x030200");
  s.add("pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:01.0/0000:04:00.0", "0x10de", "0x030000");
  s.add("pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:02.0/0000:05:00.0", "0x15b3", "0x020000");
  // One GPU alone on another root port; one straight on a root complex.
  s.add("pci0000:40/0000:40:01.1/0000:41:00.0", "0x10de", "0x030200");
  s.add("pci0000:80/0000:80:00.0", "0x10de", "0x030200");
  const HostTopology t = detect_host_topology(s.root());
  ASSERT_EQ(t.gpus.size(), 4u) << t.note;
  EXPECT_EQ(t.max_gpus_per_link, 2);
  ASSERT_EQ(t.link_groups.size(), 3u);
  EXPECT_EQ(t.gpus[0].address, "0000:03:00.0");
  EXPECT_EQ(t.gpus[0].root_port, "0000:00:01.0");
  EXPECT_EQ(t.gpus[1].root_port, "0000:00:01.0");
  EXPECT_EQ(t.gpus[2].root_port, "0000:40:01.1");
  EXPECT_EQ(t.gpus[3].root_port, "0000:80:00.0");  // its own link
  EXPECT_EQ(t.link_groups[0], (std::vector<int>{0, 1}));
}

TEST(HostTopology, NoGpuOrNoTreeIsAnAnswerWithANote) {
  FakeSysfs s;
  s.add("pci0000:00/0000:00:02.0", "0x8086", "0x030000");  // a GPU, not NVIDIA's
  HostTopology t = detect_host_topology(s.root());
  EXPECT_TRUE(t.gpus.empty());
  EXPECT_EQ(t.max_gpus_per_link, 0);
  EXPECT_NE(t.note.find("no NVIDIA GPU"), std::string::npos);
  t = detect_host_topology(s.root() + "/nowhere");
  EXPECT_NE(t.note.find("no PCI device tree"), std::string::npos);
}

}  // namespace
}  // namespace spillway
