// Which kernels the BLAS runs: a factor of 3-4 in CPU training speed.
//
// OpenBLAS (Debian's libtorch and Python torch use it) picks its kernels once, when it
// loads, from the CPU's model number. On a CPU model it does not know (seen here: a VM
// whose Xeon reports AVX-512 and AVX-512 BF16) it falls back to its generic "Prescott"
// (SSE3) kernels: one-thread sgemm ran at 24 GFLOP/s instead of 92-123 with the kernels
// the CPU supports, and the GPT example at a third of its speed (docs/benchmarks.md).
// OPENBLAS_CORETYPE overrides the choice, but only when it is set before OpenBLAS loads,
// which is before main().
//
// Tessera's programs (gpt, the examples, the benchmarks) set it before any library
// initialises, through TESSERA_TUNE_BLAS_AT_STARTUP(): to the best kernel set this CPU's
// features allow, unless OPENBLAS_CORETYPE is already set or TESSERA_BLAS_KERNELS=default.
// A program of yours does the same by putting TESSERA_TUNE_BLAS_AT_STARTUP(); in one of its
// executable's source files (not in a shared library: .preinit_array is an executable's).
// Other BLAS libraries (MKL in the PyPI torch wheels) ignore the variable. Under valgrind
// nothing is done (the restarted image would leave valgrind): set OPENBLAS_CORETYPE there.
#pragma once
#include <string>

namespace tessera::core {

// The OPENBLAS_CORETYPE this CPU's features allow ("Cooperlake", "SkylakeX", "Haswell"),
// or "" when none beats OpenBLAS's own choice.
const char* openblas_coretype_for_this_cpu();

// Runs before the shared libraries initialise (see TESSERA_TUNE_BLAS_AT_STARTUP): when
// OPENBLAS_CORETYPE should be set, the process starts itself again at once with it set
// (execve of the program's own path with the same arguments, so that ps, top and pgrep
// still show its name: argv[0] when it names this executable, else the executable's real
// path; the C library would otherwise reset the environment before OpenBLAS reads it).
// Costs one more load of the libraries.
void blas_preinit(int argc, char** argv, char** envp);

// One line for logs: the BLAS kernels in use and why, e.g. "OpenBLAS Cooperlake kernels
// (OPENBLAS_CORETYPE=Cooperlake, set by Tessera)", or "OpenBLAS Prescott kernels (generic;
// this CPU supports Cooperlake: see core/blas.h)", or "no OpenBLAS in this process".
std::string blas_summary();

}  // namespace tessera::core

// Sets OpenBLAS's kernels for this executable before any library initialises.
#define TESSERA_TUNE_BLAS_AT_STARTUP()                                                             \
  __attribute__((section(".preinit_array"), used)) static void (*tessera_blas_preinit_entry_)( \
      int, char**, char**) = &::tessera::core::blas_preinit
