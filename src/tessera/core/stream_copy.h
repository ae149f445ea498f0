#pragma once
// A copy of large buffers that bypasses the caches on the way in: non-temporal
// (streaming) stores where the CPU has AVX-512 or AVX2, memcpy elsewhere and for short
// copies. For copies whose destination is not read again soon by this core (the snapshot
// an async checkpoint takes, which a background writer reads later): an ordinary store
// first reads the destination line into the cache, so memcpy moves three bytes for every
// byte copied where streaming stores move two. Measured here (2 cores, 153 MB in 300
// pieces): 20 ms against 32 ms for memcpy, also with two processes copying at once.
#include <cstddef>

namespace tessera::core {

// Copies `bytes` from `src` to `dst` (not overlapping), any alignment. Returns after a
// store fence: the data is visible to other threads once they synchronise with this one.
void copy_streaming(void* dst, const void* src, size_t bytes);

}  // namespace tessera::core
