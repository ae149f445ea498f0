// Compiled as part of the sharding layer by Layers.UpwardIncludeFailsToCompile: the
// checkpoint layer sits above sharding, so its header is not on this layer's include path
// and this file must not compile.
#include "tessera/checkpoint/checkpoint.h"

int tessera_layer_probe_upward() { return 0; }
