"""User-wise DP-SGD on a model sharded by FSDP2 (``fully_shard`` on the decoder layers and the root), two gloo
processes on CPU, full fine-tuning of the tiny Llama reward model: the same steps as one process, one noise draw per
element of the full gradient, the single-process ε, and set-ups the sharded path does not run refused
(docs/architecture.md, "Sharded models")."""

import datetime
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from scipy import stats
from torch.utils.data import DataLoader
from trl.trainer.reward_trainer import DataCollatorForPreference

import trl_userdp
from trl_userdp.distributed import finish, shard_model

from .tiny_models import VOCAB, btl_pair_losses, preference_dataset, tiny_gpt2_rm, tiny_llama_rm

N_USERS, UPB = 12, 6.0
#: the settings of each two-process run (``_train``'s arguments beside its defaults: σ = 0 and every user clipped)
CASES = {
    "exact": dict(max_grad_norm=1e6),  # no user clipped
    "clip": dict(),
    # each layer's norms and sums from its Gram matrices and the book-kept sum, taken after the backward pass, when
    # FSDP2 has resharded the layer (the tiny model's layers take per-user gradients otherwise)
    "gram": dict(norm_route="gram"),
    "noise": dict(noise_multiplier=2.0, max_grad_norm=0.5, zero_loss=True),  # the loss times 0: noise alone
    "sparse": dict(upb=1.0),  # a rank often has no user but must still run the layers' collectives
    "micro": dict(norm_route="gram", micro_batches=3),  # each micro-batch clipped and reduce-scattered in turn
    "group": dict(mechanism="group"),  # the group privacy baseline: records clipped and sampled instead of users
    "gpt2": dict(family="gpt2"),  # Conv1D layers and learned position embeddings
    "bert": dict(family="bert"),  # an encoder (the MiniLM reward model's architecture), LayerNorm, token types
}


def tiny_bert_rm() -> torch.nn.Module:
    """A two-layer BERT with a one-output head: the packaged MiniLM reward model's architecture, tiny."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=64, num_labels=1, pad_token_id=0, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0))  # no dropout: the two runs draw it differently


MODELS = {"llama": tiny_llama_rm, "gpt2": tiny_gpt2_rm, "bert": tiny_bert_rm}


def _full(model: torch.nn.Module) -> torch.Tensor:
    """The model's parameters as one flat vector (gathered from the shards: a collective on every rank)."""
    return torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().flatten()
                      for p in model.parameters()])


#: a public one-pair batch, which a process with no user in a step runs (every process must run every layer)
PLACEHOLDER = DataCollatorForPreference(pad_token_id=0)([{"chosen_ids": [1], "rejected_ids": [2]}])


def _backward(engine, model, batch, scale=1.0):
    """The batch's mean pair loss (times ``scale``) backpropagated, or, with no row on this process, the placeholder's
    inside the hooks' placeholder pass."""
    device = next(model.parameters()).device
    if len(batch["input_ids"]):
        (scale * btl_pair_losses(model, {k: v.to(device) for k, v in batch.items()}).mean()).backward()
        return
    with engine.hooks.placeholder_pass():
        btl_pair_losses(model, {k: v.to(device) for k, v in PLACEHOLDER.items()}).mean().backward()


def _train(noise_multiplier=0.0, max_grad_norm=0.05, zero_loss=False, norm_route="auto", upb=UPB, micro_batches=1,
           mechanism="user_dpsgd", family="llama", *, sharded, device=torch.device("cpu"), dtype=torch.float32):
    """One pass of private steps (SGD at learning rate 1, so each update is the private gradient); returns the
    engine, the update of every step (full vectors) and the index ranges of the elements each rank owns."""
    model = MODELS[family]().to(device=device, dtype=dtype)  # seeded: the same initial parameters on every rank
    if sharded:
        model = shard_model(model, device.type)
    dataset = preference_dataset(n_users=N_USERS, pairs_per_user=(1, 3, 2, 3, 1, 2) * 2)
    engine = trl_userdp.PrivacyEngine(accountant="rdp")
    model, optimizer, loader = engine.make_private_user_level(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=DataLoader(dataset, collate_fn=DataCollatorForPreference(pad_token_id=0)),
        noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm, max_samples_per_user=3, users_per_batch=upb,
        rows_per_example=2, sampling_seed=0, grad_sample_mode="ghost", noise_seed=5, micro_batches=micro_batches,
        mechanism=mechanism)
    engine.hooks.norm_route = norm_route
    updates, rows = [], []
    for i, batch in enumerate(loader):
        rows.append(len(batch["input_ids"]))
        _backward(engine, model, batch, 0.0 if zero_loss else 1.0)
        if i % micro_batches == micro_batches - 1:
            before = _full(model)
            optimizer.step()
            optimizer.zero_grad()
            updates.append(before - _full(model))
    owned = []
    if sharded:  # this rank's elements of the flat vector: rows [offset, offset + local rows) of each parameter
        start = 0
        for p in model.parameters():
            local = p.to_local()
            rows = torch.tensor([local.shape[0]], device=local.device)
            all_rows = [torch.zeros_like(rows) for _ in range(dist.get_world_size())]
            dist.all_gather(all_rows, rows)
            offset = int(sum(r.item() for r in all_rows[: dist.get_rank()]))
            row = p.numel() // p.shape[0]
            owned.append((start + offset * row, start + (offset + local.shape[0]) * row))
            start += p.numel()
    return engine, torch.stack(updates), owned, rows


