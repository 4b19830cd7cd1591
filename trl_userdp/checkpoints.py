"""Saving and restoring privacy state, plain and sharded, for the engine and the trainers alike (docs/privacy_model.md,
"Faults"): a checkpoint is data, never code.

One layout for a checkpoint folder, whoever writes it:

* ``privacy_state.pt`` (:data:`PRIVACY_STATE_FILE`): the accountant's history and the private optimizer's own state
  (AUP-RLHF's AboveThreshold: a secret of the mechanism), plus the engine caller's other entries; written once, by the
  main process;
* ``sharded/`` (:data:`SHARDED_DIR`), for a model sharded by FSDP2: each process's shards (``torch.distributed
  .checkpoint``) of the optimizer state, and of the model where the folder does not hold the full model (the trainers
  save it gathered, so that ``from_pretrained`` reads it).

The engine's checkpoint of an unsharded model stays Opacus's one file, with the optimizer's state under
:data:`OPTIMIZER_STATE_KEY`. Folders written before this layout (the engine's ``privacy.pt``, the trainers'
``optimizer_sharded/``) are still read.
"""

from __future__ import annotations

import json
import math
import os
import pickle
from typing import IO, Any, BinaryIO, Dict, Optional, Union

import torch

from . import distributed

#: in a checkpoint folder: the privacy state, written once by the main process
PRIVACY_STATE_FILE = "privacy_state.pt"
#: in a checkpoint folder of a sharded model: each process's shards
SHARDED_DIR = "sharded"
#: key of the private optimizer's own state in the engine's one-file checkpoint (Opacus's format)
OPTIMIZER_STATE_KEY = "trl_userdp_optimizer_state"
#: the names an earlier layout gave the engine's privacy file and the trainers' shards (read, never written)
LEGACY_PRIVACY_FILE, LEGACY_SHARDED_DIR = "privacy.pt", "optimizer_sharded"


def load_plain(path: Any, **kwargs: Any) -> Any:
    """``torch.load(path, weights_only=True)``: tensors, numbers, strings and containers only.

    A file that needs anything else (a pickled object, a planted payload) is refused before any of it runs.

    Args:
        path: The file to load (anything ``torch.load`` accepts).
        **kwargs: Passed to ``torch.load``; ``weights_only`` may only be True.

    Returns:
        The loaded object.

    Raises:
        ValueError: If ``weights_only`` is not True, if the file holds more than plain data, or if it is
            truncated or not a torch file.
    """
    if kwargs.pop("weights_only", True) is not True:
        raise ValueError("Privacy state is loaded with weights_only=True only.")
    try:
        return torch.load(path, weights_only=True, **kwargs)
    except pickle.UnpicklingError as err:
        raise ValueError(f"{path} holds more than plain data (tensors, numbers, strings, containers), so it is not "
                         f"loaded: a checkpoint must never run code ({_first_line(err)}).") from None
    except (RuntimeError, EOFError) as err:  # truncated or not a torch file at all
        raise ValueError(f"{path} is not a readable checkpoint ({_first_line(err)}).") from None


def save_privacy_state(folder: str, accountant_state: Dict[str, Any], optimizer_state: Dict[str, Any],
                       entries: Optional[Dict[str, Any]] = None) -> None:
    """Write ``privacy_state.pt`` into ``folder`` (call it on the main process only).

    Args:
        folder: the checkpoint folder.
        accountant_state: the accountant's ``state_dict()``.
        optimizer_state: the private optimizer's ``privacy_state_dict()``.
        entries: the caller's other entries (the engine's ``checkpoint_dict``).
    """
    state = {"accountant": accountant_state, "optimizer": optimizer_state}
    if entries:
        state["entries"] = entries
    torch.save(state, os.path.join(folder, PRIVACY_STATE_FILE))


def read_privacy_state(folder: str, **torch_load_kwargs: Any) -> Dict[str, Any]:
    """The privacy state of a checkpoint folder, read as data (:func:`load_plain`), from either layout.

    Args:
        folder: the checkpoint folder.
        **torch_load_kwargs: passed to :func:`load_plain`.

    Returns:
        ``{"accountant": ..., "optimizer": ..., "entries": {...}}``.

    Raises:
        ValueError: the folder holds no privacy state (resuming would reset the accountant), or it is not plain data.
    """
    path = os.path.join(folder, PRIVACY_STATE_FILE)
    if os.path.isfile(path):
        state = load_plain(path, **torch_load_kwargs)
        if not isinstance(state, dict) or "accountant" not in state:
            raise ValueError(f"{path} holds no accountant state: resuming would reset the accountant.")
        return {"accountant": state["accountant"], "optimizer": state.get("optimizer", {}),
                "entries": state.get("entries", {})}
    legacy = os.path.join(folder, LEGACY_PRIVACY_FILE)
    if os.path.isfile(legacy):  # the engine's earlier layout: Opacus's keys beside the caller's entries
        entries = load_plain(legacy, **torch_load_kwargs)
        state = privacy_state_of(entries, source=legacy)
        return {**state, "entries": {k: v for k, v in entries.items()
                                     if k not in ("privacy_accountant_state_dict", OPTIMIZER_STATE_KEY)}}
    raise ValueError(f"{folder} has no {PRIVACY_STATE_FILE}: resuming would reset the accountant.")


