// How the launcher (launcher.cpp) writes its ranks' output: internal to the distributed
// layer. Each line of a rank is written with a "[rank R] " prefix (or handed to
// LaunchOptions::on_line), a line longer than kMaxPending in pieces, and on a terminal a
// rank's redrawn stderr line (a progress bar) as one live line at the bottom.
//
// Every function here runs on the launcher's thread only: the state it keeps (the live
// line, the line left unfinished on the output) is the launcher's, one launch at a time.
#pragma once
#include <cstddef>
#include <string>

#include "tessera/distributed/launch/launcher.h"

namespace tessera::distributed::launch_output {

// Output of a rank not yet written is bounded: a line longer than kMaxPending bytes is
// written in pieces of that size (the first with the "[rank R] " prefix, the rest
// continuing it), so a rank that never ends its line costs the launcher at most this much.
constexpr size_t kMaxPending = 64 * 1024;

// One of a rank's two output streams.
struct Stream {
  int fd = -1;
  std::string buf;         // text read but not yet written: no '\n' in it, at most kMaxPending bytes
  bool open = false;       // a piece of the current line was written (prefix included), its end not yet
  bool after_cr = false;   // the last text written or delivered ended with '\r'
};

// Reads what is available from `s` (rank `rank`'s stdout, or its stderr when is_err) and
// writes it (or hands it to o.on_line); returns false at end of file or error, after
// writing the rest and closing the descriptor.
bool pump(const LaunchOptions& o, int rank, bool is_err, Stream& s);

// The live line: on (launch(), when the launcher writes the ranks' output itself and its
// stderr is a terminal) until live_stop(), which ends it and forgets it.
void live_start();
void live_stop();
// Ends the live line where it is (before the launcher's own messages).
void live_end();
// Ends a rank's line left unfinished on the output (a piece of a long line) with '\n'.
void end_open_line();

}  // namespace tessera::distributed::launch_output
