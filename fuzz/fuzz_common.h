// Shared by the fuzz targets: the input as a file (the readers take paths and read
// with pread, as they do in production).
#pragma once
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <string>

namespace tessera::fuzz {

inline const std::string& scratch_path() {
  static const std::string p = "/tmp/tessera-fuzz-" + std::to_string(::getpid()) + ".bin";
  return p;
}

inline const std::string& write_input(const uint8_t* data, size_t size) {
  const std::string& p = scratch_path();
  FILE* f = std::fopen(p.c_str(), "wb");
  if (size) std::fwrite(data, 1, size, f);
  std::fclose(f);
  return p;
}

}  // namespace tessera::fuzz
