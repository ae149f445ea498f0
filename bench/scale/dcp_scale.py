"""PyTorch DCP side of bench/scale (issue 33 item 5; 2-D: issue 47 item 5): DCP's own save
and load planning for N virtual ranks of FSDP2 (every tensor a DTensor on N ranks, Shard(0):
torch.chunk's rule on dim 0) and of FSDP2 + TP on a (dp, tp) mesh, for the models
scale_bench.cpp plans (the same names and shapes, the same AdamW state), in one process and
without tensor data. Needs torch 2.x.

  python dcp_scale.py run --models gpt2-124m,... --ranks 8,64,... [--max-items K]
                          [--reshard 1024:16384,...] [--models-2d llama3-70b]
                          [--meshes-2d 2x8,8x8,...,64x8] [--reshard-2d 16x8:8x16] --out FILE
  python dcp_scale.py check      DCP's planners on real DTensors (fake process group)
                                 against this script's plans, at 4 ranks; 2-D on FSDP2 + TP's
                                 own DTensors at (dp 4, tp 2), loads at (2, 4)
  python dcp_scale.py save  MODEL MESH META_OUT    one coordinator (internal: run spawns it)
  python dcp_scale.py load  MODEL MESH META MESH2  one loading rank (internal)
MESH is N (FSDP2 over N ranks) or DPxTP (2-D: FSDP2 over dp with tensor parallelism over
tp, torchtitan's plan for Llama, LLAMA_TP: the DTensors FSDP2 + TP make, _StridedShard(0,
split_factor=tp) on dp for the row-cut weights).

What is DCP's own code and what is this script's:
- Local save plan of rank r (DefaultSavePlanner.create_local_plan): flatten_state_dict
  (DCP's), then per value the WriteItem create_default_local_save_plan makes: DTensors
  as _create_write_items_for_dtensor builds them (this script computes the chunk with
  torch.chunk's rule, composed over the (dp, tp) mesh as _StridedShard composes it in 2-D,
  instead of a DTensor on an N-rank mesh; `check` proves the plans equal, in 2-D against
  the DTensors fully_shard and parallelize_module make), plain tensors and bytes by DCP's _create_write_item_for_tensor /
  _create_write_item_for_bytesio; planner_data = the flatten mappings, as the planner sets.
- The coordinator: the N local plans pickled (what gather_object sends) and unpickled,
  DefaultSavePlanner.create_global_plan (dedup, Metadata, validation: DCP's code),
  FileSystemWriter.prepare_global_plan (DCP's), WriteResults per item as FileSystemWriter's
  _write_item returns them (offsets in the rank's file __r_0.distcp; lengths the bytes
  torch.save writes), Metadata.storage_data / storage_meta as FileSystemWriter.finish
  sets them, pickle.dumps(Metadata) as finish writes it.
- A loading rank: pickle.loads of the .metadata file, then DefaultLoadPlanner's local plan:
  per DTensor create_read_items_for_chunk_list (DCP's) with the rank's chunk, as
  _create_read_items does for a DTensor; per plain tensor / bytes DCP's _create_read_items.
  Files opened: the distinct storage_data[storage_index].relative_path of its read items.
Memory: each configuration runs in child processes (a coordinator, a loading rank); each
resets its peak RSS once torch is imported and its state built (/proc/self/clear_refs)
and reports the peak above the RSS it had then.
"""
import dataclasses
import io
import json
import math
import os
import pickle
import resource
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


# ---------------------------------------------------------------- models (as models.h)

def gpt(vocab, n_layer, d, seq_len, tied):
    p = [("tok.weight", (vocab, d)), ("pos.weight", (seq_len, d))]
    for i in range(n_layer):
        b = f"blocks.{i}."
        p += [(b + "ln1.weight", (d,)), (b + "ln1.bias", (d,)), (b + "qkv.weight", (3 * d, d)),
              (b + "qkv.bias", (3 * d,)), (b + "proj.weight", (d, d)), (b + "proj.bias", (d,)),
              (b + "ln2.weight", (d,)), (b + "ln2.bias", (d,)), (b + "fc.weight", (4 * d, d)),
              (b + "fc.bias", (4 * d,)), (b + "fc_out.weight", (d, 4 * d)), (b + "fc_out.bias", (d,))]
    p += [("ln_f.weight", (d,)), ("ln_f.bias", (d,))]
    if not tied:
        p.append(("head.weight", (vocab, d)))
    return p


