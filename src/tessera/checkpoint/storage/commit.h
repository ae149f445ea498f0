// The atomic commit of a finished checkpoint or output (docs/checkpoint-format.md §4):
// temporary siblings, the rename or exchange that publishes one, and the recovery of what
// an interrupted save or commit left beside the destination.
#pragma once
#include <string>

#include "tessera/checkpoint/storage/file.h"

namespace tessera::checkpoint {

// A fresh temporary sibling name for `dest`: "<parent>/.<name>.tessera-tmp-<pid>-<n>".
// This and the other sibling helpers below refuse a `dest` with control characters
// (check_path_chars), so every writer that publishes through them refuses it too.
std::string temp_sibling(const std::string& dest);
// Publishes `tmp` (a finished, fsync'ed file or directory) at `dest`: a rename when
// dest is absent or an empty directory; otherwise an atomic exchange (directories,
// RENAME_EXCHANGE, or a two-rename fallback) / rename (files), then removal of the old
// one. The caller has checked that dest may be replaced. fsyncs the parent.
void commit_rename(const std::string& tmp, const std::string& dest);
// Removes temporary siblings of `dest` left by crashed saves ("<parent>/.<name>.tessera-tmp-*"),
// and restores a previous checkpoint left aside by an interrupted fallback commit when
// dest is missing. Called before a save.
void recover_siblings(const std::string& dest);
// Removes temporary siblings of `dest` ("<parent>/.<name>.tessera-tmp-<pid>-<n>") whose
// process <pid> is no longer running on this host; those of live processes are kept. For
// writers that may run next to another writer of the same output (`tessera ckpt`).
void remove_dead_temporaries(const std::string& dest);
// The previous checkpoint left aside by an interrupted commit ("" when none): used by
// readers when `dest` is missing.
std::string aside_sibling(const std::string& dest);

// The same for a `dest` checked where it entered (CheckedPath): not checked again. The
// temporary sibling is checked once, as it is named ("temporary path").
CheckedPath temp_sibling(const CheckedPath& dest);
void commit_rename(const CheckedPath& tmp, const CheckedPath& dest);
void recover_siblings(const CheckedPath& dest);
void remove_dead_temporaries(const CheckedPath& dest);

}  // namespace tessera::checkpoint
