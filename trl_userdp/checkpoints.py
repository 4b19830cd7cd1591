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
import os
import pickle
from typing import Any, Dict, Optional

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
        return {"accountant": state["accountant"], "optimizer": state.get("optimizer", {}),
                "entries": state.get("entries", {})}
    legacy = os.path.join(folder, LEGACY_PRIVACY_FILE)
    if os.path.isfile(legacy):  # the engine's earlier layout: Opacus's keys beside the caller's entries
        entries = load_plain(legacy, **torch_load_kwargs)
        return {"accountant": entries.pop("privacy_accountant_state_dict"),
                "optimizer": entries.pop(OPTIMIZER_STATE_KEY, {}), "entries": entries}
    raise ValueError(f"{folder} has no {PRIVACY_STATE_FILE}: resuming would reset the accountant.")


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


def barrier() -> None:
    """Every process waits until the checkpoint is whole (nothing to wait for in one process)."""
    if distributed.world_size() > 1:
        torch.distributed.barrier()


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
