"""The one device seam of the LM head and the embedding lookup (``parallel.layers.kernels_for``):
CPU-only kernels on a CPU, torch's own ops everywhere else, both equal to ``F.linear``,
``F.embedding`` and a cross entropy over the unpadded vocabulary in float64."""

import pytest
import torch
import torch.nn.functional as F

from megatron_hydra.parallel import host_memory, layers
from megatron_hydra.parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_hydra.parallel.layers import StandardKernels, kernels_for, lookup, vocab_parallel_logits

B, S, H, VOCAB, PADDED = 2, 8, 6, 21, 24
KERNELS = [pytest.param(host_memory, id="cpu_kernels"), pytest.param(StandardKernels, id="standard")]


@pytest.mark.parametrize("device", ["cuda", "privateuseone", "meta", "xla"])
def test_only_a_cpu_gets_the_cpu_kernels(device):
    assert kernels_for(torch.device("cpu")) is host_memory
    assert kernels_for(torch.device(device)) is StandardKernels


def _forbid(monkeypatch, *names):
    def refuse(*args, **kwargs):
        raise AssertionError("a CPU-only kernel or private torch API ran off the CPU")

    for name in names:
        monkeypatch.setattr(host_memory, name, refuse)
    for name in ("_storage_Use_Count", "_will_engine_execute_node"):
        monkeypatch.setattr(torch._C, name, refuse, raising=False)


def test_off_a_cpu_the_head_is_a_contiguous_linear_and_no_private_api_runs(monkeypatch):
    """On the meta device (shapes only, as an accelerator would see them): contiguous
    [batch, seq, vocab] logits, and a whole step of lookup, head, loss and backward never touches
    the CPU kernels or a private torch API."""
    _forbid(monkeypatch, "head", "lookup", "reusable_empty")
    table = torch.empty(PADDED, H, device="meta", requires_grad=True)
    ids = torch.zeros(B, S, dtype=torch.long, device="meta")
    hidden = lookup(ids, table)
    logits = vocab_parallel_logits(hidden, table, None, False, VOCAB)
    assert logits.shape == (B, S, PADDED) and logits.is_contiguous()
    vocab_parallel_cross_entropy(logits, ids, inplace=True).sum().backward()
    assert table.grad.shape == table.shape


def _reference(ids, table, head_weight, bias, target):
    """Unpadded: the padded vocabulary rows are sliced off, never masked."""
    hidden = F.embedding(ids, table)
    logits = F.linear(hidden, head_weight[:VOCAB], None if bias is None else bias[:VOCAB])
    return logits, F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="none").view(B, S)


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("tied,with_bias", [(True, False), (False, False), (False, True)], ids=["tied", "untied", "bias"])
def test_each_kernel_set_equals_torchs_ops(monkeypatch, kernels, tied, with_bias):
    """Forced through the seam on a CPU, each set of kernels gives the reference's logits (padded
    entries -inf), loss and every gradient in float64; the CPU kernels twice, so that the second
    step runs in the memory the first left free."""
    monkeypatch.setattr(layers, "kernels_for", lambda device: kernels)
    host_memory.release_all()
    g = torch.Generator().manual_seed(1)
    ids, target = (torch.randint(0, VOCAB, (B, S), generator=g) for _ in range(2))
    table = torch.randn(PADDED, H, dtype=torch.float64, generator=g)
    head = table if tied else torch.randn(PADDED, H, dtype=torch.float64, generator=g)
    bias = torch.randn(PADDED, dtype=torch.float64, generator=g) if with_bias else None

    def leaves():
        made = [t.clone().requires_grad_() if t is not None else None for t in (table, head, bias)]
        return [made[0], made[0] if tied else made[1], made[2]]

    ref, params = leaves(), leaves()
    ref_logits, ref_loss = _reference(ids, *ref, target)
    ref_loss.sum().backward()
    for _ in range(2):
        for p in params:
            if p is not None:
                p.grad = None
        logits = vocab_parallel_logits(lookup(ids, params[0]), params[1], None, False, VOCAB, bias=params[2])
        torch.testing.assert_close(logits[..., :VOCAB], ref_logits, rtol=1e-12, atol=1e-12)
        assert bool((logits[..., VOCAB:] == float("-inf")).all())
        loss = vocab_parallel_cross_entropy(logits, target, inplace=True)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
        loss.sum().backward()
        for p, r in zip(params, ref):
            if p is not None:
                torch.testing.assert_close(p.grad, r.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("first_padded", [-4, 0, 5, PADDED])
def test_the_head_masks_from_the_first_padded_entry(kernels, first_padded):
    """A TP rank's shard may start past the vocabulary (every entry padding) or hold none of it."""
    g = torch.Generator().manual_seed(2)
    rows, weight = torch.randn(S, H, dtype=torch.float64, generator=g), torch.randn(PADDED, H, dtype=torch.float64, generator=g)
    expected = F.linear(rows, weight)
    expected[:, max(first_padded, 0):] = float("-inf")
    # -inf == -inf counts as close; the CPU kernels multiply in another order (within 1e-12).
    torch.testing.assert_close(kernels.head(rows, weight, None, first_padded), expected, rtol=1e-12, atol=1e-12)
