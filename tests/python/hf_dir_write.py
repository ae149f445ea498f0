"""Writes the Hugging Face model directories the HF-directory input tests read
(tests/checkpoint/test_hf_dir.cpp, tests/python/tessera_ckpt_hf_check.py), with the real
libraries: huggingface_hub's save_torch_state_dict (the split into shards, the file names and
model.safetensors.index.json as transformers writes them; every shard through
safetensors.torch.save_file) and, with --dcp, torch DCP's HuggingFaceStorageWriter.

usage: hf_dir_write.py OUT [--dcp]

OUT/reference.safetensors   every tensor in one file (safetensors.torch.save_file): the values
OUT/ok/hub                  save_torch_state_dict, several shards and the index
OUT/ok/hub-single           save_torch_state_dict, everything in model.safetensors (no index)
OUT/ok/symlink-in           hub with one shard a symbolic link to a file inside the directory
OUT/ok/total-size-off       hub with the index's total_size one more than the tensors' bytes
OUT/ok/total-size-*         hub with a total_size that is no byte count (-5, 12.5, "1 GB": a note)
                            or the right count as a JSON float (no note)
OUT/ok/dcp, OUT/ok/dcp-single  (--dcp) HuggingFaceStorageWriter: 3 files, and its default (one)
OUT/rows                    an 8 MiB tensor 'big.weight' [2048, 1024] F32 in a shard with others
OUT/bad/<name>              copies of hub, each broken in one way (the index edited, a shard
                            removed, replaced or rewritten by save_file)
OUT/manifest.json           {"ok": [dir], "bad": {dir: [substrings every error must hold]},
                             "notes": {dir: [substrings of the note]}, "reference": path,
                             "rows": {"dir", "key"}}
Prints "wrote N directories".
"""
import json
import os
import shutil
import sys

import torch
from huggingface_hub import save_torch_state_dict
from safetensors import safe_open
from safetensors.torch import load_file, save_file

out = sys.argv[1]
use_dcp = "--dcp" in sys.argv[2:]
INDEX = "model.safetensors.index.json"
os.makedirs(out, exist_ok=True)

torch.manual_seed(0)
special = torch.tensor([float("nan"), -0.0, float("inf"), -float("inf"), 1e-40, 3.5])
sd = {
    "model.embed_tokens.weight": torch.randn(64, 16),
    "model.layers.0.self_attn.q_proj.weight": torch.randn(16, 16),
    "model.layers.0.self_attn.q_proj.bias": special.clone(),
    "model.layers.0.mlp.up_proj.weight": torch.randn(32, 16, dtype=torch.float64),
    "model.layers.0.input_layernorm.weight": torch.randn(16).to(torch.bfloat16),
    "model.layers.0.post_attention_layernorm.weight": torch.randn(16).to(torch.float16),
    "model.norm.scale": torch.tensor(2.5),
    "model.empty": torch.zeros(0, 3),
    "buffers.positions": torch.arange(-5, 20, dtype=torch.int64),
    "buffers.i32": torch.tensor([-(2**31), 2**31 - 1, 0], dtype=torch.int32),
    "buffers.i16": torch.tensor([-(2**15), 7], dtype=torch.int16),
    "buffers.i8": torch.tensor([-128, 127], dtype=torch.int8),
    "buffers.u8": torch.arange(0, 250, 7, dtype=torch.uint8),
    "buffers.mask": torch.tensor([True, False, True]),
    "lm_head.weight": torch.randn(64, 16),
}
save_file(sd, os.path.join(out, "reference.safetensors"))
ok, bad, notes = [], {}, {}


def hub(d, max_shard_size):
    os.makedirs(d)
    save_torch_state_dict(sd, d, max_shard_size=max_shard_size)
    return d


def index_of(d):
    with open(os.path.join(d, INDEX)) as f:
        return json.load(f)


def write_index(d, j):
    with open(os.path.join(d, INDEX), "w") as f:
        json.dump(j, f, indent=2, sort_keys=True)


