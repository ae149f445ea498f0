"""python -m tessera_ckpt inspect PATH | verify PATH"""
import argparse
import sys

from . import CheckpointError, CheckpointNotFoundError, _crc32c, inspect, verify


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m tessera_ckpt", description="Inspect or verify a Tessera checkpoint (or a Hugging Face model directory).")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("inspect", help="print the keys: kind, dtype, shape or value, chunks, bytes").add_argument("path")
    sub.add_parser("verify", help="read every byte and check every CRC32C").add_argument("path")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "inspect":
            print(inspect(a.path))
        else:
            r = verify(a.path)
            for n in r.get("notes", []):
                print(f"note: {n}")
            if "checked" in r:  # a Hugging Face directory: no checksums, the C++ tool's words
                print(f"OK: {r['path']}: {r['chunks']} chunks, {r['bytes']} bytes read ({r['checked']})")
            else:
                how = f"CRC32C by {_crc32c.implementation()}" if r["checksummed"] else "no checksums in this file"
                print(f"OK: {r['path']}: {r['chunks']} chunks, {r['bytes']} bytes verified ({how})")
    except CheckpointNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except CheckpointError as e:
        msg = str(e)
        if a.cmd == "verify" and not msg.startswith("CORRUPT: "):
            msg = f"CORRUPT: {a.path}: 1 problem(s)\n{msg}"
        print(msg if a.cmd == "verify" else f"error: {msg}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # `... | head`
        sys.stderr.close()
        sys.exit(1)
