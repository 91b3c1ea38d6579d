"""Conversion streams: one tensor at a time, in the files' own dtype, into a directory that appears
only when complete.

References are independent of our code: the safetensors files ``transformers`` wrote (read back
with safetensors' own reader), their bf16 values upcast by torch, and the memory a process
reports (``VmHWM``) against the size of the model it converted.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors import safe_open  # noqa: E402  (transformers brings safetensors)
from safetensors.torch import load_file, save_file  # noqa: E402

VOCAB = 301  # odd: padded differently at every tp


def _hf_llama(path: str, dtype: torch.dtype) -> None:
    """A small Llama written by ``save_pretrained`` into many small shards, in ``dtype``."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
                                   tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=None)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    model.to(dtype).save_pretrained(path, max_shard_size="60KB")
    from megatron_hydra.data.tokenizers import train_bpe

    train_bpe(["the quick brown fox jumps over the lazy dog\n" * 4], VOCAB, os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"}, f)


def _hf_tensors(path: str) -> dict:
    files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    return {k: v for f in files for k, v in load_file(os.path.join(path, f)).items()}


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """{dtype: (hf directory, imported checkpoint)} for the same model in fp32 and in bf16."""
    from megatron_hydra.convert import api

    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        root = tmp_path_factory.mktemp(str(dtype).replace("torch.", ""))
        hf_dir, ckpt = str(root / "hf"), str(root / "ckpt")
        _hf_llama(hf_dir, dtype)
        api.from_hf(hf_dir, ckpt)
        out[dtype] = hf_dir, ckpt
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_import_then_export_is_bitwise(imported, tmp_path, dtype):
    from megatron_hydra.convert import api, hf_files

    hf_dir, ckpt = imported[dtype]
    assert len([f for f in os.listdir(hf_dir) if f.endswith(".safetensors")]) > 5  # many input shards
    result = api.to_hf(ckpt, str(tmp_path / "out"), max_shard_bytes=50_000)
    assert hf_files.SAFETENSORS_INDEX in result["files"] and len(result["files"]) > 5
    original, exported = _hf_tensors(hf_dir), _hf_tensors(str(tmp_path / "out"))
    assert sorted(exported) == sorted(original)
    for name, t in original.items():
        assert exported[name].dtype == dtype and torch.equal(exported[name], t), name
    index = json.loads((tmp_path / "out" / hf_files.SAFETENSORS_INDEX).read_text())
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in original.values())
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == str(dtype)[len("torch."):]
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the chat template comes along both ways
        assert (tmp_path / "out" / name).read_bytes() == open(os.path.join(hf_dir, name), "rb").read()


def test_dtype_is_kept_and_cast_on_load(imported, tmp_path):
    """bf16 files give a bf16 checkpoint; loading into an fp32 model casts exactly; an export
    asked for another dtype casts each tensor."""
    from megatron_hydra.checkpoint.safe_reader import read_metadata
    from megatron_hydra.checkpoint.standalone import load_model
    from megatron_hydra.convert import api

    hf_dir, ckpt = imported[torch.bfloat16]
    stored = read_metadata(ckpt).state_dict_metadata
    assert {md.properties.dtype for md in stored.values()} == {torch.bfloat16}
    _, _, model = load_model(ckpt)
    original = _hf_tensors(hf_dir)
    params = dict(model.named_parameters())
    assert params["embedding.weight"].dtype == torch.float32
    assert torch.equal(params["embedding.weight"][:VOCAB], original["model.embed_tokens.weight"].float())
    assert torch.equal(params["final_norm.weight"], original["model.norm.weight"].float())
    api.to_hf(ckpt, str(tmp_path / "f64"), dtype="float64")
    for name, t in _hf_tensors(str(tmp_path / "f64")).items():
        assert t.dtype == torch.float64 and torch.equal(t, original[name].double()), name


