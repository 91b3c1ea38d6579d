"""Megatron-LM checkpoints: import gives Megatron-Core's logits, export loads back into it.

The references are real Megatron-Core models (tests/megatron_reference.py): a GPT form (learned
positions, LayerNorm, GeLU fused with its bias, biases, tied embeddings) and a Llama form (RoPE,
RMSNorm, SwiGLU, grouped-query attention, QK-norm, no biases, untied), padded vocabulary, built on
two gloo ranks at tp2 and at pp2 and saved by Megatron-Core in torch_dist and as Megatron-LM's
legacy per-rank files. Each is imported and its logits compared with Megatron-Core's forward on
the same tokens (fp32, 1e-5), in one process and at another parallel layout of ours; two imports
go back through to_megatron and Megatron-Core's own load and forward. One start of two ranks
writes every checkpoint and computes every logit (module fixture); the tests read its results.

Crafted pickles (a legacy file or common.pt naming os.system, an unknown class) must be refused
in one line without running anything, as must malformed legacy layouts (the arguments' own rules:
test_megatron_arguments.py). Megatron-Core is an optional test dependency: without it only the
tests of crafted files run. It is imported in the ranks only (see ``_needs_megatron_core``).
"""

from __future__ import annotations

import os
import fractions
import importlib.util
import pickle

import pytest
import torch

from conftest import spawn_ranks


def _needs_megatron_core():
    """Megatron-Core is an optional test dependency: the tests that need its models skip without it.
    It is imported in the ranks only: importing it registers its classes with ``torch.load`` for the
    whole process, which would change what other tests' loads accept."""
    if importlib.util.find_spec("megatron.core") is None:
        pytest.skip("megatron-core is not installed (an optional test dependency)")

FORMS = ("gpt", "llama")
SOURCES = [(form, layout, fmt) for form in FORMS for layout in ("tp2", "pp2") for fmt in ("dist", "legacy")]
SOURCES.append(("llama", "tp2", "dist_per_layer"))  # torch_dist with each layer's tensors apart
SEEDS = {("gpt", "tp2"): 1, ("llama", "tp2"): 2, ("gpt", "pp2"): 3, ("llama", "pp2"): 4}
# Exports loaded back into Megatron-Core at the other layout than the source's.
EXPORTS = {("gpt", "tp2", "legacy"): (1, 2), ("llama", "pp2", "dist"): (2, 1)}


def _ours(ckpt: str, layout, tokens):
    """Our logits of ``ckpt``: one process (``layout`` None) or this rank's at (tp, pp)."""
    import torch.distributed as dist

    from megatron_hydra.checkpoint import sharded, standalone
    from megatron_hydra.config import derive
    from megatron_hydra.models.stages import build_stage_chunks
    from megatron_hydra.parallel.state import ParallelState

    if layout is None:
        with torch.no_grad():
            return standalone.load_model(ckpt)[2](tokens).numpy()
    cfg, _ = standalone.single_process(standalone.read_config(ckpt))
    cfg.parallel.tensor_parallel_size, cfg.parallel.pipeline_parallel_size = layout
    cfg.trainer.devices = 2
    derived = derive(cfg)
    ps = ParallelState.build(tp=derived.tp, pp=derived.pp, dp=derived.dp)
    chunks, _ = build_stage_chunks(cfg, derived, ps)
    model = torch.nn.ModuleList(chunks) if derived.pp > 1 else chunks[0]
    sharded.load(ckpt, model, None, ps, derived.transformer.vocab_size, load_optimizer=False)
    stage = chunks[0].eval()
    with torch.no_grad():
        if derived.pp == 1:
            return torch.cat([t for t in _gather(stage(tokens))], dim=-1).numpy()
        if ps.pp_rank == 0:
            dist.send(stage(tokens).contiguous(), dst=1)
            return None
        hidden = torch.empty(*tokens.shape, derived.transformer.hidden_size)
        dist.recv(hidden, src=0)
        return stage(hidden).numpy()


def _gather(local):
    import torch.distributed as dist

    parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, local.contiguous())
    return parts


