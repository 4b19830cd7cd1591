"""The first step's per-user self-check: each checked user's gradient recomputed by autograd on that user's rows alone.

The sum check (:func:`~trl_userdp.grad_sample.checks.check_unit_sums`) compares the sum of the per-user gradients with
autograd's gradient of the batch; a layer that puts one user's data into another user's gradient keeps that sum (a
computation shared by every row whose gradient lands on one row, a layer that mixes the rows of a batch) and passes
it. :class:`UserCheck` closes that gap for any architecture: during the step it records the model's training forward
passes (inputs, and the gradient that reaches the outputs' rows of a few users), and afterwards runs the model again
on each of those users' rows alone and backpropagates the same output gradient. With ``L`` the step's loss and ``R``
the pass's row count, that gives ``R · Σ_{r∈u} ∂L/∂θ|_r``, which is what the hooks' sum ``S_u = Σ_{r∈u} g_r`` must
be (Opacus's ``loss_reduction="mean"`` scales row gradients by ``R``). A model whose forward for one user depends on
another user's rows fails it as well: that coupling is itself a privacy defect.

The outputs' gradient is taken from views of the outputs handed to the caller (no copy), so it holds the caller's
uses alone. It can be split by user only where every output that received one has the batch's rows. The check cannot
run, keeps the sum check alone and warns why (:attr:`UserCheck.skipped`) when dropout is on (its masks are drawn for
the whole batch), when a model reduces over the batch itself (a loss computed inside it from ``labels``), or when the
caller modifies an output in place.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import torch
from torch import nn

from .checks import active_dropout

logger = logging.getLogger(__name__)

#: how many users of the first step are recomputed (each costs one forward and backward pass on its rows)
CHECKED_USERS = 2
_AUTOCAST_DEVICES = ("cpu", "cuda")


def output_tensors(output: Any) -> List[torch.Tensor]:
    """The tensors of a model's output, in a fixed order and each once: a tensor, a ``ModelOutput``, a dict, or
    nested tuples and lists of them (caches and other objects are skipped).

    Args:
        output: What the model's forward returned.

    Returns:
        The tensors.
    """
    found: Dict[int, torch.Tensor] = {}
    _map_tensors(output, lambda t: found.setdefault(id(t), t))
    return list(found.values())


def _map_tensors(o: Any, f: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``o`` with each tensor ``t`` in it replaced by ``f(t)`` (a ``ModelOutput`` or dict in place)."""
    if isinstance(o, torch.Tensor):
        return f(o)
    if isinstance(o, dict):  # ModelOutput is an OrderedDict of its non-None fields, kept in sync with its attributes
        for k in list(o.keys()):
            o[k] = _map_tensors(o[k], f)
        return o
    if isinstance(o, tuple) and hasattr(o, "_fields"):
        return type(o)(*(_map_tensors(v, f) for v in o))
    if isinstance(o, (tuple, list)):
        return type(o)(_map_tensors(v, f) for v in o)
    return o


def _take_rows(value: Any, rows: torch.Tensor, n_rows: int) -> Any:
    """``value`` restricted to ``rows`` where it has the batch's rows (tensors, and tuples or lists of them)."""
    if isinstance(value, torch.Tensor):
        return value.index_select(0, rows.to(value.device)) if value.dim() > 0 and value.shape[0] == n_rows else value
    if isinstance(value, (tuple, list)):
        return type(value)(_take_rows(v, rows, n_rows) for v in value)
    return value


@dataclass
class RecordedPass:
    """One training forward pass of the model in the checked step.

    Args:
        args: Its positional arguments.
        kwargs: Its keyword arguments.
        n_rows: The batch's row count R.
        rows: ``{unit code: row indices}`` for the checked users with rows in this pass.
        autocast: ``{device type: (enabled, dtype)}`` as the pass ran.
        grads: ``{output index: {unit code: the gradient that reached that output's rows of the unit}}``.
        unsplittable: An output without the batch's rows received a gradient.
    """

    args: tuple
    kwargs: dict
    n_rows: int
    rows: Dict[int, torch.Tensor]
    autocast: Dict[str, tuple]
    grads: Dict[int, Dict[int, torch.Tensor]] = field(default_factory=dict)
    unsplittable: bool = False


