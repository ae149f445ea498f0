// Subcommands of the `tessera` program; each registers itself on the CLI11 app and
// returns a function to run when it was chosen.
#pragma once
#include <CLI/CLI.hpp>
#include <functional>
#include <string>
#include <vector>

namespace tessera::cli {
using Runner = std::function<int()>;
Runner add_run_command(CLI::App& app);
Runner add_ckpt_command(CLI::App& app);
// The arguments after "--" on the command line, and whether "--" was there.
std::vector<std::string>& trailing_args();
bool& trailing_args_given();
}  // namespace tessera::cli
