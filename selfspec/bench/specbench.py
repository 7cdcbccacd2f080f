"""``selfspec bench``: Spec-Bench over a question file, every method in one run.

    selfspec bench ../shared/specbench/question.jsonl --out runs/sb --max-new-tokens 256 \\
        --methods hf,hf-prompt-lookup,hf-early-exit,plain,selfspec-lm,selfspec-trained-confidence
    selfspec bench report runs/sb [--compare runs/other]

Protocol (Spec-Bench's): greedy, batch 1, each turn timed; multi-turn questions see the method's own
earlier answers through the chat template. After a warm-up, methods alternate question by question
(the order rotates) so drift on a noisy machine hits all of them alike.

Run directory: ``manifest.json`` (machine, versions, model, every config), ``answers/<method>.jsonl``
(one Spec-Bench answer record per question), ``divergences.json``, ``summary.md`` / ``summary.json``
and ``speedup.png`` (see selfspec.bench.report). Each answer is appended, flushed and fsync'ed as soon
as it is finished; a rerun with the same ``--out`` skips what every method has already answered.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

import selfspec
from selfspec.api import SelfSpec
from selfspec.bench import llamacpp, results
from selfspec.bench.methods import Method, resolve_methods, run_turn
from selfspec.bench.report import (
    GROUPS,
    MT_BENCH_CATEGORIES,
    compare_runs,
    compute_divergences,
    group_of,
    read_answers,
    write_report,
)
from selfspec.config import GenerateConfig, ModelConfig, add_config_args, config_from_args, opt
from selfspec.errors import InvalidConfigError
from selfspec.progress import progress

DEFAULT_QUESTIONS = "../shared/specbench/question.jsonl"
FORMAT = "selfspec-specbench/1"
WARMUP_PROMPT = "Write two sentences about rivers and the sea, then one about mountains."


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


# ---- questions -------------------------------------------------------------------------------
@dataclass
class Question:
    question_id: int
    category: str
    turns: list[str]

    @property
    def group(self) -> str:
        return group_of(self.question_id, self.category)


def load_questions(path: str | Path) -> list[Question]:
    """Read a Spec-Bench question file; a bad line is an error naming the file and line number."""
    path = Path(path)
    if not path.is_file():
        raise InvalidConfigError(f"question file '{path}' does not exist")
    out: list[Question] = []
    seen: set[int] = set()
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except json.JSONDecodeError as e:
            raise InvalidConfigError(f"{path}, line {i}: not valid JSON ({e.msg})") from e
        qid, cat, turns = (d.get(k) if isinstance(d, dict) else None for k in ("question_id", "category", "turns"))
        if not isinstance(qid, int) or isinstance(qid, bool):
            raise InvalidConfigError(f"{path}, line {i}: 'question_id' must be an integer, got {qid!r}")
        if not isinstance(cat, str) or not cat:
            raise InvalidConfigError(f"{path}, line {i}: 'category' must be a non-empty string, got {cat!r}")
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
            raise InvalidConfigError(f"{path}, line {i}: 'turns' must be a non-empty list of non-empty strings")
        if qid in seen:
            raise InvalidConfigError(f"{path}, line {i}: question_id {qid} appears twice")
        seen.add(qid)
        out.append(Question(qid, cat, turns))
    if not out:
        raise InvalidConfigError(f"question file '{path}' has no questions")
    return out


def select_questions(questions: list[Question], categories: list[str], limit: int | None) -> list[Question]:
    """Filter by group / category names, then keep ``limit`` evenly spaced questions per group."""
    wanted = {c.strip() for v in categories for c in v.split(",") if c.strip()}
    known = {q.group for q in questions} | {q.category for q in questions}
    unknown = sorted(wanted - known)
    if unknown:
        raise InvalidConfigError(f"unknown categories {unknown} (known: {', '.join(sorted(known))})")
    chosen = [q for q in questions if not wanted or q.group in wanted or q.category in wanted]
    if limit is None:
        return chosen
    if limit < 1:
        raise InvalidConfigError(f"limit must be >= 1, got {limit}")
    by_group: dict[str, list[Question]] = {}
    for q in chosen:
        by_group.setdefault(q.group, []).append(q)
    keep: set[int] = set()  # question ids
    for qs in by_group.values():
        n = min(limit, len(qs))
        keep.update(qs[i * len(qs) // n].question_id for i in range(n))
    return [q for q in chosen if q.question_id in keep]


# ---- answers -----------------------------------------------------------------------------------
class AnswerFile:
    """One method's answers: a JSONL file, appended one durable line per finished question."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def load(self) -> dict[int, dict]:
        return read_answers(self.path, repair=True)

    def append(self, record: dict) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())


