"""Megatron-LM's ``pretrain_gpt.py`` flags as this tool knows them: how each is read, its default,
and what becomes of it here.

Three kinds. ``TRANSLATED`` flags feed config keys (``translate`` holds the semantics). ``SAME``
flags need no key: what they select is what runs here anyway, or ``pretrain_gpt.py`` ignores
them. ``NO_EQUIVALENT`` flags select something this project does not do; each says what, so that
a user sees what changes. A flag in none of them is unknown: misspelled, or newer than this
table. Defaults are Megatron-LM's as of Megatron-Core 0.16, the version whose checkpoints
``convert from_megatron`` reads; where they differ from ours, the translation writes them out.
"""

from __future__ import annotations

from typing import Dict, Tuple

# flag -> (arity, type): arity "0" a switch, "1" one value, "*" the values up to the next flag
TRANSLATED: Dict[str, Tuple[str, type]] = {}
# flag -> (arity, why)
SAME: Dict[str, Tuple[str, str]] = {}
NO_EQUIVALENT: Dict[str, Tuple[str, str]] = {}


def _translated(arity: str, kind: type, *names: str) -> None:
    TRANSLATED.update({name: (arity, kind) for name in names})


def _same(arity: str, why: str, *names: str) -> None:
    SAME.update({name: (arity, why) for name in names})


def _none(arity: str, why: str, *names: str) -> None:
    NO_EQUIVALENT.update({name: (arity, why) for name in names})


# -- translated ----------------------------------------------------------------------------------
_translated("1", int, "--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads",
            "--num-query-groups", "--kv-channels", "--seq-length", "--max-position-embeddings",
            "--make-vocab-size-divisible-by", "--vocab-size", "--num-experts", "--moe-router-topk",
            "--moe-ffn-hidden-size", "--moe-shared-expert-intermediate-size", "--tensor-model-parallel-size",
            "--pipeline-model-parallel-size", "--context-parallel-size", "--num-layers-per-virtual-pipeline-stage",
            "--num-virtual-stages-per-pipeline-rank", "--decoder-first-pipeline-num-layers",
            "--decoder-last-pipeline-num-layers", "--expert-model-parallel-size", "--expert-tensor-parallel-size",
            "--ddp-bucket-size", "--distributed-timeout-minutes", "--hysteresis", "--fp8-margin",
            "--fp8-amax-history-len", "--recompute-num-layers", "--lr-warmup-iters", "--lr-warmup-samples",
            "--lr-decay-iters", "--lr-decay-samples", "--train-iters", "--train-samples", "--micro-batch-size",
            "--global-batch-size", "--seed", "--num-workers", "--log-interval", "--eval-interval", "--eval-iters",
            "--profile-step-start", "--profile-step-end", "--save-interval", "--tiktoken-num-special-tokens")
_translated("1", float, "--rotary-base", "--rotary-percent", "--rotary-seq-len-interpolation-factor",
            "--rope-scaling-factor", "--norm-epsilon", "--init-method-std", "--hidden-dropout", "--attention-dropout",
            "--moe-aux-loss-coeff", "--moe-z-loss-coeff", "--moe-router-bias-update-rate",
            "--moe-expert-capacity-factor", "--moe-router-topk-scaling-factor", "--initial-loss-scale",
            "--min-loss-scale", "--loss-scale-window", "--lr", "--min-lr", "--weight-decay", "--adam-beta1",
            "--adam-beta2", "--adam-eps", "--clip-grad", "--lr-warmup-fraction", "--lr-warmup-init",
            "--start-weight-decay", "--end-weight-decay")
_translated("1", str, "--position-embedding-type", "--normalization", "--window-size", "--window-attn-skip-freq",
            "--transformer-impl", "--moe-layer-freq", "--moe-router-score-function",
            "--moe-router-load-balancing-type", "--moe-token-drop-policy", "--fp8-format", "--fp8-recipe",
            "--fp8-amax-compute-algo", "--recompute-granularity", "--recompute-method", "--optimizer",
            "--lr-decay-style", "--weight-decay-incr-style", "--split", "--data-cache-path", "--tokenizer-type",
            "--vocab-file", "--merge-file", "--tokenizer-model", "--tiktoken-pattern", "--wandb-project",
            "--wandb-exp-name", "--wandb-save-dir", "--save", "--load", "--dataloader-type", "--main-grads-dtype",
            "--main-params-dtype", "--exp-avg-dtype", "--exp-avg-sq-dtype")