def test_export_of_a_bf16_run_keeps_bf16_or_takes_its_fp32_main_weights(tmp_path):
    """A bf16 run's checkpoint exports as bf16 by default (its model weights, bitwise); asked for
    float32 it exports the fp32 main weights the optimizer kept, not the rounded bf16 copy."""
    from conftest import SMALL, run_training

    from megatron_hydra.checkpoint.safe_reader import read_metadata, safe_load
    from megatron_hydra.convert import api

    llama = ["precision=bf16", "model.position_embedding=rope", "model.normalization=rmsnorm",
             "model.activation=swiglu", "model.add_bias_linear=false", "trainer.max_steps=1", "optim.warmup_steps=0"]
    run_training([*SMALL, *llama], tmp_path / "run")
    ckpt = str(tmp_path / "run" / "checkpoints" / "step_0000001")
    ours = {"model.embed_tokens.weight": "embedding.weight", "model.norm.weight": "final_norm.weight",
            "model.layers.1.mlp.down_proj.weight": "layers.1.mlp.fc2.weight"}
    stored = read_metadata(ckpt).state_dict_metadata
    saved = {k: torch.empty(stored[k].size, dtype=stored[k].properties.dtype)
             for name in ours.values() for k in (f"model/{name}", f"main/{name}")}
    with warnings.catch_warnings():  # DCP's note that it reads in one process: intended
        warnings.simplefilter("ignore")
        safe_load(saved, ckpt)
    api.to_hf(ckpt, str(tmp_path / "bf16"))
    api.to_hf(ckpt, str(tmp_path / "fp32"), dtype="float32")
    as_bf16, as_fp32 = _hf_tensors(str(tmp_path / "bf16")), _hf_tensors(str(tmp_path / "fp32"))
    assert {t.dtype for t in as_bf16.values()} == {torch.bfloat16}
    assert {t.dtype for t in as_fp32.values()} == {torch.float32}
    for theirs, name in ours.items():
        assert torch.equal(as_bf16[theirs], saved[f"model/{name}"]), theirs
        assert torch.equal(as_fp32[theirs], saved[f"main/{name}"]), theirs
    assert not torch.equal(saved["main/embedding.weight"], saved["model/embedding.weight"].float())


def test_failed_import_leaves_no_directory(imported, tmp_path):
    """A tensor of the last shard holds NaN: the import fails after writing the others, and
    neither the output nor its staging directory is left."""
    from megatron_hydra.convert import api, hf_files
    from megatron_hydra.errors import CheckpointError

    hf_dir, _ = imported[torch.float32]
    bad = tmp_path / "hf"
    bad.mkdir()
    for name in os.listdir(hf_dir):
        (bad / name).write_bytes(open(os.path.join(hf_dir, name), "rb").read())
    weight_map = json.loads((bad / hf_files.SAFETENSORS_INDEX).read_text())["weight_map"]
    last = sorted(set(weight_map.values()))[-1]
    tensors = load_file(bad / last)
    victim = sorted(tensors)[-1]
    tensors[victim][0] = float("nan")
    save_file(tensors, bad / last, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="NaN"):
        api.from_hf(str(bad), str(tmp_path / "out" / "ckpt"))
    assert os.listdir(tmp_path / "out") == []


def test_failed_export_leaves_no_directory(imported, tmp_path, monkeypatch):
    """The disk fills up half way through the shards: one line, nothing left behind."""
    import errno

    from megatron_hydra.convert import api, hf_files
    from megatron_hydra.errors import CheckpointError

    calls = []
    put = hf_files.ShardWriter.put

    def fill_up(self, name, tensor):
        calls.append(name)
        if len(calls) == 10:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        put(self, name, tensor)

    monkeypatch.setattr(hf_files.ShardWriter, "put", fill_up)
    with pytest.raises(CheckpointError, match="No space left on device.*nothing was written"):
        api.to_hf(imported[torch.float32][1], str(tmp_path / "out"), max_shard_bytes=50_000)
    assert len(calls) == 10 and os.listdir(tmp_path) == []


