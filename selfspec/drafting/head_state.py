"""The exit head's per-sequence state (``SequenceState.head``, a ``selfspec.state.HeadState``) and the head's work
over it. A stateless head keeps none of it: each draft reads its exit state alone.

- **Backlog**: a stateful head runs over the exit states of the positions it has not seen before it drafts (at
  first the whole prompt; after a lookup block or a blank round, those rows). At most ``context`` rows of it
  (``DraftConfig.head_context``) are caught up; the head passes over the older ones (``ExitHead.skip``).
- **Finals**: a deep-context head also reads the verified tokens' final states, kept here as verification gives
  them (``store_finals``); a draft's own position reads the head's predicted one instead (``f_prev``).
- **The head's own state** (``ExitHead.new_state``: its KV cache) is rolled back with the target's cache after each
  verification, and the verified rows it has not seen join the backlog (``accepted``).

``depth`` is the exit depth of the states (a nested head projects each depth into one space, ``project``)."""

from __future__ import annotations

import torch

from selfspec.drafting.base import DraftBlock
from selfspec.heads.base import ExitHead
from selfspec.state import HeadState, SequenceState


def start(head: ExitHead, seq: SequenceState, exit_states: torch.Tensor, final_states: torch.Tensor | None,
          first: int, depth: int) -> None:
    """After the prompt's prefill, with its exit and final states ``# [1, P - first, hidden]`` of positions
    ``first``.. (those before came from the prefix cache: the head passes over them)."""
    hs = seq.head
    if head.stateful:
        hs.state = head.new_state(seq.cache.capacity)
        head.skip(hs.state, first)
        hs.backlog = project(head, exit_states, depth)
    if head.needs_context:
        n = exit_states.shape[1]
        assert final_states is not None, "a deep-context head starts from the prompt's final states"
        hs.finals = exit_states.new_zeros(seq.cache.capacity + 1, final_states.shape[-1])
        hs.finals[first + 1 : first + n + 1] = final_states[0]


def project(head: ExitHead, h: torch.Tensor, depth: int) -> torch.Tensor:
    """Exit states as the head reads them (a nested head maps each depth into one space, heads.nested)."""
    return head.project(h, depth) if head.needs_context else h


def backlog(hs: HeadState) -> int:
    """Rows a stateful head must still run over before it drafts (0 for a stateless head)."""
    return 0 if hs.backlog is None else int(hs.backlog.shape[1])


def catch_up_rows(hs: HeadState, context: int | None) -> int:
    """Rows the head would run over before its next draft: the backlog, at most ``context`` of it."""
    b = backlog(hs)
    return b if context is None else min(b, context)


def take_backlog(head: ExitHead, hs: HeadState, context: int | None) -> tuple[int, torch.Tensor | None]:
    """(first position, the rows ``# [1, b, hidden]`` or None) a stateful head consumes before its next exit
    state: the backlog it has not seen, at most ``context`` rows of it (the head skips the oldest others)."""
    rows, hs.backlog = hs.backlog, None
    if rows is not None and context is not None and rows.shape[1] > context:
        head.skip(hs.state, rows.shape[1] - context)  # the oldest rows: never seen
        rows = rows[:, rows.shape[1] - context :]
    if rows is not None and rows.shape[1] == 0:
        rows = None
    return head.seen(hs.state), rows


def with_backlog(head: ExitHead, hs: HeadState, context: int | None,
                 h: torch.Tensor) -> tuple[int, torch.Tensor]:
    """(first position, exit states) a stateful head consumes next: the backlog it has not seen, then ``h``."""
    first, rows = take_backlog(head, hs, context)
    return first, h if rows is None else torch.cat([rows, h], dim=1)


def store_finals(hs: HeadState, start: int, states: torch.Tensor) -> None:
    """Final states ``# [n, hidden]`` of positions start..start + n - 1 (verified tokens)."""
    finals = hs.finals
    assert finals is not None, "a deep-context head's finals start with the prompt's (start)"
    end = start + 1 + states.shape[0]
    if end > finals.shape[0]:
        finals = hs.finals = torch.cat([finals, finals.new_zeros(end, finals.shape[1])])
    width = min(finals.shape[1], states.shape[1])  # a verdict without the context layers' states: zeros there
    finals[start + 1 : end, :width] = states[:, :width]
    if width < finals.shape[1]:  # (no empty fill otherwise: each small op after a step runs cold)
        finals[start + 1 : end, width:] = 0


