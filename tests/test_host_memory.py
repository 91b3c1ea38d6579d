"""The CPU-only kernels (parallel.host_memory): host memory reused across steps for the logits and
the head's and embedding table's gradients, reused only when free, never changing a result, bounded."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_hydra.parallel import host_memory
from megatron_hydra.parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_hydra.parallel.layers import lookup, vocab_parallel_logits

B, S, H, VOCAB = 2, 16, 8, 64


def _inputs(seed: int, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, S, H, dtype=dtype, generator=g, requires_grad=True)
    w = torch.randn(VOCAB, H, dtype=dtype, generator=g, requires_grad=True)
    target = torch.randint(0, VOCAB, (B, S), generator=g)
    return x, w, target


def _loss(x, w, target):
    logits = vocab_parallel_logits(x, w, None, False, VOCAB)
    return logits, vocab_parallel_cross_entropy(logits, target, inplace=True)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_a_step_takes_the_memory_the_last_step_freed_and_never_memory_in_use():
    host_memory.release_all()
    x, w, target = _inputs(0)
    logits, loss = _loss(x, w, target)
    first = _storage(logits)
    del logits
    loss.sum().backward()  # the loss's backward was the last user of the logits
    logits, loss = _loss(x, w, target)
    assert _storage(logits) == first
    # A second micro-batch in flight before the first one's backward: its own memory.
    in_flight, loss_in_flight = _loss(x, w, target)
    assert _storage(in_flight) != first
    # Logits a caller keeps (no labels: generation) are not handed out while it holds them.
    with torch.no_grad():
        kept = vocab_parallel_logits(x, w, None, False, VOCAB)
    del logits, in_flight
    (loss.sum() + loss_in_flight.sum()).backward()
    again, _ = _loss(x, w, target)
    assert _storage(again) != _storage(kept)


def test_reused_memory_changes_no_result():
    """Loss and gradients against torch's own linear and cross entropy, in float64, with every kept
    storage filled with NaN first: the matmul must overwrite (beta=0 ignores NaN), not add."""
    host_memory.release_all()
    for seed in range(3):
        x, w, target = _inputs(seed)
        for storage in host_memory._kept:
            torch.empty(0, dtype=torch.float64).set_(storage, 0, (storage.nbytes() // 8,)).fill_(float("nan"))
        _, loss = _loss(x, w, target)
        loss.sum().backward()
        x_ref, w_ref = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        ref = F.cross_entropy(F.linear(x_ref, w_ref).flatten(0, 1), target.flatten(), reduction="none").view(B, S)
        ref.sum().backward()
        torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(w.grad, w_ref.grad, rtol=1e-12, atol=1e-12)
    assert host_memory.kept_bytes() > 0


def test_changing_shapes_do_not_grow_the_pool_without_bound():
    host_memory.release_all()
    for rows in range(1, 4 * host_memory.MAX_KEPT):
        t = host_memory.reusable_empty((rows * 1000, 3), torch.float32)
        assert t.shape == (rows * 1000, 3) and t.is_contiguous()
        del t
    assert len(host_memory._kept) <= host_memory.MAX_KEPT
    # Held tensors are never evicted or handed out again; beyond the bound they are not kept.
    held = [host_memory.reusable_empty((10,), torch.float32) for _ in range(host_memory.MAX_KEPT + 2)]
    assert len({_storage(t) for t in held}) == len(held)
    assert len(host_memory._kept) == host_memory.MAX_KEPT


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32], ids=str)
def test_the_lookup_gradient_is_torchs_to_the_bit_and_reuses_memory(dtype, id_dtype):
    """Repeated ids (rows summed in one order, 16-bit rounding after each addition): the table's
    gradient equals F.embedding's exactly; a second step's gradient lands where the first one's was
    once the optimizer let it go, and gradients accumulate into a kept ``.grad`` as autograd's own do."""
    host_memory.release_all()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 12, (B, S), generator=g).to(id_dtype)  # each of 12 rows looked up ~3 times
    ids[0, : S // 2] = 5  # and one row many times
    upstream = torch.randn(B, S, H, generator=g).to(dtype)
    table = torch.randn(VOCAB, H, generator=g).to(dtype).requires_grad_()
    ref_table = table.detach().clone().requires_grad_()
    F.embedding(ids, ref_table).backward(upstream)

    lookup(ids, table).backward(upstream)
    assert torch.equal(lookup(ids, table), F.embedding(ids, ref_table))
    assert torch.equal(table.grad, ref_table.grad)
    first = _storage(table.grad)
    table.grad = None
    lookup(ids, table).backward(upstream)
    assert torch.equal(table.grad, ref_table.grad)
    assert _storage(table.grad) == first and first in {s.data_ptr() for s in host_memory._kept}
    lookup(ids, table).backward(upstream)
    assert torch.equal(table.grad, 2 * ref_table.grad)


class _CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
def test_a_split_backward_computes_each_head_gradient_once(with_bias):
    """The zero-bubble schedules' split backward asks first for the input's gradient, then for the
    weight's (torch.distributed.pipelining: ``autograd.grad`` to the inputs, then from the saved
    intermediate gradients to the parameters): each pass runs one of the head's two gradient
    matmuls, not both, and each gradient equals torch's own linear layer's in float64."""
    x, w, _ = _inputs(3)
    g = torch.Generator().manual_seed(5)
    probe = torch.randn(B, S, VOCAB, dtype=x.dtype, generator=g)
    bias = torch.randn(VOCAB, dtype=x.dtype, generator=g).requires_grad_() if with_bias else None
    hidden = x * 1  # a non-leaf, as a stage's hidden states are
    loss = (vocab_parallel_logits(hidden, w, None, False, VOCAB, bias=bias) * probe).sum()
    x_ref, w_ref = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    b_ref = bias.detach().clone().requires_grad_() if with_bias else None
    (F.linear(x_ref, w_ref, b_ref) * probe).sum().backward()

    weights = [w, bias] if with_bias else [w]
    with _CountMatmuls() as input_pass:
        (grad_hidden,) = torch.autograd.grad(loss, [hidden], retain_graph=True)
    with _CountMatmuls() as weight_pass:
        grad_weights = torch.autograd.grad(loss, weights, retain_graph=True)
    with _CountMatmuls() as full:
        loss.backward()
    assert (input_pass.calls, weight_pass.calls, full.calls) == (1, 1, 2)
    torch.testing.assert_close(grad_hidden, x_ref.grad, rtol=1e-12, atol=1e-12)
    for grad, param, ref in zip(grad_weights, weights, [w_ref, b_ref]):
        torch.testing.assert_close(grad, ref.grad, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(param.grad, ref.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-12, atol=1e-12)


def test_a_tied_tables_two_gradients_add_in_place_in_reused_memory():
    """A tied embedding's lookup and head gradients meet at the table: autograd adds one into the
    other in place, so from the second step on the table's gradient is the pool's memory and the
    step allocates no [vocab, hidden] tensor; the sum equals torch's own in float64."""
    host_memory.release_all()
    _, table, target = _inputs(4)
    ids = target  # any ids of the vocabulary
    ref = table.detach().clone().requires_grad_()
    F.cross_entropy(F.linear(F.embedding(ids, ref), ref).flatten(0, 1), target.flatten(), reduction="sum").backward()
    for _ in range(2):
        table.grad = None
        hidden = lookup(ids, table)
        vocab_parallel_cross_entropy(vocab_parallel_logits(hidden, table, None, False, VOCAB), target,
                                     inplace=True).sum().backward()
        torch.testing.assert_close(table.grad, ref.grad, rtol=1e-12, atol=1e-12)
    assert _storage(table.grad) in {s.data_ptr() for s in host_memory._kept}