def llama(n_layer, d, heads, kv_heads, ffn, vocab):
    kv = kv_heads * (d // heads)
    p = [("embed_tokens.weight", (vocab, d))]
    for i in range(n_layer):
        b = f"layers.{i}."
        p += [(b + "self_attn.q_proj.weight", (d, d)), (b + "self_attn.k_proj.weight", (kv, d)),
              (b + "self_attn.v_proj.weight", (kv, d)), (b + "self_attn.o_proj.weight", (d, d)),
              (b + "mlp.gate_proj.weight", (ffn, d)), (b + "mlp.up_proj.weight", (ffn, d)),
              (b + "mlp.down_proj.weight", (d, ffn)), (b + "input_layernorm.weight", (d,)),
              (b + "post_attention_layernorm.weight", (d,))]
    p += [("norm.weight", (d,)), ("lm_head.weight", (vocab, d))]
    return p


MODELS = {
    "gpt2-124m": lambda: gpt(50257, 12, 768, 1024, True),
    "llama3-8b": lambda: llama(32, 4096, 32, 8, 14336, 128256),
    "llama3-70b": lambda: llama(80, 8192, 64, 8, 28672, 128256),
    "tiny": lambda: gpt(256, 1, 16, 8, False),
    # check's 2-D model: k and v of 4 rows, so that at (dp 4, tp 2) half the ranks hold empty pieces.
    "tiny-llama": lambda: llama(1, 16, 4, 1, 32, 64),
}

# torchtitan's tensor-parallel plan for Llama (Hugging Face's names, as models.h): the
# dimension each parameter's DTensor is sharded along over the tp mesh dimension:
# ColwiseParallel q, k, v, gate, up and lm_head (Shard(0)); RowwiseParallel o and down
# (Shard(1)) and embed_tokens (an Embedding: Shard(0)); the norms SequenceParallel
# (Replicate()). FSDP2's fully_shard over dp then makes the placements on the (dp, tp) mesh
# (check() builds them with FSDP2 + parallelize_module and compares):
#   Shard(0) on tp -> (_StridedShard(0, split_factor=tp), Shard(0)): the TP piece's rows cut
#                     by torch.chunk's rule over dp;
#   Shard(1) on tp -> (Shard(0), Shard(1));  Replicate() -> (Shard(0), Replicate()).
LLAMA_TP = {"self_attn.q_proj.weight": 0, "self_attn.k_proj.weight": 0, "self_attn.v_proj.weight": 0,
            "self_attn.o_proj.weight": 1, "mlp.gate_proj.weight": 0, "mlp.up_proj.weight": 0,
            "mlp.down_proj.weight": 1, "embed_tokens.weight": 0, "lm_head.weight": 0}


def tp_dim_of(fqn):
    """The dimension tensor parallelism cuts `fqn` along (torchtitan's Llama plan), None if whole."""
    for suffix, d in LLAMA_TP.items():
        if fqn == suffix or fqn.endswith("." + suffix):
            return d
    return None


def parse_mesh(text):
    """'N' (1-D: FSDP2 over N ranks) or 'DPxTP' (FSDP2 over dp with TP): (dp, tp)."""
    d = [int(x) for x in str(text).split("x")]
    if len(d) == 1:
        return d[0], 1
    if len(d) == 2:
        return d[0], d[1]
    raise ValueError(f"a mesh is N or DPxTP, not {text!r}")


# ---------------------------------------------------------------- the state dict

class Sharded:
    """A DTensor of `shape` without data (a leaf for flattening): Shard(0) over a 1-D mesh,
    or on a (dp, tp) mesh as FSDP2 places a parameter tensor parallelism cuts along
    `tp_dim` (None: one it keeps whole)."""
    __slots__ = ("shape", "tp_dim")

    def __init__(self, fqn, shape, tp_dim=None):
        self.shape = tuple(shape)
        self.tp_dim = tp_dim


def nested_state(params, make_sharded=Sharded, step=None):
    """FSDP2 + get_state_dict's layout: model params, AdamW state per param (step a 0-d
    tensor, exp_avg / exp_avg_sq sharded like the param) and one param group.
    make_sharded(fqn, shape, tp_dim) makes each sharded value."""
    step = torch.tensor(100000.0) if step is None else step
    model = {fqn: make_sharded(fqn, shape, tp_dim_of(fqn)) for fqn, shape in params}
    state = {fqn: {"step": step.clone(), "exp_avg": make_sharded(fqn, shape, tp_dim_of(fqn)),
                   "exp_avg_sq": make_sharded(fqn, shape, tp_dim_of(fqn))}
             for fqn, shape in params}
    group = dict(torch.optim.AdamW([torch.zeros(1)], lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1).param_groups[0])
    group["params"] = [fqn for fqn, _ in params]
    return {"model": model, "optim": {"state": state, "param_groups": [group]}}


def chunk_range(n, pieces, i):
    """torch.chunk's rule as DTensor's Shard applies it: piece i of n is (begin, size)
    (an empty piece begins at n)."""
    c = -(-n // pieces)
    begin = min(i * c, n)
    return begin, max(0, min(n, (i + 1) * c) - begin)


def chunk_of(shape, world, rank, tp=1, tp_dim=None):
    """The (offsets, sizes) rank `rank` holds of a tensor of `shape`, as DTensor's
    compute_local_shape_and_global_offset gives them: Shard(0) over `world` ranks (tp 1),
    else on the (world / tp, tp) mesh as FSDP2 + TP place it (see LLAMA_TP)."""
    offsets, sizes = [0] * len(shape), list(shape)
    dp, (p, t) = world // tp, divmod(rank, tp)
    if tp_dim == 0 and tp > 1:
        tb, tn = chunk_range(shape[0], tp, t)
        b, sizes[0] = chunk_range(tn, dp, p)
        # An empty piece begins at the dimension's global size, as DTensor reports it.
        offsets[0] = tb + b if sizes[0] else shape[0]
    else:
        offsets[0], sizes[0] = chunk_range(shape[0], dp, p)
        if tp_dim == 1 and tp > 1:
            offsets[1], sizes[1] = chunk_range(shape[1], tp, t)
    return torch.Size(offsets), torch.Size(sizes)


def contiguous_strides(sizes):
    out, acc = [], 1
    for s in reversed(sizes):
        out.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(out))


class Planner:
    """One model's flattened state and DCP's per-rank plans for it at world N."""

    def __init__(self, params):
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict
        self.params = params
        self.flat, self.mappings = flatten_state_dict(nested_state(params))
        self.float_props = {}

    def local_save_plan(self, world, rank, tp=1):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
        from torch.distributed.checkpoint.planner_helpers import (_create_write_item_for_bytesio,
                                                                  _create_write_item_for_tensor)
        items = []
        for fqn, obj in self.flat.items():
            if isinstance(obj, Sharded):
                offsets, sizes = chunk_of(obj.shape, world, rank, tp, obj.tp_dim)
                items.append(WriteItem(
                    index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                        properties=TensorProperties(dtype=torch.float32, layout=torch.strided, requires_grad=False,
                                                    memory_format=torch.contiguous_format, pin_memory=False,
                                                    strides=contiguous_strides(sizes)),
                        size=torch.Size(obj.shape))))
            elif isinstance(obj, torch.Tensor):
                items.append(_create_write_item_for_tensor(fqn, obj))
            else:
                items.append(_create_write_item_for_bytesio(fqn, obj))
        return SavePlan(items, planner_data=self.mappings)

    def local_load_plan(self, metadata, world, rank, tp=1):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        from torch.distributed.checkpoint.planner import LoadPlan
        from torch.distributed.checkpoint.planner_helpers import _create_read_items, create_read_items_for_chunk_list
        # DefaultLoadPlanner.create_local_plan: the key sets, then one plan item list per value.
        current, saved = set(self.flat.keys()), set(metadata.state_dict_metadata.keys())
        if saved - current:
            raise RuntimeError("keys differ")
        requests = []
        for fqn, obj in self.flat.items():
            md = metadata.state_dict_metadata[fqn]
            if isinstance(obj, Sharded):
                if tuple(md.size) != obj.shape:
                    raise ValueError("size mismatch " + fqn)
                offsets, sizes = chunk_of(obj.shape, world, rank, tp, obj.tp_dim)
                requests += create_read_items_for_chunk_list(fqn, md, [ChunkStorageMetadata(offsets, sizes)])
            else:
                requests += _create_read_items(fqn, md, obj)
        return LoadPlan(requests)


