"""Typed schema of a run: the single source of config names, types and defaults.

The dataclasses are registered in Hydra's ConfigStore (``register_configs``) so that the YAML files
under ``conf/`` only set values: a misspelled key or a wrong type fails when Hydra composes the
config, before anything else runs. Values left ``None`` are derived in ``config.derive``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional, Union

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


def one_of(*allowed: Optional[str]) -> Any:
    """A key that takes only these values, the first its default. The choices stand beside the
    key they belong to, and ``config.derive`` checks every such key against them."""
    return field(default=allowed[0], metadata={"choices": allowed})


@dataclass
class MoEConfig:
    """Mixture of Experts (docs/moe.md): the MLP of the chosen layers becomes ``num_experts``
    expert MLPs, ``top_k`` of which each token goes through (GPT family)."""

    num_experts: int = 8
    top_k: int = 2
    # Each expert's hidden size; None -> model.ffn_hidden_size.
    ffn_hidden_size: Optional[int] = None
    # Which layers are MoE: an int n -> layers 0, n, 2n, ... (1: every layer); or one 0/1 per layer.
    layer_freq: Any = 1
    router: str = one_of("softmax", "sigmoid")  # softmax (GShard, Mixtral) | sigmoid (DeepSeek-V3)
    norm_topk: bool = True  # the k routing weights renormalised to sum 1
    aux_loss_coeff: float = 0.0  # load-balancing loss (Switch/GShard)
    z_loss_coeff: float = 0.0  # router z-loss (ST-MoE)
    # Auxiliary-loss-free balancing (DeepSeek-V3): the selection bias moves this much per step.
    expert_bias_rate: float = 0.0
    # None: dropless. Else each expert takes at most ceil(factor x tokens x top_k / num_experts).
    capacity_factor: Optional[float] = None
    shared_ffn_hidden_size: int = 0  # a shared expert every token goes through (0: none)


@dataclass
class RopeScalingConfig:
    """``model.rope_scaling`` (docs/models.md): RoPE's frequencies stretched for a context longer
    than the one the model was first trained at. llama3 (Llama 3.1+): wavelengths above
    original_max_position_embeddings / low_freq_factor divided by factor, those below
    original / high_freq_factor kept, a smooth blend between. linear: every position divided by
    factor. yarn (Peng et al. 2023): frequencies blended between kept and divided by a ramp over
    beta_fast..beta_slow rotations, the attention logits scaled by attention_factor (None:
    0.1 ln(factor) + 1)."""

    type: str = one_of("llama3", "linear", "yarn")
    factor: float = 8.0
    original_max_position_embeddings: int = 8192  # llama3, yarn
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: Optional[float] = None  # yarn
    truncate: bool = True  # yarn: the ramp's bounds rounded to whole dimensions (false: gpt-oss)


@dataclass
class ModelConfig:
    """Shape and flavour of the network. Published shapes live in ``conf/model/*.yaml``."""

    # A preset's name; from_checkpoint: the model checkpoint.load holds (checkpoint/model_source.py).
    name: str = "gpt_tiny"
    arch: str = one_of("gpt", "bert", "t5")  # docs/models.md
    num_layers: int = 4
    hidden_size: int = 256
    num_attention_heads: int = 8
    # None -> num_attention_heads (plain multi-head attention); fewer -> grouped-query attention.
    num_query_groups: Optional[int] = None
    # None -> 4 * hidden (gelu) or Llama's 8/3 * hidden rounded up to a multiple of 256 (swiglu).
    ffn_hidden_size: Optional[int] = None
    # None -> hidden_size / num_attention_heads.
    kv_channels: Optional[int] = None
    seq_length: int = 256
    # None -> seq_length (only used by learned absolute positions).
    max_position_embeddings: Optional[int] = None
    vocab_size: int = 8192
    make_vocab_size_divisible_by: int = 128
    position_embedding: str = one_of("learned", "rope", "relative")  # relative: T5's buckets
    rope_theta: float = 10000.0
    # RoPE scaling for long context (RopeScalingConfig; Llama 3.1+, Qwen with yarn); null: none.
    rope_scaling: Optional[RopeScalingConfig] = None
    # The sliding-window layers' own RoPE base, without rope_scaling (Gemma 3's local layers);
    # null: they rotate like every other layer.
    local_rope_theta: Optional[float] = None
    normalization: str = one_of("layernorm", "rmsnorm")
    norm_eps: float = 1e-5
    # Norm weights stored as w with scale (1 + w) (Gemma; TE's zero_centered_gamma).
    zero_centered_gamma: bool = False
    # A norm on each sub-layer's output before the residual add too (Gemma 2/3's post-attention
    # and post-feedforward norms): x + norm_out(f(norm_in(x))).
    post_sublayer_norm: bool = False
    # Word embeddings multiplied by sqrt(hidden_size) (Gemma).
    scale_embeddings: bool = False
    # gelu (exact) | gelu_tanh (GPT-2) | swiglu (Llama) | relu (T5) | geglu (T5 v1.1)
    activation: str = one_of("gelu", "gelu_tanh", "swiglu", "relu", "geglu")
    add_bias_linear: bool = True
    # Bias on the QKV projection; null -> add_bias_linear (Qwen2: true with add_bias_linear false).
    qkv_bias: Optional[bool] = None
    # RMSNorm over each head's query and key before RoPE (Qwen3, Gemma 3).
    qk_norm: bool = False
    # Attention scores scaled by 1/sqrt(query_pre_attn_scalar); null: 1/sqrt(kv_channels) (Gemma 2/3).
    query_pre_attn_scalar: Optional[float] = None
    # Sliding-window attention (Mistral, Gemma 2/3): a query sees itself and the window-1 tokens
    # before it. null: every layer attends to the whole causal prefix.
    sliding_window: Optional[int] = None
    # Which layers use the window: an int n -> all but every n-th (layers n-1, 2n-1, ... are global;
    # 1: every layer, Mistral; 2: Gemma 2; 6: Gemma 3); or one 0/1 per layer (1: windowed).
    sliding_window_pattern: Any = 1
    # tanh soft-capping, cap * tanh(x / cap), of attention scores and final logits (Gemma 2); null: none.
    attn_logit_softcapping: Optional[float] = None
    final_logit_softcapping: Optional[float] = None
    tie_embeddings: bool = True
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    init_std: float = 0.02
    # BERT: the sentence-order prediction head (pooler + 2-way classifier on [CLS]).
    binary_head: bool = False
    # T5: decoder depth (None -> num_layers), decoder length (None -> seq_length), position buckets.
    num_decoder_layers: Optional[int] = None
    decoder_seq_length: Optional[int] = None
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    # The layers Transformer blocks run on (Megatron-Core's switch; docs/gpu.md): local (plain
    # torch, any device) | transformer_engine (NVIDIA Transformer Engine: GPU, GPT family).
    transformer_impl: str = one_of("local", "transformer_engine")
    # Mixture of Experts (MoEConfig); null: every MLP is dense.
    moe: Optional[MoEConfig] = None


@dataclass
class ParallelConfig:
    """Parallel degrees. The data-parallel degree is never set: it is world / (tp * pp * cp)."""

    name: str = "single"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # Context parallelism (docs/parallelism.md): every sequence is split over this many ranks,
    # each holding chunks i and 2 cp - 1 - i (the causal load balanced); GPT family.
    context_parallel_size: int = 1
    # How attention exchanges keys and values across them: p2p (ring passing, overlapped with the
    # block computation) | a2a (Ulysses: all-to-all from sequence to heads; heads / tp divisible by cp).
    cp_comm_type: str = one_of("p2p", "a2a")
    # Expert parallelism (model.moe): each MoE layer's experts split over this many data-parallel
    # ranks (a factor of dp), tokens dispatched to them by all-to-all.
    expert_parallel_size: int = 1
    # The experts' tensor parallelism: null (= tensor_parallel_size: each expert split like the
    # dense MLP) or 1 (whole experts; each TP rank routes its own tokens, and expert_parallel_size
    # may then divide dp x tp instead of dp).
    expert_tensor_parallel_size: Optional[int] = None
    virtual_pipeline_size: Optional[int] = None
    sequence_parallel: bool = False
    pipeline_schedule: str = one_of("1f1b", "interleaved_1f1b", "zero_bubble", "zbv")
    # None -> layers split evenly over pp * vpp stages; else one entry per stage, summing to num_layers.
    layers_per_stage: Optional[List[int]] = None
    # Bucket size (in elements) of the data-parallel gradient all-reduce.
    grad_bucket_size: int = 40_000_000
    # How data-parallel ranks share the model (docs/parallelism.md): ddp (Megatron's: every rank
    # holds the whole model, gradients all-reduced in buckets; with optim.distributed_optimizer the
    # main weights and Adam state are sharded, ZeRO-1) | fsdp (torch's FSDP2: parameters, gradients
    # and Adam state all sharded over dp x cp, each transformer block all-gathered while it runs;
    # GPT family; with pipeline parallelism the 1f1b schedule without virtual stages).
    data_parallel: str = one_of("ddp", "fsdp")
    # Megatron's overlap_grad_reduce (docs/parallelism.md): each gradient bucket's all-reduce
    # (reduce-scatter with the distributed optimizer) starts as soon as every gradient in it is final,
    # per pipeline stage and virtual chunk, behind the backward still running; false: every bucket
    # is reduced after the whole backward. FSDP (data_parallel=fsdp) reduce-scatters by its own
    # schedule either way.
    overlap_grad_reduce: bool = True
    # Megatron's overlap_param_gather: with the distributed optimizer, the updated parameters are
    # all-gathered bucket by bucket in the order the next forward reads them, each module waiting only
    # for its own buckets; false: all gathered before the next forward starts.
    overlap_param_gather: bool = True
    # Tensor-parallel communication overlap (needs sequence_parallel): the all-gather before a
    # column-parallel matmul and the reduce-scatter after a row-parallel one run as ring steps, each
    # overlapped with the partial matmul of the chunk already there (a collective matmul); exact.
    tp_comm_overlap: bool = False


@dataclass
class FP8Config:
    """Transformer Engine's FP8 recipe (docs/gpu.md). recipe: delayed (scales from the amax
    history of past steps, TE's DelayedScaling) | current (from each tensor's own amax,
    Float8CurrentScaling). format: hybrid (E4M3 forward, E5M2 gradients) | e4m3 (both). The rest
    apply to delayed scaling: the history's length, how the amax is taken from it (max |
    most_recent), and margin (scale = FP8_MAX / amax / 2^margin)."""

    recipe: str = one_of("delayed", "current")
    format: str = one_of("hybrid", "e4m3")
    amax_history_len: int = 1024
    amax_compute_algo: str = one_of("max", "most_recent")
    margin: int = 0


@dataclass
class PrecisionConfig:
    name: str = "fp32"
    # Dtype of model weights and activations: float32, bfloat16 or float16 (the latter two keep fp32
    # main weights in the optimizer and reduce grads in fp32); float64 exists so that numerics
    # tests can compare layouts at 1e-9. auto (precision=auto, the default preset): bfloat16 when
    # trainer.accelerator is gpu, else float32 (config/machine.py).
    params_dtype: str = one_of("float32", "bfloat16", "float16", "float64")
    # TF32 tensor cores for float32 matmuls and convolutions on GPU (Ampere and later): 10-bit
    # mantissa inputs, fp32 accumulation. Applied by each GPU worker; no effect on CPU.
    tf32: bool = True
    # FP8 matmuls through Transformer Engine's recipes (precision=fp8; needs
    # model.transformer_impl=transformer_engine); null: none.
    fp8: Optional[FP8Config] = None
    # Dynamic loss scaling, used with float16 only: start at initial_loss_scale; halve it (never
    # below min_loss_scale) after ``hysteresis`` overflowing steps; double it after
    # loss_scale_window steps without overflow, which also resets the hysteresis count.
    initial_loss_scale: float = 65536.0
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2


@dataclass
class RecomputeConfig:
    """Activation recomputation (Korthikanti et al. 2022)."""

    # null: keep all activations; full: keep only each recomputed layer's input; selective: keep all
    # but core attention (softmax(QK^T)V), which is recomputed in backward.
    granularity: Optional[str] = one_of(None, "full", "selective")
    # full only. uniform: checkpoint layers in chunks of num_layers; block: checkpoint the first
    # num_layers layers of each pipeline stage, keep the rest.
    method: str = one_of("uniform", "block")
    num_layers: int = 1


@dataclass
class TokenizerConfig:
    # byte: raw UTF-8 bytes (no file); hf: a tokenizers tokenizer.json; sentencepiece: a .model file;
    # bpe: a byte-level BPE trained on the corpus with vocab_size entries, saved next to the data;
    # gpt2_bpe: GPT-2's vocab.json + merges.txt (path: their folder, or the vocab.json with
    # merge_file); tiktoken: a tiktoken rank file such as Llama 3's tokenizer.model.
    type: str = one_of("byte", "hf", "sentencepiece", "bpe", "gpt2_bpe", "tiktoken")
    path: Optional[str] = None
    vocab_size: Optional[int] = None
    merge_file: Optional[str] = None  # gpt2_bpe: merges.txt when not beside path (Megatron's --merge-file)


# Data of several documents per sample, each with its own positions and attention (data=sft's
# conversations, data=preference's answers): models read position_ids and document_ids.
PACKED_DOCUMENT_DATA = ("sft", "preference")


@dataclass
class DataConfig:
    # indexed_bert, indexed_t5: indexed data as BERT / T5 samples (their presets)
    # preference: DPO pairs (prompt, chosen, rejected) from a jsonl file (data/preference_dataset.py)
    name: str = one_of("synthetic", "demo", "indexed", "indexed_bert", "indexed_t5", "sft", "preference")
    micro_batch_size: int = 4
    # Samples per optimizer step, over all data-parallel ranks. null -> micro_batch_size x dp x pp:
    # one micro-batch per data-parallel rank and pipeline stage, the smallest batch every pipeline
    # schedule accepts (config/derive.py); set it for throughput (more micro-batches, smaller bubble).
    global_batch_size: Optional[int] = None
    # indexed: [prefix] or [weight, prefix, weight, prefix, ...] of Megatron .bin/.idx pairs.
    blend: Optional[List[Any]] = None
    # Train/valid/test proportions, split by documents: "969,30,1" in YAML; on the command line
    # data.split=[969,30,1] or "data.split='969,30,1'" (a bare a,b,c would be a Hydra sweep).
    split: Any = "969,30,1"
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    # Where index arrays and the demo corpus are cached; None -> next to the data (demo: ~/.cache).
    cache_dir: Optional[str] = None
    # DataLoader worker processes per rank. auto (the data presets): 0 on CPU (a sample is a
    # memory-mapped slice, and workers would take cores from the ranks' compute threads), 2 on GPU
    # (the next batches are read and pinned while the GPU computes).
    num_workers: Union[int, str] = 0
    # The data order's seed: an integer in [0, 2**32), numpy's range (config/ranges.py).
    seed: int = 1234
    # BERT and T5 samples (model.arch=bert|t5; docs/models.md): the fraction of tokens masked
    # (T5: the noise density), the chance of a shorter sample, whole-word masking (BERT), and
    # T5's mean noise-span length.
    masked_lm_prob: float = 0.15
    short_seq_prob: float = 0.1
    whole_word_masking: bool = False
    mean_noise_span_length: float = 3.0
    # sft / preference: the jsonl file of conversations (or preference pairs), and whether samples
    # are packed into model.seq_length (data/sft_dataset.py, docs/data.md).
    path: Optional[str] = None
    packing: bool = True
    # Documents inside a GPT sample, from its EOD tokens (Megatron-LM's options; docs/data.md):
    # no loss where the input token is EOD; positions restarting at 0 after each EOD; attention
    # within each document only (block-diagonal causal). demo and indexed data, GPT family.
    eod_mask_loss: bool = False
    reset_position_ids: bool = False
    reset_attention_mask: bool = False


@dataclass
class PeftConfig:
    """Parameter-efficient fine-tuning (``conf/peft``, docs/finetuning.md): ``none`` trains every
    weight; ``lora`` freezes the model and trains low-rank adapters beside chosen linear layers
    (Hu et al. 2021), initialised as the ``peft`` library does (A Kaiming-uniform, B zero)."""

    name: str = one_of("none", "lora")
    rank: int = 16
    alpha: float = 32.0  # the adapter's output is scaled by alpha / rank (alpha / sqrt(rank): rslora)
    dropout: float = 0.0  # on the adapter's input
    # Our layers' names (docs/finetuning.md): qkv (q, k and v each get their own adapter), proj,
    # and the dense MLP's fc1, gate (gated activations) and fc2. null: every one the model has.
    target_modules: Optional[List[str]] = None
    rslora: bool = False  # rank-stabilised scaling (Kalajdzievski 2023)
    # An adapter checkpoint (of a run with peft=lora) to start from, on the base of checkpoint.load.
    adapter: Optional[str] = None


@dataclass
class ObjectiveConfig:
    """What a training step minimises (``conf/objective``): ``lm``, the next-token loss of the data
    (pre-training, SFT); ``dpo``, Direct Preference Optimization (Rafailov et al. 2023) on
    ``data=preference``: -log sigmoid(beta * ((log pi(c) - log ref(c)) - (log pi(r) - log ref(r)))),
    with label smoothing (conservative DPO). The reference is the starting model: the frozen base
    with the adapters off under ``peft=lora``, else a frozen copy sharded as the policy."""

    name: str = one_of("lm", "dpo")
    beta: float = 0.1
    label_smoothing: float = 0.0  # the assumed chance that a pair's preference is flipped, in [0, 0.5)


@dataclass
class OptimConfig:
    # adamw | muon (docs/muon.md: Muon for the blocks' hidden matrices, AdamW for the rest).
    name: str = one_of("adamw", "muon")
    # optim=muon: Muon's lr for the hidden matrices (AdamW's is muon_adam_lr).
    lr: float = 1e-3
    min_lr: float = 1e-4
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0  # 0 disables clipping
    warmup_steps: int = 10
    # None -> trainer.max_steps.
    decay_steps: Optional[int] = None
    lr_schedule: str = one_of("cosine", "linear", "constant")
    # ZeRO-1 as Megatron's: fp32 main weights and Adam state sharded over data-parallel ranks.
    distributed_optimizer: bool = False
    # The AdamW kernel (docs/gpu.md): auto (torch's fused AdamW on CUDA; on CPU the faster of
    # fused and foreach, as measured) | fused | foreach (torch.optim.AdamW's) | apex (NVIDIA
    # apex's FusedAdam in AdamW mode).
    impl: str = one_of("auto", "fused", "foreach", "apex")
    # optim=muon only (docs/muon.md). Momentum coefficient of Muon's buffer, Nesterov's form of it,
    # Newton-Schulz iterations, and whether a fused QKV weight's q, k and v of each query group
    # are orthogonalised apart rather than as one matrix.
    muon_momentum: float = 0.95
    muon_nesterov: bool = True
    muon_ns_steps: int = 5
    muon_split_qkv: bool = False
    # AdamW's lr for the parameters Muon does not step (embeddings, output, norms, biases,
    # routers), following the same schedule; None -> optim.lr.
    muon_adam_lr: Optional[float] = None


@dataclass
class WandbConfig:
    """The W&B run of ``trainer.logger=[...,wandb]`` (docs/observability.md). Offline with
    ``WANDB_MODE=offline`` (nothing leaves the machine; ``wandb sync`` uploads it later)."""

    project: str = "megatron-hydra"
    # None -> the last two parts of the run dir (outputs/<date>/<time> -> <date>/<time>; a sweep's
    # job <sweep>/<n> -> <time>/<n>).
    name: Optional[str] = None
    # None -> the run dir's parent directory name (the jobs of one sweep share it).
    group: Optional[str] = None
    # Where wandb writes its files; None -> the run dir (<run_dir>/wandb/).
    dir: Optional[str] = None
    tags: List[str] = field(default_factory=list)
    # online | offline | disabled; None -> the WANDB_MODE environment variable, else online.
    mode: Optional[str] = None


@dataclass
class SamplingConfig:
    """How the next token is chosen (generation, lm-eval's generate_until, the end-of-run sample)."""

    greedy: bool = False  # always the most likely token
    temperature: float = 1.0  # the logits divided by this before sampling
    top_k: int = 0  # sample among the k most likely tokens (0: all)
    top_p: float = 1.0  # ... among the fewest tokens whose probability reaches p (nucleus)


@dataclass
class EvalConfig:
    """lm-evaluation-harness tasks (docs/evaluation.md): during training (``trainer.eval``) and for
    ``python -m megatron_hydra.evaluate``, on the job's own layout."""

    # lm-eval task names, or paths of local task YAML files (a task over local data needs no network).
    tasks: List[str] = field(default_factory=list)
    every_n_steps: int = 0  # during training: evaluate every n optimizer steps (0: never)
    limit: Optional[int] = None  # examples per task (null: all)
    num_fewshot: Optional[int] = None  # null: each task's own
    batch_size: int = 8  # requests per forward pass (per data-parallel rank)
    # Where lm-eval's results JSON goes; null: <run_dir>/eval.
    output: Optional[str] = None


@dataclass
class GenerationConfig:
    """``mode=generate`` (``python -m megatron_hydra.generate``): text from the loaded checkpoint."""

    prompts: List[str] = field(default_factory=lambda: [""])  # "" starts from end-of-document
    max_new_tokens: int = 64  # per prompt; a prompt stops earlier at end-of-document
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    seed: int = 1234  # prompt i samples from its own generator seeded with seed + i (layout-free)
    use_cache: bool = True  # false recomputes the whole sequence for every token
    batch_size: int = 8  # prompts generated together (per data-parallel rank)


@dataclass
class TrainerConfig:
    name: str = "cpu"
    # auto (trainer=auto, the default preset) is resolved before derive (config/machine.py): gpu
    # when CUDA devices are visible, else cpu.
    accelerator: str = one_of("cpu", "gpu")
    # Ranks per node (one per GPU on GPU), or auto: the ranks an external launcher (torchrun,
    # srun) started on this node; else every visible GPU on GPU; else, on CPU, the fewest ranks
    # the layout needs (tp x pp x cp). Resolved by config/machine.py before derive.
    devices: Union[int, str] = 1
    num_nodes: int = 1
    max_steps: int = 100
    log_every_n_steps: int = 1
    enable_progress_bar: bool = True
    # Threads per rank on CPU; None -> OMP_NUM_THREADS where set, else the machine's cores divided
    # by the local ranks.
    num_threads: Optional[int] = None
    # Run validation every this many steps (0 disables it) over limit_val_batches global batches.
    val_check_interval: int = 0
    limit_val_batches: int = 10
    # Seconds a collective may wait before the run is declared hung and stopped.
    collective_timeout_s: int = 600
    # Memory of one device in GiB, for the memory plan; None -> read from the device (GPU) or the
    # machine's RAM divided by the local ranks (CPU).
    device_memory_gb: Optional[float] = None
    # TFLOP/s per rank that the logged mfu is taken against; None -> the dense bf16 datasheet peak
    # of a known GPU (conf/cluster/*.yaml), or on CPU a matmul rate measured at start-up
    # (planning/peak.py). Set it for a GPU that table lacks, or to skip the CPU measurement.
    peak_tflops: Optional[float] = None
    # When training ends, rank 0 prints a sample of this many tokens from the trained GPT (real
    # text data, at any layout the inference engine runs: not with context parallelism, virtual
    # pipeline stages or FSDP; 0 disables it).
    generate_sample_tokens: int = 48
    # lm-evaluation-harness tasks evaluated during training (EvalConfig); logged as eval/<task>/<metric>.
    eval: EvalConfig = field(default_factory=EvalConfig)
    # Where rank 0's metrics go: any of tensorboard, csv, wandb (pip install '.[wandb]').
    logger: List[str] = field(default_factory=lambda: ["tensorboard", "csv"])
    wandb: WandbConfig = field(default_factory=WandbConfig)
    # [first, last]: torch.profiler records these steps (0-based, both included, the `step` of
    # csv/metrics.csv) on every rank into <run_dir>/profile/rank<r>.json; null: no profiling.
    profile_steps: Optional[List[int]] = None
    # torch.compile of each transformer block (regional compilation, as torchtitan does: one
    # compiled graph reused by every layer of a shape), with full recompute, pipeline, tensor/sequence
    # and context parallelism (not with selective recompute, MoE, BERT/T5 or Transformer Engine
    # layers); training only, evaluation and generation run eagerly; off by default
    # (docs/performance.md).
    compile: bool = False
    # What torch.compile lowers each block with: inductor (generated kernels), aot_eager (traces
    # and partitions the graph, runs torch's own kernels: no code generation), eager (tracing only).
    compile_backend: str = one_of("inductor", "aot_eager", "eager")


@dataclass
class CheckpointConfig:
    """Sharded, layout-free checkpoints (``megatron_hydra.checkpoint``)."""

    name: str = "default"
    # Directory holding step_NNNNNNN checkpoints; None -> <run_dir>/checkpoints.
    dir: Optional[str] = None
    # Save every this many optimizer steps (0: only at the end and on SIGTERM/SIGUSR1).
    every_n_steps: int = 0
    # Save when training ends (max_steps reached).
    save_last: bool = True
    # Keep the newest this many complete checkpoints in ``dir`` (0 keeps all).
    keep_last: int = 2
    # auto: continue from the newest complete checkpoint in ``dir`` if there is one; none: never (a
    # new run: refused while ``dir`` holds checkpoints, docs/checkpoints.md).
    resume: str = one_of("auto", "none")
    # Start from this checkpoint (any layout) when ``resume`` finds none.
    load: Optional[str] = None
    # false: load the model only, with fresh optimizer state (e.g. from a weights-only checkpoint).
    load_optimizer: bool = True
    # Inside a SLURM job, SIGUSR1/SIGUSR2 (time limit near) save a checkpoint and then requeue the
    # job (scontrol requeue); the requeued job resumes from it. false: save and stop only.
    requeue_on_signal: bool = True
    # true: a save blocks training only while the state is copied to host memory (pinned buffers on
    # a GPU); a background thread writes it, on a gloo process group of its own. At most one save
    # is in flight; the next save, the end of training and a stop signal's save wait for it, and
    # its failure is raised there. false: training waits for the whole write.
    async_save: bool = True


@dataclass
class ClusterConfig:
    """A GPU cluster as the layout planner (``mode=plan_layouts``) sees it: ``conf/cluster/*.yaml``.
    Bandwidths are per GPU and per direction, as vendors quote link rates (GB/s = 1e9 bytes/s)."""

    name: str = "a100_80g_x1024"
    gpu: str = "A100-SXM4-80GB"
    # Dense (not sparse) bf16/fp16 tensor-core peak, TFLOP/s.
    peak_tflops: float = 312.0
    memory_gb: float = 80.0
    # HBM bandwidth, GB/s: the speed of the memory-bound (elementwise, softmax) kernels.
    hbm_gb_per_s: float = 2039.0
    gpus_per_node: int = 8
    num_nodes: int = 128
    # NVLink through NVSwitch, within a node.
    nvlink_gb_per_s: float = 300.0
    # InfiniBand between nodes, one adapter per GPU.
    ib_gb_per_s: float = 25.0


@dataclass
class DryRunConfig:
    """``mode=dry_run`` (``megatron_hydra.training.dry_run``)."""

    # Global ranks to simulate; null -> every distinct rank position (first/middle/last pipeline
    # stage x first/last tensor-parallel rank, plus the last data-parallel rank with the
    # distributed optimizer).
    ranks: Optional[List[int]] = None


@dataclass
class VerifyConfig:
    """``mode=verify`` (``megatron_hydra.verify``, docs/verify.md)."""

    # Optimizer steps the shrunk job trains, at its layout and in one process, before comparing.
    steps: int = 3
    # Largest relative difference of losses, grad norms and final weights that passes.
    tolerance: float = 1e-9
    # Ranks the exactness run may start on this machine; beyond it data parallelism is reduced
    # first, never tensor, pipeline, context or expert parallelism.
    max_ranks: int = 8
    # Also write the verdict as JSON to this file (launch.py's --json writes it to stdout).
    output: Optional[str] = None
    # The checks to run: exact (the shrunk job at its layout against one process), fits (the
    # full-size dry run against a GPU's memory), resume (step K resumed at another layout).
    checks: List[str] = field(default_factory=lambda: ["exact", "fits", "resume"])


@dataclass
class RunConfig:
    """The whole composed config (``conf/config.yaml``)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    # The cluster the layout planner plans for (mode=plan_layouts); null when not planning.
    cluster: Optional[ClusterConfig] = None
    # train | plan (print the per-rank memory plan, no training) | plan_layouts (rank parallel layouts
    # for the cluster given by cluster=..., no training) | dry_run (one real step of chosen ranks of
    # the job on a CPU: fake process group, fake GPU tensors; docs/dry_run.md)
    # | generate (text from checkpoint.load at this layout: ``generation``) | evaluate (lm-eval tasks
    # ``trainer.eval`` on checkpoint.load at this layout)
    # | verify (the job shrunk and trained in float64 at its layout against one process, its
    # full-size dry run against the device's memory, and a resume at another layout; docs/verify.md)
    mode: str = one_of("train", "plan", "plan_layouts", "dry_run", "generate", "evaluate", "verify")
    dry_run: DryRunConfig = field(default_factory=DryRunConfig)
    verify: VerifyConfig = field(default_factory=VerifyConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    # Weights, dropout and every other random stream: an integer in [0, 2**32) (numpy's and
    # Lightning's range), less 100 per pipeline stage after the first (each stage seeds with
    # seed + 100 x stage; config/ranges.py).
    seed: int = 1234
    # Filled by Hydra (interpolated from ${hydra:...}) so that workers know where to write.
    run_dir: str = MISSING


def register_configs() -> None:
    """Register the schema; ``conf/config.yaml`` lists it first in its defaults, so every group
    file merges into a typed node and an unknown key or a wrong type fails at compose time."""
    ConfigStore.instance().store(name="run_schema", node=RunConfig)
