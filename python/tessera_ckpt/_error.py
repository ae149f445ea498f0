"""The package's errors (C++: src/tessera/core/error.h, tessera::Error): every refusal is a
CheckpointError whose message names the file and, where one is at fault, the key."""


class CheckpointError(Exception):
    """A checkpoint that cannot be read: missing, incomplete, corrupt or not Tessera's.
    The message names the file and, where one is at fault, the key."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The checkpoint path (or a data file it lists) does not exist."""


def fail(*parts):
    raise CheckpointError("".join(str(p) for p in parts))
