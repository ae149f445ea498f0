#!/usr/bin/env python3
# reshard_same_bytes.py A B: two outputs of `tessera ckpt reshard` (say, by a binary before and
# after a change to the reshard) hold the same bytes, save ids and the checksums that cover
# them (metadata_crc32c, tessera.header_crc32c) normalised. Exit 1 at the first difference.
import json, os, re, struct, sys
a, b = sys.argv[1], sys.argv[2]
fa, fb = sorted(os.listdir(a)), sorted(os.listdir(b))
assert fa == fb, ("file lists differ", len(fa), len(fb))
ida = json.load(open(os.path.join(a, "tessera-checkpoint.json")))["save_id"]
idb = json.load(open(os.path.join(b, "tessera-checkpoint.json")))["save_id"]
def norm(text, sid):
    text = text.replace(sid.encode(), b"S" * len(sid))
    text = re.sub(rb'"metadata_crc32c":"[0-9a-f]{8}"', b'"metadata_crc32c":"XXXXXXXX"', text)
    return re.sub(rb'"tessera.header_crc32c":"[0-9a-f]{8}"', b'"tessera.header_crc32c":"XXXXXXXX"', text)
total = 0
for f in fa:
    x, y = open(os.path.join(a, f), "rb").read(), open(os.path.join(b, f), "rb").read()
    total += len(x)
    if f.endswith(".json"):
        assert norm(x, ida) == norm(y, idb), f
        continue
    assert len(x) == len(y), (f, len(x), len(y))
    n = struct.unpack("<Q", x[:8])[0]
    assert x[:8] == y[:8], f
    assert norm(x[8:8 + n], ida) == norm(y[8:8 + n], idb), (f, "header")
    assert x[8 + n:] == y[8 + n:], (f, "data")
print(f"same bytes: {len(fa)} files, {total} bytes (save ids {ida} / {idb} normalised)")
