"""Real Megatron-Core (0.16) GPT models on CPU ranks, and the checkpoints Megatron-LM saves of them.

Imports nothing of ours: this is the independent side of test_megatron_checkpoints.py. A model is
built with Megatron-Core's local layer spec (``get_gpt_layer_local_spec``) at the rank's TP x PP,
its weights spread to O(1) so that a mapping error cannot hide in near-zero logits, and saved

- as ``torch_dist``: Megatron-Core's own ``dist_checkpointing.save`` of the state dict
  Megatron-LM's ``generate_state_dict`` builds (``model``: ``model.sharded_state_dict()``,
  ``args``, ``iteration``, ``checkpoint_version``, and ``optimizer``: Megatron's optimizer's
  ``sharded_state_dict`` where one is given);
- as Megatron-LM's legacy format: ``iter_NNNNNNN/mp_rank_TT[_PPP]/model_optim_rng.pt`` holding
  ``model`` (``model.state_dict()``), ``args``, ``iteration``, ``checkpoint_version`` and
  ``rng_state``, as ``save_checkpoint`` lays it out (the PyPI package ships no Megatron-LM
  training scripts, so their layout is reproduced here).

Megatron-Core assumes CUDA in a few places that a CPU run reaches; ``cpu_workarounds`` patches
them in this process only, never in the package under test:

- ``torch.cuda.current_device`` returns ``"cpu"`` (rotary tables are moved to it);
- ``torch.cuda.synchronize`` does nothing (the checkpoint writer waits for device copies);
- a factory call asking for ``device="cuda"`` gets the CPU (the optimizer's loss-scale tensor), and
  ``Tensor.cuda()`` returns the tensor (the tied embedding's copy on the last pipeline stage);
- the CUDA RNG tracker's ``fork`` is a no-op context (dropout is 0; there is no CUDA generator);
- the writer's results queue is an in-process queue (Megatron spawns a manager process for it);
- dynamo is disabled, so Megatron's ``torch.compile``-fused GeLU runs eagerly (no compiler on a CPU
  test machine, and a cold compile would take most of the test's time);
- forwards get an explicit causal mask (Megatron builds its default one on CUDA);
- the optimizer runs without gradient clipping (its clipping asserts CUDA gradient types).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import queue
import random

import numpy as np
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

VOCAB = 100  # the real vocabulary (a NullTokenizer of 99 tokens plus its end-of-document token)
PADDED = 256  # Megatron-LM pads 100 to a multiple of 128 x tp = 256 at tp2
SEQ = 16
ITERATION = 7
TOKENS = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))


class _CpuForCuda(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "cuda" in str(kwargs.get("device", "")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        return func(*args, **kwargs)


def cpu_workarounds():
    """Apply the workarounds of the module docstring; returns the context to run Megatron in."""
    import torch._dynamo

    torch._dynamo.config.disable = True
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.tensor_parallel import random as mrandom

    filesystem_async._results_queue = queue.Queue()
    mrandom.initialize_rng_tracker(force_reset=True)
    mrandom.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    return _CpuForCuda()


FORMS = {
    # GPT-2 style: learned positions, LayerNorm, GeLU (fused with its bias: the tanh form), biases, tied.
    "gpt": dict(normalization="LayerNorm", gelu=True, groups=4, rope=False, tied=True, bias=True, qk_norm=False),
    # Llama style: RoPE, RMSNorm, SwiGLU, grouped-query attention, no biases, untied; QK-norm too.
    "llama": dict(normalization="RMSNorm", gelu=False, groups=2, rope=True, tied=False, bias=False, qk_norm=True),
}


def args_of(form: str, tp: int, pp: int, enums: bool = True) -> argparse.Namespace:
    """Megatron-LM's arguments for the model, with the names its parser gives them (core 0.16);
    ``enums``: with the Megatron-Core enum its arguments hold (importing Megatron-Core, which
    registers its classes with ``torch.load`` process-wide: only in the ranks)."""
    f = FORMS[form]
    return argparse.Namespace(
        num_layers=4, hidden_size=64, ffn_hidden_size=96 if not f["gelu"] else 256, num_attention_heads=4,
        group_query_attention=f["groups"] != 4, num_query_groups=f["groups"], kv_channels=16,
        seq_length=SEQ, max_position_embeddings=32, encoder_seq_length=SEQ,
        position_embedding_type="rope" if f["rope"] else "learned_absolute", rotary_base=50000, rotary_percent=1.0,
        rotary_interleaved=False, rotary_seq_len_interpolation_factor=None, use_rope_scaling=False,
        normalization=f["normalization"], layernorm_epsilon=1e-5, layernorm_zero_centered_gamma=False,
        swiglu=not f["gelu"], openai_gelu=False, squared_relu=False, bias_gelu_fusion=f["bias"],
        add_bias_linear=f["bias"], add_qkv_bias=f["bias"], qk_layernorm=f["qk_norm"],
        untie_embeddings_and_output_weights=not f["tied"], hidden_dropout=0.0, attention_dropout=0.0,
        init_method_std=0.02, apply_query_key_layer_scaling=False, attention_softmax_in_fp32=True,
        num_experts=None, multi_latent_attention=False, transformer_impl="local",
        attention_backend=_attn_backend() if enums else None, params_dtype=torch.float32, fp16=False, bf16=False,
        tokenizer_type="NullTokenizer", vocab_size=VOCAB - 1, make_vocab_size_divisible_by=128,
        padded_vocab_size=PADDED, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        use_distributed_optimizer=False, ckpt_format="torch_dist", consumed_train_samples=56, iteration=ITERATION,
        use_te_activation_func=False, use_legacy_models=False, add_position_embedding=True, softmax_type="vanilla",
        no_rope_freq=None, attention_output_gate=False, glu_linear_offset=0.0, activation_func_clamp_value=None,
        experimental_attention_variant=None, linear_attention_freq=None,
        # How it trains (train_step's optimizer; Megatron-LM's defaults otherwise).
        lr=1e-2, min_lr=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8, weight_decay=0.01, clip_grad=0.0,
        lr_decay_style="linear", train_iters=20, lr_decay_iters=None, lr_warmup_fraction=None, lr_warmup_iters=2,
        train_samples=None, global_batch_size=8, micro_batch_size=4,
    )


def _attn_backend():
    from megatron.core.transformer.enums import AttnBackend

    return AttnBackend.auto


def build(form: str, seed: int):
    """The form's GPTModel for this rank's stage and TP shard, weights spread to O(1)."""
    from megatron.core import parallel_state as mps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    f = FORMS[form]
    a = args_of(form, 1, 1)
    cfg = TransformerConfig(
        num_layers=a.num_layers, hidden_size=a.hidden_size, num_attention_heads=a.num_attention_heads,
        num_query_groups=a.num_query_groups, ffn_hidden_size=a.ffn_hidden_size, kv_channels=a.kv_channels,
        tensor_model_parallel_size=mps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=mps.get_pipeline_model_parallel_world_size(),
        normalization=f["normalization"], layernorm_epsilon=1e-5, gated_linear_unit=not f["gelu"],
        activation_func=torch.nn.functional.gelu if f["gelu"] else torch.nn.functional.silu,
        add_bias_linear=f["bias"], add_qkv_bias=f["bias"], qk_layernorm=f["qk_norm"],
        bias_activation_fusion=f["bias"], use_cpu_initialization=True, persist_layer_norm=False,
        gradient_accumulation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, hidden_dropout=0.0, attention_dropout=0.0, pipeline_dtype=torch.float32)
    torch.manual_seed(seed)
    model = GPTModel(cfg, get_gpt_layer_local_spec(qk_layernorm=f["qk_norm"], normalization=f["normalization"]),
                     vocab_size=PADDED, max_sequence_length=a.max_position_embeddings,
                     pre_process=mps.is_pipeline_first_stage(), post_process=mps.is_pipeline_last_stage(),
                     parallel_output=False, share_embeddings_and_output_weights=f["tied"],
                     position_embedding_type="rope" if f["rope"] else "learned_absolute", rotary_base=a.rotary_base)
    _spread(model, seed)
    return model


def _spread(model, seed: int) -> None:
    """O(1) weights: shards of a TP-split parameter differ between ranks, replicated ones agree."""
    from megatron.core import parallel_state as mps

    tp_rank = mps.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for name, p in model.named_parameters():
            sharded = getattr(p, "tensor_model_parallel", False)
            gen = torch.Generator().manual_seed(seed * 1000 + (sum(map(ord, name)) * 7 + (tp_rank if sharded else 0)))
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.2 * noise if "norm" in name else 0.3 * noise)
    if getattr(model, "share_embeddings_and_output_weights", False) and dist.get_world_size() > 1:
        if mps.get_pipeline_model_parallel_world_size() > 1:  # the last stage's copy, from the first's
            weight = model.shared_embedding_or_output_weight()
            if not mps.is_pipeline_first_stage():
                weight.data.zero_()
            dist.all_reduce(weight.data, group=mps.get_embedding_group())


def _tp() -> int:
    from megatron.core import parallel_state as mps

    return mps.get_tensor_model_parallel_world_size()


def _mask():
    return torch.triu(torch.ones(SEQ, SEQ), 1).bool()[None, None]


@torch.no_grad()
def logits(model):
    """Full logits [batch, seq, padded vocab] on the last stage (None elsewhere): stage 0 sends its
    hidden states to stage 1 (two stages at most)."""
    from megatron.core import parallel_state as mps

    model.eval()
    positions = torch.arange(SEQ).expand(TOKENS.shape[0], SEQ)
    if mps.get_pipeline_model_parallel_world_size() == 1:
        return model(TOKENS, positions, _mask())
    if mps.is_pipeline_first_stage():
        hidden = model(TOKENS, positions, _mask())
        dist.send(hidden.contiguous(), dst=mps.get_pipeline_model_parallel_next_rank())
        return None
    hidden = torch.empty(SEQ, TOKENS.shape[0], model.config.hidden_size)
    dist.recv(hidden, src=mps.get_pipeline_model_parallel_prev_rank())
    model.set_input_tensor(hidden)
    return model(TOKENS, positions, _mask())


def train_step(model):
    """One AdamW step of Megatron's own optimizer (plain, fp32) on the tokens; returns it."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=0.0), [ddp])
    positions = torch.arange(SEQ).expand(TOKENS.shape[0], SEQ)
    out = ddp(TOKENS, positions, _mask())
    (out.float().square().mean()).backward()
    ddp.finish_grad_sync()
    optimizer.step()
    return optimizer


