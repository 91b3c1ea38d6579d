"""A Hugging Face model directory and its chat template, crafted by someone else: every problem is
one line within seconds, nothing from the directory becomes a Hydra config, and nothing outside it
is copied.

The model is a tiny GPT-2 written by hand in the Hugging Face layout (config.json + safetensors),
so these checks need neither transformers nor a download. Cases that used to hang run under a
timeout that fails the test (pytest-timeout's signal method); a FIFO that would block a reader
forever is also opened for writing by a helper thread after a while, so that the old blocking read
ends in an error rather than in a hung suite.
"""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
import torch

from conftest import launch_py
from test_hf_trust import CONFIG as GPT2, H, VOCAB, gpt2_tensors, hf_dir  # noqa: F401 - hf_dir: a fixture

pytest.importorskip("safetensors")

LLAMA = {"model_type": "llama", "hidden_size": H, "intermediate_size": 16, "num_hidden_layers": 1,
         "num_attention_heads": 2, "vocab_size": VOCAB}


def _convert(argv, capsys):
    """(exit code, stdout, stderr) of ``python -m megatron_hydra.convert ...``, in this process."""
    from megatron_hydra.convert.__main__ import main

    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out.strip(), out.err.strip()


def _refused(argv, capsys) -> str:
    code, out, err = _convert(argv, capsys)
    assert code == 2 and err.startswith("error: ") and "\n" not in err, (code, out, err)
    return err


