#include "tessera/distributed/launch/output.h"

#include <unistd.h>

#include <cerrno>
#include <cstdio>

namespace tessera::distributed::launch_output {
namespace {

// A rank's live line. When the launcher writes the ranks' output itself and its stderr
// is a terminal, text a rank redraws with '\r' on stderr (the Trainer's progress bar,
// told by TESSERA_TTY_COLUMNS that a terminal shows it) is shown as it comes, as one
// "[rank R] ..." line redrawn in place at the bottom: other output clears it, is
// written, and the line is drawn again below; the rank's '\n' makes it a normal line.
// Elsewhere (output to a file or a pipe, or handed to on_line) a '\r' ends a line like
// '\n' for prefixing: each redraw is written as "[rank R] text\r", so a file keeps every
// state and a terminal showing it later still shows one prefixed line; "\r\n" is one end.
struct LiveLine {
  bool enabled = false, on = false;
  int rank = -1;
  std::string shown;  // what the terminal line holds now
};
LiveLine g_live;

// The stream whose line was left unfinished on the output (a piece of a long line), if
// any. Anything else written first ends that line with '\n' (its rest comes later with
// a fresh prefix), so that every line of the output starts with its rank's prefix; the
// live line is not shown while a line is unfinished.
Stream* g_open = nullptr;
FILE* g_open_file = nullptr;

std::string rank_prefix(int rank) { return "[rank " + std::to_string(rank) + "] "; }

void live_write(const std::string& s) {
  std::fwrite(s.data(), 1, s.size(), stderr);
  std::fflush(stderr);
}
// "\r" + text, padded over what the line showed before.
std::string live_redraw(const std::string& text) {
  std::string s = "\r" + text;
  if (text.size() < g_live.shown.size()) s.append(g_live.shown.size() - text.size(), ' ');
  return s;
}
void live_clear() {
  if (g_live.on && !g_open) live_write(live_redraw("") + "\r");
}
void live_restore() {
  if (g_live.on && !g_open) live_write("\r" + g_live.shown);
}

// Appends to `w` what the launcher writes for `text` of rank `rank` ended by `term`
// ('\n', '\r', or 0 for a piece of a longer line). Sets ends_live when this ends the
// live line (its final state becomes a normal line).
void render(std::string& w, int rank, bool is_err, Stream& s, const std::string& text, char term, bool& ends_live) {
  if (term == '\n' && text.empty() && s.after_cr && !s.open) {  // "\r\n": the line ended at the '\r'
    w += '\n';
    s.after_cr = false;
    return;
  }
  size_t from = 0;
  if (g_live.enabled) {  // on a terminal, text before a '\r' is overwritten: only the last state shows
    const size_t r = text.rfind('\r');
    if (r != std::string::npos) {
      from = r + 1;
      if (term == '\n' && g_live.on && is_err && rank == g_live.rank) ends_live = true;
    }
  }
  if (!s.open) w += rank_prefix(rank);
  w.append(text, from, std::string::npos);
  if (term) w += term;
  s.open = term == 0;
  s.after_cr = term == '\r';
}

// The unfinished tail of a rank's stderr: when it redraws with '\r', shows its newest
// state as the live line (one live line at a time; the first rank to draw keeps it).
void live_update(const LaunchOptions& o, int rank, std::string& buf) {
  if (!g_live.enabled || o.on_line) return;
  const size_t r = buf.rfind('\r');
  if (r == std::string::npos || (g_live.on && g_live.rank != rank)) return;
  buf.erase(0, r);  // earlier states are overwritten anyway
  if (buf.size() == 1) return;  // "\r" alone: the text follows
  end_open_line();
  const std::string text = rank_prefix(rank) + buf.substr(1);
  live_write(live_redraw(text));
  g_live.on = true;
  g_live.rank = rank;
  g_live.shown = text;
}

// Writes (or hands to on_line) what a stream's buffer holds up to its last line end,
// a line longer than kMaxPending in pieces of that size (the last one may be its end),
// and at end of file (eof) the rest.
void process(const LaunchOptions& o, int rank, bool is_err, Stream& s, bool eof) {
  std::string& buf = s.buf;
  std::string w;  // what this call writes (one write for all of it)
  bool ends_live = false;
  auto deliver = [&](size_t from, size_t len, char term) {
    if (!o.on_line) {
      render(w, rank, is_err, s, buf.substr(from, len), term, ends_live);
      return;
    }
    if (!(term == '\n' && len == 0 && s.after_cr)) o.on_line(rank, is_err, buf.substr(from, len));
    s.after_cr = term == '\r';
  };
  const char* ends = g_live.enabled ? "\n" : "\r\n";
  size_t start = 0;
  for (;;) {
    const size_t p = buf.find_first_of(ends, start);
    if (p == std::string::npos && g_live.enabled) {  // only the last state of a redrawn line will show
      const size_t r = buf.rfind('\r');
      if (r != std::string::npos && r > start) start = r;
    }
    const size_t len = (p == std::string::npos ? buf.size() : p) - start;
    if (p != std::string::npos && len <= kMaxPending) {
      deliver(start, len, buf[p]);
      start = p + 1;
    } else if (len >= kMaxPending) {
      deliver(start, kMaxPending, 0);
      start += kMaxPending;
    } else {
      break;
    }
  }
  if (eof && (start < buf.size() || (!o.on_line && (s.open || s.after_cr)))) {
    deliver(start, buf.size() - start, '\n');
    start = buf.size();
  }
  buf.erase(0, start);
  if (!w.empty()) {
    FILE* f = is_err ? stderr : stdout;
    if (g_open && g_open != &s) end_open_line();
    live_clear();
    if (ends_live) {
      g_live.on = false;
      g_live.shown.clear();
    }
    std::fflush(stdout);
    std::fwrite(w.data(), 1, w.size(), f);
    std::fflush(f);
    if (s.open) {
      g_open = &s;
      g_open_file = f;
    } else {
      if (g_open == &s) g_open = nullptr;
      live_restore();
    }
  }
  if (is_err && !eof) live_update(o, rank, buf);
}

}  // namespace

// Shows the live line again below the line it ends.
void end_open_line() {
  if (!g_open) return;
  std::fputc('\n', g_open_file);
  std::fflush(g_open_file);
  g_open->open = false;
  g_open = nullptr;
  g_open_file = nullptr;
  live_restore();
}

void live_end() {
  end_open_line();
  if (g_live.on) live_write("\n");
  g_live.on = false;
  g_live.shown.clear();
}

void live_start() {
  g_live = LiveLine{};
  g_live.enabled = true;
}

void live_stop() {
  live_end();
  g_live = LiveLine{};
}

bool pump(const LaunchOptions& o, int rank, bool is_err, Stream& s) {
  char tmp[65536];
  for (;;) {
    ssize_t n = ::read(s.fd, tmp, sizeof(tmp));
    if (n > 0) {
      s.buf.append(tmp, static_cast<size_t>(n));
      process(o, rank, is_err, s, false);
      continue;
    }
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
    if (n < 0 && errno == EINTR) continue;
    process(o, rank, is_err, s, true);
    ::close(s.fd);
    s.fd = -1;
    return false;
  }
}

}  // namespace tessera::distributed::launch_output
