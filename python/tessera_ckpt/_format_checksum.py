"""The checkpoint format's checksums (C++: src/tessera/checkpoint/format/checksum.cpp):
CRC32C (_crc32c.py) over fixed-size blocks of each tensor's bytes, the block sizes a reader
accepts, and the 8 hex digits the files store each checksum as."""
import json
import re

from ._error import fail

# Checksum block sizes a reader accepts (C++: checkpoint/format/checksum.h check_crc_block): a multiple of 8, so
# that every block starts on a whole element of every dtype, and at most 1 GiB.
MIN_CRC_BLOCK, MAX_CRC_BLOCK = 8, 1 << 30

_HEX8 = re.compile(r"[0-9a-fA-F]{8}\Z")


def parse_crc_hex(s, what):
    if not isinstance(s, str) or not _HEX8.match(s):
        fail(what, ": checksum ", json.dumps(s), " is not 8 hex digits")
    return int(s, 16)


def num_blocks(nbytes, block):
    return (nbytes + block - 1) // block


def check_crc_block(block, what):
    if not MIN_CRC_BLOCK <= block <= MAX_CRC_BLOCK or block % 8:
        fail(what, ": checksum block size ", block, " is not a multiple of 8 bytes between ", MIN_CRC_BLOCK, " and ",
             MAX_CRC_BLOCK, " (corrupt or tampered)")
    return block
