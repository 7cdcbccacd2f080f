"""Pure sampling functions with an explicit ``torch.Generator`` (no global RNG state).

The same processing (temperature, top-k, top-p) is applied to the target's and the draft's
logits, so speculative sampling compares like with like.
"""

from __future__ import annotations

import os

import torch

from selfspec.kernels.build import cpu_extension


def logits_to_probs(
    logits: torch.Tensor,  # [..., vocab]
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
) -> torch.Tensor:  # [..., vocab] float32, rows sum to 1
    """Temperature, then top-k (0: off), then top-p / nucleus (1.0: off), as transformers' warpers.
    temperature <= 0 is greedy: one-hot at the argmax."""
    logits = logits.float()
    if temperature <= 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # drop a token when the mass before it already reaches top_p (the top token always stays)
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """probs [..., vocab] -> token ids [...]."""
    flat = probs.reshape(-1, probs.shape[-1])
    ids = torch.multinomial(flat, 1, generator=generator).squeeze(-1)
    return ids.reshape(probs.shape[:-1])


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """logits [..., vocab] -> argmax ids [...]: ``logits.argmax(-1)``'s indices (the first largest value, or the
    first NaN), through the compiled op for float32 on the CPU (one pass over the logits, without torch's dispatch and
    reduction)."""
    if logits.dtype != torch.float32 or logits.device.type != "cpu" or logits.numel() == 0:
        return logits.argmax(-1)
    ops = cpu_extension()
    if ops is None:
        return logits.argmax(-1)
    return ops.argmax_rows(logits.contiguous()).view(logits.shape[:-1])


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(8), "little") & ((1 << 63) - 1))
    return g


def pick(logits: torch.Tensor, gen, generator: torch.Generator | None) -> int:  # logits [vocab]
    """The next token under ``gen`` (a GenerateConfig): greedy, or sampled from the processed distribution."""
    if gen.greedy:
        return int(greedy(logits))
    return int(sample(logits_to_probs(logits, gen.temperature, gen.top_k, gen.top_p), generator))