def _worker(rank, world, tmp):
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        for case, setting in CASES.items():
            engine, updates, owned, rows = _train(**setting, sharded=True)
            torch.save({"updates": updates, "owned": owned, "rows": rows, "epsilon": engine.get_epsilon(1e-5),
                        "steps": engine.accountant.steps_taken}, os.path.join(tmp, f"{case}{rank}.pt"))
        _resume(rank, tmp)
        _refusals_and_failures(rank, tmp)
        finish()  # both ranks done: the last barrier kept, then the group torn down (no gloo thread frees at exit)
    finally:
        if dist.is_initialized():  # a failure: tear down at once (a barrier could wait for a rank stuck elsewhere)
            dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks():
    """Each case's result on both ranks: {case: [rank 0's, rank 1's]}, and the resumed run's, with the checkpoint's
    files ("resume")."""
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(2, d), nprocs=2, join=True)
        results = {case: [torch.load(Path(d) / f"{case}{r}.pt") for r in range(2)]
                   for case in (*CASES, "resume", "refusals")}
        results["checkpoint_files"] = sorted(os.listdir(Path(d) / "checkpoint"))
        yield results


@pytest.mark.end_to_end
@pytest.mark.parametrize("case", ["exact", "clip", "gram", "sparse", "micro", "group", "gpt2", "bert"])
def test_the_sharded_steps_are_the_single_process_steps(ranks, case):
    """σ = 0: the sharded update (each rank clips its users with the layers gathered, the clipped sums
    reduce-scattered to the shards) equals the single-process ghost update, with no user clipped and with every
    user clipped, on either norm route, with steps where one rank has no user, in micro-batches, for the group
    privacy baseline, and for GPT-2 and a BERT encoder."""
    _, single, _, _ = _train(**CASES[case], sharded=False)
    assert (single.abs().sum(1) > 0).sum() >= 2  # real, non-empty steps
    for r in ranks[case]:
        rel = torch.linalg.vector_norm(r["updates"] - single) / torch.linalg.vector_norm(single)
        assert rel < 1e-5, float(rel)
    if case == "sparse":
        r0, r1 = ranks[case][0]["rows"], ranks[case][1]["rows"]
        assert any(a == 0 < b or b == 0 < a for a, b in zip(r0, r1))  # one rank empty, the other not


@pytest.mark.end_to_end
def test_every_element_gets_one_noise_draw_and_the_epsilon_is_the_single_process_one(ranks):
    """σ > 0, loss × 0: the update is the noise alone, std σC/ñ on every element of the full parameter: on the
    elements each rank owns and over all of them (an element noised by both ranks would have twice the variance, one
    noised by none zero). Both ranks see the same update and account the single-process ε."""
    sigma, clip = CASES["noise"]["noise_multiplier"], CASES["noise"]["max_grad_norm"]
    r0, r1 = ranks["noise"]
    torch.testing.assert_close(r0["updates"], r1["updates"], rtol=0, atol=0)
    noise = r0["updates"].double()
    expected_var = (sigma * clip / UPB) ** 2
    regions = {"all": noise.flatten()}
    for rank, r in enumerate(ranks["noise"]):
        regions[f"rank {rank}"] = torch.cat([noise[:, a:b] for a, b in r["owned"]], 1).flatten()
    assert regions["rank 0"].numel() + regions["rank 1"].numel() == regions["all"].numel()
    k = min(regions["rank 0"].numel(), regions["rank 1"].numel())  # the ranks' draws are independent, not one stream
    corr = float(torch.corrcoef(torch.stack([regions["rank 0"][:k], regions["rank 1"][:k]]))[0, 1])
    assert abs(corr) < 5 / k ** 0.5, corr
    for name, x in regions.items():
        n = x.numel()
        lo, hi = stats.chi2.interval(0.999, n)
        stat = float((x ** 2).sum()) / expected_var  # mean zero: Σx²/σ² ~ χ²(n)
        assert lo <= stat <= hi, (name, stat / n)
    single, _, _, _ = _train(**CASES["noise"], sharded=False)
    for r in ranks["noise"]:
        assert r["steps"] == single.accountant.steps_taken
        assert r["epsilon"] == pytest.approx(single.get_epsilon(1e-5), rel=1e-12)


