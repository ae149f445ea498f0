// Strategy kinds and their names (strategy/factory.h): the one map between them, in-process.
#include <gtest/gtest.h>

#include "support/test_util.h"
#include "tessera/core/error.h"
#include "tessera/strategy/factory.h"

using namespace tessera;
using namespace tessera::strategy;

TEST(StrategyFactory, KindsRoundTripThroughTheirNames) {
  const std::vector<StrategyKind> kinds{StrategyKind::Single, StrategyKind::Ddp, StrategyKind::Fsdp};
  EXPECT_EQ(strategy_names(), (std::vector<std::string>{"single", "ddp", "fsdp"}));
  for (size_t i = 0; i < kinds.size(); ++i) {
    EXPECT_EQ(to_string(kinds[i]), strategy_names()[i]);
    EXPECT_EQ(parse_strategy(to_string(kinds[i])), kinds[i]);
    EXPECT_EQ(find_strategy(to_string(kinds[i])), kinds[i]);
    // By kind and by name, the same default layout.
    EXPECT_EQ(default_state_dict_type(kinds[i]), default_state_dict_type(to_string(kinds[i])));
  }
  EXPECT_EQ(default_state_dict_type(StrategyKind::Fsdp), StateDictType::Sharded);
  EXPECT_EQ(default_state_dict_type(StrategyKind::Ddp), StateDictType::Full);
  const auto single = make_strategy(StrategyKind::Single, nullptr, c10::Device(c10::kCPU));
  EXPECT_NE(dynamic_cast<SingleDeviceStrategy*>(single.get()), nullptr);
}

TEST(StrategyFactory, UnknownNamesAreRefusedListingTheKnownOnes) {
  EXPECT_EQ(find_strategy("auto"), std::nullopt);
  EXPECT_EQ(find_strategy("FSDP"), std::nullopt);  // names are exact
  for (const std::string& bad : {std::string("deepspeed"), std::string(""), std::string("fsdp ")}) {
    const std::string want = "unknown strategy '" + bad + "' (known: single, ddp, fsdp)";
    EXPECT_EQ(tessera::testing::error_of([&] { parse_strategy(bad); }), want);
    EXPECT_EQ(tessera::testing::error_of([&] { default_state_dict_type(bad); }), want);
    EXPECT_EQ(tessera::testing::error_of([&] { make_strategy(bad, nullptr, c10::Device(c10::kCPU)); }), want);
  }
}
