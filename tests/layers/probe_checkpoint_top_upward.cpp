// Compiled as part of the checkpoint layer's top level (reader, writer, the collective save,
// load and resume) by Layers.CheckpointTopLevelCannotIncludeOffline: `tessera ckpt`'s
// operations in offline/ sit above it, so this file must not compile.
#include "tessera/checkpoint/offline/offline.h"

int tessera_layer_probe_checkpoint_top_upward() { return 0; }