def answer_text(ss: SelfSpec, token_ids: list[int]) -> str:
    """The text of a turn as the next turn's prompt sees it: special tokens (EOS) dropped, stripped."""
    ids = token_ids[:-1] if token_ids and token_ids[-1] in ss.eos_token_ids else token_ids
    return ss.tokenizer.decode(ids, skip_special_tokens=True).strip()


def turn_prompt(ss: SelfSpec, q: Question, answers: list[str], turn: int) -> list[int]:
    """Prompt ids of turn ``turn``: the earlier user turns and the given earlier answers, chat template."""
    messages: list[dict[str, str]] = []
    for t in range(turn):
        messages += [{"role": "user", "content": q.turns[t]}, {"role": "assistant", "content": answers[t]}]
    return ss.encode(messages + [{"role": "user", "content": q.turns[turn]}])


def answer_question(ss: SelfSpec, method: Method, q: Question, max_new_tokens: int, reuse: bool = False,
                    kept: dict[str, Any] | None = None) -> dict:
    """Answer every turn of a question with one method; the Spec-Bench answer record (per-turn lists). ``reuse``:
    the method's prompt cache as a server keeps it (selfspec's prefix cache holding what this method's earlier
    requests left, ``run_bench``; llama.cpp's cache_prompt, its slot's last request, answer included), so a later
    turn reuses the earlier turns' prompt; else every turn is prefilled whole.
    ``kept``: each selfspec method's drafter as its earlier turns left it (``BenchConfig.keep_drafters``)."""
    c: dict[str, list] = {k: [] for k in ("turns", "new_tokens", "wall_time", "decoding_steps", "accept_lengths",
                                          "draft_tokens", "prompt_tokens", "cached_tokens", "token_ids", "specee",
                                          "rounds", "peer", "prefill_time")}
    for turn in range(len(q.turns)):
        if not reuse:
            ss.prefix_cache.clear()
        r = run_turn(ss, method, turn_prompt(ss, q, c["turns"], turn), max_new_tokens, reuse, kept)
        for key, value in (("turns", answer_text(ss, r.token_ids)), ("new_tokens", r.new_tokens),
                           ("wall_time", r.wall_time), ("decoding_steps", r.decoding_steps),
                           ("accept_lengths", r.accept_lengths), ("draft_tokens", r.draft_tokens),
                           ("prompt_tokens", r.prompt_tokens), ("cached_tokens", r.cached_tokens),
                           ("token_ids", r.token_ids), ("specee", r.specee), ("rounds", r.rounds), ("peer", r.peer),
                           ("prefill_time", r.prefill_time)):
            c[key].append(value)
    return {"question_id": q.question_id, "category": q.category, "answer_id": f"{method.name}-{q.question_id}",
            "model_id": f"{ss.model_id}-{method.name}", "method": method.name,
            "choices": [{"index": 0, **c}], "tstamp": time.time()}


# ---- manifest ----------------------------------------------------------------------------------
def machine_info() -> dict[str, Any]:
    import transformers  # lazy: a heavy import, loaded anyway once a model is (selfspec.models.loading)

    cpu = ""
    try:
        cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "")
    except OSError:
        pass
    try:
        commit = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
                                cwd=Path(__file__).parent, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {"platform": platform.platform(), "python": platform.python_version(), "cpu": cpu,
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
            "versions": {"selfspec": selfspec.__version__, "torch": torch.__version__,
                         "transformers": transformers.__version__},
            "git": commit}


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)