def save_sharded(folder: str, module: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer],
                 accountant_state: Dict[str, Any], optimizer_state: Dict[str, Any], entries: Dict[str, Any]) -> None:
    """The engine's checkpoint of a model sharded by FSDP2: every process writes its shards of the model and the
    optimizer state, the main process the privacy state and the caller's entries, once; every process returns once the
    folder is whole (call it on every process).

    Args:
        folder: the checkpoint folder.
        module: the model sharded by FSDP2.
        optimizer: its optimizer, or None.
        accountant_state: the accountant's ``state_dict()``.
        optimizer_state: the private optimizer's ``privacy_state_dict()``.
        entries: the caller's other entries.
    """
    save_shards(folder, module, optimizer, with_model=True)
    if distributed.rank() == 0:
        save_privacy_state(folder, accountant_state, optimizer_state, entries)
    if distributed.world_size() > 1:
        torch.distributed.barrier()


def privacy_state_of(checkpoint: Dict[str, Any], source: str = "checkpoint") -> Dict[str, Any]:
    """The privacy state of the engine's one-file checkpoint (Opacus's format).

    Args:
        checkpoint: the loaded checkpoint.
        source: names the checkpoint in the message.

    Returns:
        ``{"accountant": ..., "optimizer": ...}``.

    Raises:
        ValueError: the checkpoint holds no accountant state (resuming would reset the accountant).
    """
    if not isinstance(checkpoint, dict) or "privacy_accountant_state_dict" not in checkpoint:
        raise ValueError(f"{source} holds no accountant state: resuming would reset the accountant.")
    return {"accountant": checkpoint["privacy_accountant_state_dict"],
            "optimizer": checkpoint.get(OPTIMIZER_STATE_KEY, {})}


def load_training_state(checkpoint: Dict[str, Any], module: torch.nn.Module, optimizer: Any = None,
                        schedulers: Optional[Dict[str, Any]] = None,
                        module_load_dict_kwargs: Optional[Dict[str, Any]] = None,
                        ) -> Dict[str, Any]:
    """What Opacus's ``load_checkpoint`` loads from a one-file checkpoint besides the accountant: the module, the
    optimizer and the schedulers (call it once the privacy state is checked and restored).

    Args:
        checkpoint: the loaded checkpoint (its optimizer and scheduler entries are popped).
        module: the model to load into.
        optimizer: the optimizer to load into, or None.
        schedulers: the schedulers by their entry (``"noise_scheduler_state_dict"``: the noise scheduler), or None.
        module_load_dict_kwargs: passed to ``module.load_state_dict``.

    Returns:
        The checkpoint's remaining entries (Opacus's behaviour).
    """
    module.load_state_dict(checkpoint["module_state_dict"], **(module_load_dict_kwargs or {}))
    for target, key in ((optimizer, "optimizer_state_dict"), *((s, k) for k, s in (schedulers or {}).items())):
        state = checkpoint.pop(key, {})
        if target is not None and state:
            target.load_state_dict(state)
    return checkpoint


def check_history(history: Any, noise_multiplier: float, sample_rate: float, source: str) -> None:
    """Refuse a saved accountant whose steps were not all taken at this run's (σ, q).

    Args:
        history: the saved accountant's ``[(σ, q, steps), ...]``.
        noise_multiplier: this run's σ.
        sample_rate: this run's q.
        source: names the checkpoint in the message.

    Raises:
        ValueError: a step at another (σ, q), with how to extend a run instead.
    """
    for sigma, q, n in history:
        if not (math.isclose(sigma, noise_multiplier, rel_tol=1e-9) and math.isclose(q, sample_rate, rel_tol=1e-9)):
            raise ValueError(
                f"{source}: the saved accountant holds {n} steps at σ={sigma:.6g}, q={q:.6g}, but this run's settings "
                f"give σ={noise_multiplier:.6g}, q={sample_rate:.6g}: refusing to resume. σ is calibrated to "
                "target_epsilon over the whole plan, so a longer plan (more max_steps or epochs) recalibrates it; to "
                f"extend a run, fix noise_multiplier={sigma!r} and raise target_epsilon to the total you accept "
                "(training stops when it is spent). Otherwise the state belongs to another run or was edited."
            )


