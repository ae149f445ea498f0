#include "tessera/trainer/tensorboard_logger.h"

#include "tessera/core/error.h"

namespace tessera::trainer {

TensorBoardLogger::TensorBoardLogger(std::string save_dir, std::string name, std::optional<int> version) {
  spec_.save_dir = std::move(save_dir);
  spec_.name = std::move(name);
  spec_.version = version;
}
std::shared_ptr<TensorBoardLogger> TensorBoardLogger::flat(std::string dir) {
  auto l = std::make_shared<TensorBoardLogger>();
  l->spec_.flat_dir = std::move(dir);
  return l;
}
TensorBoardLogger::~TensorBoardLogger() = default;
void TensorBoardLogger::setup(bool, const std::function<std::string(const std::string&)>&) {
  throw Error("TensorBoardLogger: not implemented yet");
}
void TensorBoardLogger::log_hyperparams(const std::map<std::string, std::string>&) {
  throw Error("TensorBoardLogger: not implemented yet");
}
void TensorBoardLogger::log_metrics(const std::map<std::string, double>&, int64_t) {
  throw Error("TensorBoardLogger: not implemented yet");
}
void TensorBoardLogger::save() {}
void TensorBoardLogger::finalize() {}
void TensorBoardLogger::open() {}
void TensorBoardLogger::write_event(const std::string&) {}

}  // namespace tessera::trainer