_translated("*", str, "--data-path", "--cp-comm-type", "--recompute-modules", "--tiktoken-special-tokens")
_translated("0", bool, "--group-query-attention", "--use-rotary-position-embeddings", "--use-rope-scaling",
            "--apply-layernorm-1p", "--swiglu", "--openai-gelu", "--untie-embeddings-and-output-weights",
            "--disable-bias-linear", "--add-qkv-bias", "--qk-layernorm", "--moe-router-pre-softmax",
            "--moe-router-enable-expert-bias", "--sequence-parallel", "--use-distributed-optimizer",
            "--use-torch-fsdp2", "--fp16", "--bf16", "--recompute-activations", "--mock-data",
            "--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss", "--profile", "--no-load-optim",
            "--finetune", "--async-save", "--no-position-embedding", "--no-bias-gelu-fusion",
            "--use-te-activation-func", "--use-legacy-models")

# Megatron-LM's defaults of the translated flags that matter when a flag is absent.
DEFAULTS = {
    "--num-query-groups": 1, "--make-vocab-size-divisible-by": 128, "--position-embedding-type": "learned_absolute",
    "--rotary-base": 10000.0, "--rotary-percent": 1.0, "--rope-scaling-factor": 8.0, "--normalization": "LayerNorm",
    "--norm-epsilon": 1e-5, "--init-method-std": 0.02, "--hidden-dropout": 0.1, "--attention-dropout": 0.1,
    "--transformer-impl": "transformer_engine", "--moe-router-topk": 2, "--moe-layer-freq": "1",
    "--moe-router-score-function": "softmax", "--moe-router-load-balancing-type": "aux_loss",
    "--moe-aux-loss-coeff": 0.0, "--moe-router-bias-update-rate": 1e-3, "--moe-token-drop-policy": "probs",
    "--tensor-model-parallel-size": 1, "--pipeline-model-parallel-size": 1, "--context-parallel-size": 1,
    "--expert-model-parallel-size": 1, "--cp-comm-type": ["p2p"], "--distributed-timeout-minutes": 10,
    "--initial-loss-scale": 2.0 ** 32, "--min-loss-scale": 1.0, "--loss-scale-window": 1000.0, "--hysteresis": 2,
    "--fp8-recipe": "delayed", "--fp8-margin": 0, "--fp8-amax-history-len": 1, "--fp8-amax-compute-algo": "most_recent",
    "--optimizer": "adam", "--min-lr": 0.0, "--weight-decay": 0.01, "--adam-beta1": 0.9, "--adam-beta2": 0.999,
    "--adam-eps": 1e-8, "--clip-grad": 1.0, "--lr-decay-style": "linear", "--lr-warmup-iters": 0,
    "--lr-warmup-samples": 0, "--lr-warmup-init": 0.0, "--weight-decay-incr-style": "constant", "--seed": 1234,
    "--log-interval": 100, "--eval-interval": 1000, "--eval-iters": 100, "--profile-step-start": 10,
    "--profile-step-end": 12, "--dataloader-type": "single", "--tiktoken-num-special-tokens": 1000,
}
# --eval-interval: 1000 up to Megatron-LM 0.15; 0.16 dropped the default, and a run without the flag
# then stops before training (while it sizes the valid set), so the default of the versions that ran
# such a command line is kept.

# -- no key needed -------------------------------------------------------------------------------
KERNEL = "a kernel choice: the function computed is the same here"
_same("0", "the model here is Megatron-Core's GPT form", "--use-mcore-models")
_same("1", "attention runs on torch's SDPA kernels, chosen per device", "--attention-backend")
_same("0", "attention runs on torch's SDPA kernels (flash attention where the GPU has it)", "--use-flash-attn")
_same("0", KERNEL, "--no-masked-softmax-fusion", "--no-bias-swiglu-fusion",
      "--no-bias-dropout-fusion", "--no-rope-fusion", "--cross-entropy-loss-fusion",
      "--no-gradient-accumulation-fusion",
      "--no-persist-layer-norm", "--no-async-tensor-model-parallel-allreduce", "--moe-permute-fusion",
      "--moe-grouped-gemm", "--moe-use-legacy-grouped-gemm", "--no-clone-scatter-output-in-embedding",
      "--no-overlap-p2p-communication")
_same("1", KERNEL, "--cross-entropy-fusion-impl", "--moe-token-dispatcher-type")
_same("0", "the data-parallel gradient reduction here always overlaps backward, bucket by bucket",
      "--overlap-grad-reduce")
_same("0", "with optim.distributed_optimizer the parameter all-gather here always overlaps the next forward",
      "--overlap-param-gather")