def moments(model, optimizer) -> dict:
    """{Megatron parameter name: (exp_avg, exp_avg_sq, TP partition dim or None)} of this rank."""
    state = optimizer.chained_optimizers[0].optimizer.state if hasattr(optimizer, "chained_optimizers") \
        else optimizer.optimizer.state
    out = {}
    for name, p in model.named_parameters():
        s = state[p]
        dim = p.partition_dim if getattr(p, "tensor_model_parallel", False) else None
        out[name] = (s["exp_avg"].clone(), s["exp_avg_sq"].clone(), dim, float(s["step"]))
    return out


def save_dist(model, form: str, root: str, optimizer=None, per_layer: bool = False) -> None:
    """Megatron-LM's torch_dist save of the model (and optimizer) into ``root``/iter_NNNNNNN; with
    ``per_layer`` each layer's tensors apart (Megatron-Core's ``non_homogeneous_layers``)."""
    from megatron.core import dist_checkpointing, parallel_state as mps
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    directory = os.path.join(root, f"iter_{ITERATION:07d}")
    if dist.get_rank() == 0:
        os.makedirs(directory, exist_ok=True)
    dist.barrier()
    sd = {"args": args_of(form, _tp(), mps.get_pipeline_model_parallel_world_size()),
          "iteration": ITERATION, "checkpoint_version": 3.0,
          "model": model.sharded_state_dict(metadata={"non_homogeneous_layers": per_layer})}
    if optimizer is not None:
        sd["optimizer"] = optimizer.sharded_state_dict(sd["model"])
    dist_checkpointing.save(sd, directory, TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1))
    if dist.get_rank() == 0:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(ITERATION))
    dist.barrier()


