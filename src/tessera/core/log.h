// Rank-aware logging to stderr. The level comes from TESSERA_LOG_LEVEL
// (debug, info, warn, error; default warn).
#pragma once
#include <chrono>
#include <string>

#include "tessera/core/error.h"

namespace tessera::log {

enum class Level { Debug = 0, Info = 1, Warn = 2, Error = 3 };

// Sets the rank shown in every line ("[tessera rank 3] ..."); -1 hides it.
void set_rank(int rank);
Level level();
void set_level(Level level);
void write(Level level, const std::string& message);

template <typename... Args>
void debug(const Args&... a) { if (level() <= Level::Debug) write(Level::Debug, concat(a...)); }
template <typename... Args>
void info(const Args&... a) { if (level() <= Level::Info) write(Level::Info, concat(a...)); }
template <typename... Args>
void warn(const Args&... a) { if (level() <= Level::Warn) write(Level::Warn, concat(a...)); }
template <typename... Args>
void error(const Args&... a) { write(Level::Error, concat(a...)); }

// Seconds from a to b, for the phase timers that debug lines report.
inline double seconds(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

}  // namespace tessera::log
