// This process's memory as Linux reports it, for the tests that bound a peak from inside the
// process (unit tests and the worker's scenarios; no gtest here).
#pragma once
#include <fstream>
#include <string>

namespace tessera::testing {

// A field of /proc/self/status ("VmRSS", "VmHWM") in KiB; -1 if absent.
inline long long proc_status_kib(const std::string& field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(field + ":", 0) == 0) return std::stoll(line.substr(field.size() + 1));
  return -1;
}

// Sets the peak (VmHWM) to the current resident set, so that a later VmHWM covers only what
// came after (/proc/self/clear_refs, Linux >= 4.0); false where that is refused.
inline bool reset_peak_rss() {
  std::ofstream f("/proc/self/clear_refs");
  return static_cast<bool>(f << "5" << std::flush);
}

}  // namespace tessera::testing
