"""The settings of ``selfspec bench`` (selfspec.bench.specbench): read by the run, its manifest and the methods'
spec strings (selfspec.bench.methods)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from selfspec.bench.questions import DEFAULT_QUESTIONS
from selfspec.config import opt


@dataclass
class BenchConfig:
    """Settings of ``selfspec bench`` (Spec-Bench harness)."""

    questions: str = opt(DEFAULT_QUESTIONS, "Spec-Bench question file (JSONL: question_id, category, turns).")
    out: str = opt("runs/specbench", "Run directory; rerunning with the same one resumes the run.")
    max_new_tokens: int = opt(256, "Most new tokens per turn.")
    limit: int | None = opt(None, "Questions per group (mt_bench, translation, ...), evenly spaced; None: all.")
    categories: list[str] = opt([], "Only these groups (mt_bench, translation, summarization, qa, "
                                    "math_reasoning, rag) or question categories; repeat or comma-separate.")
    methods: list[str] = opt([], "Methods to time (see selfspec.bench.methods; repeat or comma-separate). "
                                 "Default: hf, hf-prompt-lookup, hf-early-exit, plain, selfspec-lm[-POLICY] for "
                                 "every policy, and selfspec-trained[-POLICY] when a trained head is available.",
                            comma_separated=False)  # specs hold commas (selfspec:a=1,b=2): split_specs splits
    exit_layer: int | None = opt(None, "Exit layer of selfspec-lm and hf-early-exit (None: the trained head's "
                                       "layer, else L // 4).")
    head: str = opt("auto", "Trained head directory of the selfspec-trained methods ('auto': the bundled "
                            "head of the model if any; 'lm': none).")
    gamma: int = opt(4, "Most draft tokens per step of the selfspec methods (unless a spec sets it).")
    threshold: float = opt(0.6, "Threshold of the confidence policy (unless a spec sets it).")
    prompt_lookup_num_tokens: int = opt(10, "Candidate tokens of hf-prompt-lookup.")
    warmup: int = opt(16, "New tokens of the untimed warm-up generation of each method (0: none).")
    keep_drafters: bool = opt(False, "Keep each selfspec method's drafter across its turns, as its own server keeps "
                                     "it (its lookup policies learn across requests). False: built afresh each "
                                     "turn, an adaptive policy starting anew (every run so far).")
    baseline: str = opt("hf", "Method the speedups and token identity are measured against.")
    divergences: bool = opt(True, "After the run, explain every answer that differs from the baseline "
                                  "(first differing token, target's top-2 logit margin): divergences.json.")
    near_tie: float = opt(1e-3, "A divergence is a near-tie when the margin <= near_tie * max(1, |top-1 logit|).")
    results: str | None = opt(None, "After the run, keep its results file under this directory (RESULTS/<cpu>/"
                                    "<date>-<model>-<tokens>.json, replacing the same CPU kind, model and length): "
                                    "what `selfspec bench report RESULTS --write-docs` renders.")

    def to_dict(self) -> dict:
        return asdict(self)