def save_shards(folder: str, module: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer], *,
                with_model: bool) -> None:
    """Each process's shards of the optimizer state, and of the model with ``with_model``, under ``folder/sharded``
    (a collective: call it on every process).

    Args:
        folder: the checkpoint folder.
        module: the model sharded by FSDP2.
        optimizer: its optimizer (any wrapper of it), or None.
        with_model: also save the model's shards (the folder holds no full model).
    """
    import torch.distributed.checkpoint as dcp

    dcp.save(_sharded_state(module, optimizer, with_model), checkpoint_id=os.path.join(folder, SHARDED_DIR))


def load_shards(folder: str, module: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer], *,
                with_model: bool) -> None:
    """Read :func:`save_shards`'s shards back into this process's model and optimizer (call it on every process).

    Args:
        folder: the checkpoint folder (its ``sharded/``, or the earlier ``optimizer_sharded/``).
        module: the model sharded by FSDP2.
        optimizer: its optimizer (any wrapper of it), or None.
        with_model: also read the model's shards.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    state = _sharded_state(module, optimizer, with_model)
    dcp.load(state, checkpoint_id=sharded_dir(folder))
    if with_model:
        set_model_state_dict(module, state["model"])
    if "optimizer" in state:
        set_optimizer_state_dict(module, _optimizers(optimizer), state["optimizer"])


def sharded_dir(folder: str) -> Optional[str]:
    """The folder of a checkpoint's shards (``sharded/``, or the earlier ``optimizer_sharded/``), or None."""
    for name in (SHARDED_DIR, LEGACY_SHARDED_DIR):
        if os.path.isdir(os.path.join(folder, name)):
            return os.path.join(folder, name)
    return None


def load_full_into_shards(model: torch.nn.Module, folder: str) -> None:
    """The full model the main process saved in ``folder`` (safetensors, one file or several with their index), read
    into each process's shards of ``model``. Keys the save left out must be tied weights, filled by their twin.

    Args:
        model: the model sharded by FSDP2.
        folder: the saved model's folder.

    Raises:
        ValueError: a checkpoint whose keys are not the model's.
    """
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

    index = os.path.join(folder, SAFE_WEIGHTS_INDEX_NAME)
    files = [SAFE_WEIGHTS_NAME]
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    full: Dict[str, torch.Tensor] = {}
    for name in files:
        full.update(load_file(os.path.join(folder, name)))
    keys = set(model.state_dict())
    tied = {n for n, p in model.named_parameters(remove_duplicate=False)} - {n for n, _ in model.named_parameters()}
    if set(full) - keys or keys - set(full) - tied:
        raise ValueError(f"{folder}: its weights do not match this model's (missing "
                         f"{sorted(keys - set(full) - tied)[:3]}, unexpected {sorted(set(full) - keys)[:3]}).")
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, strict=False))


def torch_optimizer(optimizer: Any) -> Optional[torch.optim.Optimizer]:
    """The torch optimizer inside accelerate's and the private optimizer's wrappers (its state is the model's).

    Args:
        optimizer: an optimizer, possibly wrapped, or None.

    Returns:
        The innermost ``torch.optim.Optimizer`` (None for None).
    """
    while hasattr(optimizer, "optimizer") or hasattr(optimizer, "original_optimizer"):
        optimizer = getattr(optimizer, "original_optimizer", None) or optimizer.optimizer
    return optimizer


