// TrainerOptions::limit_val_batches as a count: at most n validation batches in every
// validation of fit and in validate(); 0 runs none (what `gpt train --limit-val-batches`
// sets; issue 35).
#include <gtest/gtest.h>

#include "support/test_util.h"
#include "tessera/trainer/trainer.h"
#include "trainer/regression_module.h"
#include "trainer/trainer_test_util.h"

using namespace tessera;
using namespace tessera::testing;

TEST(TrainerLimitVal, CountsValidationBatchesInFitAndValidate) {
  TempDir tmp;
  auto o = local_options(tmp.path);
  o.max_epochs = 1;          // 16 samples, batch 4: 4 steps
  o.val_check_interval = 2;  // validations after steps 2 and 4
  o.eval_batch_size = 2;     // 10 validation samples: 5 batches available
  o.limit_val_batches = 3;
  trainer::Trainer t(o);
  Reg m;
  const auto val = regression_data(10, 0.3);
  t.fit(m, regression_data(16), val);
  EXPECT_EQ(m.validations, 2);
  EXPECT_EQ(m.val_batches, 2 * 3);
  t.validate(m, val);
  EXPECT_EQ(m.validations, 3);
  EXPECT_EQ(m.val_batches, 3 * 3);

  TempDir tmp0;
  auto o0 = local_options(tmp0.path);
  o0.max_epochs = 1;
  o0.val_check_interval = 2;
  o0.limit_val_batches = 0;
  trainer::Trainer t0(o0);
  Reg m0;
  t0.fit(m0, regression_data(16), val);
  EXPECT_EQ(t0.global_step(), 4);
  EXPECT_EQ(m0.val_batches, 0);
  EXPECT_TRUE(t0.validate(m0, val).empty());
  EXPECT_EQ(m0.val_batches, 0);
}