# Run in a fresh process after a warm-up conversion each way has loaded every module: what each
# conversion adds to the process's resident memory at its peak (VmHWM).
MEASURE = r"""
import json, sys
from megatron_hydra.checkpoint import standalone
from megatron_hydra.convert import api
from megatron_hydra.training.memory_peak import resident_peak_added

standalone.READ_BYTES = 4 << 20  # export reads a few tensors at a time, as 256 MiB are to 16 GB
warm, hf, root = sys.argv[1:]
api.from_hf(warm, root + "/warm_ckpt")
api.to_hf(root + "/warm_ckpt", root + "/warm_out")
print(json.dumps({"import": resident_peak_added(lambda: api.from_hf(hf, root + "/ckpt")),
                  "export": resident_peak_added(lambda: api.to_hf(root + "/ckpt", root + "/out",
                                                                  max_shard_bytes=20 << 20))}))
"""


def _write_big_llama(path, layers=12, hidden=512, ffn=2048, vocab=4000) -> int:
    """A Llama-shaped directory of random fp32 weights in shards of about 20 MB (written shard by
    shard); returns its bytes."""
    os.makedirs(path)
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": hidden,
              "intermediate_size": ffn, "num_hidden_layers": layers, "num_attention_heads": 8,
              "num_key_value_heads": 2, "vocab_size": vocab, "max_position_embeddings": 256,
              "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
    (path / "config.json").write_text(json.dumps(config))
    kv = hidden // 4
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
              "lm_head.weight": (vocab, hidden)}
    for i in range(layers):
        m = f"model.layers.{i}."
        shapes.update({m + "input_layernorm.weight": (hidden,), m + "post_attention_layernorm.weight": (hidden,),
                       m + "self_attn.q_proj.weight": (hidden, hidden), m + "self_attn.k_proj.weight": (kv, hidden),
                       m + "self_attn.v_proj.weight": (kv, hidden), m + "self_attn.o_proj.weight": (hidden, hidden),
                       m + "mlp.gate_proj.weight": (ffn, hidden), m + "mlp.up_proj.weight": (ffn, hidden),
                       m + "mlp.down_proj.weight": (hidden, ffn)})
    gen = torch.Generator().manual_seed(0)
    shards, shard, size = [], {}, 0
    for name, shape in [*shapes.items(), (None, None)]:
        if shard and (name is None or size + 4 * math.prod(shape) > 20 << 20):
            shards.append(f"model-{len(shards):05d}.safetensors")
            save_file({n: torch.randn(s, generator=gen) for n, s in shard.items()}, path / shards[-1],
                      metadata={"format": "pt"})
            shard, size = {}, 0
        if name is not None:
            shard[name], size = shape, size + 4 * math.prod(shape)
    weight_map = {}
    for file in shards:
        with safe_open(path / file, framework="pt") as f:
            weight_map.update(dict.fromkeys(f.keys(), file))
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return 4 * sum(math.prod(s) for s in shapes.values())


def test_peak_memory_is_a_fraction_of_the_model(imported, tmp_path):
    """Converting a 200 MB model in 20 MB shards, either way, takes far less than the model: the
    whole-model conversion this replaced took more than all of it."""
    model_bytes = _write_big_llama(tmp_path / "big")
    warm = imported[torch.float32][0]
    done = subprocess.run([sys.executable, "-c", MEASURE, warm, str(tmp_path / "big"), str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    grew = json.loads(done.stdout.strip().splitlines()[-1])
    assert grew["import"] < 0.4 * model_bytes and grew["export"] < 0.4 * model_bytes, (grew, model_bytes)


def test_seal_records_every_file_then_the_marker(tmp_path):
    """The one way a checkpoint is finished (an import's writer, and a training save's steps):
    meta.json with the size and SHA-256 of every file already there, then the marker."""
    import hashlib

    from megatron_hydra.checkpoint import store

    files = {"__0_0.distcp": b"x" * 10, "tokenizer.json": b"{}", "rng/rank_00000.pt": b"y"}
    for name, content in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(content)
    (tmp_path / store.DCP_METADATA).write_bytes(b"z")
    files[store.DCP_METADATA] = b"z"
    assert not store.is_complete(str(tmp_path))
    store.seal(str(tmp_path), {"step": 0, "consumed_samples": 0, "shapes": {}, "has_optimizer": False})
    meta = store.validate(str(tmp_path))
    assert meta["checksums"] == {name: {"bytes": len(content), "sha256": hashlib.sha256(content).hexdigest()}
                                 for name, content in files.items()}
