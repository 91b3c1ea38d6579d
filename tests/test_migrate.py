"""``python -m megatron_hydra.migrate``: Megatron-LM command lines as launch.py overrides.

The references are Megatron-LM's own rules, written out here from its ``arguments.py`` and
``training.py`` (data-parallel size world / (tp x pp x cp), global batch micro x dp when absent,
ffn 4h or int(8h/3 / 64) x 64 with --swiglu, warmup as a fraction of the decay length, iterations
as samples // global batch, the padded vocabulary, ...), applied to each command line's flags in
the test, against the config that launch.py composes from the printed overrides and derive.
"""

from __future__ import annotations

import math
import re
import shlex
from pathlib import Path

import pytest

from conftest import compose_config
from megatron_hydra.config.derive import derive
from megatron_hydra.errors import ConfigError
from megatron_hydra.migrate import flags
from megatron_hydra.migrate.__main__ import main
from megatron_hydra.migrate.check import check_composed
from megatron_hydra.migrate.command import migrate
from megatron_hydra.migrate.command_line import parse
from megatron_hydra.migrate.report import classify
from megatron_hydra.migrate.shell import read_script
from megatron_hydra.migrate.translate import translate
# Imported at collection, before any backward of this process: the dry run's stand-in device must be
# registered before torch's autograd engine sizes its per-device queues (training.fake_gpu).
from megatron_hydra.training import fake_gpu  # noqa: F401

# Megatron-LM's README GPT example (v2.x) with tensor parallelism over the 8 GPUs it launches.
README_EXAMPLE = """python -m torch.distributed.launch --nproc_per_node 8 pretrain_gpt.py
    --num-layers 24 --hidden-size 1024 --num-attention-heads 16 --tensor-model-parallel-size 4
    --seq-length 1024 --max-position-embeddings 1024 --micro-batch-size 4 --global-batch-size 8
    --lr 0.00015 --train-iters 500000 --lr-decay-iters 320000 --lr-decay-style cosine --min-lr 1.0e-5
    --weight-decay 1e-2 --lr-warmup-fraction .01 --clip-grad 1.0 --fp16
    --data-path my-gpt2_text_document --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt --split 949,50,1
    --log-interval 100 --save-interval 10000 --eval-interval 1000 --eval-iters 10
    --save checkpoints/gpt2_345m --load checkpoints/gpt2_345m"""

# Llama 3 8B as Megatron-LM's examples/llama scripts train it, on 2 nodes at tp2 x pp2 x cp2.
LLAMA3_8B = """torchrun --nproc-per-node 8 --nnodes 2 pretrain_gpt.py --use-mcore-models
    --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
    --group-query-attention --num-query-groups 8 --kv-channels 128 --seq-length 8192 --max-position-embeddings 8192
    --position-embedding-type rope --rotary-base 500000 --normalization RMSNorm --swiglu
    --untie-embeddings-and-output-weights --disable-bias-linear --attention-dropout 0.0 --hidden-dropout 0.0
    --bf16 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --context-parallel-size 2
    --sequence-parallel --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
    --micro-batch-size 1 --global-batch-size 128 --tokenizer-type HuggingFaceTokenizer
    --tokenizer-model meta-llama/Meta-Llama-3-8B --vocab-size 128256
    --data-path "0.7 /data/web_text_document 0.3 /data/code_text_document" --split 99,1,0
    --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 2000 --lr-decay-style cosine --train-iters 100000
    --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0 --manual-gc --tp-comm-overlap --log-throughput"""


def _flag_values(command: str) -> dict:
    words = shlex.split(command)
    out, i = {}, 0
    while i < len(words):
        if words[i].startswith("--") and i + 1 < len(words) and not words[i + 1].startswith("--"):
            out[words[i]] = words[i + 1]
            i += 2
        else:
            out[words[i]] = True
            i += 1
    return out


def _composed(result):
    """The config launch.py composes from the printed overrides (conf/, as launch.py reads it)."""
    cfg = compose_config(result.overrides)
    return cfg, derive(cfg)


