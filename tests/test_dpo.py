"""``objective=dpo`` (``training.dpo``): the loss, the reference model and the metrics, at any layout.

- One process, float64, against an independent computation written here: each document's
  log-probability from the model's logits run on that document alone (plain ``log_softmax``, no
  packing, no document masks), the DPO formula by hand, gradients by plain autograd, for hand-made
  preference rows (pairs packed two to a row and one to a row, two rows to a micro-batch), with
  and without LoRA, label smoothing on; the policy moved off its reference first, so that every
  term counts. The rewards' metrics against the same computation.
- A policy equal to its reference (the first step) has loss log 2 and zero rewards, and the step
  reads no device value on the host.
- tp2 + sequence parallelism, pp2, cp2, dp2 with the distributed optimizer, and FSDP (without
  LoRA) equal one process after two steps (losses, rewards, validation loss, every trained
  weight), with LoRA and without: one start of two ranks runs every case.
- ``python launch.py data=preference objective=dpo peft=lora`` trains on a small jsonl and logs
  the rewards; without LoRA the frozen reference is loaded from ``checkpoint.load``.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import SMALL, compose_config, run_training, spawn_ranks

SEQ, VOCAB, BETA, EPS = 32, 500, 0.5, 0.1
LLAMA = ["model.position_embedding=rope", "model.normalization=rmsnorm", "model.activation=swiglu",
         "model.num_query_groups=2", "model.add_bias_linear=false", "model.tie_embeddings=false"]
BASE = [*SMALL[1:], *LLAMA, "data=preference", "objective=dpo", f"objective.beta={BETA}",
        f"objective.label_smoothing={EPS}", "precision=fp64", "data.micro_batch_size=1", "data.global_batch_size=4",
        "optim.clip_grad=0", "optim.warmup_steps=1"]
LORA = ["peft=lora", "peft.rank=4", "peft.alpha=8"]
# Pairs per row: two packed, one alone (then padding), one alone filling the row, two packed.
ROWS = (2, 1, 1, 2)


# A preference batch by hand (contract C2) -----------------------------------------------------------

def _documents(seed: int):
    """Per row, its pairs: (prompt, chosen answer, rejected answer) token lists."""
    g = torch.Generator().manual_seed(seed)

    def ids(n):
        return torch.randint(0, VOCAB, (n,), generator=g).tolist()

    rows = []
    for r, pairs in enumerate(ROWS):
        row = []
        for _ in range(pairs):
            prompt = ids(int(torch.randint(2, 5, (1,), generator=g)))
            answers = [ids(int(torch.randint(2, 6, (1,), generator=g))) for _ in range(2)]
            row.append((prompt, *answers))
        if r == 2:  # the last answer grows to fill the row: no padding document
            used = sum(len(p) + len(a) - 1 for p, *ans in row for a in ans)
            row[-1][2].extend(ids(SEQ - used))
        rows.append(row)
    return rows


def _batch(rows) -> dict:
    """Rows as the data pipeline hands them: each document (prompt + answer, ``n`` ids) takes
    ``n - 1`` positions with positions restarting, the loss on the answer's labels alone, then
    one padding document (loss mask 0) when room is left."""
    fields = {k: [] for k in ("tokens", "labels", "loss_mask", "position_ids", "document_ids")}
    for row in rows:
        tokens, labels, mask, pos, docs = [], [], [], [], []
        for prompt, *answers in row:
            for answer in answers:
                ids = prompt + answer
                doc = len(set(docs))
                tokens += ids[:-1]
                labels += ids[1:]
                mask += [0.0] * (len(prompt) - 1) + [1.0] * len(answer)
                pos += list(range(len(ids) - 1))
                docs += [doc] * (len(ids) - 1)
        pad = SEQ - len(tokens)
        assert pad >= 0
        tokens, labels, mask = tokens + [0] * pad, labels + [0] * pad, mask + [0.0] * pad
        pos, docs = pos + list(range(pad)), docs + [len(set(docs))] * pad
        for key, values in zip(fields, (tokens, labels, mask, pos, docs)):
            fields[key].append(values)
    return {k: torch.tensor(v, dtype=torch.float64 if k == "loss_mask" else torch.int64) for k, v in fields.items()}


# The independent fp64 computation --------------------------------------------------------------------

def _logp(model, prompt, answer) -> torch.Tensor:
    """log p(answer | prompt): the model's logits on this document alone, log_softmax by hand."""
    ids = torch.tensor(prompt + answer)
    logits = model(ids[None, :-1])[0, :, :VOCAB].double()
    logp = torch.log_softmax(logits, dim=-1).gather(1, ids[1:, None])[:, 0]
    return logp[len(prompt) - 1:].sum()


