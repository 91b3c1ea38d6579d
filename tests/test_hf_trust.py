"""A Hugging Face model directory from anyone: every problem with its files is one line naming the
file, and no file outside the model directory is ever read.

The model is a tiny GPT-2 written by hand in the Hugging Face layout (config.json + safetensors),
so that these checks need neither transformers nor a download.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

pytest.importorskip("safetensors")

H, LAYERS, VOCAB, POSITIONS = 8, 1, 10, 8
CONFIG = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": H, "n_layer": LAYERS, "n_head": 2,
          "n_positions": POSITIONS, "vocab_size": VOCAB, "n_inner": None}


def gpt2_tensors(layers: int = LAYERS):
    """Random GPT-2 tensors of the tiny config (shared by the import trust tests)."""
    gen = torch.Generator().manual_seed(0)
    shapes = {"transformer.wte.weight": [VOCAB, H], "transformer.wpe.weight": [POSITIONS, H],
              "transformer.ln_f.weight": [H], "transformer.ln_f.bias": [H]}
    for i in range(layers):
        p = f"transformer.h.{i}."
        shapes.update({p + "ln_1.weight": [H], p + "ln_1.bias": [H], p + "ln_2.weight": [H], p + "ln_2.bias": [H],
                       p + "attn.c_attn.weight": [H, 3 * H], p + "attn.c_attn.bias": [3 * H],
                       p + "attn.c_proj.weight": [H, H], p + "attn.c_proj.bias": [H],
                       p + "mlp.c_fc.weight": [H, 4 * H], p + "mlp.c_fc.bias": [4 * H],
                       p + "mlp.c_proj.weight": [4 * H, H], p + "mlp.c_proj.bias": [H]})
    return {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}


@pytest.fixture
def hf_dir(tmp_path):
    from megatron_hydra.convert import hf_files

    path = tmp_path / "tiny"
    hf_files.write(str(path), CONFIG, gpt2_tensors())
    return path


def _convert(argv, capsys):
    """(exit code, stderr) of ``python -m megatron_hydra.convert ...``, run in this process."""
    from megatron_hydra.convert.__main__ import main

    code = main(argv)
    return code, capsys.readouterr().err.strip()


def _refused(argv, capsys) -> str:
    code, err = _convert(argv, capsys)
    assert code == 2 and err.startswith("error: ") and "\n" not in err, err
    return err


def test_good_directory_imports(hf_dir, tmp_path, capsys):
    code, err = _convert(["from_hf", f"input={hf_dir}", f"output={tmp_path / 'ckpt'}"], capsys)
    assert code == 0, err


@pytest.mark.parametrize("change, words", [
    ({"n_embd": None}, "has no 'n_embd'"),
    ({"n_layer": "2"}, 'n_layer="2" should be an integer'),
    ({"layer_norm_epsilon": "tiny"}, 'layer_norm_epsilon="tiny" should be a number'),
    ({"tie_word_embeddings": 1}, "tie_word_embeddings=1 should be true or false"),
    ({"vocab_size": 10.5}, "vocab_size=10.5 should be an integer"),
], ids=["missing", "str-for-int", "str-for-float", "int-for-bool", "float-for-int"])
def test_config_json_missing_key_or_wrong_type_is_one_line(hf_dir, tmp_path, capsys, change, words):
    config = {**CONFIG, **change}
    config = {k: v for k, v in config.items() if v is not None}
    (hf_dir / "config.json").write_text(json.dumps(config))
    err = _refused(["from_hf", f"input={hf_dir}", f"output={tmp_path / 'ckpt'}"], capsys)
    assert f"{hf_dir / 'config.json'}" in err and words in err
    (hf_dir / "config.json").write_text("[1, 2]")
    assert "holds a JSON list, not an object" in _refused(["from_hf", f"input={hf_dir}", f"output={tmp_path / 'c'}"],
                                                          capsys)


def test_truncated_or_foreign_weights_file_is_one_line_naming_it(hf_dir, tmp_path, capsys):
    weights = hf_dir / "model.safetensors"
    os.truncate(weights, os.path.getsize(weights) // 2)
    err = _refused(["from_hf", f"input={hf_dir}", f"output={tmp_path / 'ckpt'}"], capsys)
    assert f"{weights}: not a readable weights file" in err
    weights.unlink()
    bin_file = hf_dir / "pytorch_model.bin"
    bin_file.write_bytes(b"PK\x03\x04 not a zip archive")
    err = _refused(["from_hf", f"input={hf_dir}", f"output={tmp_path / 'ckpt'}"], capsys)
    assert f"{bin_file}: not a readable weights file" in err


@pytest.mark.parametrize("name", ["../secret/model.safetensors", "sub/../../secret/model.safetensors", "ABSOLUTE"])
def test_index_cannot_point_outside_the_model_directory(hf_dir, tmp_path, capsys, name):
    """The weights the index names exist and are valid, but outside the directory: refused."""
    (tmp_path / "secret").mkdir()
    shutil.move(str(hf_dir / "model.safetensors"), str(tmp_path / "secret" / "model.safetensors"))
    name = str(tmp_path / "secret" / "model.safetensors") if name == "ABSOLUTE" else name
    index = {"metadata": {}, "weight_map": {k: name for k in gpt2_tensors()}}
    (hf_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    err = _refused(["from_hf", f"input={hf_dir}", f"output={tmp_path / 'ckpt'}"], capsys)
    assert "model.safetensors.index.json names" in err and "outside" in err and "refused" in err
    assert not (tmp_path / "ckpt").exists()


def test_index_file_names_inside_the_directory_load(hf_dir, tmp_path, capsys):
    """Sub-folders and ``./`` stay allowed: confinement refuses only what leaves the directory."""
    (hf_dir / "shards").mkdir()
    shutil.move(str(hf_dir / "model.safetensors"), str(hf_dir / "shards" / "all.safetensors"))
    index = {"metadata": {}, "weight_map": {k: "./shards/x/../all.safetensors" for k in gpt2_tensors()}}
    (hf_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    code, err = _convert(["from_hf", f"input={hf_dir}", f"output={tmp_path / 'ckpt'}"], capsys)
    assert code == 0, err


def _tokenizer(path) -> None:
    """A word-level tokenizer.json with an end-of-document token: what an export copies along."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"<|endoftext|>": 0, "a": 1, "b": 2, "[UNK]": 3}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """A checkpoint imported from the tiny GPT-2 with its tokenizer and chat template."""
    from megatron_hydra.convert import api, hf_files

    root = tmp_path_factory.mktemp("imported")
    hf_files.write(str(root / "hf"), CONFIG, gpt2_tensors())
    _tokenizer(root / "hf" / "tokenizer.json")
    (root / "hf" / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    api.from_hf(str(root / "hf"), str(root / "ckpt"))
    return root / "ckpt"


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json"])
def test_export_copies_no_file_from_outside_the_checkpoint(imported, tmp_path, capsys, name):
    """A checkpoint is anyone's: its tokenizer file turned into a link to a file elsewhere (a
    valid tokenizer, or any secret), left out of its checksums, is one line, and nothing is written."""
    from megatron_hydra.checkpoint import store

    ckpt = tmp_path / "ckpt"
    shutil.copytree(imported, ckpt)
    secret = tmp_path / "secret.json"
    if name == "tokenizer.json":
        _tokenizer(secret)
    else:
        secret.write_text('{"api_key": "do not export"}')
    (ckpt / name).unlink()
    (ckpt / name).symlink_to(secret)
    meta = json.loads((ckpt / store.META).read_text())
    del meta["checksums"][name]
    (ckpt / store.META).write_text(json.dumps(meta))
    err = _refused(["to_hf", f"input={ckpt}", f"output={tmp_path / 'out'}"], capsys)
    assert f"{ckpt / name} is a link to {secret}, outside the checkpoint: refused" in err
    assert not (tmp_path / "out").exists() and sorted(os.listdir(tmp_path)) == ["ckpt", "secret.json"]


def test_export_of_an_import_copies_its_tokenizer_and_chat_template(imported, tmp_path, capsys):
    code, err = _convert(["to_hf", f"input={imported}", f"output={tmp_path / 'out'}"], capsys)
    assert code == 0, err
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "out" / name).read_bytes() == (imported / name).read_bytes()


@pytest.mark.timeout(10)
@pytest.mark.parametrize("model_type, extra", [
    ("gemma2", {}), ("qwen2", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}),
    ("qwen3_moe", {"decoder_sparse_step": 2}), ("gpt2", {}),
])
def test_a_config_claiming_10_8_layers_is_refused_at_once(hf_dir, tmp_path, capsys, model_type, extra):
    """Families build per-layer lists (window and MoE flags) from the claimed layer count: a count
    above the tensors the files hold is refused before any of them is built."""
    key = "n_layer" if model_type == "gpt2" else "num_hidden_layers"
    config = {**CONFIG, "model_type": model_type, "hidden_size": H, "intermediate_size": 4 * H,
              "num_attention_heads": 2, "vocab_size": VOCAB, "max_position_embeddings": POSITIONS,
              key: 10**8, **extra}
    (hf_dir / "config.json").write_text(json.dumps(config))
    err = _refused(["from_hf", f"input={hf_dir}", f"output={tmp_path / 'ckpt'}"], capsys)
    assert f"config.json: {key}=100000000, but the weights beside it hold only {len(gpt2_tensors())} tensors" in err


def test_a_mixed_dtype_import_says_so_in_its_meta(hf_dir, tmp_path, capsys):
    """The files' dtypes are kept; a checkpoint whose tensors mix them records ``mixed``."""
    from megatron_hydra.checkpoint import store
    from megatron_hydra.convert import hf_files

    tensors = gpt2_tensors()
    tensors["transformer.ln_f.weight"] = tensors["transformer.ln_f.weight"].half()
    shutil.rmtree(hf_dir)
    hf_files.write(str(hf_dir), CONFIG, tensors)
    assert _convert(["from_hf", f"input={hf_dir}", f"output={tmp_path / 'mixed'}"], capsys)[0] == 0
    assert store.read_meta(str(tmp_path / "mixed"))["dtype"] == "mixed"
    hf_files.write(str(tmp_path / "half"), CONFIG, {n: t.half() for n, t in tensors.items()})
    assert _convert(["from_hf", f"input={tmp_path / 'half'}", f"output={tmp_path / 'one'}"], capsys)[0] == 0
    assert store.read_meta(str(tmp_path / "one"))["dtype"] == "torch.float16"