def test_readme_example_derives_megatrons_layout_batch_and_shapes():
    f = _flag_values(README_EXAMPLE)
    world, tp, pp = int(f["--nproc_per_node"]), int(f["--tensor-model-parallel-size"]), 1
    dp = world // (tp * pp)
    micro, gbs = int(f["--micro-batch-size"]), int(f["--global-batch-size"])
    hidden, heads = int(f["--hidden-size"]), int(f["--num-attention-heads"])
    gpt2_vocab = 50257
    decay = int(f["--lr-decay-iters"])

    result = migrate(shlex.split(README_EXAMPLE))
    assert "trainer.devices=8" in result.overrides and "parallel=tp4" in result.overrides
    printed = result.report().split("\n\n")[0].split("\n", 1)[1]  # the launch.py command
    assert printed in (Path(__file__).parents[1] / "docs" / "megatron.md").read_text()  # as the docs show it
    assert result.problem is None
    cfg, d = _composed(result)
    assert (d.world_size, d.tp, d.pp, d.dp) == (world, tp, pp, dp)
    assert (d.global_batch_size, d.num_microbatches) == (gbs, gbs // (micro * dp))
    tc = d.transformer
    assert (tc.num_layers, tc.hidden_size, tc.num_attention_heads) == (24, hidden, heads)
    assert (tc.ffn_hidden_size, tc.kv_channels, tc.num_query_groups) == (4 * hidden, hidden // heads, heads)
    assert (tc.seq_length, tc.max_position_embeddings) == (int(f["--seq-length"]), int(f["--max-position-embeddings"]))
    multiple = 128 * tp  # Megatron-LM's _vocab_size_with_padding
    assert tc.padded_vocab_size == math.ceil(gpt2_vocab / multiple) * multiple
    assert (tc.hidden_dropout, tc.attention_dropout) == (0.1, 0.1)  # Megatron-LM's defaults
    assert (tc.position_embedding, tc.tie_embeddings) == ("learned", True)
    assert cfg.precision.params_dtype == "float16" and cfg.precision.initial_loss_scale == 2.0 ** 32
    o = cfg.optim
    assert (o.lr, o.min_lr, o.weight_decay, o.clip_grad) == (1.5e-4, 1e-5, 0.01, 1.0)
    assert (o.adam_beta1, o.adam_beta2) == (0.9, 0.999)  # Megatron-LM's defaults
    assert (o.lr_schedule, o.decay_steps, o.warmup_steps) == ("cosine", decay, round(0.01 * decay))
    assert cfg.trainer.max_steps == int(f["--train-iters"]) and cfg.trainer.log_every_n_steps == 100
    assert (cfg.trainer.val_check_interval, cfg.trainer.limit_val_batches) == (1000, 10)
    assert cfg.data.name == "indexed" and cfg.data.blend == ["my-gpt2_text_document"] and cfg.data.split == [949, 50, 1]
    t = cfg.data.tokenizer
    assert (t.type, t.path, t.merge_file) == ("gpt2_bpe", "gpt2-vocab.json", "gpt2-merges.txt")
    c = cfg.checkpoint
    assert (c.dir, c.every_n_steps, c.keep_last) == ("checkpoints/gpt2_345m", 10000, 0)


def test_readme_example_runs_as_a_dry_run_here(capsys):
    """``--check``: the plan, then one step of rank 0 on the fake process group and fake GPU (a
    rank that fails or does not fit would end it with status 2)."""
    assert main(["--check", "--ranks", "0", "--", *shlex.split(README_EXAMPLE)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"memory plan: model=megatron_24l_1024h, 8 ranks = tp 4 x pp 1 x dp 2", out)
    assert re.search(r"dry run: model=megatron_24l_1024h, 8 ranks = tp 4 x pp 1 x dp 2; float16", out)
    assert re.search(r"^ +0 pp0 tp0 dp0 ", out.split("dry run:")[1], re.M)  # rank 0's row


def test_llama3_8b_is_the_preset_at_megatrons_layout():
    f = _flag_values(LLAMA3_8B)
    world = int(f["--nproc-per-node"]) * int(f["--nnodes"])
    tp, pp, cp = 2, 2, 2
    dp = world // (tp * pp * cp)
    result = migrate(shlex.split(LLAMA3_8B))
    assert "model=llama3_8b" in result.overrides and "parallel=tp2_pp2" in result.overrides
    assert {"trainer.devices=8", "trainer.num_nodes=2", "precision=bf16"} <= set(result.overrides)
    cfg, d = _composed(result)
    assert (d.world_size, d.tp, d.pp, d.cp, d.dp) == (world, tp, pp, cp, dp)
    assert (d.global_batch_size, d.num_microbatches) == (128, 128 // (1 * dp))
    tc = d.transformer
    assert (tc.num_query_groups, tc.kv_channels, tc.ffn_hidden_size, tc.rope_theta) == (8, 128, 14336, 500000.0)
    assert (tc.normalization, tc.activation) == ("rmsnorm", "swiglu")
    assert (tc.tie_embeddings, tc.add_bias_linear) == (False, False)
    assert tc.sequence_parallel and cfg.optim.distributed_optimizer and tc.padded_vocab_size == 128256
    assert cfg.data.blend == [0.7, "/data/web_text_document", 0.3, "/data/code_text_document"]
    assert (cfg.optim.warmup_steps, cfg.optim.decay_steps, cfg.trainer.max_steps) == (2000, None, 100000)
    lines = classify(result.translation)
    assert [flag for flag, _ in lines.none] == ["--manual-gc", "--tp-comm-overlap"]
    assert {"--use-mcore-models", "--overlap-grad-reduce", "--overlap-param-gather", "--kv-channels 128",
            "--log-throughput"} <= {flag for flag, _ in lines.same}
    assert not lines.unknown


def _keys(command: str) -> dict:
    return translate(parse(shlex.split(command))).keys


BASE = "--num-layers 4 --hidden-size 4096 --num-attention-heads 32 --seq-length 512 --max-position-embeddings 512 " \
       "--micro-batch-size 2 --lr 1e-4 --train-iters 1000 "


@pytest.mark.parametrize("extra, key, expected", [
    # --swiglu without --ffn-hidden-size: Megatron-LM's int((4h * 2/3) / 64) * 64, not ours
    ("--swiglu", "model.ffn_hidden_size", int((4 * 4096 * 2 / 3) / 64) * 64),
    ("--group-query-attention", "model.num_query_groups", 1),  # its --num-query-groups default
    ("--num-query-groups 8", "model.num_query_groups", None),  # ignored without --group-query-attention
    ("--fp16", "precision.initial_loss_scale", 2.0 ** 32),
    ("--fp16 --initial-loss-scale 65536 --loss-scale-window 500", "precision.loss_scale_window", 500),
    ("--lr-warmup-fraction 0.01 --lr-decay-iters 800", "optim.warmup_steps", 8),  # of the decay length
    ("--lr-warmup-fraction 0.01", "optim.warmup_steps", 10),  # decay length = --train-iters
    ("--lr-warmup-iters 30", "optim.warmup_steps", 30),
    ("", "optim.warmup_steps", 0),
    ("", "optim.lr_schedule", "linear"),
    ("--lr-decay-style constant", "optim.lr_schedule", "constant"),
    ("", "data.global_batch_size", 2),  # micro x dp, dp 1 without a launcher
    ("--split '969, 30, 1'", "data.split", [969, 30, 1]),
    ("--split \"'99,1,0'\"", "data.split", [99, 1, 0]),
    ('--data-path "1.0 pathA 2.0 pathB"', "data.blend", [1.0, "pathA", 2.0, "pathB"]),
    ("--data-path 1.0 pathA 2.0 pathB", "data.blend", [1.0, "pathA", 2.0, "pathB"]),
    ("--tokenizer-type HuggingFaceTokenizer --tokenizer-model tok/", "data.tokenizer.type", "hf"),
    ("--tokenizer-type SentencePieceTokenizer --tokenizer-model t.model", "data.tokenizer.type", "sentencepiece"),
    ("--tokenizer-type Llama2Tokenizer --tokenizer-model t.model", "data.tokenizer.path", "t.model"),
    ("--tokenizer-type NullTokenizer --vocab-size 1000 --mock-data", "model.vocab_size", 1001),
    ("--apply-layernorm-1p", "model.zero_centered_gamma", True),
    # Megatron-Core's MLP: the bias-GeLU fusion (on by default, off without biases) and Transformer
    # Engine's activation compute the tanh form, the unfused local MLP the exact one;
    # --openai-gelu is read by --use-legacy-models' MLP only
    ("", "model.activation", "gelu_tanh"),
    ("--no-bias-gelu-fusion", "model.activation", "gelu"),
    ("--disable-bias-linear", "model.activation", "gelu"),
    ("--openai-gelu --no-bias-gelu-fusion", "model.activation", "gelu"),
    ("--openai-gelu --no-bias-gelu-fusion --use-legacy-models", "model.activation", "gelu_tanh"),
    ("--use-te-activation-func --no-bias-gelu-fusion", "model.activation", "gelu_tanh"),
    ("--use-te-activation-func --no-bias-gelu-fusion --transformer-impl local", "model.activation", "gelu"),
    ("--window-size 4095,0 --window-attn-skip-freq 2", "model.sliding_window", 4096),
    ("--use-rope-scaling --position-embedding-type rope", "model.rope_scaling.factor", 8.0),
    ("--add-qkv-bias --disable-bias-linear", "model.qkv_bias", True),
    ("--tensor-model-parallel-size 1 --sequence-parallel", "parallel.sequence_parallel", None),
    ("--recompute-activations", "recompute.granularity", "selective"),
    ("--distributed-timeout-minutes 30", "trainer.collective_timeout_s", 1800),
    ("--profile --profile-step-start 3 --profile-step-end 5", "trainer.profile_steps", [3, 4]),
    ("--num-experts 8 --moe-router-topk 1 --moe-router-score-function sigmoid", "model.moe.norm_topk", False),
    ("--num-experts 8 --moe-router-pre-softmax", "model.moe.norm_topk", False),
    ("--num-experts 8 --moe-layer-freq ([1]*1+[0]*1)*2", "model.moe.layer_freq", [1, 0, 1, 0]),
    ("--num-experts 8 --moe-router-enable-expert-bias", "model.moe.expert_bias_rate", 1e-3),
    ("--save ck --load other", "checkpoint.load", "other-hydra"),
    # validation every --eval-interval (1000 by default up to Megatron-LM 0.15) over --eval-iters (100) batches
    ("", "trainer.val_check_interval", 1000),
    ("", "trainer.limit_val_batches", 100),
    ("--eval-interval 50 --eval-iters 5", "trainer.limit_val_batches", 5),
    ("--eval-iters 0", "trainer.val_check_interval", None),
    ("--data-path p --split 100,0,0", "trainer.val_check_interval", None),  # no valid set: nothing to validate
])
def test_megatron_semantics(extra, key, expected):
    assert _keys(BASE + extra).get(key) == expected


def test_a_split_without_valid_share_says_there_is_no_validation():
    t = translate(parse(shlex.split(BASE + "--data-path p --split 99,0,1")))
    assert any(n.startswith("no validation: --split 99,0,1 leaves the valid split empty") for n in t.notes)


@pytest.mark.parametrize("launcher, devices, nodes", [
    ("mpirun -np 16 -N 8 -x NCCL_DEBUG=INFO python", 8, 2),  # every process, per node
    ("mpirun -n 8 python", 8, 1),  # every process alone: one node (said in a note)
    ("srun --nodes 2 --ntasks 16 python", 8, 2),
    ("torchrun --nproc-per-node 4 --nnodes 2", 4, 2),
])
def test_the_launchers_world(launcher, devices, nodes):
    cl = parse(shlex.split(launcher + " pretrain_gpt.py " + BASE))
    keys = translate(cl).keys
    assert (keys["trainer.devices"], keys["trainer.num_nodes"]) == (devices, nodes)


def test_samples_become_steps_and_pp_does_not_enter_the_default_batch():
    keys = _keys("torchrun --nproc-per-node 8 pretrain_gpt.py --num-layers 8 --hidden-size 256 "
                 "--num-attention-heads 8 --seq-length 128 --max-position-embeddings 128 --micro-batch-size 2 "
                 "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 2 --lr 1e-4 "
                 "--train-samples 10001 --lr-decay-samples 8000 --lr-warmup-samples 800")
    dp = 8 // 2
    gbs = 2 * dp  # Megatron-LM: micro x dp (ours would take micro x dp x pp)
    assert keys["data.global_batch_size"] == gbs
    assert keys["trainer.max_steps"] == 10001 // gbs  # train_samples // global batch
    assert (keys["optim.decay_steps"], keys["optim.warmup_steps"]) == (8000 // gbs, 800 // gbs)
    layers_per_virtual_stage = 2
    assert keys["parallel.virtual_pipeline_size"] == 8 // 2 // layers_per_virtual_stage
    assert keys["parallel.pipeline_schedule"] == "interleaved_1f1b"


def test_flags_without_equivalent_and_unknown_ones_are_listed():
    t = translate(parse(shlex.split(
        BASE + "--lr-decay-style WSD --rampup-batch-size 16 16 1000 --tp-comm-overlap stray --lr-decy-style cosine "
               "--cp-comm-type allgather --tokenizer-type TikTokenizer --tokenizer-model t.json")))
    lines = classify(t)
    none = dict(lines.none)
    assert set(none) == {"--lr-decay-style WSD", "--rampup-batch-size 16 16 1000", "--tp-comm-overlap",
                         "--cp-comm-type allgather", "--tokenizer-type TikTokenizer"}
    assert "constant here" in none["--rampup-batch-size 16 16 1000"]
    unknown = dict(lines.unknown)
    assert "did you mean --lr-decay-style?" in unknown["--lr-decy-style cosine"]
    assert unknown["stray"] == "a value without a flag"
    assert "optim.lr_schedule" not in t.keys and "parallel.cp_comm_type" not in t.keys


def test_every_translated_flag_lands_somewhere():
    """Each translated flag, given alone on top of a model, sets keys or says why it needs none."""
    values = {int: "2", float: "0.5", bool: None}
    strings = {"--position-embedding-type": "rope", "--normalization": "RMSNorm", "--window-size": "3,0",
               "--transformer-impl": "local", "--moe-layer-freq": "1", "--moe-router-score-function": "softmax",
               "--moe-router-load-balancing-type": "aux_loss", "--moe-token-drop-policy": "probs",
               "--fp8-format": "hybrid", "--fp8-recipe": "delayed", "--fp8-amax-compute-algo": "max",
               "--recompute-granularity": "full", "--recompute-method": "block", "--optimizer": "adam",
               "--lr-decay-style": "cosine", "--weight-decay-incr-style": "constant", "--split": "98,1,1",
               "--tokenizer-type": "GPT2BPETokenizer", "--dataloader-type": "single", "--main-grads-dtype": "fp32",
               "--main-params-dtype": "fp32", "--exp-avg-dtype": "fp32", "--exp-avg-sq-dtype": "fp32",
               "--cp-comm-type": "p2p", "--recompute-modules": "core_attn"}
    context = {"--moe-": "--num-experts 4 ", "--fp8-": "--bf16 --fp8-format hybrid ",
               "--recompute-": "--recompute-granularity full ",
               "--rope-scaling-factor": "--position-embedding-type rope --use-rope-scaling ",
               "--window-attn-skip-freq": "--window-size 3,0 ", "--profile-step": "--profile ",
               "--wandb-": "--wandb-project p ", "--save-interval": "--save ck "}
    for flag, (arity, kind) in flags.TRANSLATED.items():
        value = strings.get(flag, "x" if kind is str else values[kind]) if arity != "0" else None
        prefix = "".join(v for k, v in context.items() if flag.startswith(k) and not v.startswith(flag))
        words = shlex.split(BASE + prefix) + [flag] + ([value] if value is not None else [])
        lines = classify(translate(parse(words)))
        placed = {f.split()[0]: what for f, what in lines.translated + lines.same + lines.none}
        assert flag in placed, f"{flag} was not classified"
        assert placed[flag] != "no effect with the other flags given", f"{flag} is read by nothing"


def test_a_script_is_read_without_running_it(tmp_path):
    sentinel = tmp_path / "ran"
    script = tmp_path / "train.sh"
    script.write_text(f"""#!/bin/bash
# a Megatron-LM style launch script
GPUS_PER_NODE=4
NUM_NODES=${{NUM_NODES:-1}}
CHECKPOINT_PATH=$1
STAMP=$(touch {sentinel}; date +%s)
DTYPE="bf16"
MODEL_ARGS=(
    --num-layers 8   # depth
    --hidden-size 512
    --num-attention-heads 8
    --seq-length 256 --max-position-embeddings 256
)
TRAINING_ARGS=(--micro-batch-size 2 --global-batch-size 16 --lr 3e-4 --train-iters $((100 * 5)))
if [[ "$DTYPE" == "fp16" ]]; then
    TRAINING_ARGS+=(--fp16)
elif [ "$DTYPE" = bf16 ]; then
    TRAINING_ARGS+=("--bf16" "--split 98,1,1")
fi
if [ -f "$CHECKPOINT_PATH/latest" ]; then TRAINING_ARGS+=(--no-load-optim); fi
cat <<EOF > notes.txt
--num-layers 999
EOF
torchrun --nproc_per_node $GPUS_PER_NODE --nnodes $NUM_NODES pretrain_gpt.py \\
    "${{MODEL_ARGS[@]}}" ${{TRAINING_ARGS[@]}} \\
    --save "$CHECKPOINT_PATH" --data-path ${{DATA:-corpus_text_document}} --tensorboard-dir `hostname`
""")
    result = migrate(file=str(script))
    assert not sentinel.exists()
    assert {"trainer.devices=4", "trainer.num_nodes=1", "precision=bf16", "trainer.max_steps=500",
            "data.split=[98,1,1]", "data.blend=[corpus_text_document]", "checkpoint.dir=$CHECKPOINT_PATH",
            "model.num_layers=8"} <= set(result.overrides)
    assert "checkpoint.load_optimizer=false" not in result.overrides
    unresolved = "\n".join(result.unresolved)
    assert "$CHECKPOINT_PATH <- line 5: $1: the script's argument 1" in unresolved
    assert "$(hostname): a command substitution is not run" in unresolved
    assert "line 20: if [ -f" in unresolved and "STAMP" not in unresolved  # STAMP is never used


def test_script_arithmetic_truncates_toward_zero_as_bash():
    script = read_script("A=-7\nB=2\npython pretrain_gpt.py $((A / B)) $((A % B)) $(( (0 - 9) / 4 * 4 ))\n", "t.sh")
    assert script.argv[2:] == ["-3", "-1", "-8"]  # what bash prints for these


def test_a_value_the_overrides_lose_is_a_one_line_problem():
    result = migrate(shlex.split(BASE))
    result.translation.keys["optim.lr"] = 0.5
    assert check_composed(result.translation, result.config) == \
        "optim.lr: the translation means 0.5, but the printed overrides compose to 0.0001: add optim.lr=0.5"


@pytest.mark.parametrize("body, why", [
    ('A=x\n' + 'A="$A$A"\n' * 30, r"line 2[12]: (a word expands to more than|expansions build more than)"),
    ("A=" + "x" * 600_000 + '\nA="$A$A"\n', "line 2: a word expands to more than 1,048,576 characters"),
    ("B=0123456789\n" + 'A+="$B"\n' * 3_000, r"line \d+: expansions build more than 2 MiB"),
    ("A=1\nB=$((" + "+".join(["A"] * 200_000) + "))\n", r"line 2: a \$\(\(...\)\) of 399,999 characters"),
    ("A=1\nB=$((" + "+".join(["A"] * 4_000) + "))\n", r"line 2: \$\(\(A\+A\+.*nested too deeply"),
    ("if [ a = a ]; then\n" * 1_000 + "fi\n" * 1_000, r"line \d+: nested too deeply"),
], ids=["doubling", "long word", "appending", "long arithmetic", "deep arithmetic", "deep ifs"])
def test_a_crafted_script_costs_little_and_is_one_line(tmp_path, capsys, body, why):
    script = tmp_path / "crafted.sh"
    script.write_text(body + "python pretrain_gpt.py --num-layers 2\n")
    assert main(["--file", str(script)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {script}: ") and re.search(why, err), err


def test_model_yaml_through_output_composes_with_its_searchpath(tmp_path):
    command = BASE + "--swiglu --untie-embeddings-and-output-weights --bf16"
    result = migrate(shlex.split(command), name="mine", output=str(tmp_path))
    assert result.yaml_path == str(tmp_path / "model" / "mine.yaml") and Path(result.yaml_path).is_file()
    assert f"hydra.searchpath=[file://{tmp_path}]" in result.overrides and "model=mine" in result.overrides
    cfg = compose_config(result.overrides)
    assert (cfg.model.name, cfg.model.hidden_size, cfg.model.ffn_hidden_size, cfg.model.tie_embeddings) == \
        ("mine", 4096, int((4 * 4096 * 2 / 3) / 64) * 64, False)


def test_cli_errors_are_one_line(capsys, tmp_path):
    assert main([]) == 2
    assert main(["--num-layers", "4"]) == 2  # Megatron-LM flags before --
    assert main(["--name", "../x", "--", *shlex.split(BASE)]) == 2
    assert main(["--file", str(tmp_path / "missing.sh")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-3] == ("error: unrecognized arguments: --num-layers 4: the Megatron-LM command line goes after -- "
                       "(see --help)")
    assert err[-2].startswith("error: --name '../x'") and err[-1].startswith("error: ") and "missing.sh" in err[-1]
    (tmp_path / "empty.sh").write_text("echo hello\n")
    with pytest.raises(ConfigError, match="no training command found"):
        migrate(file=str(tmp_path / "empty.sh"))
    assert main(["--", *shlex.split(BASE.replace("--num-attention-heads 32", "--num-attention-heads 30"))]) == 2
    assert "error: the translated config is refused: model.hidden_size=4096 is not divisible" in capsys.readouterr().err
