// `tessera`: the launcher (`tessera run`) and the offline checkpoint tool (`tessera ckpt`).
#include <algorithm>
#include <iostream>

#include "commands.h"
#include "tessera/config.h"
#include "tessera/core/cpu_allocator.h"
#include "tessera/core/error.h"

int main(int argc, char** argv) {
  CLI::App app{"Tessera: fully sharded training and distributed checkpoints for libtorch", "tessera"};
  app.set_version_flag("--version", std::string("tessera ") + TESSERA_VERSION + " (libtorch " +
                                        TESSERA_TORCH_VERSION + ")");
  app.require_subcommand(1);
  app.failure_message([](const CLI::App*, const CLI::Error& e) {
    return std::string("tessera: error: ") + e.what() + "\nRun with --help for more information.\n";
  });
  std::vector<std::pair<CLI::App*, tessera::cli::Runner>> commands;
  auto run = tessera::cli::add_run_command(app);
  auto ckpt = tessera::cli::add_ckpt_command(app);
  // Everything after the first "--" is the program `tessera run` starts; CLI11 sees
  // only what comes before it.
  std::vector<std::string> args;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--") {
      for (int j = i + 1; j < argc; ++j) tessera::cli::trailing_args().push_back(argv[j]);
      tessera::cli::trailing_args_given() = true;
      break;
    }
    args.push_back(argv[i]);
  }
  std::reverse(args.begin(), args.end());
  try {
    app.parse(args);
  } catch (const CLI::ParseError& e) {
    // --help and --version exit 0; every usage error exits 2 (CLI11's own codes, 105-114,
    // are not part of the interface).
    return app.exit(e) == 0 ? 0 : tessera::cli::kUsageError;
  }
  try {
    if (app.got_subcommand("run")) return run();
    if (app.got_subcommand("ckpt")) {
      tessera::core::install_cpu_allocator();  // the CPU memory policy (core/cpu_allocator.h)
      return ckpt();
    }
  } catch (const std::exception& e) {
    tessera::cli::wait_if_interrupted();  // the interrupt ends the process, not this error
    std::cerr << "tessera: error: " << e.what() << "\n";
    return 2;
  }
  return 0;
}
