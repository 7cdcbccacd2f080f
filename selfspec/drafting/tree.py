"""Token trees: several draft continuations verified in one block (SpecInfer, EAGLE-2).

Node 0 is the root, the pending token; every other node is a draft token whose parent is an earlier
node, so a root-to-node path is a draft sequence and node indices grow along every path (the order
the nodes' KV entries are written in every cache). Worked example (width 2, depth 2):

    node   0    1    2    3    4        tokens  x  a  b  c  d
    parent -1   0    0    1    2        a, b: the head's two best tokens after x (depth 1)
    depth  0    1    1    2    2        c (after a), d (after b): the best two of the four
                                           children of depth 1 by path score (EAGLE-2)

The drafter grows the tree depth by depth: at each depth the ``width`` children with the highest
path score (the sum of the draft's log-probabilities along the path) among the top children of the
current depth's nodes become the next depth's nodes. The target then verifies every node in one
block with a tree attention mask (each node sees the prefix and its own ancestors) and per-node
positions (prefix length + depth), and the longest path it agrees with is accepted
(``selfspec.verify.greedy_tree_verify`` / ``tree_sample_verify``). Lookup continuations join the tree
as one more branch (inserted like a trie, so a token already drafted is not drafted twice).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from selfspec.models.masks import TreeAttention


@dataclass
class TokenTree:
    tokens: list[int]
    parents: list[int]
    depths: list[int]
    scores: list[float]  # path log-probability under the draft (root: 0)
    _ancestors: list[set[int]] = field(default_factory=list, repr=False)

    @classmethod
    def root(cls, token: int) -> TokenTree:
        return cls([token], [-1], [0], [0.0], [{0}])

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, token: int, parent: int, score: float = 0.0) -> int:
        i = len(self.tokens)
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.scores.append(score)
        self._ancestors.append(self._ancestors[parent] | {i})
        return i

    def children(self, i: int) -> list[int]:
        return [c for c, p in enumerate(self.parents) if p == i]

    def path(self, i: int) -> list[int]:
        """Node indices root..i."""
        return sorted(self._ancestors[i])

    def insert_chain(self, tokens: list[int]) -> list[int]:
        """Add ``tokens`` as a branch from the root, reusing nodes that already hold the same prefix;
        returns the indices of the nodes created."""
        node, new = 0, []
        for t in tokens:
            nxt = next((c for c in self.children(node) if self.tokens[c] == t), None)
            if nxt is None:
                nxt = self.add(t, node, self.scores[node])
                new.append(nxt)
            node = nxt
        return new

    def attention(self, rows: list[int], start: int, device: torch.device | str = "cpu") -> TreeAttention:
        """Tree attention for nodes ``rows`` (the newest ones, in order) over every node written so far;
        ``start``: the root's absolute position."""
        t = rows[-1] + 1
        mask = torch.zeros(len(rows), t, dtype=torch.bool)
        for r, i in enumerate(rows):
            mask[r, list(self._ancestors[i])] = True
        pos = torch.tensor(self.depths[:t]) + start
        return TreeAttention(mask.to(device), pos.to(device))

    def positions(self, rows: list[int], start: int, device: torch.device | str = "cpu") -> torch.Tensor:  # [1, n]
        return (torch.tensor([self.depths[i] for i in rows]) + start).unsqueeze(0).to(device)