def _expected(policy, reference, rows, micro_batch_size: int = 1):
    """The step's loss (the mean over micro-batches of the mean over their pairs of the smoothed
    DPO loss) with its autograd, and the rewards' means over every pair."""
    losses, chosen_rewards, rejected_rewards = [], [], []
    for start in range(0, len(rows), micro_batch_size):
        pair_losses = []
        for row in rows[start:start + micro_batch_size]:
            for prompt, chosen, rejected in row:
                with torch.no_grad():
                    rc, rr = _logp(reference, prompt, chosen), _logp(reference, prompt, rejected)
                c = BETA * (_logp(policy, prompt, chosen) - rc)
                r = BETA * (_logp(policy, prompt, rejected) - rr)
                z = c - r
                pair_losses.append(-(1 - EPS) * F.logsigmoid(z) - EPS * F.logsigmoid(-z))
                chosen_rewards.append(c.detach())
                rejected_rewards.append(r.detach())
        losses.append(torch.stack(pair_losses).mean())
    loss = torch.stack(losses).mean()
    loss.backward()
    c, r = torch.stack(chosen_rewards), torch.stack(rejected_rewards)
    return loss.detach(), [c.mean(), r.mean(), (c - r).mean(), (c > r).double().mean()]


# One process ---------------------------------------------------------------------------------------

def _module(overrides, ps=None):
    from megatron_hydra.config import derive
    from megatron_hydra.parallel.state import ParallelState
    from megatron_hydra.training.module import LMModule
    from megatron_hydra.training.strategy import MegatronStrategy

    cfg = compose_config([*BASE, *overrides])
    derived = derive(cfg)
    ps = ps or ParallelState.single()
    module = LMModule(cfg, derived, ps)
    strategy = MegatronStrategy(ps, torch.device("cpu"), grad_bucket_size=cfg.parallel.grad_bucket_size,
                                distributed_optimizer=cfg.optim.distributed_optimizer,
                                data_parallel=cfg.parallel.data_parallel)
    strategy.wrap_model(module)
    return module, module.build_optimizer(strategy.grad_buffer)


@torch.no_grad()
def _move_off_reference(model, lora: bool) -> None:
    """The policy moved off its starting point: LoRA's B (zero at init) or every weight, seeded."""
    g = torch.Generator().manual_seed(7)
    for name, p in model.named_parameters():
        if not lora or (".lora." in name and name.split(".")[-1].startswith("b")):
            p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))


def _base_of(model) -> torch.nn.Module:
    """The base model by hand: a copy whose LoRA B matrices are zero (not ``adapters_off``)."""
    base = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in base.named_parameters():
            if ".lora." in name:
                p.zero_()
    return base


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_step_equals_an_independent_fp64_dpo(lora):
    from megatron_hydra.training.step import TrainStep

    module, optimizer = _module([*(LORA if lora else []), "data.micro_batch_size=2"])
    reference = _base_of(module.model) if lora else copy.deepcopy(module.model)
    _move_off_reference(module.model, lora)
    policy = copy.deepcopy(module.model)
    for p in policy.parameters():
        p.grad = None
    seen = {}

    def step_optimizer():
        seen["grads"] = {n: p.main_grad.clone() for n, p in module.model.named_parameters() if p.requires_grad}
        optimizer.step()

    rows = _documents(0)
    want_loss, want_metrics = _expected(policy, reference, rows, micro_batch_size=2)
    result = TrainStep(module, optimizer, step_optimizer=step_optimizer)(_batch(rows), 0)
    assert abs(want_loss.item() - math.log(2)) > 1e-3  # the policy is off its reference
    torch.testing.assert_close(result.loss, want_loss, rtol=1e-10, atol=0)
    want_grads = {n: p.grad for n, p in policy.named_parameters() if p.requires_grad}
    assert sorted(seen["grads"]) == sorted(want_grads) and (any(".lora." in n for n in want_grads) == lora)
    for name, grad in want_grads.items():
        torch.testing.assert_close(seen["grads"][name], grad, rtol=1e-10, atol=1e-13, msg=name)
    metrics = torch.stack(module.dpo.metrics(module.ps, "cpu"))
    torch.testing.assert_close(metrics, torch.stack(want_metrics), rtol=1e-10, atol=1e-13)
    optimizer.close()


