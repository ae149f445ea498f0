"""Files for the checkpoint layer (C++: src/tessera/checkpoint/storage/file.cpp): opening
for reading, exact reads with pread, directory fsync, path checks and the path helpers the
messages use. Errors name the path."""
import os
import stat

from ._error import CheckpointError, CheckpointNotFoundError, fail


def open_file(path):
    try:
        return os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"'{path}' does not exist") from None
    except OSError as e:
        fail("cannot open '", path, "': ", e.strerror or e)


def pread_into(fd, view, offset, path):
    """Fills the writable byte memoryview ``view`` from ``offset`` of the file."""
    done = 0
    total = len(view)
    while done < total:
        try:
            n = os.preadv(fd, [view[done:]], offset + done)
        except OSError as e:
            fail("'", path, "': read of bytes ", offset, "..", offset + total, " failed: ", e.strerror or e)
        if n == 0:
            fail("'", path, "': unexpected end of file at byte ", offset + done, " (truncated?)")
        done += n


def pread(fd, offset, n, path):
    buf = bytearray(n)
    pread_into(fd, memoryview(buf), offset, path)
    return bytes(buf)


def join_path(d, name):
    """``d/name`` as the C++ reader writes it in messages (join_path)."""
    if d in ("", "."):
        return name
    return d + name if d.endswith("/") else d + "/" + name


def escape_path(s):
    """Control characters and backslashes escaped C-style, as the C++ reader's escape_path."""
    out = []
    for ch in s:
        c = ord(ch)
        if ch == "\\":
            out.append("\\\\")
        elif ch in "\n\t\r":
            out.append({"\n": "\\n", "\t": "\\t", "\r": "\\r"}[ch])
        elif c < 0x20 or c == 0x7F:
            out.append(f"\\x{c:02x}")
        else:
            out.append(ch)
    return "".join(out)


def not_regular_file_reason(path):
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return "does not exist"
    except OSError as e:
        return f"cannot be read: {e.strerror or e}"
    m = st.st_mode
    if stat.S_ISREG(m):
        return ""
    what = ("a directory" if stat.S_ISDIR(m) else "a FIFO" if stat.S_ISFIFO(m) else "a socket" if stat.S_ISSOCK(m)
            else "a character device" if stat.S_ISCHR(m) else "a block device" if stat.S_ISBLK(m) else "not a file")
    return f"is not a regular file ({what})"


def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_path_chars(path):
    if any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in path):
        raise CheckpointError(f"checkpoint path {path!r} holds a control character: refused")