def _megatron_side(rank, root, out):
    """Build, train one step (GPT at tp2), save and take Megatron's logits of every source."""
    import megatron_reference as ref

    for layout, (tp, pp) in (("tp2", (2, 1)), ("pp2", (1, 2))):
        ref.set_layout(tp, pp)
        for form in FORMS:
            model = ref.build(form, SEEDS[form, layout])
            optimizer = ref.train_step(model) if (form, layout) == ("gpt", "tp2") else None
            if optimizer is not None:
                out["moments", rank] = {k: (a.numpy(), b.numpy(), d, s)
                                        for k, (a, b, d, s) in ref.moments(model, optimizer).items()}
            logits = ref.logits(model)
            if logits is not None:
                out["megatron", form, layout] = logits.numpy()
            ref.save_dist(model, form, os.path.join(root, f"{form}_{layout}_dist"), optimizer)
            ref.save_legacy(model, form, os.path.join(root, f"{form}_{layout}_legacy"))
            if (form, layout, "dist_per_layer") in SOURCES:
                ref.save_dist(model, form, os.path.join(root, f"{form}_{layout}_dist_per_layer"), per_layer=True)


def _import_all(root, out, tokens, rank):
    """Every source imported (at another layout than its own) and our logits of it; two imports
    exported back. Both ranks do it, each into its own directories: our checkpoint code runs its
    checks collectively whenever a process group exists, so the ranks go through it in step."""
    from megatron_hydra.convert import megatron

    for form, layout, fmt in SOURCES:
        source = os.path.join(root, f"{form}_{layout}_{fmt}")
        ours = os.path.join(root, f"ours{rank}_{form}_{layout}_{fmt}")
        result = megatron.from_megatron(source, ours, parallel="tp2" if layout == "pp2" else "pp2")
        out["imported", form, layout, fmt] = (result.command, result.optimizer, result.notes)
        out["ours", form, layout, fmt] = _ours(ours, None, tokens)
    for form, layout, fmt in EXPORTS:
        exported = megatron.to_megatron(os.path.join(root, f"ours{rank}_{form}_{layout}_{fmt}"),
                                        os.path.join(root, f"back{rank}_{form}_{layout}_{fmt}"))
        out["exported", form, layout, fmt] = str(exported)


def _world(rank, world, root):
    import megatron_reference as ref

    out = {}
    with ref.cpu_workarounds():
        _megatron_side(rank, root, out)
        _import_all(root, out, ref.TOKENS, rank)
        # Ours at a layout of ours: the tp2 Llama import at pp2, the pp2 GPT import at tp2.
        out["ours_pp2", "llama"] = _ours(os.path.join(root, "ours0_llama_tp2_dist"), (1, 2), ref.TOKENS)
        out["ours_tp2", "gpt"] = _ours(os.path.join(root, "ours0_gpt_pp2_legacy"), (2, 1), ref.TOKENS)
        for (form, layout, fmt), (tp, pp) in EXPORTS.items():
            ref.set_layout(tp, pp)
            model = ref.build(form, 99)  # other weights, replaced by the load
            ref.load_dist(model, os.path.join(root, f"back0_{form}_{layout}_{fmt}"))
            logits = ref.logits(model)
            if logits is not None:
                out["back", form, layout, fmt] = logits.numpy()
    # Rank 0's results, but the last pipeline stage's (rank 1's) logits where it alone has them.
    shared = ("megatron", "back", "ours_pp2", "moments")
    return {k: v for k, v in out.items() if v is not None and (rank == 0 or k[0] in shared)}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    _needs_megatron_core()
    root = str(tmp_path_factory.mktemp("megatron"))
    results = spawn_ranks(_world, 2, root)
    merged = dict(results[0])
    merged.update({k: v for k, v in results[1].items() if k not in merged})
    return root, merged


def _vocab(logits):
    return torch.from_numpy(logits)[..., :100]


def _close(ours, ref):
    """fp32 agreement: 1e-5, absolute or relative to logits of a few units."""
    print(f"max |diff| {float((ours - ref).abs().max()):.2e} (max |logit| {float(ref.abs().max()):.1f})")
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("form,layout,fmt", SOURCES)
def test_imported_logits_match_megatron(world, form, layout, fmt):
    _, out = world
    ref = _vocab(out["megatron", form, layout])
    ours = _vocab(out["ours", form, layout, fmt])
    _close(ours, ref)


