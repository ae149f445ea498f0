"""What the tessera_ckpt package says of each checkpoint: one line per PATH argument,
"PATH<TAB>OK" when inspect() (the metadata parsed and checked, no data read) accepts it,
else "PATH<TAB>ERROR<TAB>message" with every newline of the message written as "\\n".
tests/checkpoint/test_metadata_agreement.cpp compares these verdicts with the C++ reader's.
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))

import tessera_ckpt  # noqa: E402

for path in sys.argv[1:]:
    try:
        tessera_ckpt.inspect(path)
        print(f"{path}\tOK")
    except tessera_ckpt.CheckpointError as e:
        print(f"{path}\tERROR\t" + str(e).replace("\n", "\\n"))
