"""One round of decoding: the pieces every decode loop is made of.

A loop (batch-1 ``Engine.generate_tokens``, continuous batching ``selfspec.batch``, SpecEE's two modes,
the pipeline's two stages) is a short ``while`` over these, in this order:

    prefill        the prompt's rows through the layers; the first token (the target's own) is pending
    propose        a Drafter's block after the pending token (``selfspec.drafting``)
    rows_of        the rows a round sends through the (deep) layers: the block's exit states, or embeddings
    verify         the target's verdict on the block: m drafts accepted, then a recovered or bonus token
    commit         the sequence takes the verdict: KV cache rolled back to the accepted rows (a pointer
                   move, or a compaction for a tree's path), length and pending token moved, the drafter
                   told (it re-syncs and learns), the tokens extended, the stats counted
    cut            stop: at most ``remaining`` tokens, and nothing after an EOS

Worked example (greedy, pending x at position p = 10, drafts [5, 9, 2], target argmax after each row
[5, 9, 7, 4]): verify gives m = 2, next token 7 (recovered); commit keeps the KV of positions 10..12 (x,
5, 9: the cache's length becomes 13), the pending token becomes 7, and [5, 9, 7] is emitted.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from selfspec.config import GenerateConfig
from selfspec.drafting.base import DraftBlock, Drafter
from selfspec.models.split import Ride, SplitModel
from selfspec.sampling import greedy, logits_to_probs, pick
from selfspec.state import SequenceState
from selfspec.stats import LOOKUP_SOURCES, GenerationStats
from selfspec.verify import greedy_tree_verify, speculative_verify, tree_sample_verify


def prefill(split: SplitModel, seq: SequenceState, prompt_ids: list[int], gen: GenerateConfig,
            capture: int | None = None, first: int = 0, context_layers: list[int] | None = None,
            tail: int | None = None) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The prompt through every layer into ``seq``'s cache; its first token becomes pending and ``seq.tokens``
    the prompt plus it. ``capture``: also return the states after this many layers (a drafter's exit states).
    ``first``: the cache already holds positions [0, first) (the prefix cache's), only the rest is computed.
    ``context_layers`` (each past ``capture``): the states after them follow the last layer's (``through_layers``).
    ``tail``: only the last ``tail`` rows' last-layer states are needed (``SplitModel.run_layers``; the rows before
    them hold their states entering the last layer).
    -> (captured states ``# [1, P - first, hidden]`` or None, last-layer states ``# [1, P - first, hidden]``,
    or ``# [1, P - first, hidden * (1 + C)]`` with C context layers)."""
    ids = torch.tensor([prompt_ids[first:]], dtype=torch.long, device=split.device)
    pos = seq.positions(first, len(prompt_ids) - first)
    if capture is None:
        h_k, h, ctx = None, split.run_layers(split.embed(ids), 0, split.num_layers, pos, seq.cache, tail=tail), None
    else:
        h_k = split.run_layers(split.embed(ids), 0, capture, pos, seq.cache)
        h, ctx = through_layers(split, Ride(capture, h_k, pos, seq.cache, tail=tail), context_layers)
    take_first(seq, prompt_ids, split.logits(h[:, -1:])[0, -1], gen)
    return h_k, h if ctx is None else ctx


