// The Trainer's checks of what it is given (internal to the trainer layer): its options,
// the data of fit / validate / test, and what TrainingModule::configure_optimizers
// returned. Each throws tessera::Error naming the option or argument at fault.
#pragma once
#include "tessera/trainer/lr_scheduler.h"
#include "tessera/trainer/options.h"
#include "tessera/trainer/training_module.h"

namespace tessera::trainer {

// The options checked, with the defaults that depend on others filled in (max_epochs
// 1000 when neither limit is set; Full checkpoints unless fabric.state_dict_type is set).
TrainerOptions checked_options(TrainerOptions o);

// `fn` names the call ("Trainer::fit"), `what` the data ("training", "validation").
// allow_empty: no data at all (both tensors undefined) is fine.
void check_data(const TensorData& d, const char* fn, const char* what, bool allow_empty);

// At least one optimizer, none null; every scheduler set, its frequency >= 1 and its
// optimizer one of those configured.
void check_optimizer_config(const OptimizerConfig& oc);

}  // namespace tessera::trainer
