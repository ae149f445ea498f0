"""A PyTorch Distributed Checkpoint (DCP) storage backend for Tessera checkpoints.

    import torch.distributed.checkpoint as dcp
    import tessera_ckpt.dcp

    # load a Tessera checkpoint (sharded at any world size, format 1, 2 or 3, or a consolidated
    # safetensors file) into a plain or FSDP2 / DTensor state dict, at any world size
    dcp.load({"model": model.state_dict()}, storage_reader=tessera_ckpt.dcp.Reader(path))

    # write a Tessera format-2 sharded checkpoint from any state dict DCP can save
    dcp.save({"model": model.state_dict(), "optimizer": optim_sd}, storage_writer=tessera_ckpt.dcp.Writer(path))

Keys: DCP flattens nested dicts with "." exactly as Tessera does, so ``{"model": {...}}``
meets the checkpoint's ``model.<name>`` keys. The Writer also stores DCP's flatten mapping
(each key's path of dict keys and list indices) in the metadata's ``dcp_nesting`` member, so
that a load into an empty state dict (``format_utils.dcp_to_torch_save``,
``_load_state_dict_from_keys``) gets the nested dict back and can pick keys like ``"model"``;
a checkpoint without it (Tessera's own saves, other writers) comes back with flat keys, as
``tessera_ckpt.load`` gives them. ``Writer(path, overwrite=False)`` refuses a checkpoint
already at ``path``, as DCP's FileSystemWriter does.

Reader: each rank reads only the byte ranges of the pieces its ReadItems need (rounded out
to the 4 MiB checksum blocks that cover them) and verifies those blocks' CRC32C; plain values
are served to DCP as the torch.save'd buffer its planner expects.

Writer: each rank writes ``data-rank%05d.safetensors`` of its WriteItems, the coordinator
writes ``tessera-checkpoint.json`` (format 2: ``whole`` / ``chunk`` layouts where the pieces
follow those rules, else ``list``), everything into a temporary sibling directory that is
renamed into place at the end (docs/checkpoint-format.md §4): a failed save leaves the previous
checkpoint at the path. Non-tensor values become Tessera plain values (int, float, bool, str,
bytes); tuples, lists and dicts of them are flattened to ``KEY.0``, ``KEY.name`` (as
``tessera ckpt import-dcp`` does) and ``None`` is left out, with their shape recorded in the
metadata's ``dcp_values`` member so that the Reader hands DCP back the same objects. Any other
value is refused, naming its key.

Needs torch 2.2 or later (``torch.distributed.checkpoint.load`` / ``save``); ``import
tessera_ckpt`` itself does not import this module. The code: _dcp_reader.py (Reader),
_dcp_writer.py (Writer, committing through _storage_commit.py), _dcp_members.py (``dcp_values``
and ``dcp_nesting``), _trainer_checkpoint.py (TrainerState, converting the optimizer's state
with _state_optimizer_state.py).
"""
import torch

# What the Reader and Writer use of DCP, imported here first: on a torch without it the import
# of this module fails with the message below, not somewhere inside theirs.
try:
    import torch.distributed.checkpoint as _dcp
    from torch.distributed.checkpoint import StorageReader, StorageWriter  # noqa: F401
    from torch.distributed.checkpoint.metadata import (  # noqa: F401
        BytesStorageMetadata, ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties, TensorStorageMetadata)
    from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType  # noqa: F401
    from torch.distributed.checkpoint.storage import WriteResult  # noqa: F401
    from torch.futures import Future  # noqa: F401

    if not (hasattr(_dcp, "load") and hasattr(_dcp, "save")):
        raise ImportError("torch.distributed.checkpoint has no load/save")
except ImportError as _e:  # torch 1.x: DCP missing or a prototype with another interface
    raise ImportError(f"tessera_ckpt.dcp needs torch 2.2 or later with torch.distributed.checkpoint "
                      f"(load/save); this is torch {torch.__version__} ({_e}). The rest of tessera_ckpt "
                      "works without it.") from None

from ._dcp_reader import Reader  # noqa: E402
from ._dcp_writer import Writer  # noqa: E402
from ._trainer_checkpoint import TrainerState  # noqa: E402

__all__ = ["Reader", "TrainerState", "Writer"]