_same("0", "gradients here are always accumulated and reduced in fp32", "--accumulate-allreduce-grads-in-fp32")
_same("0", "gradients here are averaged over the data-parallel ranks too", "--ddp-average-in-collective")
_same("0", "the GPU attention kernels keep the softmax in fp32", "--attention-softmax-in-fp32")
_same("0", "it divides QK^T by the layer number and multiplies it back inside an fp16 softmax: the same scores",
      "--apply-query-key-layer-scaling")
_same("0", "weights are initialised layout-free on their device: the same values at any layout",
      "--use-cpu-initialization", "--init-model-with-meta-device")
_same("1", "nccl on GPU, gloo on CPU (trainer.accelerator)", "--distributed-backend")
_same("1", "set by the launcher", "--local-rank", "--local_rank")
_same("0", "the causal mask is made inside attention here", "--no-create-attention-mask-in-dataloader")
_same("0", "how .bin files are read: the samples are the same", "--no-mmap-bin-files")
_same("1", "index building runs once per corpus here", "--num-dataset-builder-threads")
_same("0", "SIGTERM saves a checkpoint and stops here always (docs/checkpoints.md)", "--exit-signal-handler")
_same("0", "tokens/s, TFLOP/s and MFU are logged here always", "--log-throughput")
_same("0", "the profiler here is torch.profiler", "--use-pytorch-profiler")
_same("0", "a checkpoint.load that does not exist stops the run here", "--exit-on-missing-checkpoint")
CHECKPOINT_FORMAT = ("checkpoints here are sharded and layout-free in their own format; python -m "
                     "megatron_hydra.convert from_megatron / to_megatron converts")
_same("0", CHECKPOINT_FORMAT, "--use-dist-ckpt", "--auto-detect-ckpt-format", "--ckpt-fully-parallel-save",
      "--ckpt-fully-parallel-load", "--no-ckpt-fully-parallel-save", "--ckpt-assume-constant-structure",
      "--use-persistent-ckpt-worker")
_same("1", CHECKPOINT_FORMAT, "--ckpt-format", "--dist-ckpt-format", "--dist-ckpt-strictness")
_same("0", "pretrain_gpt.py does not read it (BERT / T5 / inference)", "--bert-no-binary-head", "--flash-decode",
      "--enable-cuda-graph", "--inference-dynamic-batching", "--output-bert-embeddings")
_same("1", "pretrain_gpt.py does not read it (BERT / T5 / inference)", "--mask-prob", "--short-seq-prob",
      "--inference-max-requests", "--inference-max-seq-length", "--inference-batch-times-seqlen-threshold",
      "--max-tokens-to-oom", "--bert-embedder-type")
_same("1", "read by --optimizer sgd only", "--sgd-momentum")
_same("1", "deprecated in Transformer Engine: the amax is taken every step", "--fp8-interval")

# -- no equivalent -------------------------------------------------------------------------------
PERFORMANCE = "not available here (performance only: the numbers trained are the same)"
_none("0", PERFORMANCE, "--tp-comm-overlap", "--disable-tp-comm-overlap-ag", "--disable-tp-comm-overlap-rs",
      "--tp-comm-overlap-rs-dgrad", "--disable-tp-comm-bulk-dgrad", "--disable-tp-comm-bulk-wgrad",
      "--disable-tp-comm-split-ag", "--disable-tp-comm-split-rs", "--defer-embedding-wgrad-compute",
      "--ddp-pad-buckets-for-high-nccl-busbw", "--no-align-grad-reduce", "--no-align-param-gather",
      "--no-scatter-gather-tensors-in-pipeline", "--use-ring-exchange-p2p", "--overlap-p2p-communication-warmup-flush",
      "--manual-gc", "--no-manual-gc-eval", "--moe-shared-expert-overlap", "--moe-enable-deepep",
      "--overlap-param-gather-with-optimizer-step", "--external-cuda-graph", "--disable-gloo-process-groups")
_none("1", PERFORMANCE, "--tp-comm-overlap-cfg", "--tp-comm-bootstrap-backend", "--wgrad-deferral-limit",
      "--ddp-num-buckets", "--manual-gc-interval", "--empty-unused-memory-level", "--nccl-communicator-config-path",
      "--cuda-graph-scope", "--cuda-graph-impl", "--pipeline-model-parallel-comm-backend")
_none("1", "the batch is split into micro-batches by torch's pipeline schedules here",
      "--microbatch-group-size-per-virtual-pipeline-stage")
_none("0", "the pipeline split counts transformer layers only here (parallel.layers_per_stage sets it)",
      "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split")