def _refusals_and_failures(rank, tmp):
    """A noise generator passed by the caller (seeded alike on every rank: the same noise on every shard) is refused on
    both ranks; a check failing on rank 1 alone, after the step's collectives, stops both ranks instead of hanging."""
    from trl_userdp.optimizers import ShardedUserDPOptimizerFastGradientClipping

    out = {}

    def setup(**options):
        model = shard_model(tiny_llama_rm())
        engine = trl_userdp.PrivacyEngine(accountant="rdp")
        return engine, model, engine.make_private_user_level(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(preference_dataset(n_users=N_USERS, pairs_per_user=2),
                                   collate_fn=DataCollatorForPreference(pad_token_id=0)),
            noise_multiplier=1.0, max_grad_norm=0.5, max_samples_per_user=3, users_per_batch=UPB, rows_per_example=2,
            sampling_seed=0, grad_sample_mode="ghost", **options)[1]

    try:
        setup(noise_generator=torch.Generator().manual_seed(0))
        out["generator"] = None
    except ValueError as err:
        out["generator"] = str(err)
    engine, model, optimizer = setup(noise_seed=1)
    if rank == 1:
        def failing_check(self):
            raise ValueError("injected check failure")
        optimizer._check_backward_complete = failing_check.__get__(optimizer)
    try:
        _backward(engine, model, next(iter(engine.data_loader)))
        optimizer.step()
        out["fail"] = None
    except ValueError as err:
        out["fail"] = str(err)
    assert isinstance(optimizer, ShardedUserDPOptimizerFastGradientClipping)
    torch.save(out, os.path.join(tmp, f"refusals{rank}.pt"))


def _resume(rank, tmp):
    """Four noisy steps straight, and two steps, a checkpoint, a fresh set-up that loads it, and two more."""
    def run(steps, save=None, load=None):
        model = shard_model(tiny_llama_rm())
        engine = trl_userdp.PrivacyEngine(accountant="rdp")
        model, optimizer, loader = engine.make_private_user_level(
            module=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
            data_loader=DataLoader(preference_dataset(n_users=N_USERS, pairs_per_user=2),
                                   collate_fn=DataCollatorForPreference(pad_token_id=0)),
            noise_multiplier=1.0, max_grad_norm=0.5, max_samples_per_user=3, users_per_batch=3.0,  # 4 steps a pass
            rows_per_example=2, sampling_seed=0, grad_sample_mode="ghost", noise_seed=5, steps=4)
        if load:
            engine.load_checkpoint(path=load, module=model, optimizer=optimizer)
        batches = iter(loader)
        for _ in range(steps):
            _backward(engine, model, next(batches))
            optimizer.step()
            optimizer.zero_grad()
        if save:
            engine.save_checkpoint(path=save, module=model, optimizer=optimizer)
        return _full(model), engine.get_epsilon(1e-5), engine.accountant.history

    straight = run(4)
    run(2, save=os.path.join(tmp, "checkpoint"))
    resumed = run(2, load=os.path.join(tmp, "checkpoint"))
    if rank == 0:
        _as_written_before_one_layout(os.path.join(tmp, "checkpoint"), os.path.join(tmp, "legacy"))
    dist.barrier()
    legacy = run(2, load=os.path.join(tmp, "legacy"))
    torch.save({"straight": straight, "resumed": resumed, "legacy": legacy}, os.path.join(tmp, f"resume{rank}.pt"))


def _as_written_before_one_layout(folder, legacy):
    """The engine's sharded checkpoint as it was written before checkpoints had one layout: the shards under
    ``sharded/`` and, in ``privacy.pt``, Opacus's keys beside the caller's entries."""
    shutil.copytree(os.path.join(folder, "sharded"), os.path.join(legacy, "sharded"))
    state = torch.load(os.path.join(folder, "privacy_state.pt"), weights_only=True)
    torch.save({"privacy_accountant_state_dict": state["accountant"], "trl_userdp_optimizer_state": state["optimizer"],
                **state.get("entries", {})}, os.path.join(legacy, "privacy.pt"))


