"""The atomic commit of a checkpoint directory (C++: src/tessera/checkpoint/storage/commit.cpp,
docs/checkpoint-format.md §4): the temporary sibling `.NAME.tessera-tmp-PID-N` a save writes
into, the rename or exchange that publishes it, the removal of what earlier saves left, and,
for readers, the previous checkpoint an interrupted publish left aside at
`.NAME.tessera-old-*`. The DCP Writer (_dcp_writer.py) commits through it."""
import ctypes
import errno
import os
import shutil
import stat
import sys

from ._error import CheckpointError
from ._format_metadata import METADATA_FILE
from ._storage_file import fsync_dir

_tmp_counter = [0]
_own_temps = {}  # destination -> temporaries this process created for it (left by a failed save)


def aside_sibling(path):
    """A `.NAME.tessera-old-*` sibling holding a whole checkpoint: where the previous one is
    during the one window of a publish without RENAME_EXCHANGE (docs/checkpoint-format.md 4)."""
    parent = os.path.dirname(os.path.abspath(path))
    prefix = "." + os.path.basename(os.path.normpath(path)) + ".tessera-old-"
    try:
        names = sorted(os.listdir(parent))
    except OSError:
        return None
    for n in names:
        p = os.path.join(parent, n)
        if n.startswith(prefix) and os.path.exists(os.path.join(p, METADATA_FILE)):
            return p
    return None

def _pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def check_destination(dest):
    """Case 3 of docs/checkpoint-format.md §4: only a missing path, an empty directory or a
    Tessera checkpoint directory may be replaced."""
    if os.path.islink(dest):
        raise CheckpointError(f"'{dest}' is a symbolic link (to '{os.readlink(dest)}'): refusing to replace it; "
                              "give the target's path")
    if not os.path.lexists(dest):
        return
    st = os.stat(dest)
    if not stat.S_ISDIR(st.st_mode):
        raise CheckpointError(f"'{dest}' exists and is not a directory: refusing to replace it with a sharded "
                              "checkpoint (remove it, or choose another path)")
    if os.listdir(dest) and not os.path.isfile(os.path.join(dest, METADATA_FILE)):
        raise CheckpointError(f"'{dest}' is a non-empty directory without {METADATA_FILE}, not a Tessera "
                              "checkpoint: refusing to replace it")


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a, b):
    """renameat2(RENAME_EXCHANGE): True when the two paths were swapped atomically."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, getattr(errno, "EOPNOTSUPP", errno.ENOTSUP)):
        return False
    raise OSError(err, f"renameat2(RENAME_EXCHANGE) of '{a}' and '{b}' failed: {os.strerror(err)}")


def refuse_existing(dest):
    """``overwrite=False`` (DCP's FileSystemWriter's meaning): a checkpoint at ``dest`` stays."""
    if os.path.isfile(os.path.join(dest, METADATA_FILE)):
        raise CheckpointError(f"'{dest}' already holds a Tessera checkpoint and the Writer has overwrite=False: "
                              "refusing to replace it (nothing was written)")


def publish(tmp, dest, overwrite=True):
    """Puts the finished temporary directory at ``dest`` (§4): rename when nothing (or an
    empty directory) is there, else swap with the Tessera checkpoint there and remove it
    (unless ``overwrite`` is False)."""
    check_destination(dest)
    if not overwrite:
        refuse_existing(dest)
    parent = os.path.dirname(dest) or "."
    if not os.path.lexists(dest) or not os.listdir(dest):
        os.rename(tmp, dest)  # rename(2) replaces an empty directory
    elif _exchange(tmp, dest):
        shutil.rmtree(tmp)  # the old checkpoint, now at the temporary name
    else:
        base = os.path.basename(dest)
        _tmp_counter[0] += 1
        old = os.path.join(parent, f".{base}.tessera-old-{os.getpid()}-{_tmp_counter[0]}")
        os.rename(dest, old)
        os.rename(tmp, dest)
        shutil.rmtree(old)
    fsync_dir(parent)


def remove_stale_temps(dest):
    """Temporaries of earlier saves to ``dest`` that will never be published: those of
    processes no longer running here, and those this process left after a failed save."""
    parent = os.path.dirname(dest) or "."
    prefix = "." + os.path.basename(dest) + ".tessera-tmp-"
    try:
        names = os.listdir(parent)
    except OSError:
        return
    mine = _own_temps.pop(dest, set())
    for n in names:
        if not n.startswith(prefix):
            continue
        p = os.path.join(parent, n)
        pid = n[len(prefix):].split("-", 1)[0]
        if p in mine or (pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid))):
            shutil.rmtree(p, ignore_errors=True)


def make_temp_dir(dest):
    """Creates a fresh temporary sibling directory of ``dest``
    (`.NAME.tessera-tmp-PID-N`) and remembers it as this process's, until forget_temp."""
    parent = os.path.dirname(dest)
    while True:
        _tmp_counter[0] += 1
        tmp = os.path.join(parent, f".{os.path.basename(dest)}.tessera-tmp-{os.getpid()}-{_tmp_counter[0]}")
        try:
            os.mkdir(tmp)
            break
        except FileExistsError:
            continue
    _own_temps.setdefault(dest, set()).add(tmp)
    return tmp


def forget_temp(dest, tmp):
    """``tmp`` was published or removed: remove_stale_temps no longer needs to remove it."""
    _own_temps.get(dest, set()).discard(tmp)
