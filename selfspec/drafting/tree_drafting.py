"""Token-tree drafting (EAGLE-2 style) with an exit head: ``width`` nodes per level, chosen by path score, for
``depth`` levels, plus the lookup continuation as one more branch. The tree itself and its attention mask:
``selfspec.drafting.tree``."""

from __future__ import annotations

import torch

from selfspec.drafting import head_state
from selfspec.drafting.base import DraftBlock
from selfspec.drafting.sources import LookupSources
from selfspec.drafting.tree import TokenTree
from selfspec.heads.base import ExitHead
from selfspec.models.split import SplitModel
from selfspec.state import SequenceState


def propose_tree(split: SplitModel, head: ExitHead, context: int | None, sources: LookupSources,
                 seq: SequenceState, k: int, depth: int, width: int, limit: int) -> DraftBlock:
    """A token tree of ``depth`` levels, ``width`` nodes per level chosen by path score (EAGLE-2), drafted at exit
    depth ``k``, plus the lookup continuation as one more branch (at most ``limit`` long). Each level's nodes go
    through the shallow layers as one tree block and then through the head (the deepest level skips the head), so
    every node's exit state is ready for verification. ``context``: the most backlog rows the head catches up
    (``selfspec.drafting.head_state``)."""
    p = seq.length
    dev = split.device
    tree = TokenTree.root(seq.pending)
    ids = torch.tensor([[seq.pending]], dtype=torch.long, device=dev)
    states = [split.run_layers(split.embed(ids), 0, k, seq.positions(p, 1), seq.cache)]
    frontier: list[tuple[int, torch.Tensor, torch.Tensor | None]]  # (node, its draft logits, its f^)
    if head.needs_context:
        logits, f_hat = head_state.deep_logits(head, seq, states[0], None, k, context)
        frontier = [(0, logits, f_hat)]
    else:
        frontier = [(0, head_state.head_logits(head, seq, states[0], p, context), None)]
    for d in range(1, depth + 1):
        cands = []
        for node, logits, f in frontier:
            top = torch.log_softmax(logits.float(), -1).topk(width)
            for lp, tok in zip(top.values.tolist(), top.indices.tolist()):
                if lp > float("-inf"):
                    cands.append((tree.scores[node] + lp, node, tok, f))
        cands.sort(key=lambda c: -c[0])
        cands = cands[:width]
        rows = [tree.add(tok, node, score) for score, node, tok, _ in cands]
        att = tree.attention(rows, p, dev)
        pos = tree.positions(rows, p, dev)
        new_ids = torch.tensor([[tree.tokens[i] for i in rows]], dtype=torch.long, device=dev)
        h = split.run_layers(split.embed(new_ids), 0, k, pos, seq.cache, tree=att)
        states.append(h)
        if d == depth:
            break
        if head.needs_context:
            # [1, n, hidden]: each parent's f^ (every node has one when the head reads context)
            ctx = torch.cat([f for _, _, _, f in cands if f is not None], dim=1)
            f_new = head.features(head_state.project(head, h, k), ctx, pos, seq.head.state, tree=att)
            logits_new = head.logits_of(f_new)[0]
            frontier = [(r, logits_new[j], f_new[:, j : j + 1]) for j, r in enumerate(rows)]
        else:  # a stateless head (supports_tree)
            logits_new = head(h, pos)[0]
            frontier = [(r, logits_new[j], None) for j, r in enumerate(rows)]
    if sources.lookup > 0 and seq.tokens:
        rows = tree.insert_chain(sources.index(seq).continuation(min(limit, sources.lookup)))
        if rows:
            new_ids = torch.tensor([[tree.tokens[i] for i in rows]], dtype=torch.long, device=dev)
            states.append(split.run_layers(split.embed(new_ids), 0, k, tree.positions(rows, p, dev), seq.cache,
                                           tree=tree.attention(rows, p, dev)))
    return DraftBlock(tree.tokens[1:], None, torch.cat(states, dim=1), start=p, source="tree", tree=tree,
                      exit_layer=k)
