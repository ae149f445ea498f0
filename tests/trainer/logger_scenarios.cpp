// Rank programs for the logger tests: every rank sets up a CsvLogger and a
// TensorBoardLogger with a real byte broadcast as `share`, so rank zero alone picks and
// creates the run directory and every rank reports it.
#include <iostream>

#include "support/scenario.h"
#include "tessera/trainer/csv_logger.h"
#include "tessera/trainer/tensorboard_logger.h"

using namespace tessera;
using namespace tessera::testing;

// args: save_dir. Prints "csv_dir=<dir>" and "tb_dir=<dir>" on every rank, or
// "setup_error=<message>" when setup fails (every rank must fail, none may hang).
SCENARIO("logger_setup") {
  auto c = comm();
  const bool zero = c->rank() == 0;
  auto share = [&](const std::string& s) { return c->broadcast_bytes(s, 0); };
  trainer::CsvLogger csv(args.arg(0), "lightning_logs");
  trainer::TensorBoardLogger tb(args.arg(0), "tb");
  try {
    csv.setup(zero, share);
  } catch (const Error& e) {
    std::cout << "setup_error=" << e.what() << std::endl;
    return 0;
  }
  tb.setup(zero, share);
  std::cout << "csv_dir=" << csv.log_dir() << "\ntb_dir=" << tb.log_dir() << std::endl;
  // Every rank logs; only rank zero's values may reach the files.
  csv.log_hyperparams({{"rank", std::to_string(c->rank())}});
  csv.log_metrics({{"loss", 1.0 + c->rank()}, {"epoch", 0}}, 1);
  csv.save();
  tb.log_metrics({{"loss", 1.0 + c->rank()}}, 1);
  tb.save();
  std::cout << "tb_file=" << tb.events_path() << std::endl;
  c->barrier();
  return 0;
}
