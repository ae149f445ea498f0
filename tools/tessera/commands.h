// Subcommands of the `tessera` program; each registers itself on the CLI11 app and
// returns a function to run when it was chosen.
#pragma once
#include <CLI/CLI.hpp>
#include <functional>
#include <string>
#include <vector>

namespace tessera::cli {
// The exit code of a usage error (bad flag, missing argument) and of an input error.
constexpr int kUsageError = 2;
using Runner = std::function<int()>;
Runner add_run_command(CLI::App& app);
Runner add_ckpt_command(CLI::App& app);
// The arguments after "--" on the command line, and whether "--" was there.
std::vector<std::string>& trailing_args();
bool& trailing_args_given();
// When a SIGINT/SIGTERM/SIGHUP is being handled (`tessera ckpt` removing its unfinished
// output), waits for that handling to end the process; returns at once otherwise.
void wait_if_interrupted();
}  // namespace tessera::cli
