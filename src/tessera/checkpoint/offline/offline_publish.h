// The output handling of the offline operations (offline.cpp), for the other writers
// behind `tessera ckpt` (hf_export.cpp): the same source-vs-output check and the same
// publish through a temporary sibling, registered so that abandon_output_in_progress()
// (the CLI's interrupt handler) removes an unfinished output. Internal to the library.
#pragma once
#include <functional>
#include <string>

#include "tessera/checkpoint/format/metadata.h"

namespace tessera::checkpoint {

// Refuses (tessera::Error naming both paths) an output that is the source `src` (or the
// location `m` was read from), lies inside it or contains it; real paths compared.
void offline_check_not_source(const std::string& src, const CheckpointMetadata& m, const std::string& out);

// Writes `out` through a temporary sibling: `write(tmp)` fills it (a directory when
// `dir`, else a file; created before the call), then one atomic rename publishes it
// (commit_rename: the caller has checked that `out` may be replaced). On any error, or
// after an interrupt, the temporary is removed and `out` is untouched.
void offline_publish(const std::string& out, bool dir, const std::function<void(const std::string& tmp)>& write);

}  // namespace tessera::checkpoint