_none("1", "give the layers of each stage as parallel.layers_per_stage", "--pipeline-model-parallel-layout")
_none("1", "one distributed-optimizer instance over all data-parallel ranks here",
      "--num-distributed-optimizer-instances")
_none("0", "Megatron's own FSDP: parallel.data_parallel=fsdp runs torch's FSDP2 instead", "--use-custom-fsdp",
      "--use-megatron-fsdp")
_none("1", "Megatron's own FSDP: parallel.data_parallel=fsdp runs torch's FSDP2 instead",
      "--data-parallel-sharding-strategy")
_none("*", "hierarchical context parallelism: one context-parallel group here", "--hierarchical-context-parallel-sizes")
_none("0", "ranks are ordered as Megatron's default (tp innermost, then cp, dp, pp) here", "--use-tp-pp-dp-mapping")
_none("0", "FP8 weights: the weights stay bf16 here", "--fp8-param-gather")
_none("0", "FP8 weight gradients are always on under precision=fp8 here", "--no-fp8-wgrad")
_none("0", "every layer runs FP8 under precision=fp8 here", "--first-last-layers-bf16")
_none("1", "every layer runs FP8 under precision=fp8 here", "--num-layers-at-start-in-bf16",
      "--num-layers-at-end-in-bf16", "--te-precision-config-file")
_none("0", "Transformer Engine's RNG tracker: dropout here draws from our own tensor-parallel streams",
      "--te-rng-tracker", "--inference-rng-tracker")
_none("0", "the residual stream follows the weights' dtype here", "--fp32-residual-connection")
_none("0", "the loss is computed in fp32 here", "--fp16-lm-cross-entropy")
_none("0", "gradients are reduced in fp32 here", "--grad-reduce-in-bf16")
_none("1", "a static loss scale: fp16 here scales dynamically (precision.initial_loss_scale and the rest)",
      "--loss-scale")
_none("0", "bf16 matmuls here use the GPU library's defaults", "--disable-bf16-reduced-precision-matmul")
_none("0", "the optimizer keeps fp32 state here", "--use-precision-aware-optimizer")
_none("0", "the optimizer state stays on the GPU here (no CPU offload)", "--optimizer-cpu-offload",
      "--use-torch-optimizer-for-cpu-offload", "--overlap-cpu-optimizer-d2h-h2d", "--no-pin-cpu-grads",
      "--no-pin-cpu-params")
_none("1", "the optimizer state stays on the GPU here (no CPU offload)", "--optimizer-offload-fraction")
_none("0", "not available here", "--deterministic-mode", "--check-for-spiky-loss", "--check-for-large-grads",
      "--data-parallel-random-init", "--distribute-saved-activations", "--moe-layer-recompute", "--moe-extended-tp",
      "--moe-use-upcycling", "--moe-per-layer-logging", "--moe-pad-expert-input-to-capacity", "--skip-train",
      "--full-validation", "--log-params-norm", "--log-num-zeros-in-grad", "--log-timers-to-tensorboard",
      "--log-validation-ppl-to-tensorboard", "--log-world-size-to-tensorboard", "--log-memory-to-tensorboard",
      "--no-log-loss-scale-to-tensorboard", "--log-progress", "--log-straggler", "--record-memory-history",
      "--no-barrier-with-level-1-timing", "--log-energy", "--override-opt_param-scheduler",
      "--use-checkpoint-opt_param-scheduler", "--no-initialization", "--rotary-interleaved",
      "--apply-residual-connection-post-layernorm", "--squared-relu", "--quick-geglu", "--init-method-xavier-uniform",
      "--onnx-safe", "--enable-ft-package", "--calc-ft-timeouts", "--adlr-autoresume",
      "--no-one-logger", "--one-logger-async", "--ckpt-convert-update-legacy-dist-opt-format")
_none("1", "not available here", "--rerun-mode", "--error-injection-rate", "--error-injection-type",
      "--timing-log-level", "--timing-log-option", "--logging-level", "--tensorboard-log-interval",
      "--tensorboard-queue-size", "--memory-snapshot-path", "--moe-router-dtype", "--moe-router-num-groups",
      "--moe-router-group-topk", "--moe-input-jitter-eps", "--result-rejected-tracker-filename",
      "--check-weight-hash-across-dp-replicas-interval", "--train-sync-interval", "--adlr-autoresume-interval",
      "--one-logger-project", "--one-logger-run-name", "--straggler-ctrlr-port", "--straggler-minmax-count",
      "--config-logger-dir", "--heterogeneous-layers-config-path", "--heterogeneous-layers-config-encoded-json",
      "--yaml-cfg", "--s3-cache-path", "--data-args-path", "--per-split-data-args-path")
