"""Read Tessera checkpoints from Python, without Tessera.

    import tessera_ckpt
    sd = tessera_ckpt.load("runs/gpt/checkpoints/last.ckpt")            # every key, save order
    model.load_state_dict(tessera_ckpt.load(path, prefix="model."))     # one part, prefix stripped
    print(tessera_ckpt.inspect(path))                                     # what is in it, no data read
    tessera_ckpt.verify(path)                                             # every checksum, or CheckpointError

A checkpoint is a sharded directory (tessera-checkpoint.json + one safetensors data file per
rank, any world size; format version 1 or 2) or a consolidated safetensors file
(docs/checkpoint-format.md), or a Hugging Face model directory (_interop_hf_dir.py). Tensors
come back whole (or some dim-0 rows of one: ``Checkpoint.get(key, rows=(begin, end))``),
assembled from their pieces, on the CPU; plain values as int, float, bool, str, bytes (an empty
nested dict as {}). Files are read with plain file I/O, only the byte ranges needed, and of a
version-2 checkpoint only the data files that hold what is read are opened; nothing is
unpickled or executed. Requires torch and google-crc32c (hardware CRC32C; without it a slow
pure-Python CRC is used).

Each private module follows one C++ file and is named after it (_format_metadata.py:
src/tessera/checkpoint/format/metadata.cpp); docs/python.md#the-code maps them all.
"""
from . import _crc32c, _offline, _verify
from ._error import CheckpointError, CheckpointNotFoundError
from ._offline import inspect
from ._verify import verify
from ._reader import CheckpointReader, load

__all__ = ["load", "inspect", "verify", "Checkpoint", "CheckpointError", "CheckpointNotFoundError", "crc32c"]
__version__ = "2.0"

crc32c = _crc32c.crc32c


class Checkpoint(CheckpointReader):
    """An open checkpoint: its metadata parsed and checked, data files opened on demand; what
    it holds is read by CheckpointReader (_reader.py), and it inspects and verifies itself as
    inspect() and verify() do (_offline.py, _verify.py).

        with tessera_ckpt.Checkpoint(path) as ck:
            ck.keys()              # every FQN, save order
            ck["model.w"]          # one tensor, whole, or a plain value
            ck.get("model.w", rows=(2, 5))   # dim-0 rows [2, 5) of it: only the pieces holding them are read
            ck.load(prefix="model.")         # as load(path, prefix="model.")
    """

    def inspect(self):
        return _offline.inspect_checkpoint(self)

    def verify(self):
        return _verify.verify_checkpoint(self)
