// tessera ckpt: offline checkpoint tool (placeholder until the checkpoint layer lands).
#include <iostream>

#include "commands.h"

namespace tessera::cli {

Runner add_ckpt_command(CLI::App& app) {
  CLI::App* sub = app.add_subcommand("ckpt", "Inspect, verify, consolidate, reshard and export checkpoints");
  (void)sub;
  return []() {
    std::cerr << "tessera ckpt: not available in this build yet\n";
    return 2;
  };
}

}  // namespace tessera::cli