_none("*", "not available here", "--iterations-to-skip", "--profile-ranks", "--mrope-section", "--spec")
_none("0", "the NaN/inf check here is always on (a NaN/inf loss or gradient norm stops the run)",
      "--no-check-for-nan-in-loss-and-grad")
_none("0", "each micro-batch's loss is its mean over its tokens here (the same without loss masks)",
      "--calculate-per-token-loss")
_none("*", "the global batch is constant here: data.global_batch_size from the first step", "--rampup-batch-size",
      "--step-batch-size-schedule")
_none("0", "the global batch is constant here", "--decrease-batch-size-if-needed")
_none("1", "stop by trainer.max_steps, or the scheduler's time limit (under SLURM its signal saves and requeues)",
      "--exit-duration-in-mins", "--exit-interval")
_none("1", "TensorBoard logs go to <run_dir>/tensorboard (trainer.logger); hydra.run.dir chooses the run dir",
      "--tensorboard-dir")
_none("0", "every checkpoint here holds the optimizer and random states", "--no-save-optim", "--no-save-rng")
_none("0", "random states are restored when the layout is unchanged, else freshly seeded", "--no-load-rng")
_none("1", "local (non-persistent) checkpoints are not available here", "--non-persistent-save-interval",
      "--non-persistent-ckpt-type", "--non-persistent-global-ckpt-dir", "--non-persistent-local-ckpt-dir",
      "--non-persistent-local-ckpt-algo")
_none("1", "give the step's directory as checkpoint.load=<dir>/step_NNNNNNN", "--ckpt-step")
_none("1", "convert it (python -m megatron_hydra.convert from_megatron) and give it as checkpoint.load",
      "--pretrained-checkpoint")
_none("0", "model=from_checkpoint reads the model of a converted checkpoint (checkpoint.load)",
      "--use-checkpoint-args", "--use-mp-args-from-checkpoint-args", "--no-use-tokenizer-model-from-checkpoint-args")
_none("1", "python -m megatron_hydra.convert converts checkpoints", "--ckpt-convert-format", "--ckpt-convert-save")
_none("1", "a separate learning rate for the embeddings and output layer", "--decoupled-lr", "--decoupled-min-lr")
_none("1", "the WSD schedule is not available here", "--lr-wsd-decay-style", "--lr-wsd-decay-samples",
      "--lr-wsd-decay-iters")
_none("1", "T5's sentinel tokens: pretrain_gpt.py trains a GPT", "--vocab-extra-ids")
_none("1", "encoder-decoder sizes: pretrain_gpt.py trains a GPT (model.arch=t5 has its own keys)",
      "--encoder-num-layers", "--decoder-num-layers", "--encoder-seq-length", "--decoder-seq-length")
_none("*", "per-split data: data.blend and data.split choose the data here", "--train-data-path",
      "--valid-data-path", "--test-data-path")
_none("0", "multi-latent attention (DeepSeek-V2/V3) is not a model feature here", "--multi-latent-attention")
_none("1", "multi-latent attention (DeepSeek-V2/V3) is not a model feature here", "--q-lora-rank", "--kv-lora-rank",
      "--qk-head-dim", "--qk-pos-emb-head-dim", "--v-head-dim", "--rotary-scaling-factor", "--mscale",
      "--mscale-all-dim")
_none("1", "multi-token prediction is not a model feature here", "--mtp-num-layers", "--mtp-loss-scaling-factor")
_none("0", "hybrid Mamba models are not a model feature here", "--is-hybrid-model")
_none("1", "hybrid Mamba models are not a model feature here", "--hybrid-attention-ratio", "--hybrid-mlp-ratio",
      "--hybrid-override-pattern", "--mamba-state-dim", "--mamba-head-dim", "--mamba-num-groups")
_none("0", "removed from Megatron-LM: use --recompute-activations", "--checkpoint-activations")
_none("1", "removed from Megatron-LM: use --micro-batch-size", "--batch-size")
_none("1", "removed from Megatron-LM: use --tensor-model-parallel-size", "--model-parallel-size")
_none("1", "removed from Megatron-LM: use --lr-warmup-fraction", "--warmup")


def arity(flag: str) -> str:
    """How many values ``flag`` takes; an unknown flag takes what follows up to the next flag."""
    for table in (TRANSLATED, SAME, NO_EQUIVALENT):
        if flag in table:
            return table[flag][0]
    return "*"


def known(flag: str) -> bool:
    return flag in TRANSLATED or flag in SAME or flag in NO_EQUIVALENT