hub_dir = hub(os.path.join(out, "ok", "hub"), 4096)
ix = index_of(hub_dir)
files = sorted(set(ix["weight_map"].values()))
assert len(files) >= 3, files
S1, S2 = files[0], files[1]
in_s1 = sorted(k for k, f in ix["weight_map"].items() if f == S1)
in_s2 = sorted(k for k, f in ix["weight_map"].items() if f == S2)
T = in_s1[0]  # a tensor of the first shard, moved, dropped or duplicated below
ok.append(hub_dir)
ok.append(hub(os.path.join(out, "ok", "hub-single"), "5GB"))
assert sorted(os.listdir(ok[-1])) == ["model.safetensors"], os.listdir(ok[-1])

d = os.path.join(out, "ok", "symlink-in")
shutil.copytree(hub_dir, d)
os.makedirs(os.path.join(d, "blobs"))
os.rename(os.path.join(d, S2), os.path.join(d, "blobs", S2))
os.symlink(os.path.join("blobs", S2), os.path.join(d, S2))  # as the hub cache links its snapshots
ok.append(d)

d = os.path.join(out, "ok", "total-size-off")
shutil.copytree(hub_dir, d)
j = index_of(d)
j["metadata"]["total_size"] += 1
write_index(d, j)
ok.append(d)
notes[d] = [f"'{d}/{INDEX}': metadata.total_size is {j['metadata']['total_size']} but the tensors hold "
            f"{j['metadata']['total_size'] - 1} bytes (not an error"]

# total_size is informational: one that is no byte count is a note and ignored; a whole
# number written as a JSON float is the count.
for name, value, note in (("total-size-negative", -5, "-5"), ("total-size-fraction", 12.5, "12.5"),
                          ("total-size-text", "1 GB", '"1 GB"'), ("total-size-float", None, None)):
    d = os.path.join(out, "ok", name)
    shutil.copytree(hub_dir, d)
    j = index_of(d)
    j["metadata"]["total_size"] = float(j["metadata"]["total_size"]) if value is None else value
    write_index(d, j)
    ok.append(d)
    if note is not None:
        notes[d] = [f"'{d}/{INDEX}': metadata.total_size is {note}, not a byte count: ignored (not an error"]

if use_dcp:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    keys = list(sd)
    mapping = {k: 1 + i % 3 for i, k in enumerate(keys)}
    for name, writer_args in (("dcp", {"fqn_to_index_mapping": mapping}), ("dcp-single", {})):
        d = os.path.join(out, "ok", name)
        dcp.save({k: v.clone() for k, v in sd.items()}, storage_writer=HuggingFaceStorageWriter(d, **writer_args),
                 no_dist=True)
        assert os.path.exists(os.path.join(d, INDEX)), os.listdir(d)
        ok.append(d)

# A large tensor, for the reads of one rank's rows.
rows = os.path.join(out, "rows")
os.makedirs(rows)
big = {"small.a": torch.randn(100), "big.weight": torch.randn(2048, 1024), "small.b": torch.randn(7, 3)}
save_torch_state_dict(big, rows, max_shard_size="8MB")  # big.weight alone in one file
assert os.path.exists(os.path.join(rows, INDEX)), os.listdir(rows)
save_file(big, os.path.join(out, "rows-reference.safetensors"))


def broken(name, expect):
    d = os.path.join(out, "bad", name)
    shutil.copytree(hub_dir, d)
    bad[d] = [e.replace("DIR", d) for e in expect]
    return d, index_of(d)


d, j = broken("missing-tensor", ["'DIR/" + INDEX + f"': tensor 'ghost.weight' is mapped to '{S1}', but 'DIR/{S1}' "
                                 "does not hold it"])
j["weight_map"]["ghost.weight"] = S1
write_index(d, j)

d, j = broken("moved", [f"tensor '{T}' is mapped to '{S2}', but 'DIR/{S2}' does not hold it (it is in 'DIR/{S1}')"])
j["weight_map"][T] = S2
write_index(d, j)

d, j = broken("unmapped", [f"'DIR/{S1}': tensor '{T}' is not in the weight map of 'DIR/{INDEX}' (unmapped)"])
del j["weight_map"][T]
write_index(d, j)

d, j = broken("duplicated", [f"tensor '{T}' is in 2 shards, 'DIR/{S1}' and 'DIR/{S2}' (duplicated)"])
with safe_open(os.path.join(d, S2), framework="pt") as f:
    meta = f.metadata()