@pytest.mark.end_to_end
def test_a_caller_generator_is_refused_and_a_check_failing_on_one_rank_stops_both(ranks):
    r0, r1 = ranks["refusals"]
    for r in (r0, r1):
        assert "noise_generator seeded alike on every process" in r["generator"]
    assert r1["fail"] == "injected check failure" and "Another process failed" in r0["fail"]


@pytest.mark.end_to_end
def test_a_sharded_run_resumes_from_its_checkpoint_with_the_same_steps_and_epsilon(ranks):
    """Issue 28: each process saves its shards of the model and of AdamW's state, the main process the privacy state
    once; a fresh set-up on both processes loads them and continues: the same parameters as the run that never
    stopped (the noise keyed by step and rank continues, not replayed) and the same ε and history."""
    assert ranks["checkpoint_files"] == ["privacy_state.pt", "sharded"]  # the trainers' layout (issue 43)
    for result in ranks["resume"]:
        straight, eps, history = result["straight"]
        for resumed, eps_resumed, history_resumed in (result["resumed"], result["legacy"]):  # the earlier layout too
            torch.testing.assert_close(resumed, straight, rtol=1e-6, atol=1e-7)
            assert history_resumed == history and sum(n for *_, n in history) == 4
            assert eps_resumed == eps


def _killed_worker(rank, world, tmp):
    """Rank 1 dies at its third step (after its backward pass, before the step's collectives); rank 0 must fail."""
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        model = shard_model(tiny_llama_rm())
        engine = trl_userdp.PrivacyEngine(accountant="rdp")
        model, optimizer, loader = engine.make_private_user_level(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(preference_dataset(n_users=N_USERS, pairs_per_user=2),
                                   collate_fn=DataCollatorForPreference(pad_token_id=0)),
            noise_multiplier=1.0, max_grad_norm=0.5, max_samples_per_user=3, users_per_batch=3.0, rows_per_example=2,
            sampling_seed=0, grad_sample_mode="ghost")
        for step, batch in enumerate(loader):
            _backward(engine, model, batch)
            if step == 2 and rank == 1:
                os._exit(17)
            optimizer.step()
            optimizer.zero_grad()
    except Exception as err:  # noqa: BLE001 - the test reads it
        Path(tmp, f"error{rank}.txt").write_text(f"{type(err).__name__}: {err}")
        raise


@pytest.mark.slow  # a pair of processes of its own (about 10 s)
def test_a_killed_process_fails_the_other_instead_of_hanging(tmp_path):
    """Issue 28: one process of a sharded run dies mid-step; the other fails at its next collective, well within the
    process group's timeout, and both exit with an error (nothing to resume but the last checkpoint)."""
    import time

    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_killed_worker, args=(rank, 2, str(tmp_path))) for rank in range(2)]
    start = time.monotonic()
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    elapsed = time.monotonic() - start
    alive = [p.is_alive() for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert not any(alive), "a process hung"
    assert procs[1].exitcode == 17 and procs[0].exitcode not in (0, None)
    assert (tmp_path / "error0.txt").exists() and elapsed < 60, elapsed


def test_a_checkpoint_loads_into_the_shards_only_if_its_weights_are_the_models(tmp_path):
    """The trainers' resume of a model sharded before them reads the full saved model into the shards: a tied model
    (the head saved once, as its embedding) loads exactly; a checkpoint of another model is refused, not half-loaded."""
    from trl_userdp.checkpoints import load_full_into_shards

    from .tiny_models import tiny_llama_lm

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        saved = tiny_llama_lm(VOCAB, tie=True)
        saved.save_pretrained(tmp_path / "checkpoint")
        model = shard_model(tiny_llama_lm(VOCAB, tie=True))
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        load_full_into_shards(model, str(tmp_path / "checkpoint"))
        for name, value in saved.state_dict().items():
            torch.testing.assert_close(model.state_dict()[name].full_tensor(), value, rtol=0, atol=0, msg=name)
        with pytest.raises(ValueError, match="do not match this model's"):
            load_full_into_shards(shard_model(tiny_llama_lm(VOCAB, tie=False)), str(tmp_path / "checkpoint"))
    finally:
        dist.destroy_process_group()
