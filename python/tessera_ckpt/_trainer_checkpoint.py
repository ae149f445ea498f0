"""A Tessera Trainer checkpoint written and read from PyTorch (``tessera_ckpt.dcp.TrainerState``;
C++: src/tessera/trainer/trainer_checkpoint.cpp, which resumes such a checkpoint): the model
under ``model.``, the optimizer under ``optimizer_0.`` in Tessera's layout
(_state_optimizer_state.py), ``global_step`` and ``hparams.*``, saved and loaded through DCP
with the package's Writer and Reader. Imported through dcp.py, which checks first that this
torch has DCP."""
import torch.distributed.checkpoint as _dcp

from ._dcp_reader import Reader
from ._dcp_writer import Writer
from ._reader import CheckpointReader
from ._state_optimizer_state import from_tessera_optimizer, optimizer_kind, to_tessera_optimizer


def _hparam_text(v):
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return f"{v:f}"
    return str(v)


class TrainerState:
    """A Tessera Trainer checkpoint (what ``gpt train --resume`` and ``Trainer::fit(...,
    ckpt_path)`` continue from) of a PyTorch model and optimizer, plain or FSDP2 / DTensor::

        state = tessera_ckpt.dcp.TrainerState(model, optimizer, global_step=step,
                                              hparams={"n_layer": 4, "n_head": 4, ...})
        state.save(path)   # dcp.save through Writer: model.*, optimizer_0.*, global_step, hparams.*
        state.load(path)   # dcp.load through Reader, e.g. a checkpoint gpt train wrote;
                           # then state.global_step, state.hparams

    The model's weights go under ``model.<fqn>``; the optimizer's state (torch.optim SGD, Adam,
    AdamW, Adagrad or RMSprop, through ``get_state_dict`` so FSDP2 state stays sharded) under
    ``optimizer_0`` in Tessera's layout: the per-parameter state by FQN with an integer
    ``step``, each group's hyperparameters (Adam's betas as ``beta1`` / ``beta2``) and its
    parameters' FQNs in order. There is no loop state: the Trainer resumes such a checkpoint
    at ``global_step`` with its own data order and LR schedule at that step (and says so).
    ``hparams`` values are stored as text, as the Trainer writes them. Collective, like
    dcp.save / dcp.load."""

    def __init__(self, model, optimizer, *, global_step=0, hparams=None):
        self.model, self.optimizer = model, optimizer
        self.kind = optimizer_kind(optimizer)
        self.global_step = int(global_step)
        self.hparams = dict(hparams or {})

    def _torch_state(self):
        from torch.distributed.checkpoint.state_dict import get_state_dict

        return get_state_dict(self.model, self.optimizer)

    def state_dict(self):
        msd, osd = self._torch_state()
        sd = {"model": msd, "optimizer_0": to_tessera_optimizer(self.kind, osd), "global_step": self.global_step}
        if self.hparams:
            sd["hparams"] = {str(k): _hparam_text(v) for k, v in self.hparams.items()}
        return sd

    def load_state_dict(self, sd):
        from torch.distributed.checkpoint.state_dict import set_state_dict

        _, osd = self._torch_state()
        where = "TrainerState.load_state_dict"
        optim = from_tessera_optimizer(self.kind, sd["optimizer_0"], osd, where)
        set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"], optim_state_dict=optim)
        self.global_step = int(sd["global_step"])
        if "hparams" in sd:
            self.hparams = dict(sd["hparams"])

    def save(self, path):
        _dcp.save(self.state_dict(), storage_writer=Writer(path))

    def load(self, path, *, verify=True):
        sd = self.state_dict()
        sd.pop("hparams", None)
        _dcp.load(sd, storage_reader=Reader(path, verify=verify))
        with CheckpointReader(path) as ck:
            sd["hparams"] = {k[len("hparams."):]: ck.get(k) for k in ck.keys() if k.startswith("hparams.")}
        self.load_state_dict(sd)
