"""CRC32C (Castagnoli: polynomial 0x1EDC6F41 reflected, init and xorout 0xFFFFFFFF), the
checksum of every Tessera checkpoint: by the C extension of ``google-crc32c`` (a dependency of
this package; the CPU's CRC32C instruction, GB/s) once it gives the right CRC of a test vector,
else by a pure-Python table loop (a few MB/s; a warning says so once, on a large input).
``TESSERA_CKPT_CRC=package|python`` forces one (the tests check each against the other).
"""
import ctypes
import os
import warnings

KINDS = ("package", "python")
PIECE = 1 << 20  # bytes copied at a time for the extension: it takes bytes objects only, and
#                  releases the GIL from 1 MiB (the loader checksums on a thread while it reads)
WARN_BYTES = 1 << 20  # the Python loop warns (once) from this many bytes at a time
_impl = False  # not chosen yet; then the google_crc32c module, or None for the Python loop
_warned = False


def _entry(c):
    for _ in range(8):
        c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
    return c


_T0 = [_entry(i) for i in range(256)]  # the CRC of each byte value, for the Python loop


def crc32c_python(data, crc=0):
    """CRC32C of ``data`` (bytes-like), continuing from ``crc``; pure Python."""
    t, crc = _T0, crc ^ 0xFFFFFFFF
    for b in bytes(data):
        crc = t[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _make(kind):
    if kind not in KINDS:
        raise ValueError(f"TESSERA_CKPT_CRC={kind!r}: expected one of {', '.join(KINDS)}")
    if kind == "python":
        return None
    with warnings.catch_warnings():  # google_crc32c warns when only its own Python code loads
        warnings.simplefilter("ignore")
        import google_crc32c as g
    if getattr(g, "implementation", None) != "c" or g.value(b"123456789") != 0xE3069283:
        raise ImportError("google_crc32c's C extension is not available")
    return g


def _choose():
    global _impl
    if _impl is False:
        forced = os.environ.get("TESSERA_CKPT_CRC", "")
        try:
            _impl = _make(forced or "package")
        except ImportError:
            if forced:
                raise
            _impl = None
    return _impl


def implementation():
    """The implementation in use (chosen once): "google_crc32c" or "python"."""
    return "python" if _choose() is None else "google_crc32c"


def byte_view(data):
    """A flat, zero-copy byte memoryview of bytes-like data, a numpy array or a contiguous CPU
    torch tensor (any dtype: bf16 has no numpy view, so tensors go through their address)."""
    if hasattr(data, "data_ptr") and hasattr(data, "element_size"):  # torch tensor
        n = data.numel() * data.element_size()
        if n and (not data.is_contiguous() or data.device.type != "cpu"):
            raise ValueError("CRC32C needs a contiguous CPU tensor")
        return memoryview((ctypes.c_ubyte * n).from_address(data.data_ptr()) if n else b"").cast("B")
    m = memoryview(data)
    return m if m.format == "B" and m.ndim == 1 else m.cast("B")


def block_crcs(data, block):
    """CRC32C of every ``block``-byte block of ``data`` (the last may be shorter; an empty
    ``data`` has none): bytes-like, a numpy array or a contiguous CPU torch tensor, which the
    caller keeps alive meanwhile."""
    global _warned
    g, view = _choose(), byte_view(data)
    n = len(view)
    if g is None:
        if n >= WARN_BYTES and not _warned and not os.environ.get("TESSERA_CKPT_CRC"):
            _warned = True
            warnings.warn("tessera_ckpt: google-crc32c (with its C extension) is not installed; checksums use "
                          "a slow pure-Python loop", RuntimeWarning, stacklevel=2)
        return [crc32c_python(view[o : o + block]) for o in range(0, n, block)]
    out = []
    for o in range(0, n, block):
        end, crc = min(n, o + block), 0
        for p in range(o, end, PIECE):
            crc = g.extend(crc, bytes(view[p : min(end, p + PIECE)]))
        out.append(crc)
    return out


def crc32c(data):
    """CRC32C of ``data`` (as for block_crcs)."""
    n = len(byte_view(data))
    return block_crcs(data, n)[0] if n else 0