def test_imports_at_other_layouts_of_ours(world):
    _, out = world
    _close(_vocab(out["ours_pp2", "llama"]), _vocab(out["megatron", "llama", "tp2"]))
    _close(_vocab(out["ours_tp2", "gpt"]), _vocab(out["megatron", "gpt", "pp2"]))


@pytest.mark.parametrize("form,layout,fmt", list(EXPORTS))
def test_export_loads_back_into_megatron(world, form, layout, fmt):
    _, out = world
    back = _vocab(out["back", form, layout, fmt])
    _close(back, _vocab(out["ours", form, layout, fmt]))
    assert "--load" in out["exported", form, layout, fmt]


def _plain(path, limit=None):
    """A Megatron file as plain objects, read without importing Megatron-Core (``megatron_pickle``),
    its Megatron enum and random states dropped, so that it can be changed and saved again."""
    from megatron_hydra.convert import megatron_pickle

    state = megatron_pickle.load(str(path), limit)
    state["args"].attention_backend = None
    state.pop("rng_state", None)
    return state


def _relayer(chunk, start, stop, shift):
    """Layers ``start`` .. ``stop - 1`` of a legacy model chunk, renumbered by ``shift``, and the rest."""
    out = {}
    for key, value in chunk.items():
        if key.startswith("decoder.layers."):
            index, rest = key[len("decoder.layers."):].split(".", 1)
            if start <= int(index) < stop:
                out[f"decoder.layers.{int(index) + shift}.{rest}"] = value
    return out


def _outer(chunk, prefix):
    return {k: v for k, v in chunk.items() if k.startswith(prefix)}


def _save_legacy(target, files, args):
    """Legacy files ``{directory name: model chunks}`` under ``target`` (an iteration directory)."""
    for name, chunks in files.items():
        (target / name).mkdir(parents=True)
        torch.save({"args": args, "iteration": 7, "checkpoint_version": 3.0, **chunks},
                   target / name / "model_optim_rng.pt")


def _import_logits(target, tmp_path):
    from megatron_hydra.checkpoint import standalone
    from megatron_hydra.convert import megatron
    import megatron_reference as ref

    megatron.from_megatron(str(target), str(tmp_path / "ours"))
    with torch.no_grad():
        return standalone.load_model(str(tmp_path / "ours"))[2](ref.TOKENS).numpy()


def test_legacy_virtual_pipeline_stages(world, tmp_path):
    """Megatron's interleaved layout (virtual stage v of pipeline rank r is global stage v * pp + r):
    the pp2 GPT files regrouped into two virtual stages of one layer per rank give the same model."""
    root, out = world
    source = os.path.join(root, "gpt_pp2_legacy", "iter_0000007")
    first, last = (_plain(os.path.join(source, f"mp_rank_00_00{p}", "model_optim_rng.pt")) for p in (0, 1))
    files = {  # global layers 0, 1, 2, 3 on (r0, v0), (r1, v0), (r0, v1), (r1, v1)
        "mp_rank_00_000": {"model0": {**_outer(first["model"], "embedding."), **_relayer(first["model"], 0, 1, 0)},
                           "model1": _relayer(last["model"], 0, 1, 0)},
        "mp_rank_00_001": {"model0": _relayer(first["model"], 1, 2, -1),
                           "model1": {**_relayer(last["model"], 1, 2, -1),
                                      **_outer(last["model"], "decoder.final_layernorm"),
                                      **_outer(last["model"], "output_layer")}},
    }
    _save_legacy(tmp_path / "vpp" / "iter_0000007", files, first["args"])
    _close(_vocab(_import_logits(tmp_path / "vpp" / "iter_0000007", tmp_path)), _vocab(out["megatron", "gpt", "pp2"]))


