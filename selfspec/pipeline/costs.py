"""The cost model of the two-stage pipeline (PPSD), next to sequential self-speculation.

A round drafts a block of g tokens and verifies it. Sequentially (selfspec's engine) the two halves
take turns on one device:

    T_seq = T_S + T_D          T_S = (g + 1) t_shallow + g t_head     T_D = t_deep(g + 1)

In the pipeline the shallow stage runs on its own device and, while the deep stage verifies block t,
drafts block t + 1 as if block t were accepted whole (its first token is the head's guess of the
bonus token). That draft is right with probability P = a^(g + 1) (every draft and the guess
accepted, i.i.d. acceptance a); otherwise it is thrown away and the shallow stage drafts again once
the verdict is in, while the deep stage waits:

    T_pipe = max(T_S', T_D) + (1 - P) T_S'       T_S' = T_S + t_head (the guess)

Both emit E = (1 - a^(g + 1)) / (1 - a) tokens per round (the mean accepted length), so the speeds over plain
decoding (t_plain per token) are E t_plain / T_seq and E t_plain / T_pipe. Worked example (illustrative costs
of a small model and its head: t_shallow 1.5 ms, t_head 2.6 ms, t_deep(2) 25 ms, t_plain 26 ms, a 0.3, g 1):
T_S = 5.6, T_seq = 30.6, P = 0.09, T_pipe = max(8.2, 25) + 0.91 * 8.2 = 32.5, E = 1.3; sequential 1.10x plain,
pipelined 1.04x: the guess is rarely right, and a wrong guess puts the redraft back on the critical path.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from selfspec.costs import DraftCosts


@dataclass
class PipelinePrediction:
    gamma: int
    acceptance: float
    mean_accepted_length: float  # E, tokens per round
    t_round_sequential: float  # seconds
    t_round_pipelined: float  # seconds, two devices
    p_ahead: float  # probability the block drafted ahead is the right one
    speedup_sequential: float  # over plain decoding
    speedup_pipelined: float  # over plain decoding

    def to_dict(self) -> dict:
        return asdict(self)


def predict(costs: DraftCosts, acceptance: float, gamma: int, p_ahead: float | None = None) -> PipelinePrediction:
    """The two-stage pipeline's expected speed on two devices (see the module text). ``p_ahead``: the
    measured share of rounds whose block drafted ahead was right, in place of a^(g + 1) (a confidence
    stop ends blocks where acceptance is likely, so the i.i.d. guess underestimates it)."""
    a, g = acceptance, gamma
    e = (1 - a ** (g + 1)) / (1 - a) if a < 1 else float(g + 1)
    t_s = (g + 1) * costs.t_shallow + g * costs.t_head
    t_d = costs.deep(g + 1)
    t_s_ahead = t_s + costs.t_head
    p = a ** (g + 1) if p_ahead is None else p_ahead
    t_seq = t_s + t_d
    t_pipe = max(t_s_ahead, t_d) + (1 - p) * t_s_ahead
    return PipelinePrediction(g, a, e, t_seq, t_pipe, p, e * costs.t_plain / t_seq, e * costs.t_plain / t_pipe)
