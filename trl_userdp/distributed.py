"""Data-parallel helpers: the world the engine runs in (``torch.distributed``), seeds every rank
must share, identical starting parameters (what Opacus's ``DPDDP`` does at wrap time), and the sharded layouts
(FSDP2) the engine runs."""

from __future__ import annotations

import secrets
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn


def world_size() -> int:
    """The number of processes in the default group.

    Returns:
        The world size (1 without an initialized ``torch.distributed``).
    """
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return 1


#: the last barrier's ``Work``, held until the interpreter exits (:func:`finish`)
_FINAL_BARRIER: List[object] = []


def finish() -> None:
    """Leave ``torch.distributed`` at the end of a run, on every rank: a barrier whose ``Work`` is kept, then
    ``destroy_process_group``. Call it last in scripts that run several processes (the package's scripts do).

    Gloo's barrier keeps weak references to the collectives still queued (the last FSDP2 state-dict gathers, say),
    and a gloo worker thread drops its reference to the barrier only after the barrier has returned. If that drop is
    the last one, the worker frees those collectives' tensors, which takes the GIL; once the interpreter is shutting
    down, taking it ends the thread inside a ``noexcept`` destructor and the process aborts ("terminate called without
    an active exception", exit −6), now and then, after every file was written. Holding the barrier's ``Work`` makes
    the main thread free them instead (docs/trainers.md, "Many processes").
    """
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    work = torch.distributed.barrier(async_op=True)
    work.wait()
    _FINAL_BARRIER.append(work)
    torch.distributed.destroy_process_group()


def rank() -> int:
    """This process's rank.

    Returns:
        The rank in the default group (0 with a single process).
    """
    return torch.distributed.get_rank() if world_size() > 1 else 0


def shared_seed(seed: Optional[int]) -> Optional[int]:
    """A seed every rank shares.

    Every rank must draw the same users (each keeps its shard), and nobody outside learns the draw.

    Args:
        seed: The user's seed, or None.

    Returns:
        ``seed``, or with several processes and no seed, one drawn from the OS on rank 0 and sent to all
        (None with one process and no seed).
    """
    if seed is not None or world_size() == 1:
        return seed
    box = [secrets.randbits(63) if rank() == 0 else None]
    torch.distributed.broadcast_object_list(box, src=0)
    return int(box[0])


def broadcast_parameters(module: nn.Module) -> None:
    """Copy rank 0's parameters to every rank, so that identical updates keep the replicas identical.

    Args:
        module: The model whose parameters are broadcast in place.
    """
    for p in module.parameters():
        torch.distributed.broadcast(p.data, src=0)


# -- sharded models (FSDP2's fully_shard) -------------------------------------------------------
def dtensor_class() -> type:
    """The class of sharded parameters.

    Returns:
        ``torch.distributed.tensor.DTensor``, or a class no parameter is an instance of where torch has no distributed
        support.
    """
    if not torch.distributed.is_available():
        return type("NoDTensor", (), {})
    from torch.distributed.tensor import DTensor

    return DTensor


def is_sharded(module: nn.Module) -> bool:
    """Whether any parameter of ``module`` is a DTensor (FSDP2's ``fully_shard``, or another sharded layout).

    Args:
        module: The model.

    Returns:
        True if some parameter is sharded.
    """
    sharded = dtensor_class()
    return any(isinstance(p, sharded) for p in module.parameters())