def test_legacy_tensor_and_pipeline_parallel(world, tmp_path):
    """tp2 x pp2 legacy files (the tp2 GPT's shards cut into two stages of two layers, the last
    stage holding its copy of the tied embeddings, as Megatron-LM saves it) give the same model."""
    root, out = world
    source = os.path.join(root, "gpt_tp2_legacy", "iter_0000007")
    files, args = {}, None
    for t in (0, 1):
        state = _plain(os.path.join(source, f"mp_rank_0{t}", "model_optim_rng.pt"))
        model, args = state["model"], state["args"]
        files[f"mp_rank_0{t}_000"] = {"model": {**_outer(model, "embedding."), **_relayer(model, 0, 2, 0)}}
        files[f"mp_rank_0{t}_001"] = {"model": {**_relayer(model, 2, 4, -2),
                                                **_outer(model, "decoder.final_layernorm"),
                                                "output_layer.weight": model["embedding.word_embeddings.weight"]}}
    args.pipeline_model_parallel_size = 2
    _save_legacy(tmp_path / "tp2pp2" / "iter_0000007", files, args)
    _close(_vocab(_import_logits(tmp_path / "tp2pp2" / "iter_0000007", tmp_path)),
           _vocab(out["megatron", "gpt", "tp2"]))


def test_legacy_tensor_no_part_reads_is_refused(world, tmp_path):
    """A tensor of a feature the arguments do not reveal (a learnable softmax offset) is one line."""
    from megatron_hydra.convert import megatron
    from megatron_hydra.errors import CheckpointError

    root, _ = world
    source = os.path.join(root, "gpt_pp2_legacy", "iter_0000007")
    files, args = {}, None
    for p in (0, 1):
        state = _plain(os.path.join(source, f"mp_rank_00_00{p}", "model_optim_rng.pt"))
        files[f"mp_rank_00_00{p}"], args = {"model": state["model"]}, state["args"]
    files["mp_rank_00_001"]["model"]["decoder.layers.1.self_attention.core_attention.softmax_offset"] = torch.zeros(4)
    _save_legacy(tmp_path / "src" / "iter_0000007", files, args)
    with pytest.raises(CheckpointError, match=r"holds decoder\.layers\.1\.self_attention\.core_attention\.softmax_"
                                              r"offset \(pipeline rank 1, model chunk 0\), which no tensor"):
        megatron.from_megatron(str(tmp_path / "src" / "iter_0000007"), str(tmp_path / "ours"))


def test_dist_tensor_no_part_reads_is_found(world):
    from megatron_hydra.convert import megatron_dist
    from megatron_hydra.convert.megatron_names import parts

    root, _ = world
    ck = megatron_dist.open_dist(os.path.join(root, "gpt_tp2_dist", "iter_0000007"))
    layer = [_our_name(f"decoder.layers.{i}.{k}") for i in range(4) for k in MEGATRON_TO_OURS if "." in k
             and not k.startswith(("embedding.", "decoder.")) and k != "mlp.linear_fc2.bias"]
    wanted = parts(["embedding.weight", "position_embedding.weight", "final_norm.weight", *layer], gated=False)
    assert sorted(megatron_dist.unused(ck, list(wanted.values()), tied=True)) == [
        "decoder.final_layernorm.bias", "decoder.layers.mlp.linear_fc2.bias"]


# Megatron's parameter names -> ours (the GPT form: one layer's and the outer ones).
MEGATRON_TO_OURS = {
    "embedding.word_embeddings.weight": "embedding.weight",
    "embedding.position_embeddings.weight": "position_embedding.weight",
    "decoder.final_layernorm.weight": "final_norm.weight", "decoder.final_layernorm.bias": "final_norm.bias",
    "input_layernorm.weight": "norm1.weight", "input_layernorm.bias": "norm1.bias",
    "self_attention.linear_qkv.weight": "attention.qkv.weight", "self_attention.linear_qkv.bias": "attention.qkv.bias",
    "self_attention.linear_proj.weight": "attention.proj.weight",
    "self_attention.linear_proj.bias": "attention.proj.bias",
    "pre_mlp_layernorm.weight": "norm2.weight", "pre_mlp_layernorm.bias": "norm2.bias",
    "mlp.linear_fc1.weight": "mlp.fc1.weight", "mlp.linear_fc1.bias": "mlp.fc1.bias",
    "mlp.linear_fc2.weight": "mlp.fc2.weight", "mlp.linear_fc2.bias": "mlp.fc2.bias",
}


def _our_name(name: str) -> str:
    if name.startswith("decoder.layers."):
        index, rest = name[len("decoder.layers."):].split(".", 1)
        return f"layers.{index}.{MEGATRON_TO_OURS[rest]}"
    return MEGATRON_TO_OURS[name]