def save_legacy(model, form: str, root: str) -> None:
    """Megatron-LM's legacy save: one file per tensor and pipeline rank."""
    from megatron.core import parallel_state as mps

    tp, pp = _tp(), mps.get_pipeline_model_parallel_world_size()
    t, p = mps.get_tensor_model_parallel_rank(), mps.get_pipeline_model_parallel_rank()
    name = f"mp_rank_{t:02d}" if pp == 1 else f"mp_rank_{t:02d}_{p:03d}"
    directory = os.path.join(root, f"iter_{ITERATION:07d}", name)
    os.makedirs(directory, exist_ok=True)
    rng = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
           "torch_rng_state": torch.get_rng_state(), "rng_tracker_states": {}}
    torch.save({"args": args_of(form, tp, pp), "checkpoint_version": 3.0, "iteration": ITERATION,
                "model": model.state_dict(), "rng_state": [rng]}, os.path.join(directory, "model_optim_rng.pt"))
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(ITERATION))


def load_dist(model, root: str) -> None:
    """Megatron-Core's own load into ``model`` of the iteration ``root``/latest_checkpointed_iteration.txt names."""
    from megatron.core import dist_checkpointing

    with open(os.path.join(root, "latest_checkpointed_iteration.txt")) as f:
        directory = os.path.join(root, f"iter_{int(f.read()):07d}")
    state = dist_checkpointing.load({"model": model.sharded_state_dict()}, directory)
    model.load_state_dict(state["model"])


def set_layout(tp: int, pp: int) -> None:
    from megatron.core import parallel_state as mps

    mps.destroy_model_parallel()
    mps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
