#include "tessera/core/log.h"

#include <atomic>
#include <cstdio>
#include <mutex>

#include "tessera/core/env.h"

namespace tessera::log {
namespace {
std::atomic<int> g_rank{-1};
std::atomic<int> g_level{-1};
std::mutex g_mu;

int initial_level() {
  auto v = env::get("TESSERA_LOG_LEVEL");
  if (!v) return static_cast<int>(Level::Warn);
  if (*v == "debug") return 0;
  if (*v == "info") return 1;
  if (*v == "warn") return 2;
  if (*v == "error") return 3;
  throw Error(concat("TESSERA_LOG_LEVEL='", *v, "' is not one of debug, info, warn, error"));
}
}  // namespace

void set_rank(int rank) { g_rank = rank; }

Level level() {
  int l = g_level.load();
  if (l < 0) {
    l = initial_level();
    g_level = l;
  }
  return static_cast<Level>(l);
}

void set_level(Level l) { g_level = static_cast<int>(l); }

void write(Level l, const std::string& message) {
  static const char* names[] = {"debug", "info", "warn", "error"};
  std::lock_guard<std::mutex> lock(g_mu);
  int r = g_rank.load();
  if (r >= 0) {
    std::fprintf(stderr, "[tessera %s rank %d] %s\n", names[static_cast<int>(l)], r, message.c_str());
  } else {
    std::fprintf(stderr, "[tessera %s] %s\n", names[static_cast<int>(l)], message.c_str());
  }
  std::fflush(stderr);
}

}  // namespace tessera::log