def test_torch_dist_optimizer_moments_are_carried(world):
    """The plain optimizer's Adam moments and step (Megatron's own, after one step) in our entries."""
    from megatron_hydra.checkpoint import standalone
    from megatron_hydra.checkpoint.safe_reader import read_metadata

    root, out = world
    imported = out["imported", "gpt", "tp2", "dist"]
    assert imported[1] and "checkpoint.load_optimizer=false" not in imported[0]
    for setting in ("precision=fp32", "optim.adam_beta2=0.999", "optim.lr=0.01", "trainer.max_steps=20"):
        assert f" {setting}" in imported[0]  # Adam's moments go on under the hyperparameters that built them
    ckpt = os.path.join(root, "ours0_gpt_tp2_dist")
    per_rank = [out["moments", r] for r in (0, 1)]
    metadata = read_metadata(ckpt).state_dict_metadata
    wanted = []
    for name, (_, _, dim, step) in per_rank[0].items():
        assert step == 1.0
        ours = _our_name(name)
        for i, kind in enumerate(("exp_avg", "exp_avg_sq")):
            shards = [torch.from_numpy(m[name][i]) for m in per_rank]
            full = torch.cat(shards, dim=dim) if dim is not None else shards[0]
            wanted.append((f"optim/{ours}/{kind}", full[:100] if ours == "embedding.weight" else full))
        assert f"optim/{ours}/step" in metadata
    keys = [(key, list(t.shape), metadata[key].properties.dtype) for key, t in wanted]
    got = dict(standalone.read_tensors(ckpt, keys))
    for key, t in wanted:
        torch.testing.assert_close(got[key], t, atol=0, rtol=0)
    assert standalone.store.read_meta(ckpt)["step"] == 7


def test_legacy_and_untrained_imports_start_the_optimizer_afresh(world):
    _, out = world
    command, carried, notes = out["imported", "gpt", "tp2", "legacy"]
    assert not carried and "checkpoint.load_optimizer=false" in command
    assert any("optimizer state not carried" in n for n in notes)
    assert not out["imported", "llama", "pp2", "dist"][1]  # saved without an optimizer


def test_carried_optimizer_resumes_in_our_run(world):
    """The gpt tp2 import loads with its optimizer (sharded.load, load_optimizer=True) and its next
    AdamW step is the one Megatron's moments and step count give."""
    from megatron_hydra.checkpoint import sharded, standalone
    from megatron_hydra.models.archs import ARCHS
    from megatron_hydra.parallel.data_parallel import GradBuffer
    from megatron_hydra.parallel.optimizer import MegatronOptimizer
    from megatron_hydra.parallel.state import ParallelState

    root, out = world
    ckpt = os.path.join(root, "ours0_gpt_tp2_dist")
    cfg, derived = standalone.single_process(standalone.read_config(ckpt))
    ps = ParallelState.single()
    model = ARCHS["gpt"].build(derived.transformer, ps)
    lr, (b1, b2), eps, wd = 1e-2, (0.9, 0.999), 1e-8, 0.01  # Megatron's, as the printed command carries them
    opt = MegatronOptimizer(model, GradBuffer(model.parameters(), None, cfg.parallel.grad_bucket_size), ps, lr=lr,
                            betas=(b1, b2), eps=eps, weight_decay=wd, clip_grad=0.0, impl="foreach")
    with standalone.one_process():
        sharded.load(ckpt, model, opt, ps, derived.transformer.vocab_size)
    name = "decoder.layers.1.mlp.linear_fc2.weight"
    m, v = (torch.cat([torch.from_numpy(out["moments", r][name][i]) for r in (0, 1)], dim=1) for i in (0, 1))
    param = dict(model.named_parameters())[_our_name(name)]
    before = param.detach().clone()
    grad = torch.randn(before.shape, generator=torch.Generator().manual_seed(0))
    for p in model.parameters():
        p.main_grad.zero_()
    param.main_grad.copy_(grad)
    opt.step()
    m, v = b1 * m + (1 - b1) * grad, b2 * v + (1 - b2) * grad.square()  # Adam's second step (Megatron's was 1)
    expected = before * (1 - lr * wd) - lr / (1 - b1**2) * m / ((v / (1 - b2**2)).sqrt() + eps)
    torch.testing.assert_close(param.detach(), expected, rtol=1e-5, atol=1e-6)
    assert float(opt.state[opt.pieces[0].main]["step"]) == 2.0


