#include "tessera/core/stream_copy.h"

#include <cstdint>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define TESSERA_STREAM_X86 1
#endif

namespace tessera::core {
namespace {

// Below this, the copy likely stays in cache and memcpy is as fast.
constexpr size_t kStreamFrom = size_t{1} << 20;

#ifdef TESSERA_STREAM_X86
// dst is 64-byte aligned here and n a multiple of 64.
__attribute__((target("avx512f"))) void stream_avx512(char* dst, const char* src, size_t n) {
  for (size_t i = 0; i < n; i += 64) _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i),
                                                         _mm512_loadu_si512(reinterpret_cast<const void*>(src + i)));
  _mm_sfence();
}

__attribute__((target("avx2"))) void stream_avx2(char* dst, const char* src, size_t n) {
  for (size_t i = 0; i < n; i += 32)
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i),
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
  _mm_sfence();
}

using StreamFn = void (*)(char*, const char*, size_t);

StreamFn stream_fn() {
  static const StreamFn fn = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return &stream_avx512;
    if (__builtin_cpu_supports("avx2")) return &stream_avx2;
    return static_cast<StreamFn>(nullptr);
  }();
  return fn;
}
#endif

}  // namespace

void copy_streaming(void* dst, const void* src, size_t bytes) {
#ifdef TESSERA_STREAM_X86
  StreamFn fn = bytes >= kStreamFrom ? stream_fn() : nullptr;
  if (fn != nullptr) {
    char* d = static_cast<char*>(dst);
    const char* s = static_cast<const char*>(src);
    // memcpy up to the first 64-byte boundary of dst, stream whole 64-byte lines, memcpy the rest.
    const size_t head = (64 - reinterpret_cast<uintptr_t>(d) % 64) % 64;
    std::memcpy(d, s, head);
    const size_t body = (bytes - head) / 64 * 64;
    fn(d + head, s + head, body);
    std::memcpy(d + head + body, s + head + body, bytes - head - body);
    return;
  }
#endif
  std::memcpy(dst, src, bytes);
}

}  // namespace tessera::core
