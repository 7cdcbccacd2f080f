"""Token-tree forward and KV compaction (the groundwork of tree drafting): every node of a tree run as
one block with a tree mask gets the states a causal forward over its own root-to-node path gives, on
both backends; compacting an accepted path leaves a cache a fresh forward over those tokens equals."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, tiny_model

from selfspec.models.masks import TreeAttention
from selfspec.models.split import SplitModel

pytestmark = pytest.mark.usefixtures("one_thread")

# a tree of 7 nodes in breadth-first order: parent of each node (-1: the root, the pending token)
PARENTS = [-1, 0, 0, 1, 1, 2, 3]


def ancestors(i: int) -> list[int]:
    path = []
    while i >= 0:
        path.append(i)
        i = PARENTS[i]
    return path[::-1]


def tree_of(parents: list[int]) -> tuple[torch.Tensor, torch.Tensor]:  # mask [n, n], depth [n]
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    depth = torch.zeros(n, dtype=torch.long)
    for i in range(n):
        for j in ancestors(i):
            mask[i, j] = True
        depth[i] = len(ancestors(i)) - 1
    return mask, depth


def fresh(split: SplitModel, ids: list[int]) -> torch.Tensor:  # [len, hidden] final states
    cache = split.new_cache(len(ids))
    return split.forward_all(torch.tensor([ids]), torch.arange(len(ids))[None], cache)[0]


@pytest.mark.parametrize("backend", ["fast", "reference"])
@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma3_text", "qwen3"])
def test_tree_block_equals_each_path(arch, backend):
    split = SplitModel(tiny_model(arch), backend=backend)
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(2, VOCAB, (9,), generator=g).tolist()
    nodes = torch.randint(2, VOCAB, (len(PARENTS),), generator=g).tolist()
    mask, depth = tree_of(PARENTS)
    with torch.inference_mode():
        cache = split.new_cache(32)
        split.forward_all(torch.tensor([prefix]), torch.arange(len(prefix))[None], cache)
        pos = (len(prefix) + depth)[None]
        k = 1
        # the shallow layers see the tree in two blocks (root + depth 1, then the rest), the deep in one
        a = 3
        first = TreeAttention(mask[:a, :a], pos[0, :a])
        h_a = split.run_layers(split.embed(torch.tensor([nodes[:a]])), 0, k, pos[:, :a], cache, tree=first)
        rest = TreeAttention(mask[a:], pos[0])
        h_b = split.run_layers(split.embed(torch.tensor([nodes[a:]])), 0, k, pos[:, a:], cache, tree=rest)
        h_k = torch.cat([h_a, h_b], dim=1)
        out = split.run_layers(h_k, k, split.num_layers, pos, cache, tree=TreeAttention(mask, pos[0]))[0]
        for i in range(len(PARENTS)):
            path = [nodes[j] for j in ancestors(i)]
            torch.testing.assert_close(out[i], fresh(split, prefix + path)[-1], atol=1e-4, rtol=1e-4)
        # accept the path to node 6 (0 -> 1 -> 3 -> 6), compact, then decode one more token
        keep = ancestors(6)
        cache.compact(len(prefix), keep)
        assert cache.lengths == [len(prefix) + len(keep)] * split.num_layers
        nxt = 5
        last = split.forward_all(torch.tensor([[nxt]]), torch.tensor([[len(prefix) + len(keep)]]), cache)[0, -1]
        want = fresh(split, prefix + [nodes[j] for j in keep] + [nxt])[-1]
        torch.testing.assert_close(last, want, atol=1e-4, rtol=1e-4)