def _fsdp_modules(module: nn.Module) -> List[nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def check_sharding(module: nn.Module, packable: Tuple[type, ...]) -> None:
    """Refuse a sharded layout the user-level path does not run: every parameter a DTensor sharded on dim 0 over one
    mesh of all processes (FSDP2's ``fully_shard`` on blocks and the root, the layout its documentation recommends),
    and no layer sharded on its own (FSDP2 gives it a class of its own, which the per-user hooks, keyed by layer type,
    do not know): a ``packable`` layer (``nn.Linear``…) or any leaf module holding trainable parameters.

    Args:
        module: The model, after ``fully_shard``.
        packable: The layer types the per-user ghost hooks compute by type.

    Raises:
        ValueError: with the reason.
    """
    from torch.distributed.tensor import Shard

    sharded = dtensor_class()
    params = dict(module.named_parameters())
    plain = [n for n, p in params.items() if not isinstance(p, sharded)]
    if plain:
        raise ValueError(f"Some parameters are sharded and some are not ({plain[0]!r} is a plain tensor): apply "
                         "fully_shard to the root module as well, so that every parameter is sharded.")
    for name, p in params.items():
        if p.device_mesh.ndim != 1 or p.device_mesh.size() != world_size() or tuple(p.placements) != (Shard(0),):
            raise ValueError(f"{name!r} is laid out as {tuple(p.placements)} over a mesh of shape "
                             f"{tuple(p.device_mesh.shape)}: the user-level path runs FSDP2 with one mesh of all "
                             f"{world_size()} processes and parameters sharded on dim 0 (fully_shard's default; no HSDP "
                             "or tensor parallelism).")
    for m in _fsdp_modules(module):
        own = any(p.requires_grad for p in m.parameters(recurse=False))
        if isinstance(m, packable) or (own and not list(m.children())):
            layer = type(m).__mro__[2]  # FSDP2's class is (FSDP<Layer>, FSDPModule, <Layer>, ...)
            raise ValueError(f"A {layer.__name__} layer is sharded on its own (fully_shard on the layer): "
                             "the per-user hooks compute its gradients by layer type. Apply fully_shard to blocks "
                             "(decoder layers) and to the root instead.")


def gathered_parameters(module: nn.Module) -> Dict[nn.Parameter, nn.Parameter]:
    """The unsharded parameter FSDP2 gathers for each sharded one.

    FSDP2 swaps each sharded parameter for one unsharded ``nn.Parameter`` (the same object at every forward and
    backward pass) while a module runs; hooks that key per-sample state by parameter must key it by that one. Each group
    is gathered in turn to find them, so no process holds the whole model.

    Args:
        module: The model, after ``fully_shard``.

    Returns:
        ``{sharded parameter: its unsharded parameter}``.
    """
    dtensor = dtensor_class()
    sharded = dict(module.named_parameters())
    live: Dict[str, nn.Parameter] = {}
    for m in _fsdp_modules(module):
        m.unshard()
        try:
            live.update((n, p) for n, p in module.named_parameters() if n not in live and not isinstance(p, dtensor))
        finally:
            m.reshard()
    return {sharded[name]: live[name] for name in sharded}


def shard_model(module: nn.Module, device_type: str = "cpu", blocks: Optional[List[str]] = None,
                **fully_shard_options) -> nn.Module:
    """FSDP2 over every process, as accelerate's transformer-based policy applies it to the blocks: ``fully_shard`` on
    each block (the classes the model names in ``_no_split_modules``: Hugging Face's decoder or encoder layers), then
    on the root. This is the layout the user-level path runs (:func:`check_sharding`).

    Args:
        module: A Hugging Face model (not yet wrapped).
        device_type: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL).
        blocks: The block class names, instead of the model's ``_no_split_modules``.
        **fully_shard_options: For every ``fully_shard`` call (``mp_policy``, ``offload_policy``,
            ``reshard_after_forward``).

    Returns:
        The model, sharded in place.

    Raises:
        ValueError: without a process group, or a model that names no block class.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        raise ValueError("Sharding needs a process group: launch with torchrun or accelerate launch.")
    names = set(blocks or getattr(module, "_no_split_modules", None) or [])
    layers = [m for m in module.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"{type(module).__name__} has no block of the classes {sorted(names)} to shard by.")
    mesh = init_device_mesh(device_type, (world_size(),))
    for layer in layers:
        fully_shard(layer, mesh=mesh, **fully_shard_options)
    return fully_shard(module, mesh=mesh, **fully_shard_options)