def open_manifest(run: Path, cfg: BenchConfig, model_cfg: ModelConfig | None, ss: SelfSpec,
                  methods: list[Method]) -> dict[str, Any]:
    """Create the manifest, or check a resumed run is the same experiment and record this resumption."""
    path = run / "manifest.json"
    now = time.strftime("%Y-%m-%d %H:%M:%S")
    settings = {m.name: m.settings() for m in methods}
    gen = GenerateConfig(max_new_tokens=cfg.max_new_tokens, ignore_eos=False)
    model = {"model_id": ss.model_id, "num_layers": ss.split.num_layers, "vocab_size": ss.split.vocab_size,
             "dtype": str(ss.split.dtype).removeprefix("torch."), "parameters": sum(p.numel() for p in ss.model.parameters())}
    if path.is_file():
        m = json.loads(path.read_text())
        problems = []
        if m["model"]["model_id"] != ss.model_id:
            problems.append(f"model {m['model']['model_id']} vs {ss.model_id}")
        if m["generate"]["max_new_tokens"] != cfg.max_new_tokens:
            problems.append(f"max_new_tokens {m['generate']['max_new_tokens']} vs {cfg.max_new_tokens}")
        for name, s in settings.items():
            old = m["methods"].get(name)
            if old is not None and json.loads(json.dumps(old)) != json.loads(json.dumps(s)):
                problems.append(f"method {name}: {old} vs {s}")
        if problems:
            raise InvalidConfigError(f"'{run}' holds a different run ({'; '.join(problems)}): use another --out")
        m["methods"].update(settings)
        m["method_order"] += [n for n in settings if n not in m["method_order"]]
    else:
        run.mkdir(parents=True, exist_ok=True)
        m = {"format": FORMAT, "created": now, "model": model, "model_config": asdict(model_cfg) if model_cfg else None,
             "generate": asdict(gen), "baseline": cfg.baseline, "methods": settings, "method_order": list(settings),
             "sessions": []}
    m["sessions"].append({"started": now, "finished": None, "bench": asdict(cfg), "machine": machine_info(),
                          "methods": list(settings)})
    _write_json(path, m)
    return m


# ---- the run -----------------------------------------------------------------------------------
def run_bench(cfg: BenchConfig, model_cfg: ModelConfig | None = None, ss: SelfSpec | None = None,
              on_answer: Callable[[str, int], None] | None = None) -> str:
    """Run (or resume) the benchmark; returns the summary as markdown. ``ss`` lets a caller pass an
    already loaded model; ``on_answer(method, question_id)`` is called after each durable answer."""
    from transformers.utils import logging as hf_logging  # lazy: as in machine_info

    questions = load_questions(cfg.questions)
    chosen = select_questions(questions, cfg.categories, cfg.limit)
    if ss is None:
        ss = SelfSpec.load(model_cfg or ModelConfig())
    methods = resolve_methods(cfg.methods, cfg, ss)
    run = Path(cfg.out)
    manifest = open_manifest(run, cfg, model_cfg, ss, methods)
    files = {m.name: AnswerFile(run / "answers" / f"{m.name}.jsonl") for m in methods}
    done = {name: f.load() for name, f in files.items()}
    pending = [q for q in chosen if any(q.question_id not in done[m.name] for m in methods)]
    reuse = ss.prefix_cache.capacity > 0  # --prefix-cache 0: every turn prefilled whole, llama.cpp's too
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # generate's deprecation notes would break the progress bar
    try:
        # Each method as its own server: selfspec's prefix cache holds what that method's own requests left (a
        # question's earlier turns, the chat template's opening), never another method's prompts
        held: dict[str, OrderedDict] = {m.name: OrderedDict() for m in methods}
        kept: dict[str, Any] | None = {} if cfg.keep_drafters else None  # ... and, if asked, its drafter
        failed: dict[str, str] = {}  # peers that cannot run on this machine (a build that faults, no binary)

        def skip(m: Method, e: Exception) -> None:  # such a peer is recorded and left out; the others go on
            failed[m.name] = str(e)
            manifest["methods"][m.name]["failed"] = str(e)
            _write_json(run / "manifest.json", manifest)
            print(f"selfspec bench: {m.name} does not run on this machine, skipped: {e}", file=sys.stderr)

        if pending and cfg.warmup > 0:  # not a question's prompt: no cache then holds one
            for m in methods:
                ss.prefix_cache.entries = held[m.name]
                try:
                    run_turn(ss, m, ss.encode([{"role": "user", "content": WARMUP_PROMPT}]), cfg.warmup, reuse, kept)
                except llamacpp.PeerUnavailable as e:
                    skip(m, e)
        bar = progress(pending, desc="spec-bench", unit="question", dynamic_ncols=True, total=len(chosen),
                   initial=len(chosen) - len(pending))
        for i, q in enumerate(bar):
            k = i % len(methods)
            for m in methods[k:] + methods[:k]:
                if q.question_id in done[m.name]:
                    continue
                if m.name in failed:
                    continue
                bar.set_postfix_str(f"{q.group} {q.question_id} {m.name}")
                ss.prefix_cache.entries = held[m.name]
                try:
                    rec = answer_question(ss, m, q, cfg.max_new_tokens, reuse, kept)
                except llamacpp.PeerUnavailable as e:
                    skip(m, e)
                    continue
                files[m.name].append(rec)
                done[m.name][q.question_id] = rec
                if on_answer is not None:
                    on_answer(m.name, q.question_id)
        bar.close()
        if cfg.divergences and cfg.baseline in done:
            by_id = {q.question_id: q for q in questions}
            texts = {qid: r["choices"][0]["turns"] for qid, r in done[cfg.baseline].items()}
            div_path = run / "divergences.json"
            known = json.loads(div_path.read_text()) if div_path.is_file() else []
            divs = compute_divergences(ss, lambda qid, t: turn_prompt(ss, by_id[qid], texts[qid], t), done,
                                       cfg.baseline, cfg.near_tie, known)
            _write_json(div_path, divs)
    finally:
        llamacpp.stop_all()
        hf_logging.set_verbosity(verbosity)
        ss.prefix_cache.entries = OrderedDict()
    manifest["sessions"][-1]["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    _write_json(run / "manifest.json", manifest)
    return write_report(run, cfg.baseline)


# ---- command line ------------------------------------------------------------------------------
def run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="selfspec bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Subcommand: selfspec bench report RUN_DIR [--compare RUN_DIR] (see --help there).")
    p.add_argument("questions", nargs="?", default=DEFAULT_QUESTIONS, help="Spec-Bench question file (JSONL).")
    add_config_args(p, ModelConfig)
    add_config_args(p, BenchConfig, skip=("questions",))
    return p