def test_policy_equal_to_its_reference_has_loss_log2_and_zero_rewards():
    """The first step: the policy is its reference. The step reads no device value on the host
    (``test_host_sync``'s counter)."""
    from test_host_sync import counting_host_reads

    from megatron_hydra.training.step import TrainStep

    for overrides in ([], LORA):
        module, optimizer = _module(overrides)
        with counting_host_reads() as reads:
            result = TrainStep(module, optimizer)(_batch(_documents(1)), 0)
        assert reads.counts[None, "ours"] == 0
        assert result.loss.item() == pytest.approx(math.log(2), rel=1e-14)
        assert [m.item() for m in module.dpo.metrics(module.ps, "cpu")] == [0.0, 0.0, 0.0, 0.0]
        assert result.grad_norm.item() > 1e-3  # the gradient still moves the policy
        optimizer.close()


# Layouts against one process -------------------------------------------------------------------------

LAYOUTS = {
    "tp2_sp": ["parallel.tensor_parallel_size=2", "parallel.sequence_parallel=true"],
    "pp2": ["parallel.pipeline_parallel_size=2"],
    "cp2": ["parallel.context_parallel_size=2"],
    "dp2_distopt": ["optim.distributed_optimizer=true"],
    "fsdp_dp2": ["parallel.data_parallel=fsdp"],  # LoRA refuses FSDP (config.peft)
}
CASES = [(layout, lora) for layout in LAYOUTS for lora in (False, True) if not (lora and layout == "fsdp_dp2")]
STEPS = 2


def _gather(t, dim, group):
    import torch.distributed as dist

    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _trained_weights(module) -> dict:
    """Every trained parameter whole (TP shards gathered by raw all_gather), by logical name."""
    out = {}
    for name, p in module.model.named_parameters():
        if not p.requires_grad:
            continue
        name = name.split(".", 1)[1] if module.derived.pp > 1 else name  # a chunk's index dropped
        dim = getattr(p, "tp_partition_dim", None)
        value = p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach()  # FSDP: DTensor
        whole = dim is None or module.ps.tp_size == 1
        out[name] = value.clone() if whole else _gather(value, dim, module.ps.tp_group)
    return out


def _train(overrides, ps, shard) -> dict:
    """Two steps on the same global batches, then the validation loss of a third batch: what a
    layout must reproduce."""
    from megatron_hydra.training.step import TrainStep

    module, optimizer = _module(overrides, ps)
    step = TrainStep(module, optimizer)
    losses = [step(shard(_batch(_documents(seed))), seed).loss.item() for seed in range(STEPS)]
    metrics = [m.item() for m in module.dpo.metrics(module.ps, "cpu")]
    if hasattr(optimizer, "finish_param_gather"):
        optimizer.finish_param_gather()
    module.on_validation_epoch_start()
    with torch.no_grad():
        module.validation_step(shard(_batch(_documents(STEPS))), 0)
    optimizer.close()
    return {"losses": losses, "metrics": metrics, "val": module._val_losses[0].item(),
            "weights": _trained_weights(module)}


def _layouts(rank, world):
    from datetime import timedelta

    from megatron_hydra.config import derive
    from megatron_hydra.data.sequence_shards import shard_batch
    from megatron_hydra.parallel.state import ParallelState

    # The one-process runs too, one per rank side by side (no process group in use).
    results = {("single", bool(rank)): _train(LORA if rank else [], None, lambda b: b)}
    for layout, lora in CASES:
        overrides = [*LAYOUTS[layout], "trainer.devices=2", *(LORA if lora else [])]
        d = derive(compose_config([*BASE, *overrides]))
        ps = ParallelState.build(tp=d.tp, pp=d.pp, dp=d.dp, cp=d.cp, timeout=timedelta(seconds=60))

        def shard(batch, ps=ps):
            if ps.cp_size > 1:
                return shard_batch(batch, ps.cp_size, ps.cp_rank)
            rows = batch["tokens"].shape[0] // ps.dp_size
            return {k: v[ps.dp_rank * rows:(ps.dp_rank + 1) * rows] for k, v in batch.items()}

        results[(layout, lora)] = _train(overrides, ps, shard)
    return results


@pytest.fixture(scope="module")
def layouts():
    ranks = spawn_ranks(_layouts, 2)
    return {lora: ranks[int(lora)].pop(("single", lora)) for lora in (False, True)}, ranks