def through_layers(split: SplitModel, ride: Ride, context_layers: list[int] | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``ride``'s rows through layers [ride.layer, L) (into its cache). -> (last-layer states ``# [1, n, hidden]``,
    with ``context_layers`` (each past ``ride.layer``) those states followed by the states after each of them
    ``# [1, n, hidden * (1 + C)]``: what a deep head with fused features keeps of verified tokens; else None)."""
    if not context_layers:
        return split.run_layers(ride.h, ride.layer, split.num_layers, ride.positions, ride.cache, tree=ride.tree,
                                tail=ride.tail), None
    ride.context = tuple(context_layers)  # run_rides cuts its stages there and keeps the states (a batch's way too)
    h = split.run_rides([ride])[0]
    return h, ride.with_contexts(h)


def take_first(seq: SequenceState, prompt_ids: list[int], logits: torch.Tensor, gen: GenerateConfig) -> int:
    """After a prefill: the first token picked from the last prompt row's ``logits`` ``# [vocab]`` is pending."""
    seq.length = len(prompt_ids)
    seq.pending = pick(logits, gen, seq.generator)
    seq.tokens = [*prompt_ids, seq.pending]
    return seq.pending


def rows_of(split: SplitModel, seq: SequenceState, block: DraftBlock | None, exit_layer: int = 0) -> Ride:
    """The rows a round sends through the layers: with no block (a plain step) the pending token from the
    embeddings; a chain's exit states from its depth (``block.exit_layer``, else ``exit_layer``); a tree's
    nodes under its tree mask; a block without exit states (a drafter that shares no layers) from the
    embeddings of [pending, d_1..d_g]."""
    if block is None or block.exit_states is None:
        toks = [seq.pending] if block is None else [seq.pending, *block.tokens]
        ids = torch.tensor([toks], dtype=torch.long, device=split.device)
        return Ride(0, split.embed(ids), seq.positions(seq.length, len(toks)), seq.cache)
    k = block.exit_layer if block.exit_layer is not None else exit_layer
    if block.tree is None:
        return Ride(k, block.exit_states, seq.positions(block.start, len(block.tokens) + 1), seq.cache)
    nodes = list(range(len(block.tree)))
    return Ride(k, block.exit_states, block.tree.positions(nodes, block.start, split.device), seq.cache,
                block.tree.attention(nodes, block.start, split.device))


def verify_chain(gen: GenerateConfig, drafts: list[int], draft_probs: torch.Tensor | None,
                 target_logits: torch.Tensor, generator: torch.Generator | None) -> tuple[int, int]:
    """The target's verdict on a chain: greedy (longest agreeing prefix) or speculative sampling (exactly the
    target's distribution). ``draft_probs`` ``# [g, vocab]`` (None: greedy drafts, one-hot under sampling),
    ``target_logits`` ``# [1, g + 1, vocab]``. -> (accepted m, recovered or bonus token)."""
    if gen.greedy:
        return greedy_chain(drafts, greedy(target_logits[0]).tolist())
    d = torch.tensor([drafts], dtype=torch.long, device=target_logits.device)  # [1, g]
    target_probs = logits_to_probs(target_logits, gen.temperature, gen.top_k, gen.top_p)
    if draft_probs is not None:
        q = draft_probs.unsqueeze(0)  # [1, g, vocab]
    else:  # greedy (one-hot) drafts under sampling: still exactly lossless
        q = F.one_hot(d, target_logits.shape[-1]).to(target_probs.dtype)
    res = speculative_verify(d, q, target_probs, generator)
    return int(res.num_accepted[0]), int(res.next_token[0])


def greedy_chain(drafts: list[int], target_ids: list[int]) -> tuple[int, int]:
    """Greedy verdict on a chain from the target's argmax after each row (``target_ids``, g + 1 of them): the
    longest prefix equal to it, then its argmax (greedy_verify, batch 1). -> (accepted m, next token)."""
    m = next((i for i, t in enumerate(drafts) if t != target_ids[i]), len(drafts))
    return m, target_ids[m]


def greedy_tree(block: DraftBlock, target_ids: torch.Tensor) -> tuple[list[int], int]:
    """Greedy verdict on a token tree from the target's argmax after each node (``target_ids`` ``# [nodes]``):
    the accepted path (node indices, root first) and the target's token after it (greedy_tree_verify)."""
    assert block.tree is not None, "greedy_tree takes a token tree's block"
    return greedy_tree_verify(block.tree.parents, block.tree.tokens, target_ids)


def verify_tree(gen: GenerateConfig, block: DraftBlock, target_logits: torch.Tensor,
                generator: torch.Generator | None) -> tuple[list[int], int]:
    """The target's verdict on a token tree, ``target_logits`` ``# [nodes, vocab]``: the accepted path (node
    indices, root first) and the recovered or bonus token after it."""
    tree = block.tree
    assert tree is not None, "verify_tree takes a token tree's block"
    if gen.greedy:
        return greedy_tree(block, greedy(target_logits))
    probs = logits_to_probs(target_logits, gen.temperature, gen.top_k, gen.top_p)
    return tree_sample_verify(tree.parents, tree.tokens, probs, generator)


def commit(seq: SequenceState, drafter: Drafter | None, block: DraftBlock, m: int, nxt: int,
           final_states: torch.Tensor | None, stats: GenerationStats | None = None,
           proposed: int | None = None, observe: bool = True) -> list[int]:
    """``seq`` takes the verdict (``m`` of ``block``'s drafts accepted, then ``nxt``): its cache keeps the
    pending token and the accepted drafts (``block.start`` + 1 + m positions), ``nxt`` becomes pending, the
    drafter re-syncs from ``final_states`` ``# [1, m + 1, hidden]`` or more (the verification's last-layer
    states of the block's rows) and its policy learns (unless ``observe`` is False: a verdict the pipeline
    only supposes), ``stats`` counts the round (``proposed``: the draft length it counts, default the
    block's). -> the emitted tokens, accepted drafts then ``nxt``."""
    p = block.start
    seq.cache.truncate(p + 1 + m)
    seq.length, seq.pending = p + 1 + m, nxt
    if drafter is not None:
        drafter.accepted(seq, block, m, final_states, proposed=proposed, observe=observe)
    g = len(block.tokens) if proposed is None else proposed
    if stats is not None:
        stats.record_step(g, m, block.source)
        if g and block.source not in LOOKUP_SOURCES and block.exit_layer is not None:
            stats.draft_depths[block.exit_layer] = stats.draft_depths.get(block.exit_layer, 0) + 1
    out = block.tokens[:m] + [nxt]
    seq.tokens.extend(out)
    return out


def commit_path(seq: SequenceState, drafter: Drafter, block: DraftBlock, path: list[int], nxt: int,
                final_states: torch.Tensor, stats: GenerationStats | None = None) -> list[int]:
    """``commit`` for a token tree whose accepted path is the nodes ``path`` (root first): their KV entries
    move into place in every layer, then the path is committed as a chain; the policy learns from the depth
    the tree was drafted to. ``final_states`` ``# [1, nodes, hidden]``."""
    p = block.start
    assert block.tree is not None and block.exit_states is not None, "commit_path takes a token tree's block"
    seq.cache.compact(p, path)
    chain = DraftBlock([block.tree.tokens[i] for i in path[1:]], None, block.exit_states[:, path], start=p,
                      exit_layer=block.exit_layer)
    return commit(seq, drafter, chain, len(path) - 1, nxt, final_states[:, path], stats, proposed=block.levels)


def commit_plain(seq: SequenceState, nxt: int, stats: GenerationStats | None = None) -> list[int]:
    """A plain step's bookkeeping: the pending token's KV is in the cache now, ``nxt`` becomes pending."""
    seq.length += 1
    seq.pending = nxt
    seq.tokens.append(nxt)
    if stats is not None:
        stats.record_step(0, 0)
    return [nxt]


def cut(tokens: list[int], remaining: int, eos: set[int] | frozenset[int] = frozenset()) -> tuple[list[int], bool]:
    """Stop: a round's ``tokens`` cut to the ``remaining`` budget and after the first EOS.
    -> (the tokens to emit, whether the sequence is finished)."""
    out = tokens[:remaining]
    for i, t in enumerate(out):
        if t in eos:
            return out[: i + 1], True
    return out, len(out) >= remaining
