"""Optimizer state in Tessera's layout (C++: src/tessera/state/optimizer_state.cpp, whose
header comment draws it) next to torch.optim's state_dict: the kind ("sgd", "adam", "adamw",
"adagrad", "rmsprop"), each group's hyperparameters (Adam's betas as beta1 / beta2) and its
parameters' FQNs in order, the per-parameter state by FQN with an integer step. The
conversions TrainerState (_trainer_checkpoint.py) saves and loads an optimizer through."""
import torch

from ._error import CheckpointError

_OPTIMIZER_KINDS = {"SGD": "sgd", "Adam": "adam", "AdamW": "adamw", "Adagrad": "adagrad", "RMSprop": "rmsprop"}
_HYPER = {
    "sgd": ("lr", "momentum", "dampening", "weight_decay", "nesterov"),
    "adam": ("lr", "beta1", "beta2", "eps", "weight_decay", "amsgrad"),
    "adamw": ("lr", "beta1", "beta2", "eps", "weight_decay", "amsgrad"),
    "adagrad": ("lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps"),
    "rmsprop": ("lr", "alpha", "eps", "weight_decay", "momentum", "centered"),
}
_BOOL_HYPER = ("nesterov", "amsgrad", "centered")
_STATE = {
    "sgd": ("momentum_buffer",),
    "adam": ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
    "adamw": ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
    "adagrad": ("sum",),
    "rmsprop": ("square_avg", "momentum_buffer", "grad_avg"),
}


def optimizer_kind(optimizer):
    name, module = type(optimizer).__name__, type(optimizer).__module__
    torch_optim = module.split(".")[:2] == ["torch", "optim"]
    if not torch_optim or name not in _OPTIMIZER_KINDS:
        what = f"torch.optim.{name}" if torch_optim else f"{module}.{name}"
        raise CheckpointError(f"TrainerState: a {what} has no Tessera counterpart "
                              f"(supported: torch.optim.{', torch.optim.'.join(_OPTIMIZER_KINDS)})")
    kind = _OPTIMIZER_KINDS[name]
    for i, g in enumerate(optimizer.param_groups):
        if kind == "adam" and g.get("decoupled_weight_decay"):
            kind = "adamw"  # Adam(decoupled_weight_decay=True) is AdamW
        if g.get("maximize"):
            raise CheckpointError(f"TrainerState: param group {i} has maximize=True, which libtorch's optimizers "
                                  "do not have")
    return kind


def _number(v, where):
    if isinstance(v, torch.Tensor):
        if v.numel() != 1:
            raise CheckpointError(f"TrainerState: {where} is a tensor of {v.numel()} elements, not a number")
        v = v.item()
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise CheckpointError(f"TrainerState: {where} is a {type(v).__name__}, not a number")
    return float(v)


def to_tessera_optimizer(kind, osd):
    """torch.optim state dict keyed by FQN (get_state_dict's form) -> Tessera's layout."""
    groups = {}
    for gi, g in enumerate(osd["param_groups"]):
        hp = dict(g)
        if "betas" in hp:
            hp["beta1"], hp["beta2"] = hp["betas"]
        out = {}
        for k in _HYPER[kind]:
            if k not in hp:
                raise CheckpointError(f"TrainerState: param group {gi} has no '{k}' (a {kind} optimizer needs it)")
            out[k] = bool(hp[k]) if k in _BOOL_HYPER else _number(hp[k], f"param group {gi} '{k}'")
        out["params"] = {str(i): str(fqn) for i, fqn in enumerate(g["params"])}
        groups[str(gi)] = out
    state = {}
    for fqn, s in osd["state"].items():
        fields = {}
        for k, v in s.items():
            if k == "step":
                fields["step"] = int(_number(v, f"state of '{fqn}' 'step'"))
            elif k in _STATE[kind]:
                if v is not None and not (isinstance(v, torch.Tensor) and v.numel() == 0):
                    fields[k] = v
            else:
                raise CheckpointError(f"TrainerState: the state of '{fqn}' has '{k}', which a Tessera {kind} "
                                      "optimizer does not hold")
        if kind != "sgd" and "step" not in fields:
            raise CheckpointError(f"TrainerState: the state of '{fqn}' has no 'step'")
        state[str(fqn)] = fields
    return {"optimizer": kind, "state": state, "param_groups": groups}


def from_tessera_optimizer(kind, tsd, osd, where):
    """Tessera's layout (as dcp.load filled it) -> a torch.optim state dict like ``osd``
    (the optimizer's own, giving the fields Tessera does not keep, e.g. foreach)."""
    if tsd.get("optimizer") != kind:
        raise CheckpointError(f"{where}: optimizer_0 is a {tsd.get('optimizer')!r} optimizer's state, this one is {kind}")
    groups = []
    for gi, g in enumerate(osd["param_groups"]):
        t = tsd["param_groups"][str(gi)]
        mine = [str(p) for p in g["params"]]
        saved = [t["params"][str(i)] for i in range(len(mine))]
        if saved != mine:
            bad = next(i for i in range(len(mine)) if saved[i] != mine[i])
            raise CheckpointError(f"{where}: param group {gi} parameter {bad} is '{saved[bad]}' in the checkpoint but "
                                  f"'{mine[bad]}' in the optimizer")
        ng = dict(g)
        for k in _HYPER[kind]:
            ng[k] = bool(t[k]) if k in _BOOL_HYPER else float(t[k])
        if "beta1" in ng:
            ng["betas"] = (ng.pop("beta1"), ng.pop("beta2"))
        for k, old in g.items():  # the optimizer's own types: an int default stays an int, a tensor lr a tensor
            new = ng[k]
            if isinstance(old, torch.Tensor) and isinstance(new, float):
                ng[k] = torch.tensor(new, dtype=old.dtype, device=old.device)
            elif isinstance(old, int) and not isinstance(old, bool) and isinstance(new, float) and new.is_integer():
                ng[k] = int(new)
        groups.append(ng)
    state = {}
    for fqn, s in osd["state"].items():
        t = tsd["state"].get(fqn)
        if t is None:
            continue
        ns = dict(s)
        for k, v in t.items():
            if k == "step":
                old = s.get("step")
                ns["step"] = (torch.tensor(float(v), dtype=old.dtype, device=old.device)
                              if isinstance(old, torch.Tensor) else v)
            else:
                ns[k] = v
        state[fqn] = ns
    return {"state": state, "param_groups": groups}
