// CLI11 validators for the `tessera` tool (tools/tessera/cmd_run.cpp, cmd_ckpt.cpp)
// whose messages read well: "--grace: must be between 0 and 3600, got 5000".
// CLI11's own PositiveNumber / NonNegativeNumber print their bound, DBL_MAX, as a
// 300-digit number, its Range prints "0.000000 to 3600.000000", and both accept "nan".
// Here the bounds are printed as written and NaN / infinity are refused. CLI11 puts
// the option's name in front of the message. Header-only; needs <CLI/CLI.hpp>.
#pragma once
#include <CLI/CLI.hpp>
#include <cmath>
#include <limits>
#include <sstream>
#include <string>

namespace tessera::cli {

namespace checks_detail {
inline std::string show(double v) {
  if (v == std::floor(v) && std::fabs(v) < 1e15) return std::to_string(static_cast<long long>(v));  // 3600, 10000000
  std::ostringstream os;
  os << v;  // 6 significant digits: 0.9, 1e+300
  return os.str();
}
inline std::string show(long long v) { return std::to_string(v); }

template <typename T>
CLI::Validator bounded(T lo, T hi, bool lo_open, const std::string& what, const std::string& name) {
  return CLI::Validator(
      [=](std::string& in) -> std::string {
        T v{};
        if (!CLI::detail::lexical_cast(in, v)) return "'" + in + "' is not " + what;
        if constexpr (std::is_floating_point_v<T>) {
          if (!std::isfinite(v)) return "'" + in + "' is not a finite number";
        }
        const bool low = lo_open ? !(v > lo) : v < lo;
        if (!low && !(v > hi)) return "";
        if (lo_open) return "must be greater than " + show(lo) + ", got " + in;
        if (hi == std::numeric_limits<T>::max()) return "must be at least " + show(lo) + ", got " + in;
        return "must be between " + show(lo) + " and " + show(hi) + ", got " + in;
      },
      name);
}
}  // namespace checks_detail

// An integer in [lo, hi].
inline CLI::Validator int_range(long long lo, long long hi) {
  return checks_detail::bounded<long long>(lo, hi, false, "an integer",
                                           "INT in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
}
// An integer >= lo.
inline CLI::Validator int_at_least(long long lo) {
  return checks_detail::bounded<long long>(lo, std::numeric_limits<long long>::max(), false, "an integer",
                                           "INT >= " + std::to_string(lo));
}
// A finite number in [lo, hi].
inline CLI::Validator number_range(double lo, double hi) {
  return checks_detail::bounded<double>(lo, hi, false, "a number",
                                        "NUMBER in [" + checks_detail::show(lo) + ", " + checks_detail::show(hi) + "]");
}
// A finite number >= lo.
inline CLI::Validator number_at_least(double lo) {
  return checks_detail::bounded<double>(lo, std::numeric_limits<double>::max(), false, "a number",
                                        "NUMBER >= " + checks_detail::show(lo));
}
// A finite number > 0.
inline CLI::Validator positive_number() {
  return checks_detail::bounded<double>(0.0, std::numeric_limits<double>::max(), true, "a number", "NUMBER > 0");
}

}  // namespace tessera::cli
