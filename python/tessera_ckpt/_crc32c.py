"""CRC32C (Castagnoli: polynomial 0x1EDC6F41 reflected, init and xorout 0xFFFFFFFF), the
checksum of every Tessera checkpoint.

Implementations, fastest available first (each compiled one is used only after it gives the
right CRC of test vectors):

* ``crc32c`` or ``google_crc32c`` (optional PyPI packages using the CPU's crc32 instruction,
  several GB/s) when one of them is importable;
* ``ext2fs_crc32c_le`` of e2fsprogs' libext2fs.so.2 (present on nearly every Linux system: the
  ext4 tools use it), called through ctypes: compiled slicing-by-8, under 1 GB/s;
* a table-driven CRC vectorised with numpy (or with torch where numpy is missing) over many
  short lanes of the data at once, joined with the CRC's linearity (below);
* a plain Python loop for short inputs (headers, metadata), where the vectorised setup costs
  more than it saves.

Inputs of 8 MiB or more are split over up to 4 threads (``TESSERA_CKPT_CRC_THREADS``): numpy and
ctypes calls release the GIL. ``TESSERA_CKPT_CRC=package|ext2fs|numpy|torch|python`` forces one
(tests check each against the others).

How the vectorised one works. With init 0 and no final xor (the "raw" CRC), the CRC is linear
over GF(2): raw(A || B) = shift_|B|(raw(A)) ^ raw(B), where shift_k(x) is the register x run
through k zero bytes, itself a linear map of x. So a 64-byte lane's raw CRC is the xor of 64
table entries T[p][byte_p] = shift_{63-p}(T0[byte_p]) -- one gather per byte with no dependency
between bytes, which numpy does for every lane at once. Lanes are then joined 64 at a time the
same way (their CRCs' bytes index tables of shift_{(63-i)*64}, ...), until one CRC per block is
left; the init and xorout are applied last: crc = raw(M) ^ shift_|M|(0xFFFFFFFF) ^ 0xFFFFFFFF.
Zero bytes in front of a message do not change its raw CRC, so a length that is not a multiple
of a lane is padded in front.
"""
import ctypes
import os
import warnings

POLY = 0x82F63B78
_MASK = 0xFFFFFFFF


def _byte_table():
    t = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ POLY if c & 1 else c >> 1
        t.append(c)
    return t


_T0 = _byte_table()


def _python_raw(crc, data):
    t = _T0
    for b in data:
        crc = t[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc


def crc32c_python(data, crc=0):
    """CRC32C of ``data`` (bytes-like), continuing from ``crc``; pure Python (short inputs)."""
    return _python_raw(crc ^ _MASK, bytes(data)) ^ _MASK


# ---------------------------------------------------------------- GF(2) shift operators
# A linear map of 32-bit values is kept as its 32 column images (the images of 1 << j).


def _apply(cols, x):
    r = 0
    j = 0
    while x:
        if x & 1:
            r ^= cols[j]
        x >>= 1
        j += 1
    return r


def _compose(a, b):
    """The map x -> a(b(x))."""
    return [_apply(a, c) for c in b]


_SHIFT1 = [_T0[(1 << j) & 0xFF] ^ ((1 << j) >> 8) for j in range(32)]  # one zero byte
_shift_cache = {}


def _shift_cols(k):
    """Column images of shift_k (the register run through k zero bytes)."""
    cols = _shift_cache.get(k)
    if cols is not None:
        return cols
    result = [1 << j for j in range(32)]
    power = _SHIFT1
    n = k
    while n:
        if n & 1:
            result = _compose(power, result)
        n >>= 1
        if n:
            power = _compose(power, power)
    if len(_shift_cache) < 4096:
        _shift_cache[k] = result
    return result


def shift(x, k):
    """The raw CRC register ``x`` run through ``k`` zero bytes."""
    return _apply(_shift_cols(k), x)


def finish_raw(raw, length):
    """CRC32C of a message of ``length`` bytes whose raw CRC (init 0, no xorout) is ``raw``."""
    return raw ^ shift(_MASK, length) ^ _MASK


# ---------------------------------------------------------------- vectorised (numpy or torch)

LANE = 64  # bytes per lane at the first level
GROUP = 64  # lanes (then lane CRCs) joined per step
BATCH_LANES = 512  # first-level lanes per vector step (32 KiB of data: the temporaries stay in cache)
TORCH_BATCH_LANES = 8192  # torch ops cost more per call
BATCH_BYTES = 64 << 20  # blocks handled per raw_blocks call, at most (or one block)


def _table_rows(seg, group, first_level):
    """Rows of 256 entries, row i*4+b (or p at the first level): the contribution of byte
    value y at that place of a group of `group` segments of `seg` bytes each."""
    rows = []
    if first_level:
        # the byte at place p of the lane: T0[y] run through the (group - 1 - p) bytes after it
        row = list(_T0)
        for _ in range(group):
            rows.append(row)
            row = [_T0[x & 0xFF] ^ (x >> 8) for x in row]
        return rows[::-1]
    for i in range(group):
        cols = _shift_cols((group - 1 - i) * seg)
        for b in range(4):
            # y << 8b through a linear map: xor of the images of its set bits.
            base = [cols[8 * b + bit] for bit in range(8)]
            row = [0] * 256
            for y in range(1, 256):
                low = y & -y
                row[y] = row[y ^ low] ^ base[low.bit_length() - 1]
            rows.append(row)
    return rows


THREADS = int(os.environ.get("TESSERA_CKPT_CRC_THREADS", "0") or 0)  # 0: up to 4, by CPU count
_pools = {}


def _threads(nbytes):
    if nbytes < (8 << 20):
        return 1
    n = THREADS or min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))
    return max(1, min(n, nbytes >> 22))


