"""The data of examples/gpt, in the same order, for the torch 2.x peers.

- examples/gpt/data.h: the text is the regular files (symlinks skipped) of
  /usr/share/common-licenses sorted by path, or the --data files in the order given, read
  as bytes; the last int(total * val_fraction) bytes are held out; the training bytes are
  cut into windows of seq_len + 1 bytes with stride seq_len (inputs: the first seq_len,
  targets: the last seq_len).
- src/tessera/fabric/sampler.cpp (the Trainer's training sampler: shuffle on, seed =
  gpt's --seed, drop_last off): each epoch, the identity permutation of the n windows is
  shuffled by Fisher-Yates from the end with std::mt19937_64(seed + epoch) and a
  modulo-bias-free uniform draw; the list is padded to a multiple of the world size W by
  repeating it from its start; rank r takes positions r, r + W, r + 2W, ...
- src/tessera/trainer/trainer.cpp: a rank's batches are consecutive runs of
  batch_size / W of its indices (the last one of an epoch shorter), then the next epoch.
"""
import os

import numpy as np

DEFAULT_DATA_DIR = "/usr/share/common-licenses"
MASK64 = (1 << 64) - 1


class MT19937_64:
    """std::mt19937_64 (the C++ standard's 64-bit Mersenne Twister), seeded like
    std::mt19937_64(seed)."""

    N, M = 312, 156
    A = 0xB5026F5AA96619E9
    UPPER, LOWER = 0xFFFFFFFF80000000, 0x7FFFFFFF

    def __init__(self, seed):
        mt = [0] * self.N
        mt[0] = seed & MASK64
        for i in range(1, self.N):
            mt[i] = (6364136223846793005 * (mt[i - 1] ^ (mt[i - 1] >> 62)) + i) & MASK64
        self.mt, self.i = mt, self.N

    def _twist(self):
        mt, N, M, A = self.mt, self.N, self.M, self.A
        for k in range(N):
            y = (mt[k] & self.UPPER) | (mt[(k + 1) % N] & self.LOWER)
            mt[k] = mt[(k + M) % N] ^ (y >> 1) ^ (A if y & 1 else 0)
        self.i = 0

    def __call__(self):
        if self.i >= self.N:
            self._twist()
        x = self.mt[self.i]
        self.i += 1
        x ^= (x >> 29) & 0x5555555555555555
        x ^= (x << 17) & 0x71D67FFFEDA60000
        x ^= (x << 37) & 0xFFF7EEE000000000
        x ^= x >> 43
        return x


def uniform_below(g, bound):
    """sampler.cpp's uniform_below: rejection of the top partial range, then modulo."""
    limit = MASK64 - (MASK64 % bound)
    while True:
        x = g()
        if x < limit:
            return x % bound


def distributed_indices(n, replicas, rank, seed, epoch, shuffle=True, drop_last=False):
    """sampler.cpp's distributed_indices."""
    if not (0 <= rank < replicas):
        raise ValueError(f"rank {rank} is outside [0, {replicas})")
    order = list(range(n))
    if shuffle and n > 1:
        g = MT19937_64((seed + epoch) & MASK64)
        for i in range(n - 1, 0, -1):
            j = uniform_below(g, i + 1)
            order[i], order[j] = order[j], order[i]
    per_rank = n // replicas if drop_last else (n + replicas - 1) // replicas
    total = per_rank * replicas
    if total > n:
        if n == 0:
            raise ValueError(f"cannot pad an empty dataset to {total} samples")
        order += [order[i - n] for i in range(n, total)]
    return order[rank:total:replicas]


def default_data_files(directory=DEFAULT_DATA_DIR):
    files = []
    with os.scandir(directory) as it:
        for e in it:
            if not e.is_symlink() and e.is_file():
                files.append(e.path)
    # data.h sorts the path strings bytewise (std::string's operator<).
    files.sort(key=lambda p: os.fsencode(p))
    if not files:
        raise RuntimeError(f"no text files in the default data directory {directory} (pass --data FILE)")
    return files


def read_text(files):
    parts = []
    for f in files:
        with open(f, "rb") as fh:
            parts.append(fh.read())
    return b"".join(parts)


def make_windows(data, seq_len):
    """[N, seq_len] inputs and targets (int64) of the non-overlapping windows."""
    n = (len(data) - 1) // seq_len
    if n <= 0:
        return np.zeros((0, seq_len), np.int64), np.zeros((0, seq_len), np.int64)
    b = np.frombuffer(data, dtype=np.uint8).astype(np.int64)
    idx = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    win = b[idx]
    return np.ascontiguousarray(win[:, :seq_len]), np.ascontiguousarray(win[:, 1:])


def train_windows(files, seq_len, val_fraction):
    """The training windows of data.h's make_dataset (inputs, targets)."""
    text = read_text(files)
    total = len(text)
    val_bytes = int(float(total) * val_fraction)
    inputs, targets = make_windows(text[: total - val_bytes], seq_len)
    if len(inputs) == 0:
        raise RuntimeError(f"{total - val_bytes} training bytes make no window of --seq-len {seq_len} + 1 bytes")
    return inputs, targets


def rank_batches(n, world, rank, local_batch, seed):
    """This rank's batches (lists of window indices) in the Trainer's order, endless over
    epochs."""
    epoch = 0
    while True:
        mine = distributed_indices(n, world, rank, seed, epoch)
        for p in range(0, len(mine), local_batch):
            yield mine[p:p + local_batch]
        epoch += 1
