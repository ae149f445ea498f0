// TrainingModule's methods: the default validation / test steps, access to the model,
// Fabric and Trainer while a stage runs, init_module, and metric logging (forwarded to
// the Trainer that runs the module).
#include "tessera/trainer/training_module.h"

#include <ATen/ATen.h>

#include "tessera/core/error.h"
#include "tessera/trainer/trainer.h"

namespace tessera::trainer {

void TrainingModule::validation_step(const Batch&, int64_t) {
  throw Error("Trainer: validation data was given but the TrainingModule does not override validation_step");
}

void TrainingModule::test_step(const Batch&, int64_t) {
  throw Error("Trainer::test: the TrainingModule does not override test_step");
}

torch::nn::AnyModule& TrainingModule::model() {
  TESSERA_CHECK(trainer_ && !model_.is_empty(), "TrainingModule::model(): only valid during Trainer::fit/validate/",
                "test, after configure_model");
  return model_;
}

fabric::Fabric& TrainingModule::fabric() {
  TESSERA_CHECK(trainer_, "TrainingModule::fabric(): only valid during Trainer::fit/validate/test");
  return trainer_->fabric();
}

torch::nn::AnyModule TrainingModule::init_module(const std::function<torch::nn::AnyModule()>& build) {
  TESSERA_CHECK(trainer_ && trainer_->setup_ == Trainer::Setup::ConfiguringModel,
                "TrainingModule::init_module: only valid inside configure_model()");
  return trainer_->fabric().init_module(build);
}

Trainer& TrainingModule::trainer() {
  TESSERA_CHECK(trainer_, "TrainingModule::trainer(): only valid during Trainer::fit/validate/test");
  return *trainer_;
}

void TrainingModule::log(const std::string& name, double value, bool prog_bar, bool sync_dist) {
  TESSERA_CHECK(trainer_, "TrainingModule::log('", name, "'): only valid during Trainer::fit/validate/test");
  trainer_->log_metric(name, value, prog_bar, sync_dist);
}

void TrainingModule::log(const std::string& name, const at::Tensor& value, bool prog_bar, bool sync_dist) {
  TESSERA_CHECK(value.defined() && value.numel() == 1, "TrainingModule::log('", name,
                "'): the tensor must have exactly one element, got ",
                value.defined() ? std::to_string(value.numel()) : std::string("an undefined tensor"));
  log(name, value.detach().to(at::kCPU).to(at::kDouble).item<double>(), prog_bar, sync_dist);
}

void TrainingModule::log_dict(const Metrics& metrics, bool prog_bar, bool sync_dist) {
  for (const auto& [k, v] : metrics) log(k, v, prog_bar, sync_dist);
}

}  // namespace tessera::trainer