second = load_file(os.path.join(d, S2))
second[T] = sd[T].clone()
save_file(second, os.path.join(d, S2), metadata=meta)

d, j = broken("missing-shard", [f"'DIR/{INDEX}': shard '{S2}' is missing (the weight map puts {len(in_s2)} tensor(s) "
                                f"there, e.g. '{in_s2[0]}')"])
os.remove(os.path.join(d, S2))

for name, target, shown in (("name-dotdot", "../../../reference.safetensors", "../../../reference.safetensors"),
                            ("name-absolute", os.path.join(out, "reference.safetensors"),
                             os.path.join(out, "reference.safetensors")),
                            ("name-control", "model\n.safetensors", "model\\n.safetensors")):
    d, j = broken(name, [f"'DIR/{INDEX}': tensor '{T}' is mapped to '{shown}', which is not a plain file name inside "
                         "the directory"])
    j["weight_map"][T] = target
    write_index(d, j)

d, j = broken("symlink-out", [f"'DIR/{S2}' is a symbolic link to", "outside the directory: refusing to follow it"])
os.makedirs(os.path.join(out, "elsewhere"), exist_ok=True)
os.rename(os.path.join(d, S2), os.path.join(out, "elsewhere", S2))
os.symlink(os.path.join(out, "elsewhere", S2), os.path.join(d, S2))

d, j = broken("fifo", [f"'DIR/{S2}' is not a regular file (a FIFO)"])
os.remove(os.path.join(d, S2))
os.mkfifo(os.path.join(d, S2))

d, j = broken("truncated-shard", [f"'DIR/{S2}'"])
with open(os.path.join(d, S2), "r+b") as f:
    f.truncate(os.path.getsize(os.path.join(d, S2)) - 10)

d, j = broken("huge-index", [f"'DIR/{INDEX}' is {(100 << 20) + 1} bytes, more than the limit of {100 << 20}"])
with open(os.path.join(d, INDEX), "r+b") as f:
    f.truncate((100 << 20) + 1)  # sparse: nothing is written

d, j = broken("not-json", [f"'DIR/{INDEX}' is not valid JSON"])
with open(os.path.join(d, INDEX), "w") as f:
    f.write('{"weight_map": {"a": ')

d, j = broken("duplicate-key", [f"'DIR/{INDEX}'", f"duplicate key '{T}'"])
text = json.dumps(j, indent=2, sort_keys=True)
text = text.replace(f'"{T}": "{S1}"', f'"{T}": "{S1}",\n    "{T}": "{S2}"', 1)
with open(os.path.join(d, INDEX), "w") as f:
    f.write(text)

d, j = broken("no-weight-map", [f"'DIR/{INDEX}': no weight_map object"])
write_index(d, {"metadata": j["metadata"]})

d, j = broken("value-not-string", [f"'DIR/{INDEX}': the weight_map value of '{T}' is not a string"])
j["weight_map"][T] = 3
write_index(d, j)

d, j = broken("empty-map", [f"'DIR/{INDEX}': the weight map names no tensor"])
j["weight_map"] = {}
write_index(d, j)

d, j = broken("both", ["'DIR' holds both model.safetensors and " + INDEX + ", whose weight map does not name it"])
shutil.copy(os.path.join(out, "ok", "hub-single", "model.safetensors"), os.path.join(d, "model.safetensors"))

# Several problems in one directory: every one is named.
d, j = broken("several", [f"tensor 'ghost.weight' is mapped to '{S1}'", f"tensor '{T}' is not in the weight map"])
del j["weight_map"][T]
j["weight_map"]["ghost.weight"] = S1
write_index(d, j)

manifest = {"ok": ok, "bad": bad, "notes": notes, "reference": os.path.join(out, "reference.safetensors"),
            "rows": {"dir": rows, "key": "big.weight", "reference": os.path.join(out, "rows-reference.safetensors")},
            "index_total_size": ix["metadata"]["total_size"], "hub_files": files}
with open(os.path.join(out, "manifest.json"), "w") as f:
    json.dump(manifest, f, indent=1)
print("wrote", len(ok) + len(bad) + 1, "directories")
