"""The known state tests/checkpoint/checkpoint_scenarios.cpp saves (full_value, iteration 0):
each key's FQN, shape and dtype, and the value every element must have; and the real
safetensors reader the checks read Tessera's files with."""
import torch

SPECS = [
    ("model.w", [7, 5], torch.float32),
    ("model.v", [3, 10], torch.bfloat16),
    ("model.e", [0, 4], torch.float32),
    ("model.b", [5], torch.float32),
    ("model.s", [], torch.float64),
    ("model.z", [0], torch.int64),
    ("opt.m", [9], torch.bfloat16),
    ("opt.big", [6, 3, 2], torch.float32),
]


def expected(fqn, shape, dtype):
    h = 0
    for c in fqn:
        h = (h * 31 + ord(c)) % 23
    n = 1
    for d in shape:
        n *= d
    t = torch.remainder(torch.arange(n, dtype=torch.float64) * 7 + h, 23) - 11
    return (t * 0.25).reshape(shape).to(dtype)


def read_safetensors_file(path):
    """Every tensor of a safetensors file and its __metadata__, through safetensors' own
    parser and validation."""
    from safetensors import safe_open

    out = {}
    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
        for name in f.keys():
            out[name] = f.get_tensor(name)
    return out, meta