def report_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="selfspec bench report",
                                description="Re-render the summary table and plot of a run from its answer files, "
                                            "or compare two runs.")
    p.add_argument("run", help="Run directory (the --out of selfspec bench), or a results directory (the --results "
                               "of selfspec bench: RESULTS/<cpu>/*.json) to render its tables and plots.")
    p.add_argument("--compare", default=None, help="A second run directory to compare with.")
    p.add_argument("--baseline", default=None, help="Baseline method (default: the run's, usually hf).")
    p.add_argument("--write-docs", action="store_true",
                   help="With a results directory: fill the results blocks of README.md and docs/BENCHMARKS.md.")
    p.add_argument("--readme", default="README.md", help="The README that --write-docs fills.")
    p.add_argument("--benchmarks", default="docs/BENCHMARKS.md", help="The benchmarks doc that --write-docs fills.")
    return p


def cmd(args: argparse.Namespace) -> int:
    """Dispatch ``selfspec bench ...`` to the run or to ``report``."""
    argv = list(args.rest)
    if argv[:1] == ["report"]:
        a = report_parser().parse_args(argv[1:])
        if results.is_results_dir(a.run):
            if a.write_docs:
                for path in results.write_docs(a.run, a.readme, a.benchmarks):
                    print(f"filled {path}", file=sys.stderr)
            print(results.render(a.run))
            return 0
        if a.write_docs:
            raise InvalidConfigError(f"--write-docs needs a results directory, and '{a.run}' is a run directory: "
                                     "keep its results first (selfspec bench ... --results results)")
        print(compare_runs(a.run, a.compare, a.baseline) if a.compare else write_report(a.run, a.baseline))
        return 0
    a = run_parser().parse_args(argv)
    cfg = config_from_args(a, BenchConfig, questions=a.questions)
    print(run_bench(cfg, config_from_args(a, ModelConfig)))
    print(f"\nrun directory: {cfg.out}", file=sys.stderr)
    if cfg.results:
        path = results.write_results(cfg.out, cfg.results, ["selfspec", "bench", *argv])
        print(f"results file: {path}", file=sys.stderr)
    return 0


def add_parser(sub: Any) -> None:
    """Register ``bench``: everything after it is parsed by run_parser() or report_parser()."""
    p = sub.add_parser("bench", add_help=False, prefix_chars="\x00",
                       help="Spec-Bench harness: selfspec bench [QUESTIONS] [options] | selfspec bench report RUN "
                            "[--compare RUN] (see selfspec bench --help).")
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd)


__all__ = ["GROUPS", "MT_BENCH_CATEGORIES", "BenchConfig", "Question", "load_questions", "run_bench",
           "select_questions"]