# ---------------------------------------------------------------- measuring

def _status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def rss_kib():
    return _status("VmRSS")


def start_peak():
    """Resets the process's peak RSS (VmHWM) to its current RSS (Linux: clear_refs 5) and
    returns that RSS in KiB: peak_kib() - start_peak() is then the work's own peak, not
    the import of torch's (which peaks above the RSS it leaves)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return rss_kib()


def peak_kib():
    return _status("VmHWM")


def now():
    return time.perf_counter()


def torch_save_len(obj):
    b = io.BytesIO()
    torch.save(obj, b)
    return len(b.getvalue())


def items_per_rank(params):
    return len(Planner(params).flat)


def save_main(model, mesh, meta_out):
    """The coordinator of a DCP save on `mesh` ('N' or 'DPxTP'), and the per-rank pieces of it."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.filesystem import FileSystemWriter, _StorageInfo
    from torch.distributed.checkpoint.metadata import StorageMeta
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult
    from torch.distributed.checkpoint import filesystem
    planner = Planner(MODELS[model]())
    base_kib = start_peak()
    dp, tp = parse_mesh(mesh)
    world = dp * tp
    out = {"model": model, "ranks": world, "mesh": mesh, "tp": tp, "items_per_rank": len(planner.flat),
           "base_rss_kib": base_kib}
    sample = sorted({0, world // 2, world - 1})
    # Every rank's local plan, pickled as gather_object sends it.
    t_local, pickled, sizes = {}, [], []
    t0 = now()
    for r in range(world):
        a = now()
        plan = planner.local_save_plan(world, r, tp)
        b = pickle.dumps(plan)
        if r in sample:
            t_local[r] = now() - a
        pickled.append(b)
        sizes.append(len(b))
        del plan
    out["local_plans_s_total"] = now() - t0
    out["local_plan_ms"] = {str(r): 1000 * t for r, t in t_local.items()}
    out["local_plan_bytes"] = {"sum": sum(sizes), "max": max(sizes), "min": min(sizes)}
    # The coordinator: unpickle the gathered plans, plan globally, prepare the storage.
    t0 = now()
    plans = [pickle.loads(b) for b in pickled]
    out["unpickle_local_plans_s"] = now() - t0
    del pickled
    sp = DefaultSavePlanner()
    sp.is_coordinator = True
    t0 = now()
    global_plans, metadata = sp.create_global_plan(plans)
    out["create_global_plan_s"] = now() - t0
    t0 = now()
    global_plans = FileSystemWriter.prepare_global_plan(None, global_plans)
    out["prepare_global_plan_s"] = now() - t0
    del plans
    t0 = now()
    gp = [pickle.dumps(p) for p in global_plans]
    out["pickle_global_plans_s"] = now() - t0
    out["global_plan_bytes"] = {"sum": sum(map(len, gp)), "max": max(map(len, gp))}
    del gp
    # Each rank's writes, as FileSystemWriter (one file per rank, torch.save per item).
    empty_len = torch_save_len(torch.empty(0))
    bytes_len = {}
    results, wr_sizes = [], []
    for r, plan in enumerate(global_plans):
        offset, res = 0, []
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                if item.index.fqn not in bytes_len:
                    bytes_len[item.index.fqn] = torch_save_len(planner.flat[item.index.fqn])
                n = bytes_len[item.index.fqn]
            else:
                n = empty_len + 4 * math.prod(item.tensor_data.chunk.sizes)
            res.append(WriteResult(index=item.index, size_in_bytes=n,
                                   storage_data=_StorageInfo(f"{plan.storage_data.prefix}0{filesystem.DEFAULT_SUFFIX}",
                                                             offset, n)))
            offset += n
        wr_sizes.append(len(pickle.dumps(res)))
        results.append(res)
    out["write_results_bytes"] = {"sum": sum(wr_sizes), "max": max(wr_sizes)}
    # FileSystemWriter.finish.
    t0 = now()
    metadata.version = filesystem.CURRENT_DCP_VERSION
    storage_md = {}
    for wr_list in results:
        storage_md.update({wr.index: wr.storage_data for wr in wr_list})
    metadata.storage_data = storage_md
    metadata.storage_meta = StorageMeta(checkpoint_id="/checkpoints/llama-3-70b/step-00100000",
                                        save_id="0f1e2d3c4b5a69788796a5b4c3d2e1f0")
    out["finish_s"] = now() - t0
    del results, global_plans
    t0 = now()
    blob = pickle.dumps(metadata)
    out["pickle_metadata_s"] = now() - t0
    out["metadata_bytes"] = len(blob)
    with open(meta_out, "wb") as f:
        f.write(blob)
    t0 = now()
    pickle.loads(blob)
    out["unpickle_metadata_s"] = now() - t0
    out["chunks"] = sum(len(md.chunks) for md in metadata.state_dict_metadata.values() if hasattr(md, "chunks"))
    out["storage_entries"] = len(metadata.storage_data)
    out["peak_rss_kib"] = peak_kib()
    print(json.dumps(out), flush=True)


def load_main(model, mesh, meta_path, target_mesh):
    """One loading rank (several sampled ranks in turn) of a target on `target_mesh`, from a
    save on `mesh`."""
    planner = Planner(MODELS[model]())
    base_kib = start_peak()
    dp, tp = parse_mesh(mesh)
    tdp, ttp = parse_mesh(target_mesh)
    target_world = tdp * ttp
    out = {"model": model, "ranks": dp * tp, "mesh": mesh, "target_ranks": target_world, "target_mesh": target_mesh,
           "base_rss_kib": base_kib, "ranks_sampled": []}
    t0 = now()
    with open(meta_path, "rb") as f:
        blob = f.read()
    metadata = pickle.loads(blob)
    out["read_unpickle_metadata_s"] = now() - t0
    out["metadata_rss_kib"] = rss_kib() - base_kib
    del blob
    for r in sorted({0, target_world // 2, target_world - 1}):
        t0 = now()
        plan = planner.local_load_plan(metadata, target_world, r, ttp)
        dt = now() - t0
        files = {metadata.storage_data[item.storage_index].relative_path for item in plan.items}
        out["ranks_sampled"].append({"rank": r, "local_plan_ms": 1000 * dt, "read_items": len(plan.items),
                                     "files": len(files), "load_plan_bytes": len(pickle.dumps(plan))})
        del plan
    out["peak_rss_kib"] = peak_kib()
    print(json.dumps(out), flush=True)


def run_child(args):
    """Runs this script with `args` in a child process: (its JSON, its whole peak RSS in
    KiB, torch's import included; the JSON's peak_rss_kib is the work's, from its start)."""
    p = subprocess.Popen([sys.executable, os.path.abspath(__file__)] + args, stdout=subprocess.PIPE)
    out = p.stdout.read()
    _, status, ru = os.wait4(p.pid, 0)
    if status != 0:
        raise RuntimeError(f"dcp_scale {' '.join(args)} failed ({status})")
    return json.loads(out.decode().strip().splitlines()[-1]), ru.ru_maxrss


def compare_plans(what, real, mine):
    """Raises SystemExit naming the first differing item unless the plans are equal."""
    if real.items != mine.items or getattr(real, "planner_data", None) != getattr(mine, "planner_data", None):
        for x, y in zip(real.items, mine.items):
            if x != y:
                print(f"{what}: item differs:\n", x, "\n", y, file=sys.stderr)
                break
        raise SystemExit(f"check: {what}: the plans differ ({len(real.items)} and {len(mine.items)} items)")


def tiny_llama_2d(params, dp, tp):
    """Llama (Hugging Face's names, `params`' shapes) with torchtitan's TP plan over the
    mesh's tp dimension, then FSDP2's fully_shard per layer and at the root over dp:
    its state dict's DTensors by name."""
    import torch.nn as nn
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                   parallelize_module)
    shapes = dict(params)
    d, vocab = shapes["embed_tokens.weight"][1], shapes["embed_tokens.weight"][0]
    kv, ffn = shapes["layers.0.self_attn.k_proj.weight"][0], shapes["layers.0.mlp.gate_proj.weight"][0]
    n_layer = sum(1 for k in shapes if k.endswith(".input_layernorm.weight"))

    def linear(i, o):
        return nn.Linear(i, o, bias=False)

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attn = nn.Module()
            for name, o in (("q_proj", d), ("k_proj", kv), ("v_proj", kv)):
                setattr(self.self_attn, name, linear(d, o))
            self.self_attn.o_proj = linear(d, d)
            self.mlp = nn.Module()
            self.mlp.gate_proj, self.mlp.up_proj, self.mlp.down_proj = linear(d, ffn), linear(d, ffn), linear(ffn, d)
            self.input_layernorm, self.post_attention_layernorm = nn.RMSNorm(d), nn.RMSNorm(d)

    model = nn.Module()
    model.embed_tokens = nn.Embedding(vocab, d)
    model.layers = nn.ModuleList([Layer() for _ in range(n_layer)])
    model.norm = nn.RMSNorm(d)
    model.lm_head = linear(d, vocab)
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    plan = {"embed_tokens": RowwiseParallel(), "norm": SequenceParallel(), "lm_head": ColwiseParallel()}
    for i in range(n_layer):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"layers.{i}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"layers.{i}.{name}"] = RowwiseParallel()
        for name in ("input_layernorm", "post_attention_layernorm"):
            plan[f"layers.{i}.{name}"] = SequenceParallel()
    parallelize_module(model, mesh["tp"], plan)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return get_model_state_dict(model)


def check_2d_rank(dp, tp, target_dp, target_tp, rank):
    """Rank `rank` of a (dp, tp) mesh and of a (target_dp, target_tp) one (each in this
    process alone: DTensor's mesh state outlives a re-initialized fake process group):
    FSDP2 + TP's real DTensors for tiny-llama (placements as LLAMA_TP says, local shapes as
    chunk_of computes), DCP's DefaultSavePlanner's local plan equal to this script's, then
    DefaultLoadPlanner's local plans, against the metadata of every rank's plan, at the same
    mesh and at the target (a reshard) equal to this script's. Prints the item counts."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard
    from torch.testing._internal.distributed.fake_pg import FakeStore
    params = MODELS["tiny-llama"]()
    planner = Planner(params)
    world = dp * tp
    _, md = DefaultSavePlanner().create_global_plan([planner.local_save_plan(world, r, tp) for r in range(world)])

    def real_state(mesh_dp, mesh_tp):
        sd = tiny_llama_2d(params, mesh_dp, mesh_tp)
        want = {0: (_StridedShard(0, split_factor=mesh_tp), Shard(0)), 1: (Shard(0), Shard(1)),
                None: (Shard(0), Replicate())}
        for fqn, shape in params:
            v = sd[fqn]
            if tuple(v.placements) != want[tp_dim_of(fqn)]:
                raise SystemExit(f"check: FSDP2 + TP placed {fqn} as {v.placements}, not {want[tp_dim_of(fqn)]}")
            _, sizes = chunk_of(shape, mesh_dp * mesh_tp, rank, mesh_tp, tp_dim_of(fqn))
            if tuple(v.to_local().shape) != tuple(sizes):
                raise SystemExit(f"check: rank {rank} holds {tuple(v.to_local().shape)} of {fqn}, not {tuple(sizes)}")

        def like(fqn, shape, tp_dim):  # the parameter, and AdamW's state of it: DTensors placed alike
            v = sd[fqn]
            return DTensor.from_local(torch.zeros(v.to_local().shape), v.device_mesh, v.placements, run_check=False,
                                      shape=v.shape, stride=v.stride())
        return nested_state(params, make_sharded=like)

    out = {"rank": rank}
    if rank < world:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        real_sd = real_state(dp, tp)
        sp = DefaultSavePlanner()
        sp.set_up_planner(real_sd, is_coordinator=False)
        real = sp.create_local_plan()
        compare_plans(f"2-D ({dp}, {tp}) rank {rank} save", real, planner.local_save_plan(world, rank, tp))
        lp = DefaultLoadPlanner()
        lp.set_up_planner(real_sd, md, False)
        real_load = lp.create_local_plan()
        compare_plans(f"2-D ({dp}, {tp}) rank {rank} load", real_load, planner.local_load_plan(md, world, rank, tp))
        out.update(save_items=len(real.items), load_items=len(real_load.items))
        dist.destroy_process_group()
    else:
        target_world = target_dp * target_tp
        rank -= world
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=target_world)
        lp = DefaultLoadPlanner()
        lp.set_up_planner(real_state(target_dp, target_tp), md, False)
        real_load = lp.create_local_plan()
        compare_plans(f"2-D ({dp}, {tp}) -> ({target_dp}, {target_tp}) rank {rank} load", real_load,
                      planner.local_load_plan(md, target_world, rank, target_tp))
        out.update(reshard_load_items=len(real_load.items))
        dist.destroy_process_group()
    print(json.dumps(out), flush=True)


def check():
    """DCP's planners on real DTensors (fake process group) against this script's plans for
    the same state, which must be equal: 1-D at 4 ranks (rank 1, Shard(0)); 2-D on a
    (dp 4, tp 2) mesh with FSDP2 + TP's own DTensors, and loads of that save at (2, 4)
    (check_2d_rank)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore
    world, rank = 4, 1
    params = MODELS["tiny"]() + [("odd.weight", (3, 5))]  # an odd shape: trailing ranks get empty shards
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))

    def dtensor(fqn, shape, tp_dim):
        offsets, sizes = chunk_of(shape, world, rank)
        return DTensor.from_local(torch.zeros(sizes), mesh, [Shard(0)], run_check=False, shape=torch.Size(shape),
                                  stride=contiguous_strides(shape))

    real_sd = nested_state(params, make_sharded=dtensor)
    sp = DefaultSavePlanner()
    sp.set_up_planner(real_sd, is_coordinator=False)
    real = sp.create_local_plan()
    compare_plans("1-D save", real, Planner(params).local_save_plan(world, rank))
    # A metadata for the same state (every rank's plan), then the load plans.
    planner = Planner(params)
    gsp = DefaultSavePlanner()
    _, md = gsp.create_global_plan([planner.local_save_plan(world, r) for r in range(world)])
    lp = DefaultLoadPlanner()
    lp.set_up_planner(nested_state(params, make_sharded=dtensor), md, False)
    real_load = lp.create_local_plan()
    compare_plans("1-D load", real_load, planner.local_load_plan(md, world, rank))
    dist.destroy_process_group()
    # 2-D: ranks 0, 3, 4, 7 of (4, 2) saving and loading (tp ranks 0 and 1, dp ranks 0-3, the
    # last two with empty k and v pieces) and ranks 0, 3, 5, 6 of (2, 4) loading that save
    # (8 + 0, 3, 5, 6); a child each, two at a time.
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(2) as pool:
        ranks_2d = list(pool.map(lambda r: run_child(["check2d", "4", "2", "2", "4", str(r)])[0],
                                 [0, 3, 4, 7, 8, 11, 13, 14]))
    print(json.dumps({"check": "ok", "save_items": len(real.items), "load_items": len(real_load.items),
                      "check_2d": "ok: FSDP2 + TP on (dp 4, tp 2): ranks 0, 3, 4, 7's save and load plans, and "
                                  "ranks 0, 3, 5, 6 of (2, 4) loading that save",
                      "save_items_2d": ranks_2d[0]["save_items"], "load_items_2d": ranks_2d[0]["load_items"],
                      "torch": torch.__version__}))


def measure(model, mesh, targets, work):
    """One configuration, each step a child process: DCP's save on `mesh` (the
    coordinator's planning), a resuming rank's load planning on the same mesh, and a loading
    rank's on each mesh of `targets` (reshards). Returns the row; a line on stderr."""
    meta = os.path.join(work, f"dcp-scale-{os.getpid()}-{model}-{mesh}.metadata")
    try:
        t0 = now()
        save, save_kib = run_child(["save", model, mesh, meta])
        save["process_peak_rss_kib"] = save_kib
        load, load_kib = run_child(["load", model, mesh, meta, mesh])
        load["process_peak_rss_kib"] = load_kib
        row = {"model": model, "ranks": save["ranks"], "save": save, "load": load, "reshard": []}
        for dst in targets:
            rl, rk = run_child(["load", model, mesh, meta, dst])
            rl["process_peak_rss_kib"] = rk
            row["reshard"].append(rl)
        row["wall_s"] = now() - t0
        print(f"dcp {model:11s} {mesh:>8s} N={save['ranks']:<6d} metadata {save['metadata_bytes']:>11d} B  "
              f"global plan {save['create_global_plan_s']:.2f} s  coordinator peak "
              f"{(save['peak_rss_kib'] - save['base_rss_kib']) / 1024:.0f} MiB  "
              f"load {load['ranks_sampled'][0]['local_plan_ms']:.1f} ms ({row['wall_s']:.1f} s)",
              file=sys.stderr, flush=True)
        return row
    finally:
        if os.path.exists(meta):
            os.unlink(meta)


def run(args):
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="gpt2-124m,llama3-8b,llama3-70b")
    ap.add_argument("--ranks", default="8,64,512,1024,4096,16384")
    ap.add_argument("--reshard", default="16384:1024,1024:16384")
    ap.add_argument("--max-items", type=int, default=int(os.environ.get("DCP_SCALE_MAX_ITEMS", 400000)),
                    help="skip a configuration whose N x items-per-rank exceeds this (time and memory)")
    ap.add_argument("--models-2d", default="llama3-70b")
    ap.add_argument("--meshes-2d", default="2x8,8x8,16x8,32x8,64x8",
                    help="FSDP2 x TP meshes DPxTP (those within --max-items are measured)")
    ap.add_argument("--reshard-2d", default="16x8:8x16")
    ap.add_argument("--work", default="/tmp")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(args)
    res = {"benchmark": "scale-dcp", "torch": torch.__version__, "max_items": a.max_items}
    res["check"], _ = run_child(["check"])
    ranks = [int(x) for x in a.ranks.split(",") if x]
    reshard = [tuple(int(y) for y in x.split(":")) for x in a.reshard.split(",") if x]
    configs, skipped = [], []
    for model in [m for m in a.models.split(",") if m]:
        per_rank = items_per_rank(MODELS[model]())
        for n in ranks:
            if n * per_rank > a.max_items:
                skipped.append({"model": model, "ranks": n, "items": n * per_rank})
                continue
            targets = [str(dst) for src, dst in reshard if src == n and dst * per_rank <= 64 * a.max_items]
            configs.append(measure(model, str(n), targets, a.work))
    res["configs"] = configs
    res["skipped"] = skipped
    # 2-D: FSDP2 over dp with TP (torchtitan's plan), DTensors on the (dp, tp) mesh.
    configs_2d = []
    reshard_2d = [tuple(x.split(":")) for x in a.reshard_2d.split(",") if x]
    for model in [m for m in a.models_2d.split(",") if m]:
        per_rank = items_per_rank(MODELS[model]())
        for mesh in [m for m in a.meshes_2d.split(",") if m]:
            dp, tp = parse_mesh(mesh)
            if dp * tp * per_rank > a.max_items:
                skipped.append({"model": model, "ranks": dp * tp, "mesh": mesh, "items": dp * tp * per_rank})
                continue
            row = measure(model, mesh, [dst for src, dst in reshard_2d if src == mesh], a.work)
            row.update(sharding="fsdp+tp", mesh=mesh, tp=tp)
            configs_2d.append(row)
    res["configs_2d"] = configs_2d
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


def main():
    cmd = sys.argv[1] if len(sys.argv) > 1 else ""
    if cmd == "save":
        save_main(sys.argv[2], sys.argv[3], sys.argv[4])
    elif cmd == "load":
        load_main(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5])
    elif cmd == "check":
        check()
    elif cmd == "check2d":
        check_2d_rank(*(int(x) for x in sys.argv[2:7]))
    elif cmd == "run":
        run(sys.argv[2:])
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main()
