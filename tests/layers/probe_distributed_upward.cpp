// Compiled as part of the distributed layer's top level (world, rendezvous, communicator) by
// Layers.DistributedCannotIncludeTheLauncher: `tessera run`'s launcher in launch/ sits above
// what every rank runs, so this file must not compile.
#include "tessera/distributed/launch/launcher.h"

int tessera_layer_probe_distributed_upward() { return 0; }
