// The Trainer's stages: which of fit / validate / test is running (Trainer::stage(),
// Callback::setup / teardown), with the word each prints as in logs and messages.
#pragma once

namespace tessera::trainer {

enum class Stage {
  None,      // outside fit / validate / test
  Fit,       // Trainer::fit (its validation and sanity batches included)
  Validate,  // Trainer::validate
  Test,      // Trainer::test
};

// "fit", "validate", "test"; "none" outside them.
inline const char* to_string(Stage stage) {
  switch (stage) {
    case Stage::Fit: return "fit";
    case Stage::Validate: return "validate";
    case Stage::Test: return "test";
    case Stage::None: break;
  }
  return "none";
}

}  // namespace tessera::trainer