class UserCheck:
    """Records a step's training forward passes of ``model`` and recomputes the gradients of a few of its users.

    Args:
        model: The model the hooks are attached to (its forward is what the step called).
        users: How many users to recompute.
    """

    def __init__(self, model: nn.Module, users: int = CHECKED_USERS):
        self.model = model
        self.max_users = users
        self.reset()

    def reset(self) -> None:
        """Forget the recorded passes (a new step)."""
        self.users: List[int] = []
        self.passes: List[RecordedPass] = []
        #: why the last step could not be checked per user (None if it could)
        self.skipped: Optional[str] = None

    def record(self, args: tuple, kwargs: dict, output: Any, row_users: torch.Tensor) -> Any:
        """Record one training forward pass: its inputs, and the gradient that the caller's loss sends to the checked
        users' rows of its outputs.

        Args:
            args: The forward's positional arguments.
            kwargs: Its keyword arguments.
            output: What it returned.
            row_users: The unit code of each of its rows.

        Returns:
            The output to hand the caller: the same tensors, each that needs a gradient as a view with a hook.
        """
        codes = row_users.tolist()
        if not self.users:
            self.users = list(dict.fromkeys(codes))[: self.max_users]
        rows = {u: torch.tensor([i for i, c in enumerate(codes) if c == u], dtype=torch.long) for u in self.users}
        rows = {u: r for u, r in rows.items() if len(r)}
        if not rows:
            return output
        autocast = {d: (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _AUTOCAST_DEVICES}
        recorded = RecordedPass(args, dict(kwargs), len(codes), rows, autocast)
        self.passes.append(recorded)
        tapped: Dict[int, torch.Tensor] = {}

        def tap(t: torch.Tensor) -> torch.Tensor:
            # the caller gets a view of each output (no copy) with a hook on it: the view carries the gradient of the
            # caller's own uses alone, not of the model's uses inside its forward (a loss it computes); a caller that
            # modifies the view in place detaches the hook, and the check then says that it could not run
            if id(t) not in tapped:
                index = len(tapped)
                tapped[id(t)] = t
                if t.requires_grad:
                    tapped[id(t)] = t.view_as(t)
                    splittable = t.dim() > 0 and t.shape[0] == len(codes)
                    tapped[id(t)].register_hook(functools.partial(self._keep, recorded, index) if splittable
                                                else functools.partial(self._unsplittable, recorded))
            return tapped[id(t)]

        return _map_tensors(output, tap)

    @staticmethod
    def _keep(recorded: RecordedPass, index: int, grad: torch.Tensor) -> None:
        kept = recorded.grads.setdefault(index, {})
        for u, r in recorded.rows.items():
            part = grad.detach().index_select(0, r.to(grad.device))
            kept[u] = part if u not in kept else kept[u] + part

    @staticmethod
    def _unsplittable(recorded: RecordedPass, _grad: torch.Tensor) -> None:
        recorded.unsplittable = True

    def check(self, params: Sequence[nn.Parameter], quiet: Callable[[], contextlib.AbstractContextManager],
              compare: Callable[[int, List[torch.Tensor]], None]) -> bool:
        """Recompute each checked user's gradient on its rows alone, ``Σ_passes R · ∂L/∂θ`` through its rows, and hand
        it to ``compare``, one user at a time (so that no more than one user's gradient is held besides the step's).

        Args:
            params: The parameters, in the order of the lists handed to ``compare``.
            quiet: A context in which the per-sample hooks record nothing.
            compare: ``(unit code, [gradient per parameter, fp32 or the parameter's dtype; zeros where none])``;
                raises if they differ from the hooks'.

        Returns:
            True if the users were compared, False when the step cannot be checked per user (:attr:`skipped` says why,
            in a warning).
        """
        dropout = active_dropout(self.model)
        if dropout:
            self.skipped = (f"dropout is on ({dropout[0]}): its masks are drawn for the whole batch, so no user's "
                            "rows can be replayed alone. Turn it off (trl_userdp.grad_sample.checks.disable_dropout)")
        elif any(p.unsplittable for p in self.passes):
            self.skipped = ("an output without the batch's rows received a gradient (a loss the model computes over "
                            "the batch, e.g. from `labels`). Compute the loss from the model's per-row outputs "
                            "(logits): a loss averaged over the batch's tokens also makes each user's gradient depend "
                            "on the other users' lengths")
        elif not any(p.grads for p in self.passes):
            self.skipped = ("no output with the batch's rows received a gradient through the output the model returned "
                            "(an output modified in place loses it: modify a copy)")
        if self.skipped is not None:
            self._warn_skipped()
            return False
        saved = [p.grad for p in params]
        try:
            for user in self.users:
                total: List[Optional[torch.Tensor]] = [None] * len(params)
                try:
                    with quiet():
                        for recorded in self.passes:
                            if user in recorded.rows:
                                for i, grad in enumerate(self._replay(recorded, user, params)):
                                    if grad is not None:
                                        grad = grad.mul_(recorded.n_rows)
                                        total[i] = grad if total[i] is None else total[i].add_(grad)
                except Exception as err:  # noqa: BLE001 - the model cannot run on one user's rows: say so
                    self.skipped = f"the model's forward failed on one user's rows alone ({type(err).__name__}: {err})"
                    self._warn_skipped()
                    return False
                compare(user, [torch.zeros_like(p) if g is None else g for p, g in zip(params, total)])
        finally:
            for p, g in zip(params, saved):
                p.grad = g
        return True

    def _warn_skipped(self) -> None:
        logger.warning("The per-user half of the self-check did not run: %s. Only the users' sum was checked, which "
                       "cannot see one user's data in another user's gradient.", self.skipped)

    def _replay(self, recorded: RecordedPass, user: int, params: Sequence[nn.Parameter]) -> List[Optional[torch.Tensor]]:
        """One user's rows of a recorded pass, forward and backward with the recorded output gradient."""
        rows, n = recorded.rows[user], recorded.n_rows
        args = tuple(_take_rows(a, rows, n) for a in recorded.args)
        kwargs = {k: _take_rows(v, rows, n) for k, v in recorded.kwargs.items()}
        with torch.enable_grad(), _autocast(recorded.autocast):
            outputs = output_tensors(self.model(*args, **kwargs))
        pairs = [(outputs[i], kept[user]) for i, kept in recorded.grads.items() if user in kept]
        if not pairs:  # no output of this pass reached the loss
            return [None] * len(params)
        for p in params:
            p.grad = None
        with warnings.catch_warnings():  # torch's notice about input layers, which the step's own pass already gave
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            # backward, not autograd.grad: reentrant gradient checkpointing supports only the former
            torch.autograd.backward([t for t, _ in pairs], [g.to(t.dtype) for t, g in pairs])
        return [p.grad for p in params]


@contextlib.contextmanager
def _autocast(state: Dict[str, tuple]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for device, (enabled, dtype) in state.items():
            if enabled:
                stack.enter_context(torch.autocast(device, dtype=dtype))
        yield


def tolerance(p: nn.Parameter) -> float:
    """The relative tolerance of a comparison of ``p``'s gradients: the precision its rows were computed in (bf16
    under autocast, whatever the parameter's dtype), at least 10⁻³.

    Args:
        p: The parameter (``p._row_dtype`` when the hooks recorded one).

    Returns:
        The tolerance.
    """
    return max(1e-3, 16 * torch.finfo(p.dtype).eps, 16 * torch.finfo(getattr(p, "_row_dtype", p.dtype)).eps)


def check_user_gradient(user: int, reference: List[torch.Tensor], groups: Sequence[Sequence[int]],
                        params: Sequence[nn.Parameter], observed: Callable[[int, int], Optional[torch.Tensor]],
                        row_norms: Callable[[int, int], float], name_of: Callable[[nn.Parameter], str],
                        norms_only: bool = False) -> None:
    """Refuse to train if a checked user's gradient from the hooks differs from its recomputation.

    Each group of parameters (one parameter, or a layer's when only its norm is known) is compared with tolerance
    ``rtol · max(‖E‖, Σ_{r∈u} ‖row gradient‖, ‖E_u‖ · √(numel_group / numel))`` (``E`` the recomputed gradient; as in
    :func:`~trl_userdp.grad_sample.checks.check_unit_sums`, the second term covers a user's rows that cancel, the third
    a group whose true gradient is zero).

    Args:
        user: The unit code.
        reference: Its recomputed gradient per parameter (:meth:`UserCheck.check`).
        groups: Parameter indices (into ``params``) compared together.
        params: The parameters.
        observed: ``(unit code, group index) ->`` the hooks' gradient of the group, flattened (``norms_only``: a
            1-element tensor, the norm), or None if the unit had none there.
        row_norms: ``(unit code, group index) ->`` the sum of the unit's row-gradient norms in the group.
        name_of: A parameter's name, for the message.
        norms_only: Compare norms (ghost clipping keeps no per-user gradient).

    Raises:
        ValueError: The user's gradient differs from its recomputation beyond the tolerance.
    """
    numel = sum(p.numel() for p in params)
    whole = math.sqrt(sum(float(torch.linalg.vector_norm(r, dtype=torch.float32)) ** 2 for r in reference))
    if not math.isfinite(whole):
        return  # a non-finite user adds nothing (its factor is 0): nothing to compare
    for g, group in enumerate(groups):
        expected = torch.cat([reference[i].flatten().float() for i in group])
        got = observed(user, g)
        got = torch.zeros_like(expected) if got is None else got.float().to(expected.device)
        if norms_only:
            err = abs(float(got.reshape(-1)[0]) - float(torch.linalg.vector_norm(expected)))
        else:
            err = float(torch.linalg.vector_norm(got - expected))
        rtol = max(tolerance(params[i]) for i in group)
        size = sum(params[i].numel() for i in group)
        scale = max(float(torch.linalg.vector_norm(expected)), row_norms(user, g), whole * math.sqrt(size / numel))
        if not err <= rtol * scale + 1e-12:
            what = "the norm of " if norms_only else ""
            raise ValueError(
                f"Self-check failed for {name_of(params[group[0]])!r}: {what}one user's gradient from the per-sample "
                f"hooks differs from the gradient recomputed on that user's rows alone (relative error "
                f"{err / max(scale, 1e-30):.2e}, tolerance {rtol:.1e}), although the users' sum may agree. A layer "
                "mixes the rows of the batch or runs a computation shared by every row, so one user's gradient "
                "would hold other users' data; training stops here. Freeze that layer (`requires_grad_(False)`; "
                "with LoRA, leave it out of target_modules), or report the architecture."
            )
