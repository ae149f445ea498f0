"""pytest of tessera_ckpt's pure functions: layout arithmetic, strict JSON and metadata
parsing, the overlap sweep, and the package's import layers. They need neither torch nor the
C++ build (`make test` runs them first: python -m pytest python/tests); torch is made
unimportable here, so a test that reaches for it fails. What reads and writes real
checkpoints is tested from C++ (tests/checkpoint/test_python_package.cpp and the scripts under
tests/python/)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.modules["torch"] = None  # `import torch` raises ImportError in these tests
