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
import sys
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from selfspec.api import SelfSpec
from selfspec.bench import llamacpp, results
from selfspec.bench.answers import AnswerFile
from selfspec.bench.config import BenchConfig
from selfspec.bench.divergences import compute_divergences
from selfspec.bench.manifest import open_manifest, write_json
from selfspec.bench.methods import Method, resolve_methods
from selfspec.bench.questions import (
    DEFAULT_QUESTIONS,
    Question,
    load_questions,
    select_questions,
    turn_prompt,
)
from selfspec.bench.report import write_report
from selfspec.bench.tables import compare_runs
from selfspec.bench.turn import run_turn
from selfspec.cli_options import add_config_args, config_from_args
from selfspec.config import ModelConfig
from selfspec.errors import InvalidConfigError
from selfspec.progress import announce, progress

WARMUP_PROMPT = "Write two sentences about rivers and the sea, then one about mountains."


# ---- answers -----------------------------------------------------------------------------------
def answer_text(ss: SelfSpec, token_ids: list[int]) -> str:
    """The text of a turn as the next turn's prompt sees it: special tokens (EOS) dropped, stripped."""
    ids = token_ids[:-1] if token_ids and token_ids[-1] in ss.eos_token_ids else token_ids
    return ss.tokenizer.decode(ids, skip_special_tokens=True).strip()


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


# ---- the run -----------------------------------------------------------------------------------
def run_bench(cfg: BenchConfig, model_cfg: ModelConfig | None = None, ss: SelfSpec | None = None,
              on_answer: Callable[[str, int], None] | None = None) -> str:
    """Run (or resume) the benchmark; returns the summary as markdown. ``ss`` lets a caller pass an
    already loaded model; ``on_answer(method, question_id)`` is called after each durable answer."""
    from transformers.utils import logging as hf_logging  # lazy: as in selfspec.bench.manifest.machine_info

    questions = load_questions(cfg.questions)
    chosen = select_questions(questions, cfg.categories, cfg.limit)
    if ss is None:
        ss = SelfSpec.load(model_cfg or ModelConfig())
        announce(ss.describe())
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
            write_json(run / "manifest.json", manifest)
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
            write_json(div_path, divs)
    finally:
        llamacpp.stop_all()
        hf_logging.set_verbosity(verbosity)
        ss.prefix_cache.entries = OrderedDict()
    manifest["sessions"][-1]["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    write_json(run / "manifest.json", manifest)
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
