// Bytes of heap memory live in the process, counted by replacing the global operator new
// and delete (alloc_count.cpp): every std::vector, std::string, std::map and nlohmann::json
// node of the planning code (libtessera included, which calls the replaced operators)
// goes through them. Each block counts as malloc_usable_size() of it, the bytes malloc
// really set aside. No malloc hook, no sampling: live() is exact at any instant, and
// peak() is the highest live() since the last reset_peak().
#pragma once
#include <cstdint>

namespace scale::alloc {

int64_t live();
int64_t peak();
// Sets the peak to the current live bytes; returns them.
int64_t reset_peak();

}  // namespace scale::alloc