# Severe 1: the fine-tune command never makes the checkpoint a Hydra config search path ------------
def test_printed_command_takes_the_model_from_the_checkpoint_as_data(hf_dir, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    code, out, err = _convert(["from_hf", f"input={hf_dir}", f"output={ckpt}", "name=tiny"], capsys)
    assert code == 0, err
    command = out.splitlines()[-1].split()
    assert command == ["python", "launch.py", "model=from_checkpoint", f"checkpoint.load={ckpt}",
                       "checkpoint.load_optimizer=false", "parallel=single", "trainer.devices=1"]
    assert not (ckpt / "model").exists()  # no YAML for a config search path is written


def test_yaml_planted_in_a_checkpoint_never_runs_hydra_callbacks(hf_dir, tmp_path, capsys, env_no_launcher):
    """A checkpoint from someone else may hold ``model/<name>.yaml`` declaring Hydra callbacks (Hydra
    instantiates them before our code runs): the printed command must not read it. Needs
    ``model=from_checkpoint`` (checkpoint/model_source.py)."""
    ckpt, victim = tmp_path / "ckpt", tmp_path / "victim.txt"
    victim.write_text("precious")
    code, out, err = _convert(["from_hf", f"input={hf_dir}", f"output={ckpt}", "name=tiny"], capsys)
    assert code == 0, err
    (ckpt / "model").mkdir(exist_ok=True)
    (ckpt / "model" / "tiny.yaml").write_text(
        "# @package _global_\nhydra:\n  callbacks:\n    evil:\n      _target_: builtins.open\n"
        f"      _args_: ['{victim}', 'w']\n")
    command = out.splitlines()[-1].split()
    code = launch_py([*command[2:], "mode=plan", f"hydra.run.dir={tmp_path / 'run'}"], env_no_launcher)
    captured = capsys.readouterr()
    assert code == 0, (captured.out + captured.err)[-2000:]
    assert victim.read_text() == "precious"


# Crafted config.json: one line, at once ------------------------------------------------------------
@pytest.mark.timeout(30, method="signal")
def test_config_claiming_100000_layers_is_refused_before_building(hf_dir, tmp_path, capsys):
    """Two-layer-sized files under a config of 100000 layers: refused from the files' headers, not
    after minutes spent building the whole model."""
    (hf_dir / "config.json").write_text(json.dumps({**GPT2, "n_layer": 100000}))
    start = time.monotonic()
    err = _refused(["from_hf", f"input={hf_dir}", f"output={tmp_path / 'ckpt'}"], capsys)
    assert time.monotonic() - start < 10
    assert err == (f"error: {hf_dir / 'config.json'}: n_layer=100000, but the weights beside it hold only "
                   f"{len(gpt2_tensors())} tensors: the weights and config.json do not belong together")
    assert not (tmp_path / "ckpt").exists()


def test_weights_shaped_otherwise_are_refused_from_the_headers(hf_dir, tmp_path, capsys, monkeypatch):
    """The shape check runs on the files' headers, before the model is built: only the one-layer
    model that gives the expected shapes is built."""
    import dataclasses

    from megatron_hydra.convert import api, hf_files

    tensors = gpt2_tensors(layers=3)
    tensors["transformer.h.0.mlp.c_fc.weight"] = torch.zeros(H, 3 * H)
    hf_files.write(str(hf_dir), {**GPT2, "n_layer": 3}, tensors)
    built = []
    gpt = api.ARCHS["gpt"]

    def build(tcfg, *args, **kwargs):
        built.append(tcfg.num_layers)
        return gpt.build(tcfg, *args, **kwargs)

    monkeypatch.setitem(api.ARCHS, "gpt", dataclasses.replace(gpt, build=build))
    err = _refused(["from_hf", f"input={hf_dir}", f"output={tmp_path / 'ckpt'}"], capsys)
    assert "tensor transformer.h.0.mlp.c_fc.weight has shape [8, 24] but config.json implies [8, 32]" in err
    assert built == [1]


@pytest.mark.parametrize("config, key", [
    ({**GPT2, "layer_norm_epsilon": float("nan")}, "layer_norm_epsilon=NaN"),
    ({**LLAMA, "rms_norm_eps": float("inf")}, "rms_norm_eps=Infinity"),
    ({**LLAMA, "rope_theta": float("nan")}, "rope_theta=NaN"),
    ({**LLAMA, "rope_parameters": {"rope_type": "default", "rope_theta": float("-inf")}}, "rope_theta=-Infinity"),
], ids=["gpt2-eps-nan", "llama-eps-inf", "rope-theta-nan", "rope-parameters-theta-minus-inf"])
def test_non_finite_float_in_config_json_is_refused_naming_the_key(hf_dir, tmp_path, capsys, config, key):
    (hf_dir / "config.json").write_text(json.dumps(config))  # NaN / Infinity: what Python's json writes
    err = _refused(["from_hf", f"input={hf_dir}", f"output={tmp_path / 'ckpt'}"], capsys)
    assert f"{hf_dir / 'config.json'}: {key} is not a finite number" in err


@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json"])
def test_json_nested_100k_deep_is_one_line(hf_dir, tmp_path, capsys, name):
    deep = "[" * 100_000 + "]" * 100_000
    if name == "config.json":
        text = json.dumps(GPT2)[:-1] + f', "x": {deep}}}'
    else:
        (hf_dir / "model.safetensors").rename(hf_dir / "shard.safetensors")
        text = '{"weight_map": {"transformer.wte.weight": "shard.safetensors"}, "metadata": ' + deep + "}"
    (hf_dir / name).write_text(text)
    err = _refused(["from_hf", f"input={hf_dir}", f"output={tmp_path / 'ckpt'}"], capsys)
    assert f"{hf_dir / name}: nested deeper than" in err


# FIFOs and links where a file belongs ---------------------------------------------------------------
def _open_for_writing_later(path, stop: threading.Event, after: float = 8.0) -> threading.Thread:
    """Open the FIFO ``path`` for writing (and close it) after ``after`` s, again and again until
    ``stop``: a reader blocked on it then reads end-of-file and fails instead of hanging forever."""

    def run():
        if stop.wait(after):
            return
        while not stop.wait(0.2):
            try:
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:  # no reader: nothing blocks on it
                pass

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.timeout(60, method="signal")
@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"])
def test_fifo_in_place_of_a_model_file_is_refused_at_once(hf_dir, tmp_path, capsys, name):
    (hf_dir / "tokenizer.json").write_text("{}")  # read as bytes only: a stand-in is enough
    path = hf_dir / name
    path.unlink(missing_ok=True)
    os.mkfifo(path)
    stop = threading.Event()
    _open_for_writing_later(path, stop)
    try:
        start = time.monotonic()
        err = _refused(["from_hf", f"input={hf_dir}", f"output={tmp_path / 'ckpt'}"], capsys)
        assert time.monotonic() - start < 5
    finally:
        stop.set()
    assert f"{path}: is a FIFO, not a regular file: refused" in err


def test_tokenizer_linked_outside_the_model_directory_is_refused(hf_dir, tmp_path, capsys):
    secret = tmp_path / "secret.json"
    secret.write_text('{"private": "not for a shared checkpoint"}')
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (hf_dir / "tokenizer.json").unlink(missing_ok=True)
        (hf_dir / "tokenizer.json").write_text("{}")
        (hf_dir / name).unlink(missing_ok=True)
        (hf_dir / name).symlink_to(secret)  # the tokenizer itself, then the settings beside a plain one
        err = _refused(["from_hf", f"input={hf_dir}", f"output={tmp_path / 'ckpt'}"], capsys)
        assert f"{hf_dir / name} is a link to {secret}, outside the model directory: refused" in err
        assert not (tmp_path / "ckpt").exists()


def test_tokenizer_links_inside_the_directory_or_into_hf_cache_blobs_are_copied(tmp_path, capsys):
    """A Hugging Face cache snapshot is links into the repository's ``blobs``: it still imports, and
    a link to a file inside the model directory is fine too. What lands in the checkpoint is the
    file, not a link."""
    from megatron_hydra.convert import hf_files

    repo = tmp_path / "hub" / "models--org--tiny"
    source = tmp_path / "plain"
    hf_files.write(str(source), GPT2, gpt2_tensors())
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    files = {"config.json": (source / "config.json").read_bytes(),
             "model.safetensors": (source / "model.safetensors").read_bytes(),
             "tokenizer.json": b'{"tokenizer": "blob"}'}
    for i, (name, content) in enumerate(files.items()):
        (repo / "blobs" / f"hash{i}").write_bytes(content)
        (snapshot / name).symlink_to(f"../../blobs/hash{i}")
    (snapshot / "extra").mkdir()
    (snapshot / "extra" / "settings.json").write_text('{"chat_template": null}')
    (snapshot / "tokenizer_config.json").symlink_to("extra/settings.json")
    ckpt = tmp_path / "ckpt"
    code, out, err = _convert(["from_hf", f"input={snapshot}", f"output={ckpt}"], capsys)
    assert code == 0, err
    assert not (ckpt / "tokenizer.json").is_symlink()
    assert (ckpt / "tokenizer.json").read_bytes() == files["tokenizer.json"]
    assert (ckpt / "tokenizer_config.json").read_text() == '{"chat_template": null}'


# Chat templates that loop or grow without bound ----------------------------------------------------
NESTED = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
DOUBLING = "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(40) }}"
TEMPLATES = {
    "nested-loops": (NESTED, "its chat_template still ran after 1 s rendering one conversation: refused"),
    "doubling-macro": (DOUBLING, "its chat_template still ran after 1 s rendering one conversation: refused"),
    "huge-range": ("{% for i in range(10**6) %}{% for j in range(10**6) %}x{% endfor %}{% endfor %}",
                   "failed on the conversation (OverflowError: Range too big."),
    "x-times-4e9-int": ("{{ 'x' * 4000000000 }}", "its chat_template needed more than 1 GiB of memory"),
    "x-times-4e9-float": ("{{ 'x' * 4e9 }}", "failed on the conversation (TypeError: can't multiply sequence"),
    "recursive-macro": ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
                        "its chat_template recursed deeper than Python allows rendering one conversation"),
    "long-output": ("{% for m in messages %}{{ m['content'] * 100000 }}{% endfor %}",
                    "its chat_template wrote more than 100,000 characters rendering one conversation: refused"),
}


