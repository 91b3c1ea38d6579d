"""Planted bugs for test_verify.py, which patches the one a case names into each rank it forks for
the layout run. Each bug matters only at its layout (tp > 1, pp > 1, cp > 1, a sharded
optimizer), as real ones do, so the single-process reference would be untouched by it."""


def forget_tp_all_reduce() -> None:
    """A row-parallel layer that returns its partial sum without the all-reduce over TP."""
    import torch.nn.functional as F

    from megatron_hydra.parallel import layers

    def forward(self, x):
        y = layers.add_adapter(F.linear(x, self.weight), self.lora, x)
        return y if self.bias is None else y + self.bias

    layers.RowParallelLinear.forward = forward


def drop_microbatch() -> None:
    """A pipeline whose last stage leaves the last micro-batch of each step out (its loss, and so
    its gradients, count for nothing)."""
    import inspect

    from megatron_hydra.parallel import pipeline

    init = pipeline.Pipeline.__init__
    signature = inspect.signature(init)

    def dropping_init(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        loss_fn, every, calls = bound.arguments["loss_fn"], bound.arguments["num_microbatches"], [0]

        def dropping(*a, **k):
            calls[0] += 1
            loss = loss_fn(*a, **k)
            return loss * 0 if calls[0] % every == 0 else loss

        bound.arguments["loss_fn"] = dropping
        init(*bound.args, **bound.kwargs)

    pipeline.Pipeline.__init__ = dropping_init


def window_off_by_one() -> None:
    """Context-parallel attention whose sliding window is one token short."""
    from megatron_hydra.models import transformer

    attention = transformer.context_parallel_attention

    def short(*args, window=None, **kwargs):
        return attention(*args, window=None if window is None else window - 1, **kwargs)

    transformer.context_parallel_attention = short


def lora_b_wrong_dim() -> None:
    """LoRA's B matrices marked as sharded along their rank instead of their output rows."""
    from megatron_hydra.parallel import lora

    adapter_param = lora.adapter_param

    def wrong(shape, dtype, device, partition_dim, summed_over_tp=False):
        return adapter_param(shape, dtype, device, 1 if partition_dim == 0 else partition_dim, summed_over_tp)

    lora.adapter_param = wrong


def optimizer_skips_a_parameter() -> None:
    """A distributed optimizer that leaves its last parameter shard un-stepped (AdamW passes over
    a parameter without a gradient)."""
    from megatron_hydra.parallel import optimizer

    step_inner = optimizer.MegatronOptimizer._step_inner

    def skipping(self):
        if not self.distributed:
            return step_inner(self)
        main = self.pieces[-1].main
        grad, main.grad = main.grad, None
        try:
            step_inner(self)
        finally:
            main.grad = grad

    optimizer.MegatronOptimizer._step_inner = skipping


PLANTS = {f.__name__: f for f in (forget_tp_all_reduce, drop_microbatch, window_off_by_one, lora_b_wrong_dim,
                                  optimizer_skips_a_parameter)}
