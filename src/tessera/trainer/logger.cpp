#include "tessera/trainer/logger.h"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "tessera/core/error.h"

namespace fs = std::filesystem;

namespace tessera::trainer {

namespace {
fs::path version_base(const std::string& root, const std::string& name) {
  return name.empty() ? fs::path(root) : fs::path(root) / name;
}

// Marks an error message travelling through `share` in place of a directory.
constexpr char kErrorMark[] = "\x01tessera-logger-error:";
}  // namespace

std::string next_version_dir(const std::string& root, const std::string& name) {
  const fs::path base = version_base(root, name);
  long next = 0;
  std::error_code ec;
  if (fs::is_directory(base, ec)) {
    for (const auto& e : fs::directory_iterator(base, ec)) {
      const std::string n = e.path().filename().string();
      if (n.rfind("version_", 0) != 0 || !e.is_directory()) continue;
      const std::string num = n.substr(8);
      if (num.empty() || num.size() > 9 || num.find_first_not_of("0123456789") != std::string::npos) continue;
      next = std::max(next, std::stol(num) + 1);
    }
  }
  return (base / ("version_" + std::to_string(next))).string();
}

std::string create_run_dir(const RunDirSpec& spec) {
  std::error_code ec;
  auto make_all = [&](const fs::path& p) {
    fs::create_directories(p, ec);
    TESSERA_CHECK(!ec, "logger: cannot create the log directory '", p.string(), "': ", ec.message());
  };
  if (spec.flat_dir) {
    TESSERA_CHECK(!spec.flat_dir->empty(), "logger: the flat log directory is empty");
    make_all(*spec.flat_dir);
    return *spec.flat_dir;
  }
  const fs::path base = version_base(spec.save_dir, spec.name);
  if (spec.version) {
    TESSERA_CHECK(*spec.version >= 0, "logger: version must be >= 0, got ", *spec.version);
    const fs::path dir = base / ("version_" + std::to_string(*spec.version));
    make_all(dir);
    return dir.string();
  }
  make_all(base);
  // create_directory is atomic: when another run claims the same version first, take the next.
  for (int attempt = 0; attempt < 1000; ++attempt) {
    const std::string dir = next_version_dir(spec.save_dir, spec.name);
    if (fs::create_directory(dir, ec)) return dir;
    TESSERA_CHECK(!ec || ec == std::errc::file_exists, "logger: cannot create the log directory '", dir,
                  "': ", ec.message());
  }
  throw Error(concat("logger: could not claim a free version directory below '", base.string(), "' in 1000 attempts"));
}

std::string setup_run_dir(const RunDirSpec& spec, bool rank_zero,
                          const std::function<std::string(const std::string&)>& share) {
  if (!share) {
    TESSERA_CHECK(rank_zero, "logger: setup on a rank other than zero needs a share function (the run "
                             "directory is chosen by rank zero)");
    return create_run_dir(spec);
  }
  std::string dir, error;
  if (rank_zero) {
    try {
      dir = create_run_dir(spec);
    } catch (const std::exception& e) {
      error = e.what();
      dir = kErrorMark + error;  // tell the other ranks instead of leaving them waiting
    }
  }
  dir = share(dir);
  if (dir.rfind(kErrorMark, 0) == 0) {
    TESSERA_CHECK(!rank_zero || error.empty(), error);
    throw Error(concat("logger: rank zero could not create the log directory: ", dir.substr(sizeof(kErrorMark) - 1)));
  }
  return dir;
}

RunDirLogger::RunDirLogger(std::string save_dir, std::string name, std::optional<int> version) {
  spec_.save_dir = std::move(save_dir);
  spec_.name = std::move(name);
  spec_.version = version;
}

void RunDirLogger::setup(bool rank_zero, const std::function<std::string(const std::string&)>& share) {
  if (set_up_) return;  // once per object: every rank has the same state, so no rank waits in share
  dir_ = setup_run_dir(spec_, rank_zero, share);
  write_ = rank_zero;
  if (write_) on_writer_setup();  // throws before this logger counts as set up
  set_up_ = true;
}

bool RunDirLogger::writes() {
  if (!set_up_) setup(true, {});  // used on its own, outside a Trainer: a single writer
  return write_;
}

std::string yaml_scalar(const std::string& s) {
  auto lower = s;
  std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return std::tolower(c); });
  // Words YAML 1.1/1.2 read as null or as booleans other than true/false: quoted so they
  // stay strings. Numbers and true/false stay plain so that "lr: 0.001" reads back as
  // the number the caller meant.
  static const char* const kWords[] = {"null", "~", "yes", "no", "on", "off", "y", "n"};
  bool plain = !s.empty() && std::none_of(std::begin(kWords), std::end(kWords),
                                          [&](const char* w) { return lower == w; });
  if (plain) {
    // A leading indicator character starts a YAML construct; '-' is allowed only as the
    // sign of a number ("-0.5").
    const bool negative_number =
        s.size() > 1 && s[0] == '-' && (std::isdigit(static_cast<unsigned char>(s[1])) || s[1] == '.');
    plain = std::string("-?:,[]{}#&*!|>'\"%@`").find(s.front()) == std::string::npos || negative_number;
  }
  if (plain) {
    plain = s.front() != ' ' && s.back() != ' ' && s.back() != ':' && s.find(": ") == std::string::npos &&
            s.find(" #") == std::string::npos && s.find('\t') == std::string::npos;
    for (unsigned char c : s)
      if (c < 0x20 || c == 0x7f) plain = false;
  }
  if (plain) return s;
  std::string o = "\"";
  char buf[8];
  for (unsigned char c : s) {
    switch (c) {
      case '"': o += "\\\""; break;
      case '\\': o += "\\\\"; break;
      case '\n': o += "\\n"; break;
      case '\t': o += "\\t"; break;
      case '\r': o += "\\r"; break;
      default:
        if (c < 0x20 || c == 0x7f) {
          std::snprintf(buf, sizeof buf, "\\x%02x", c);
          o += buf;
        } else {
          o += static_cast<char>(c);
        }
    }
  }
  return o + "\"";
}

void write_file_atomic(const std::string& path, const std::string& content) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    TESSERA_CHECK(out, "logger: cannot write '", tmp, "'");
    out.write(content.data(), static_cast<std::streamsize>(content.size()));
    out.flush();
    TESSERA_CHECK(out.good(), "logger: writing '", tmp, "' failed");
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  TESSERA_CHECK(!ec, "logger: cannot rename '", tmp, "' to '", path, "': ", ec.message());
}

void write_hparams_yaml(const std::string& dir, const std::map<std::string, std::string>& hparams) {
  std::string y;
  if (hparams.empty()) y = "{}\n";
  for (const auto& [k, v] : hparams) y += yaml_scalar(k) + ": " + yaml_scalar(v) + "\n";
  write_file_atomic((fs::path(dir) / "hparams.yaml").string(), y);
}

}  // namespace tessera::trainer