@pytest.mark.timeout(30, method="signal")
@pytest.mark.parametrize("case", list(TEMPLATES))
def test_chat_template_that_loops_or_grows_is_one_line_within_seconds(tmp_path, monkeypatch, case):
    from megatron_hydra.data import chat_template
    from megatron_hydra.data.sft_dataset import tokenize_conversations
    from megatron_hydra.data.tokenizers import ByteTokenizer
    from megatron_hydra.errors import DataError

    monkeypatch.setattr(chat_template, "RENDER_SECONDS", 1.0)
    monkeypatch.setattr(chat_template, "MAX_CHARS", 100_000)
    source, words = TEMPLATES[case]
    settings = tmp_path / "tokenizer_config.json"
    settings.write_text(json.dumps({"chat_template": source}))
    tokenizer = ByteTokenizer()
    tokenizer.path = str(tmp_path / "tokenizer.json")  # the template is the one beside it
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"prompt": "hi", "response": "hello"}) + "\n")
    start = time.monotonic()
    with pytest.raises(DataError) as caught:
        tokenize_conversations(str(chat), tokenizer, seq_length=64, vocab_size=512)
    message = str(caught.value)
    assert time.monotonic() - start < 8
    assert "\n" not in message and str(settings) in message and words in message, message


def test_renderer_process_ends_with_its_template(tmp_path):
    """Each template's renderer is a process: it must not outlive the template, nor a timeout."""
    import gc

    from megatron_hydra.data.chat_template import JinjaTemplate
    from megatron_hydra.data.tokenizers import ByteTokenizer

    template = JinjaTemplate(ByteTokenizer(), "{{ messages[0]['content'] }}", {}, str(tmp_path / "t.json"))
    assert template.render([{"role": "user", "content": "hi"}], add_generation_prompt=False) == "hi"
    proc = template._renderer.proc
    del template
    gc.collect()
    assert proc.wait(timeout=10) is not None