class EngineCheckpoints:
    """The checkpoint methods of :class:`~trl_userdp.PrivacyEngine` (placed before Opacus's engine): Opacus's one file
    for an unsharded model, this module's folder layout for one sharded by FSDP2, each read as data and its privacy
    state checked against the run it resumes before anything is loaded."""

    def save_checkpoint(self, *, path, module: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
                        checkpoint_dict: Optional[Dict[str, Any]] = None, **kwargs) -> None:
        """Opacus's ``save_checkpoint``, plus the private optimizer's own state (AUP-RLHF's AboveThreshold: a secret
        of the mechanism; keep such checkpoints private).

        Args:
            path: where to write (for a model sharded by FSDP2, a folder: each process writes its shards, the main
                process the privacy state; call it on every process).
            module: the model.
            optimizer: the optimizer whose state to save.
            checkpoint_dict: more entries to save.
            **kwargs: Opacus's (schedulers, ``torch.save`` options).
        """
        entries = dict(checkpoint_dict or {})
        optimizer_state = {} if self.optimizer is None else self.optimizer.privacy_state_dict()
        if not distributed.is_sharded(module):
            entries[OPTIMIZER_STATE_KEY] = optimizer_state
            super().save_checkpoint(path=path, module=module, optimizer=optimizer, checkpoint_dict=entries, **kwargs)
        elif kwargs:
            raise ValueError(f"{sorted(kwargs)}: not saved for a sharded model (its checkpoint is a folder of shards).")
        else:
            save_sharded(path, module, optimizer, self.accountant.state_dict(), optimizer_state, entries)

    def load_checkpoint(
        self,
        *,
        path: Union[str, os.PathLike, BinaryIO, IO[bytes]],
        module: torch.nn.Module,
        optimizer: Optional[torch.optim.Optimizer] = None,
        noise_scheduler: Any = None,
        grad_clip_scheduler: Any = None,
        module_load_dict_kwargs: Optional[Dict[str, Any]] = None,
        torch_load_kwargs: Optional[Dict[str, Any]] = None,
    ) -> Dict:
        """Opacus's ``load_checkpoint`` for a run set up by ``make_private_user_level``, but a checkpoint is data,
        never code (``weights_only=True``; Opacus's runs whatever a tampered pickle holds), and its privacy state is
        checked against this run (:meth:`restore_privacy_state`) before anything is loaded.

        Args:
            path: the checkpoint written by :meth:`save_checkpoint` (a folder for a sharded model: call it on every
                process).
            module: the model to load into.
            optimizer: the optimizer to load into.
            noise_scheduler: as Opacus's.
            grad_clip_scheduler: as Opacus's.
            module_load_dict_kwargs: passed to ``module.load_state_dict``.
            torch_load_kwargs: passed to ``torch.load`` (``weights_only`` stays True).

        Returns:
            The checkpoint's remaining entries (Opacus's behaviour).

        Raises:
            ValueError: a privacy state that does not belong to this run.
        """
        sharded = distributed.is_sharded(module)  # a folder in this module's layout, else Opacus's one file
        checkpoint = None if sharded else load_plain(path, **(torch_load_kwargs or {}))
        state = (read_privacy_state(path, **(torch_load_kwargs or {})) if sharded
                 else privacy_state_of(checkpoint, source=str(path)))
        self.restore_privacy_state(state["accountant"], state["optimizer"], source=str(path))  # checked first
        if sharded:
            load_shards(path, module, optimizer, with_model=True)
            return state["entries"]
        return load_training_state(
            checkpoint, module, optimizer, {"noise_scheduler_state_dict": noise_scheduler,
                                            "grad_clip_scheduler_state_dict": grad_clip_scheduler},
            module_load_dict_kwargs)

    def restore_privacy_state(self, accountant_state: Dict[str, Any], optimizer_state: Dict[str, Any], *,
                              source: str = "checkpoint") -> None:
        """Resume the privacy of a checkpoint in this run (after ``make_private_user_level``): its accountant must
        be this run's configuration with every step at this run's (σ, q), and the optimizer's own state must agree
        with it (AUP-RLHF: one AboveThreshold query per accounted step); otherwise nothing is restored. Then the
        sampling continues at the accounted step (with a seed: no replayed draws).

        Args:
            accountant_state: the accountant's ``state_dict()``.
            optimizer_state: the private optimizer's ``privacy_state_dict()``.
            source: names the checkpoint in the messages.

        Raises:
            ValueError: no run was set up, or the state belongs to another run (other σ or q, another event) or
                was edited.
        """
        if self.optimizer is None:
            raise ValueError("Call make_private_user_level first: a checkpoint's privacy state is checked against the "
                             "run it resumes.")
        restored = self.accountant.spawn()
        restored.load_state_dict(accountant_state)
        check_history(restored.history, self.optimizer.noise_multiplier, self.data_loader.sample_rate, source)
        self.optimizer.load_privacy_state_dict(optimizer_state, accounted_steps=restored.steps_taken, source=source)
        self.accountant.history = restored.history
        self.data_loader.user_sampler.position = self.steps_accounted()


def _sharded_state(module: torch.nn.Module, optimizer: Any, with_model: bool) -> Dict[str, Any]:
    """This process's state dicts (DTensor shards) that :func:`save_shards` writes and :func:`load_shards` fills."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    state: Dict[str, Any] = {"model": get_model_state_dict(module)} if with_model else {}
    if _optimizers(optimizer):
        state["optimizer"] = get_optimizer_state_dict(module, _optimizers(optimizer))
    return state


def _optimizers(optimizer: Any) -> list:
    inner = torch_optimizer(optimizer)
    return [inner] if inner is not None else []


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
