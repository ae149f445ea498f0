"""Damaged checkpoints must be refused by the tessera_ckpt package, naming what is at fault.

usage: tessera_ckpt_expect_error.py CASE [-- CASE ...]
  CASE: CKPT [--also-verify] [--loads-unverified] SUBSTR...
For each case: tessera_ckpt.load(CKPT) (verify=True) raises CheckpointError whose message
contains every SUBSTR. --also-verify: tessera_ckpt.verify(CKPT) and `python -m tessera_ckpt
verify CKPT` (exit 1, "CORRUPT") report it too. --loads-unverified: load(CKPT, verify=False)
succeeds (the damage is in tensor data, which only the block checksums catch).
Prints "refused: MESSAGE" per case.
"""
import os
import subprocess
import sys

PKG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python")
sys.path.insert(0, PKG)

import tessera_ckpt  # noqa: E402


def expect(fn, what, ckpt, wanted):
    try:
        fn()
    except tessera_ckpt.CheckpointError as e:
        msg = str(e)
        missing = [w for w in wanted if w not in msg]
        assert not missing, f"{ckpt}: {what}: message lacks {missing}: {msg}"
        return msg
    raise AssertionError(f"{what}: the damaged checkpoint {ckpt} was accepted")


def run_case(args):
    also_verify = "--also-verify" in args
    loads_unverified = "--loads-unverified" in args
    args = [a for a in args if a not in ("--also-verify", "--loads-unverified")]
    ckpt, wanted = args[0], args[1:]
    assert wanted, f"{ckpt}: give at least one expected substring"
    msg = expect(lambda: tessera_ckpt.load(ckpt), "load", ckpt, wanted)
    if also_verify:
        expect(lambda: tessera_ckpt.verify(ckpt), "verify", ckpt, wanted)
        env = dict(os.environ, PYTHONPATH=PKG)
        p = subprocess.run([sys.executable, "-m", "tessera_ckpt", "verify", ckpt], env=env, capture_output=True,
                           text=True)
        assert p.returncode == 1 and "CORRUPT" in p.stderr and all(w in p.stderr for w in wanted), (
            ckpt, p.returncode, p.stdout, p.stderr)
    if loads_unverified:
        tessera_ckpt.load(ckpt, verify=False)
    print("refused:", msg.replace("\n", " | "))


case = []
for a in sys.argv[1:] + ["--"]:
    if a == "--":
        run_case(case)
        case = []
    else:
        case.append(a)