def deep_inputs(head: ExitHead, seq: SequenceState, h: torch.Tensor, f_prev: torch.Tensor | None, depth: int,
                context: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the deep head reads for exit state ``h`` (its backlog first): (exit states ``# [1, n, hidden]``,
    the previous positions' final states ``# [1, n, width]``, positions ``# [1, n]``). ``f_prev``: the predicted
    final state of the position before when that token is itself a draft (None: it is verified, its true
    final state is stored)."""
    hs = seq.head
    first, h = with_backlog(head, hs, context, project(head, h, depth))
    n = h.shape[1]
    assert hs.finals is not None, "a deep-context head's finals start with the prompt's (start)"
    ctx = hs.finals[first : first + n].unsqueeze(0)  # [1, n, hidden]: positions first - 1 ...
    if f_prev is not None:  # a draft's context: f^ alone (the context layers' part reads zeros)
        ctx = ctx.clone()
        ctx[:, -1] = 0
        ctx[:, -1, : f_prev.shape[-1]] = f_prev[:, -1]
    return h, ctx, seq.positions(first, n)


def deep_features(head: ExitHead, seq: SequenceState, h: torch.Tensor, f_prev: torch.Tensor | None, depth: int,
                  context: int | None) -> torch.Tensor:
    """The predicted final state ``# [1, 1, hidden]`` at the position of exit state ``h`` (``deep_inputs``)."""
    h, ctx, pos = deep_inputs(head, seq, h, f_prev, depth, context)
    return head.features(h, ctx, pos, seq.head.state, tail=1)[:, -1:]


def deep_draft(head: ExitHead, seq: SequenceState, h: torch.Tensor, f_prev: torch.Tensor | None, depth: int,
               context: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A greedy draft's inputs: (f^ ``# [1, 1, hidden]`` as ``deep_features``, the drafted vocabulary's logits
    there ``# [V']``, their ids or None), in one compiled call where the head has one (``draft_step``)."""
    h, ctx, pos = deep_inputs(head, seq, h, f_prev, depth, context)
    fused = head.draft_step(h, ctx, pos, seq.head.state)
    if fused is not None:
        return fused[0][:, -1:], fused[1], fused[2]
    f_hat = head.features(h, ctx, pos, seq.head.state, tail=1)[:, -1:]
    part, ids = head.logits_part_of(f_hat)
    return f_hat, part[0, -1], ids


def deep_logits(head: ExitHead, seq: SequenceState, h: torch.Tensor, f_prev: torch.Tensor | None, depth: int,
                context: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft logits ``# [vocab]`` for the token after exit state ``h`` and the predicted final state
    ``# [1, 1, hidden]`` there (``deep_features``)."""
    f_hat = deep_features(head, seq, h, f_prev, depth, context)
    return head.logits_of(f_hat)[0, -1], f_hat


def head_logits(head: ExitHead, seq: SequenceState, h: torch.Tensor, pos: int,
                context: int | None) -> torch.Tensor:  # -> [vocab]
    """A head that reads no context: draft logits for the token after exit state ``h`` at position ``pos`` (a
    stateful one over its backlog first)."""
    if not head.stateful:
        return head(h, seq.positions(pos, 1))[0, -1]
    first, h = with_backlog(head, seq.head, context, h)
    return head(h, seq.positions(first, h.shape[1]), seq.head.state)[0, -1]


def accepted(head: ExitHead, seq: SequenceState, block: DraftBlock, num_accepted: int,
             final_states: torch.Tensor | None, exit_layer: int) -> None:
    """After verification (``seq`` holds ``seq.length`` final tokens): the verified final states
    ``final_states[0, : num_accepted + 1]`` stored, the head's own state rolled back to what stays true, and the
    block's verified exit states it has not seen (of depth ``block.exit_layer``, else ``exit_layer``) put on its
    backlog."""
    hs = seq.head
    if head.needs_context:
        assert final_states is not None, "a deep-context head keeps the verified final states"
        store_finals(hs, block.start, final_states[0, : num_accepted + 1])
    if not head.stateful:
        return
    p, length = block.start, seq.length
    seen = head.seen(hs.state)
    # Entries the head made from a draft's predicted final state are redone from the true one; the
    # entry at p read the verified f(p - 1) and stays.
    valid = min(seen, p + 1) if head.needs_context else min(seen, length)
    head.rollback(hs.state, valid)
    assert block.exit_states is not None, "a stateful head's drafter makes blocks with exit states"
    new = project(head, block.exit_states[:, max(valid, p) - p : length - p], block.exit_layer or exit_layer)
    old = hs.backlog  # positions [valid, p) when the head did not run this round
    hs.backlog = new if old is None or old.shape[1] == 0 else torch.cat([old, new], dim=1)
