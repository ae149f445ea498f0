// Compiled as part of the checkpoint layer's interop/ folder by
// Layers.CheckpointPartFindsItsOwnAndLowerFolders: its own folder's headers, those of the
// folders below it (format/, storage/) and those of the layers below checkpoint are found.
#include "tessera/checkpoint/format/metadata.h"
#include "tessera/checkpoint/interop/torch_file.h"
#include "tessera/checkpoint/storage/file.h"
#include "tessera/state/state_dict.h"

int tessera_layer_probe_checkpoint_own_and_lower() { return 0; }
