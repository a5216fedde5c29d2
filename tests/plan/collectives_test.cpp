// Collectives (spillway/plan/collectives.hpp, docs/collectives.md): the ring formulas against
// hand-computed numbers, a group of 1 is free, the link rule on the catalog profiles, the
// hardware profile's "interconnect" object, and bad input named by field and value.
#include "spillway/plan/collectives.hpp"

#include <gtest/gtest.h>

#include <fstream>
#include <iterator>
#include <string>

#include "core/json_io.hpp"
#include "plan_helpers.hpp"
#include "test_support.hpp"

namespace spillway {
namespace {

using spillway::testing::error_of;
using spillway::testing::expect_error;
using spillway::testing::hardware;

constexpr int64_t kGB = 1'000'000'000;

TEST(Collectives, KindNamesRoundTrip) {
  for (CollectiveKind k : {CollectiveKind::kAllReduce, CollectiveKind::kAllGather,
                           CollectiveKind::kReduceScatter, CollectiveKind::kAllToAll}) {
    EXPECT_EQ(parse_collective_kind(to_string(k)), k);
  }
  EXPECT_EQ(to_string(CollectiveKind::kAllReduce), "all-reduce");
  EXPECT_EQ(to_string(CollectiveKind::kAllGather), "all-gather");
  EXPECT_EQ(to_string(CollectiveKind::kReduceScatter), "reduce-scatter");
  EXPECT_EQ(to_string(CollectiveKind::kAllToAll), "all-to-all");
  EXPECT_EQ(error_of([] { (void)parse_collective_kind("allreduce"); }),
            "kind is 'allreduce'; must be one of all-reduce, all-gather, reduce-scatter, "
            "all-to-all");
}

TEST(Collectives, RingFormulasMatchHandComputedTimes) {
  // All-reduce of 1 GB over 8 GPUs at 450 GB/s: 2 * 7/8 * 1e9 / 450e9 s.
  EXPECT_DOUBLE_EQ(ring_ms(CollectiveKind::kAllReduce, kGB, 8, 450.0, 0.0),
                   2.0 * 7.0 / 8.0 * 1e9 / 450e9 * 1e3);
  // The others move (n-1)/n x S: 4 GPUs at 50 GB/s, 1 GB -> 3/4 * 1e9 / 50e9 s = 15 ms.
  for (CollectiveKind k :
       {CollectiveKind::kAllGather, CollectiveKind::kReduceScatter, CollectiveKind::kAllToAll}) {
    EXPECT_DOUBLE_EQ(ring_ms(k, kGB, 4, 50.0, 0.0), 15.0) << to_string(k);
  }
  // Latency: n-1 steps (2(n-1) for all-reduce) of latency_us each.
  EXPECT_DOUBLE_EQ(ring_ms(CollectiveKind::kAllGather, 0, 8, 450.0, 5.0), 7 * 5.0e-3);
  EXPECT_DOUBLE_EQ(ring_ms(CollectiveKind::kAllReduce, 0, 8, 450.0, 5.0), 14 * 5.0e-3);
  EXPECT_DOUBLE_EQ(ring_ms(CollectiveKind::kAllReduce, kGB, 2, 100.0, 10.0),
                   1.0 * 1e9 / 100e9 * 1e3 + 2 * 10.0e-3);
  EXPECT_DOUBLE_EQ(ring_volume_factor(CollectiveKind::kAllReduce, 8), 1.75);
  EXPECT_DOUBLE_EQ(ring_volume_factor(CollectiveKind::kAllToAll, 8), 0.875);
  EXPECT_EQ(ring_steps(CollectiveKind::kAllReduce, 8), 14);
  EXPECT_EQ(ring_steps(CollectiveKind::kReduceScatter, 8), 7);
}

TEST(Collectives, GroupOfOneIsFree) {
  for (CollectiveKind k : {CollectiveKind::kAllReduce, CollectiveKind::kAllGather,
                           CollectiveKind::kReduceScatter, CollectiveKind::kAllToAll}) {
    EXPECT_EQ(ring_ms(k, 10 * kGB, 1, 1.0, 100.0), 0.0) << to_string(k);
    EXPECT_EQ(ring_volume_factor(k, 1), 0.0);
    EXPECT_EQ(ring_steps(k, 1), 0);
  }
  const CollectivePlan c = make_collective(CollectiveKind::kAllReduce, "dp.grad_reduce", true, kGB,
                                           1, {"nvlink", 450.0}, 5.0);
  EXPECT_EQ(c.ms, 0.0);
  EXPECT_EQ(ring_bytes(c), 0);
}

TEST(Collectives, MakeCollectiveFillsTimeAndExposure) {
  const CollectiveLink nvl{"nvlink", 450.0};
  const CollectivePlan ar =
      make_collective(CollectiveKind::kAllReduce, "dp.grad_reduce", true, kGB, 8, nvl, 0.0);
  EXPECT_EQ(ar.what, "dp.grad_reduce");
  EXPECT_TRUE(ar.backward);
  EXPECT_EQ(ar.bytes, kGB);
  EXPECT_EQ(ar.group, 8);
  EXPECT_EQ(ar.link, "nvlink");
  EXPECT_EQ(ar.gbps, 450.0);
  EXPECT_DOUBLE_EQ(ar.ms, 2.0 * 7.0 / 8.0 * 1e9 / 450e9 * 1e3);
  EXPECT_FALSE(ar.exposed);
  EXPECT_EQ(ring_bytes(ar), 1'750'000'000);
  const CollectivePlan a2a =
      make_collective(CollectiveKind::kAllToAll, "ep.dispatch", false, kGB, 8, nvl, 0.0);
  EXPECT_TRUE(a2a.exposed);
  EXPECT_EQ(ring_bytes(a2a), 875'000'000);
  EXPECT_FALSE(
      make_collective(CollectiveKind::kAllGather, "zero.weight_gather", false, kGB, 8, nvl, 0.0)
          .exposed);
  EXPECT_FALSE(
      make_collective(CollectiveKind::kReduceScatter, "zero.grad_reduce", true, kGB, 8, nvl, 0.0)
          .exposed);
}

TEST(Collectives, LinkRuleOnH100Sxm) {
  const HardwareProfile& h = hardware("h100-sxm");
  const CollectiveLink in_node = collective_link(h, 8, 1);
  EXPECT_EQ(in_node.link, "nvlink");
  EXPECT_EQ(in_node.gbps, 450.0);
  EXPECT_EQ(collective_link(h, 4, 2).link, "nvlink");  // 4 members 2 apart: 8 GPUs
  const CollectiveLink beyond = collective_link(h, 16, 1);
  EXPECT_EQ(beyond.link, "network");
  EXPECT_EQ(beyond.gbps, 50.0);
  EXPECT_EQ(collective_link(h, 2, 8).link, "network");  // DP over 2 nodes of tp 8
}

TEST(Collectives, LinkRuleOnH100PcieGoesThroughTheHost) {
  HardwareProfile h = hardware("h100-pcie");
  const CollectiveLink in_node = collective_link(h, 4, 1);
  EXPECT_EQ(in_node.link, "host");
  EXPECT_EQ(in_node.gbps, std::min(h.d2h_typical.value, h.h2d_typical.value));
  // Four GPUs behind one switch uplink share it: a quarter each.
  h.gpus_per_link = 4;
  EXPECT_DOUBLE_EQ(collective_link(h, 4, 1).gbps,
                   std::min(h.d2h_typical.value, h.h2d_typical.value) / 4.0);
  const CollectiveLink beyond = collective_link(h, 8, 1);
  EXPECT_EQ(beyond.link, "network");
  EXPECT_EQ(beyond.gbps, h.interconnect.network_gbps);
}

TEST(Collectives, LinkRuleOnGb200SpansTheRack) {
  const HardwareProfile& h = hardware("gb200");
  EXPECT_EQ(collective_link(h, 72, 1).link, "nvlink");
  EXPECT_EQ(collective_link(h, 72, 1).gbps, 900.0);
  EXPECT_EQ(collective_link(h, 8, 9).link, "nvlink");
  EXPECT_EQ(collective_link(h, 73, 1).link, "network");
  EXPECT_EQ(collective_link(h, 2, 64).link, "network");
  // GH200 as catalogued: one superchip per node, so any group meets over the network.
  EXPECT_EQ(collective_link(hardware("gh200"), 2, 1).link, "network");
}

TEST(Collectives, BadInputNamesTheFieldAndValue) {
  EXPECT_EQ(error_of([] { (void)ring_ms(CollectiveKind::kAllReduce, kGB, 0, 450.0, 0.0); }),
            "group is 0; must be in [1, 1048576]");
  EXPECT_EQ(error_of([] { (void)ring_ms(CollectiveKind::kAllReduce, -1, 8, 450.0, 0.0); }),
            "bytes is -1; must be >= 0");
  expect_error([] { (void)ring_ms(CollectiveKind::kAllGather, kGB, 8, 0.0, 0.0); },
               {"gbps is 0; must be in"});
  expect_error([] { (void)ring_ms(CollectiveKind::kAllGather, kGB, 8, 450.0, -1.0); },
               {"latency_us is -1"});
  expect_error([] { (void)collective_link(hardware("h100-sxm"), 8, 0); },
               {"gpus_between_members is 0"});
  expect_error([] { (void)collective_link(hardware("h100-sxm"), -3, 1); }, {"group is -3"});
  expect_error(
      [] {
        (void)make_collective(CollectiveKind::kAllReduce, "dp.grad_reduce", true, kGB, 8,
                              {"pcie", 50.0}, 0.0);
      },
      {"link is \"pcie\"; must be nvlink, network or host"});
  expect_error(
      [] {
        (void)make_collective(CollectiveKind::kAllReduce, "", true, kGB, 8, {"host", 50.0}, 0.0);
      },
      {"what is \"\""});
}

// ---- the hardware profile's "interconnect" ------------------------------------------------

Json profile_json(const std::string& name) {
  std::ifstream in(std::string(SPILLWAY_DATA_DIR) + "/hardware/" + name + ".json");
  return Json::parse(in);
}

TEST(Interconnect, EveryCatalogProfileHasOne) {
  for (const std::string& name : hardware_names()) {
    SCOPED_TRACE(name);
    const Json doc = profile_json(name);
    ASSERT_TRUE(doc.contains("interconnect"));
    // Right after the "host_link" object in the file.
    std::ifstream in(std::string(SPILLWAY_DATA_DIR) + "/hardware/" + name + ".json");
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const size_t link = text.find("\"host_link\"");
    const size_t fabric = text.find("\"interconnect\"");
    ASSERT_NE(fabric, std::string::npos);
    EXPECT_LT(link, fabric);
    EXPECT_EQ(text.find('"', text.find('}', link) + 1), fabric);
    const HardwareProfile& h = hardware(name);
    EXPECT_GT(h.interconnect.network_gbps, 0.0);
    EXPECT_EQ(h.interconnect.nvlink_gbps > 0.0, h.interconnect.gpus_per_nvlink_domain > 1);
  }
  EXPECT_EQ(hardware("h100-sxm").interconnect.nvlink_gbps, 450.0);
  EXPECT_EQ(hardware("h100-sxm").interconnect.gpus_per_nvlink_domain, 8);
  EXPECT_EQ(hardware("b200").interconnect.nvlink_gbps, 900.0);
  EXPECT_EQ(hardware("gb200").interconnect.gpus_per_nvlink_domain, 72);
  EXPECT_EQ(hardware("h100-pcie").interconnect.nvlink_gbps, 0.0);
  EXPECT_EQ(describe_interconnect(hardware("h100-sxm").interconnect),
            "NVLink 450 GB/s x 8 GPUs, network 50 GB/s, 5 us/step");
  EXPECT_EQ(describe_interconnect(hardware("h100-pcie").interconnect),
            "no NVLink, network 25 GB/s, 10 us/step");
}

TEST(Interconnect, AbsentObjectGivesTheDefaults) {
  Json doc = profile_json("h100-sxm");
  doc.erase("interconnect");
  const HardwareProfile h = parse_hardware_profile(doc, "hw.json");
  const Interconnect defaults;
  EXPECT_EQ(h.interconnect.nvlink_gbps, 0.0);
  EXPECT_EQ(h.interconnect.gpus_per_nvlink_domain, 1);
  EXPECT_EQ(h.interconnect.network_gbps, defaults.network_gbps);
  EXPECT_EQ(h.interconnect.collective_latency_us, defaults.collective_latency_us);
  EXPECT_EQ(collective_link(h, 8, 1).link, "host");  // no NVLink known: inside the node
}

TEST(Interconnect, BadFieldsAreNamedWithValueAndFile) {
  auto with = [](const char* key, Json value) {
    Json doc = profile_json("h100-sxm");
    doc["interconnect"][key] = std::move(value);
    return error_of([&] { (void)parse_hardware_profile(doc, "hw.json"); });
  };
  const std::string neg = with("nvlink_gbps", -1);
  EXPECT_NE(neg.find("hardware profile: \"interconnect.nvlink_gbps\" is -1"), std::string::npos)
      << neg;
  EXPECT_NE(neg.find("(file: hw.json)"), std::string::npos) << neg;
  EXPECT_NE(with("network_gbps", 0).find("\"interconnect.network_gbps\" is 0"), std::string::npos);
  EXPECT_NE(with("gpus_per_nvlink_domain", 0).find("\"interconnect.gpus_per_nvlink_domain\" is 0"),
            std::string::npos);
  EXPECT_NE(with("collective_latency_us", "5").find("\"interconnect.collective_latency_us\""),
            std::string::npos);
  const std::string lone = with("gpus_per_nvlink_domain", 1);
  EXPECT_NE(lone.find("\"interconnect.gpus_per_nvlink_domain\" is 1; an NVLink of 450 GB/s"),
            std::string::npos)
      << lone;
  Json doc = profile_json("h100-pcie");
  doc["interconnect"]["gpus_per_nvlink_domain"] = 4;
  expect_error([&] { (void)parse_hardware_profile(doc, "pcie.json"); },
               {"\"interconnect.gpus_per_nvlink_domain\" is 4; with \"nvlink_gbps\" 0",
                "(file: pcie.json)"});
  Json not_object = profile_json("h100-sxm");
  not_object["interconnect"] = 3;
  expect_error([&] { (void)parse_hardware_profile(not_object, "hw.json"); },
               {"\"interconnect\"", "(file: hw.json)"});
}

}  // namespace
}  // namespace spillway
