// What tests of the checkpoint layer reach inside it through: faults a save injects on one
// rank, and a hook in the async save. Not set in any real run; internal to the layer (not
// installed, so not part of its interface).
#pragma once
#include <cstdint>
#include <functional>
#include <string>

namespace tessera::checkpoint {

// Tests only (issue 35): whether TESSERA_TEST_SAVE_FAULT is "<rank>:<what>" for this
// rank and fault. save_full.cpp reads it to make a consolidated save fail on one rank:
// "write" throws where the rank hands a piece to its writer (as a failed narrow, copy or
// thread start would), "flip" inverts a byte the rank wrote after its fsync (as a write
// lost on an incoherent filesystem would). Not set in any real run.
bool test_fault(int rank, const char* what);

// Tests only: each later save_async's background thread calls `hook` before it writes
// anything (an exception from it fails that save); tests block in it to see that
// save_async returned while the write had not begun. Empty: no hook (the default).
// Here, not in checkpoint.h, so that it is not part of the installed interface.
void set_async_save_hook_for_tests(std::function<void()> hook);

// Inverts the byte at `at` of `path` and fsyncs (the fault "flip" above, and tests that
// damage a file).
void flip_byte(const std::string& path, uint64_t at);

}  // namespace tessera::checkpoint