def _copy_dist(root, name, to):
    import shutil

    shutil.copytree(os.path.join(root, name), to)
    return os.path.join(to, "iter_0000007")


@pytest.mark.parametrize("kind,why", [("dp_reshardable", "flat per-rank ranges"),
                                      ("fully_sharded_model_space", "flattened range of its TP shard")])
def test_distributed_optimizer_formats_are_not_carried(world, tmp_path, kind, why):
    """The distributed optimizer's other formats: weights only, saying why."""
    from megatron_hydra.convert import megatron

    root, _ = world
    directory = _copy_dist(root, "gpt_tp2_dist", tmp_path / "src")
    common = _plain(os.path.join(directory, "common.pt"), 1 << 20)
    common["optimizer"] = {"param_state_sharding_type": kind, "optimizer": {"param_groups": []}}
    torch.save(common, os.path.join(directory, "common.pt"))
    result = megatron.from_megatron(str(tmp_path / "src"), str(tmp_path / "ours"))
    assert not result.optimizer and any(kind in n and why in n for n in result.notes)


def test_linked_storage_file_is_refused(world, tmp_path):
    from megatron_hydra.convert import megatron
    from megatron_hydra.errors import CheckpointError

    root, _ = world
    directory = _copy_dist(root, "llama_tp2_dist", tmp_path / "src")
    victim = next(n for n in os.listdir(directory) if n.endswith(".distcp"))
    os.replace(os.path.join(directory, victim), tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", os.path.join(directory, victim))
    with pytest.raises(CheckpointError, match="not a regular file"):
        megatron.from_megatron(str(tmp_path / "src"), str(tmp_path / "ours"))


def test_storage_file_swapped_for_a_link_after_the_check_is_refused(world, tmp_path):
    """The reads open each file without following a link: a file replaced after open_dist checked it
    is refused too, not read through the link."""
    from megatron_hydra.convert import megatron_dist
    from megatron_hydra.convert.megatron_names import Part
    from megatron_hydra.errors import CheckpointError

    root, _ = world
    directory = _copy_dist(root, "llama_tp2_dist", tmp_path / "src")
    ck = megatron_dist.open_dist(directory)
    for name in (n for n in os.listdir(directory) if n.endswith(".distcp")):
        os.replace(os.path.join(directory, name), tmp_path / name)
        os.symlink(tmp_path / name, os.path.join(directory, name))
    with pytest.raises(CheckpointError, match="not a regular file"):
        megatron_dist.read_part(ck, Part("decoder.final_layernorm.weight"), [64])


# Safety and refusals: no Megatron-Core needed --------------------------------------------------
class _RunsCode:
    def __init__(self, sentinel):
        self.sentinel = str(sentinel)

    def __reduce__(self):
        return (os.system, (f"touch {self.sentinel}",))


def test_crafted_legacy_pickle_runs_nothing(tmp_path):
    from megatron_hydra.convert import megatron
    from megatron_hydra.errors import CheckpointError

    rank = tmp_path / "iter_0000001" / "mp_rank_00"
    rank.mkdir(parents=True)
    torch.save({"args": _RunsCode(tmp_path / "pwned"), "model": {}}, rank / "model_optim_rng.pt")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("1")
    with pytest.raises(CheckpointError) as e:
        megatron.from_megatron(str(tmp_path), str(tmp_path / "out"))
    assert "posix.system" in str(e.value) and "\n" not in str(e.value)
    assert not os.path.exists(tmp_path / "pwned")


def test_crafted_dcp_metadata_runs_nothing(tmp_path):
    from megatron_hydra.convert import megatron
    from megatron_hydra.errors import CheckpointError

    directory = tmp_path / "iter_0000001"
    directory.mkdir()
    (directory / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    (directory / ".metadata").write_bytes(pickle.dumps(_RunsCode(tmp_path / "pwned")))
    with pytest.raises(CheckpointError, match="posix.system is not allowed"):
        megatron.from_megatron(str(directory), str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "pwned")


def test_crafted_common_pt_and_unknown_class_are_refused(tmp_path):
    from megatron_hydra.convert import megatron_pickle
    from megatron_hydra.errors import CheckpointError

    path = tmp_path / "common.pt"
    torch.save({"args": fractions.Fraction(1, 3)}, path)  # a class no checkpoint holds
    with pytest.raises(CheckpointError, match="fractions.Fraction"):
        megatron_pickle.load(str(path), megatron_pickle.COMMON_BYTES)
    path.write_bytes(pickle.dumps(_RunsCode(tmp_path / "pwned")))  # not even a torch.save file
    with pytest.raises(CheckpointError):
        megatron_pickle.load(str(path), megatron_pickle.COMMON_BYTES)
    assert not os.path.exists(tmp_path / "pwned")


@pytest.mark.parametrize("files,shown", [
    ({"mp_rank_00": {"model0": {}, "model2": {}}}, "model chunks model0, model2 but no model1"),
    ({"mp_rank_00": {"model": {}}, "mp_rank_00_000": {"model": {}}}, "both mp_rank_00 and mp_rank_00_000 hold"),
    ({"mp_rank_00": {"model": {"language_model": {"embedding": {}}}}}, "pre-Megatron-Core model"),
])
def test_malformed_legacy_layouts_are_one_line(tmp_path, files, shown):
    import megatron_reference as ref

    from megatron_hydra.convert import megatron
    from megatron_hydra.errors import CheckpointError

    _save_legacy(tmp_path / "iter_0000007", files, ref.args_of("gpt", 1, 1, enums=False))
    with pytest.raises(CheckpointError, match=shown) as e:
        megatron.from_megatron(str(tmp_path / "iter_0000007"), str(tmp_path / "out"))
    assert "\n" not in str(e.value)


def test_unzipped_pickle_is_read_within_a_bound(tmp_path, monkeypatch):
    """A pre-1.6 torch.save file cannot be memory-mapped: it is read whole, so its size is bounded."""
    from megatron_hydra.convert import megatron_pickle
    from megatron_hydra.errors import CheckpointError

    path = tmp_path / "model_optim_rng.pt"
    torch.save({"model": {"w": torch.ones(64)}}, path, _use_new_zipfile_serialization=False)
    assert torch.equal(megatron_pickle.load(str(path))["model"]["w"], torch.ones(64))
    monkeypatch.setattr(megatron_pickle, "UNZIPPED_BYTES", 100)
    with pytest.raises(CheckpointError, match="larger than 100 bytes"):
        megatron_pickle.load(str(path))


def test_arguments_are_read_as_data(world):
    """Megatron-LM's Namespace with a Megatron-Core enum and numpy random states (a legacy file
    Megatron-Core's ranks wrote) loads with neither Megatron nor numpy objects built."""
    from megatron_hydra.convert import megatron_pickle

    root, _ = world
    state = megatron_pickle.load(os.path.join(root, "gpt_tp2_legacy", "iter_0000007", "mp_rank_01",
                                              "model_optim_rng.pt"))
    assert state["args"].num_layers == 4 and state["iteration"] == 7
    backend = state["args"].attention_backend
    assert isinstance(backend, megatron_pickle.MegatronEnum) and backend.cls.endswith("enums.AttnBackend")
    assert isinstance(state["rng_state"][0]["np_rng_state"][1], megatron_pickle.Opaque)


def test_cli_from_megatron(world, tmp_path, capsys):
    """The command line: python -m megatron_hydra.convert from_megatron / to_megatron."""
    from megatron_hydra.convert import __main__ as cli

    root, _ = world
    out = tmp_path / "ours"
    assert cli.main(["from_megatron", f"input={root}/llama_tp2_dist", f"output={out}", "parallel=tp2"]) == 0
    assert "launch.py" in capsys.readouterr().out
    assert cli.main(["to_megatron", f"input={out}", f"output={tmp_path / 'back'}"]) == 0
    assert (tmp_path / "back" / "latest_checkpointed_iteration.txt").read_text().strip() == "0"


def test_megatron_core_stays_out_of_this_process():
    """Neither the converter nor these tests import Megatron-Core here (only the ranks do): it
    would register its classes with ``torch.load`` for every later test of this process."""
    import sys

    importlib.import_module("megatron_hydra.convert.megatron")
    assert "megatron.core" not in sys.modules
