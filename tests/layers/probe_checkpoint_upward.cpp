// Compiled as part of the checkpoint layer's interop/ folder by
// Layers.CheckpointInteropCannotIncludeTheReader: the readers of other programs' files sit
// below the checkpoint reader, so its header is not on their include path and this file
// must not compile.
#include "tessera/checkpoint/reader.h"

int tessera_layer_probe_checkpoint_upward() { return 0; }