def _pool(n):
    """A pool of n threads, per process (a forked child has none of its parent's threads)."""
    key = (os.getpid(), n)
    p = _pools.get(key)
    if p is None:
        from concurrent.futures import ThreadPoolExecutor

        p = _pools[key] = ThreadPoolExecutor(n, thread_name_prefix="tessera-crc")
    return p


class _NumpyCrc:
    name = "numpy"

    def __init__(self):
        import numpy as np

        self.np = np
        self._tables = {}

    def _table(self, seg, group, first):
        key = (seg, group, first)
        t = self._tables.get(key)
        if t is None:
            np = self.np
            t = np.array(_table_rows(seg, group, first), dtype=np.uint32).reshape(-1)
            off = (np.arange(t.size // 256, dtype=np.uint16) * 256).astype(np.uint16)
            t = (t, off)
            self._tables[key] = t
        return t

    def _lanes(self, lanes, out):
        # one gather per byte (uint16 indices: numpy's take is fastest with them here), then
        # the xor of each lane's 64 values
        np = self.np
        table, off = self._table(1, LANE, True)
        for s in range(0, lanes.shape[0], BATCH_LANES):
            part = lanes[s : s + BATCH_LANES]
            idx = np.add(part, off, dtype=np.uint16)
            np.bitwise_xor.reduce(table.take(idx), axis=1, out=out[s : s + part.shape[0]])

    def raw_blocks(self, blocks):
        """Raw CRCs of the rows of a 2-D uint8 array whose row length is a multiple of LANE."""
        np = self.np
        rows, n = blocks.shape
        lanes = blocks.reshape(-1, LANE)
        out = np.empty(lanes.shape[0], dtype=np.uint32)
        workers = _threads(lanes.shape[0] * LANE)
        if workers > 1:  # numpy releases the GIL in take, add and reduce
            step = -(-lanes.shape[0] // workers)
            parts = [(lanes[i : i + step], out[i : i + step]) for i in range(0, lanes.shape[0], step)]
            list(_pool(workers).map(lambda p: self._lanes(*p), parts))
        else:
            self._lanes(lanes, out)
        crcs = out.reshape(rows, n // LANE)
        seg = LANE
        while crcs.shape[1] > 1:
            m = crcs.shape[1]
            g = min(GROUP, m)
            g = 1 << (g - 1).bit_length()  # a power of two: lanes of equal length
            pad = (-m) % g
            if pad:
                crcs = np.concatenate([np.zeros((rows, pad), dtype=np.uint32), crcs], axis=1)
            groups = np.ascontiguousarray(crcs.reshape(rows, -1, g))
            table, off = self._table(seg, g, False)
            by = groups.view(np.uint8).reshape(rows, groups.shape[1], g * 4)
            idx = np.add(by, off, dtype=np.uint16 if g * 4 * 256 <= 65536 else np.uint32)
            crcs = np.bitwise_xor.reduce(table.take(idx), axis=2)
            seg *= g
        return crcs[:, 0]

    def as_bytes(self, view):
        return self.np.frombuffer(view, dtype=self.np.uint8)

    def pad_front(self, arr, total):
        np = self.np
        out = np.zeros(total, dtype=np.uint8)
        out[total - arr.size :] = arr
        return out

    def to_list(self, crcs):
        return [int(c) for c in crcs]


class _TorchCrc:
    """The same algorithm with torch tensors (int64 CRC values: torch 1.13 has no uint32)."""

    name = "torch"

    def __init__(self):
        import torch

        self.torch = torch
        self._tables = {}

    def _table(self, seg, group, first):
        key = (seg, group, first)
        t = self._tables.get(key)
        if t is None:
            torch = self.torch
            t = torch.tensor(_table_rows(seg, group, first), dtype=torch.int64).reshape(-1)
            off = torch.arange(t.numel() // 256, dtype=torch.int64) * 256
            t = (t, off)
            self._tables[key] = t
        return t

    def _fold0(self, v):
        # xor-reduce the first axis (a power of two long) by halving: contiguous halves, which
        # torch's elementwise kernels handle far faster than strided ones
        n = v.shape[0]
        while n > 1:
            n //= 2
            v = v[:n] ^ v[n : 2 * n]
        return v[0]

    def _gather_fold(self, table, off, places):
        """places: (P, K) int64 byte values, place-major; the xor over P of table[p, value]."""
        idx = places + off[:, None]
        return self._fold0(table.index_select(0, idx.reshape(-1)).reshape(idx.shape))

    def raw_blocks(self, blocks):
        torch = self.torch
        rows, n = blocks.shape
        lanes = blocks.reshape(-1, LANE)
        table, off = self._table(1, LANE, True)
        out = torch.empty(lanes.shape[0], dtype=torch.int64)
        for s in range(0, lanes.shape[0], TORCH_BATCH_LANES):
            part = lanes[s : s + TORCH_BATCH_LANES]
            out[s : s + part.shape[0]] = self._gather_fold(table, off, part.t().contiguous().to(torch.int64))
        crcs = out.reshape(rows, n // LANE)
        seg = LANE
        shifts = torch.arange(4, dtype=torch.int64) * 8
        while crcs.shape[1] > 1:
            m = crcs.shape[1]
            g = min(GROUP, m)
            g = 1 << (g - 1).bit_length()
            pad = (-m) % g
            if pad:
                crcs = torch.cat([torch.zeros((rows, pad), dtype=torch.int64), crcs], dim=1)
            groups = crcs.reshape(rows, -1, g)
            table, off = self._table(seg, g, False)
            by = ((groups.unsqueeze(-1) >> shifts) & 255).reshape(rows * groups.shape[1], g * 4)
            crcs = self._gather_fold(table, off, by.t().contiguous()).reshape(rows, groups.shape[1])
            seg *= g
        return crcs[:, 0]

    def as_bytes(self, view):
        torch = self.torch
        if len(view) == 0:
            return torch.empty(0, dtype=torch.uint8)
        with warnings.catch_warnings():  # a read-only buffer: only read here
            warnings.simplefilter("ignore")
            return torch.frombuffer(view, dtype=torch.uint8)

    def pad_front(self, arr, total):
        torch = self.torch
        out = torch.zeros(total, dtype=torch.uint8)
        out[total - arr.numel() :] = arr
        return out

    def to_list(self, crcs):
        return [int(c) for c in crcs.tolist()]


class _CallCrc:
    """A compiled CRC32C function called once per block (blocks in parallel threads when
    there are many: both kinds below release the GIL)."""

    def crc(self, view):
        raise NotImplementedError

    def check(self):
        for data, want in ((b"123456789", 0xE3069283), (bytes(range(32)), 0x46DD794E)):
            got = self.crc(memoryview(bytearray(data)))
            if got != want:
                raise ImportError(f"{self.name}: crc32c(test vector) = {got:08x}, expected {want:08x}")
        return self


class _PackageCrc(_CallCrc):
    """An installed hardware CRC32C package (neither is required)."""

    def __init__(self):
        try:
            import crc32c as mod  # ICRAR's crc32c

            self.name = "crc32c package"
            self._f = mod.crc32c
        except ImportError:
            import google_crc32c as mod

            self.name = "google_crc32c package"
            self._f = lambda data: mod.value(bytes(data))
        self.check()

    def crc(self, view):
        return self._f(view)


class _Ext2fsCrc(_CallCrc):
    """ext2fs_crc32c_le of e2fsprogs' libext2fs (present on nearly every Linux system, as the
    ext4 tools use it), through ctypes: a compiled slicing-by-8 CRC32C. Used only after it
    gives the right answer on test vectors."""

    name = "libext2fs"

    def __init__(self):
        import ctypes.util

        names = ["libext2fs.so.2", ctypes.util.find_library("ext2fs")]
        lib = None
        for n in names:
            if not n:
                continue
            try:
                lib = ctypes.CDLL(n)
                break
            except OSError:
                continue
        if lib is None or not hasattr(lib, "ext2fs_crc32c_le"):
            raise ImportError("libext2fs with ext2fs_crc32c_le is not available")
        f = lib.ext2fs_crc32c_le
        f.restype = ctypes.c_uint32
        f.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
        self._f = f
        self.check()

    def crc(self, view):
        n = len(view)
        if n == 0:
            return 0
        try:
            buf = (ctypes.c_char * n).from_buffer(view)
        except TypeError:  # a read-only buffer: copy it
            buf = ctypes.create_string_buffer(view.tobytes(), n)
        return self._f(_MASK, ctypes.addressof(buf), n) ^ _MASK


KINDS = ("package", "ext2fs", "numpy", "torch", "python")


def _make(kind):
    if kind == "package":
        return _PackageCrc()
    if kind == "ext2fs":
        return _Ext2fsCrc()
    if kind == "numpy":
        return _NumpyCrc()
    if kind == "torch":
        return _TorchCrc()
    if kind == "python":
        return None
    raise ValueError(f"TESSERA_CKPT_CRC={kind!r}: expected one of {', '.join(KINDS)}")


_impl = False  # not chosen yet


def implementation():
    """The implementation in use, chosen once: a name for messages and benchmarks."""
    i = _choose()
    return "python" if i is None else i.name


def _choose():
    global _impl
    if _impl is not False:
        return _impl
    forced = os.environ.get("TESSERA_CKPT_CRC", "")
    if forced:
        _impl = _make(forced)
        return _impl
    for kind in KINDS[:-1]:
        try:
            _impl = _make(kind)
            return _impl
        except (ImportError, OSError, AttributeError):
            continue
    _impl = None
    return _impl


SMALL = 1 << 14  # below this many bytes the Python loop is faster than the vectorised setup


def byte_view(data):
    """A flat, zero-copy byte memoryview of bytes-like data, a numpy array or a contiguous CPU
    torch tensor (any dtype: bf16 has no numpy view, so tensors go through their address)."""
    if hasattr(data, "data_ptr") and hasattr(data, "element_size"):  # torch tensor
        n = data.numel() * data.element_size()
        if n == 0:
            return memoryview(b"")
        if not data.is_contiguous() or data.device.type != "cpu":
            raise ValueError("CRC32C needs a contiguous CPU tensor")
        return memoryview((ctypes.c_ubyte * n).from_address(data.data_ptr())).cast("B")
    m = memoryview(data)
    if m.format != "B" or m.ndim != 1:
        m = m.cast("B")
    return m


def block_crcs(data, block):
    """CRC32C of every ``block``-byte block of ``data`` (the last may be shorter; an empty
    ``data`` has none). ``data``: bytes-like, a numpy array or a contiguous CPU torch tensor;
    the caller keeps it alive meanwhile."""
    impl = _choose()
    view = byte_view(data)
    n = len(view)
    if n == 0:
        return []
    if isinstance(impl, _CallCrc):
        pieces = [view[o : o + block] for o in range(0, n, block)]
        workers = _threads(n)
        if workers > 1 and len(pieces) > 1:
            return list(_pool(workers).map(impl.crc, pieces))
        return [impl.crc(p) for p in pieces]
    if impl is None or n <= SMALL:
        return [crc32c_python(view[o : o + block]) for o in range(0, n, block)]
    arr = impl.as_bytes(view)
    full = n // block
    out = []
    if full and block % LANE == 0:
        step = max(1, BATCH_BYTES // block)  # blocks per call: bounds the temporaries
        for r0 in range(0, full, step):
            r1 = min(full, r0 + step)
            raws = impl.to_list(impl.raw_blocks(arr[r0 * block : r1 * block].reshape(r1 - r0, block)))
            out += [finish_raw(r, block) for r in raws]
    else:
        full = 0
    for o in range(full * block, n, block):
        length = min(n, o + block) - o
        if length <= SMALL:
            out.append(crc32c_python(view[o : o + length]))
            continue
        part = arr[o : o + length]
        total = -(-length // LANE) * LANE
        padded = impl.pad_front(part, total) if total != length else part
        raw = impl.to_list(impl.raw_blocks(padded.reshape(1, total)))[0]
        out.append(finish_raw(raw, length))
    return out


def crc32c(data):
    """CRC32C of ``data`` (as for block_crcs)."""
    n = len(byte_view(data))
    return block_crcs(data, n)[0] if n else 0