@pytest.mark.parametrize("layout, lora", CASES, ids=[f"{n}_{'lora' if lora else 'full'}" for n, lora in CASES])
def test_layout_equals_one_process(layouts, layout, lora):
    single, ranks = layouts
    want = single[lora]
    assert want["losses"][0] == pytest.approx(math.log(2), rel=1e-14) and want["losses"][1] < math.log(2)
    weights = {}
    for rank in ranks.values():
        got = rank[(layout, lora)]
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), rtol=1e-9, atol=0)
        torch.testing.assert_close(torch.tensor(got["metrics"]), torch.tensor(want["metrics"]), rtol=1e-9, atol=1e-12)
        assert got["val"] == pytest.approx(want["val"], rel=1e-9)
        weights.update(got["weights"])
    assert sorted(weights) == sorted(want["weights"])
    for name, value in want["weights"].items():
        rows = min(value.shape[0], weights[name].shape[0])  # vocabulary padding differs by layout
        torch.testing.assert_close(weights[name][:rows], value[:rows], rtol=1e-9, atol=1e-12, msg=name)


# The launch path -------------------------------------------------------------------------------------

def _pairs_file(tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    with open(pairs, "w") as f:
        for i in range(16):
            f.write(json.dumps({"prompt": f"q{i}?", "chosen": f"yes {i}", "rejected": f"no {i % 3}"}) + "\n")
    return [*SMALL[1:], "model.seq_length=64", "data=preference", f"data.path={pairs}", "data.tokenizer.type=byte",
            "objective=dpo", "optim.warmup_steps=1", "checkpoint.async_save=false", "trainer.generate_sample_tokens=0"]


def test_launch_trains_dpo_with_lora_and_logs_rewards(tmp_path):
    rows = run_training([*_pairs_file(tmp_path), "peft=lora", "peft.rank=4", "trainer.max_steps=2"], tmp_path / "run")
    assert [r["step"] for r in rows] == [0, 1]
    assert rows[0]["loss"] == pytest.approx(math.log(2), rel=1e-6)
    assert rows[0]["rewards/margins"] == 0.0 and rows[0]["rewards/accuracy"] == 0.0
    assert rows[1]["rewards/margins"] > 0 and rows[1]["loss"] < rows[0]["loss"]
    # From trained adapters (peft.adapter: SFT with LoRA, then DPO) the reference is base + those
    # adapters, the model the run starts from: log 2 again, where the bare base would not give it.
    from megatron_hydra.checkpoint import store

    trained = store.latest(str(tmp_path / "run" / "checkpoints"))
    again = run_training([*_pairs_file(tmp_path), "peft=lora", "peft.rank=4", "trainer.max_steps=1",
                          f"peft.adapter={trained}"], tmp_path / "again")
    assert again[0]["loss"] == pytest.approx(math.log(2), rel=1e-6) and again[0]["rewards/margins"] == 0.0


def test_launch_loads_the_frozen_reference_from_checkpoint_load(tmp_path):
    """Without LoRA the reference is a copy of the starting weights: a policy loaded from a
    checkpoint equals it (loss log 2), which the seeded initial weights would not."""
    from megatron_hydra.checkpoint import plan
    from megatron_hydra.checkpoint.standalone import save_model
    from megatron_hydra.config import derive
    from megatron_hydra.models.stages import build_model
    from megatron_hydra.parallel.state import ParallelState

    overrides = [*_pairs_file(tmp_path), "trainer.max_steps=1"]
    cfg = compose_config(overrides)
    derived = derive(cfg)
    model = build_model(cfg, derived, ParallelState.single(), "cpu")
    _move_off_reference(model, lora=False)
    save_model(str(tmp_path / "start"), model, cfg, derived, plan.layout(derived))
    rows = run_training([*overrides, f"checkpoint.load={tmp_path / 'start'}", "checkpoint.load_optimizer=false"],
                        tmp_path / "run")
    assert rows[0]["loss"] == pytest.approx(math.log(2), rel=1e-6) and rows[0]["rewards/chosen"] == 0.0
    # Resuming it without its checkpoint.load would give the copy the seeded weights: one line first.
    from conftest import preflight_error

    message = preflight_error(tmp_path, *overrides, f"checkpoint.dir={tmp_path / 'run' / 'checkpoints'}",
                              "trainer.max_steps=2")
    assert "continues a DPO run whose reference is checkpoint.load=" in message and "set checkpoint.load=" in message
