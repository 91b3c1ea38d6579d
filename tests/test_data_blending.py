"""Blending: every prefix of the stream stays within a proven distance of the weights."""

import numpy as np
import pytest

from megatron_hydra.data.blending import BlendedDataset, blending_indices, deviation_bound

WEIGHT_SETS = [[1], [0.5, 0.5], [0.7, 0.3], [0.9, 0.05, 0.05], [3, 1, 1, 1, 2], [1e-3, 1, 0.2, 0.01, 0.4, 0.3]]


def megatron_greedy(weights, size):
    """Megatron's rule, written from its description: take the dataset furthest below its share."""
    w = np.asarray(weights, float) / np.sum(weights)
    counts, order = np.zeros(len(w)), []
    for i in range(size):
        d = int(np.argmax(w * max(i, 1) - counts))
        order.append(d)
        counts[d] += 1
    return np.array(order)


def prefix_deviation(order, weights):
    w = np.asarray(weights, float) / np.sum(weights)
    counts = np.cumsum(np.eye(len(w))[order], axis=0)
    n = np.arange(1, len(order) + 1)[:, None]
    return np.abs(counts - w * n).max(axis=0)


@pytest.mark.parametrize("weights", WEIGHT_SETS)
def test_every_prefix_is_within_the_bound(weights):
    size = 5000
    order, index = blending_indices(weights, size)
    assert len(order) == size
    dev = prefix_deviation(order, weights)
    K = len(weights)
    assert np.all(dev <= deviation_bound(weights) + 1e-9)
    # Megatron's greedy rule guarantees max(1, K - 1); we are never worse ...
    assert dev.max() <= max(1.0, K - 1) + 1e-9
    # ... and on these weights within half an item of what the greedy rule actually does.
    assert dev.max() <= prefix_deviation(megatron_greedy(weights, size), weights).max() + 0.5
    # Each dataset's items are taken in order 0, 1, 2, ...
    for d in range(K):
        taken = index[order == d]
        assert np.array_equal(taken, np.arange(len(taken)))


def test_deterministic_and_required_sizes_suffice():
    rng = np.random.default_rng(0)
    for _ in range(50):
        w = rng.random(int(rng.integers(1, 6))) + 1e-3
        size = int(rng.integers(1, 3000))
        a, ai = blending_indices(w, size)
        b, bi = blending_indices(list(w), size)
        assert np.array_equal(a, b) and np.array_equal(ai, bi)
        need = BlendedDataset.required_sizes(w, size)
        for d in range(len(w)):
            assert np.count_nonzero(a == d) <= need[d]


def test_blended_dataset_serves_items_of_its_parts():
    parts = [[("a", i) for i in range(100)], [("b", i) for i in range(100)]]
    blend = BlendedDataset(parts, [2, 1], 120)
    items = [blend[i] for i in range(len(blend))]
    assert sum(1 for s, _ in items if s == "a") == 80
    assert [i for s, i in items if s == "b"] == list(range(40))
    with pytest.raises(IndexError):
        blend[120]
    with pytest.raises(ValueError, match="takes"):
        BlendedDataset([parts[0][:10], parts[1]], [0.5, 0.5], 100)
    with pytest.raises(ValueError, match="positive"):
        blending_indices([1, -1], 10)
