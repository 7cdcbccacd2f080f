"""Command line: ``selfspec generate | bench-quick | ...``. Options are built from the dataclass
configs (selfspec.config), so names match the Python API: ``max_new_tokens`` <-> ``--max-new-tokens``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from selfspec import __version__
from selfspec.api import SelfSpec
from selfspec.bench.batching import add_parser as add_bench_batch
from selfspec.bench.forward import add_parser as add_bench_forward
from selfspec.bench.pipeline import add_parser as add_bench_pipeline
from selfspec.bench.quick import add_parser as add_bench_quick
from selfspec.bench.rounds import add_parser as add_bench_rounds
from selfspec.bench.specbench import add_parser as add_bench
from selfspec.cli_options import add_config_args, config_from_args
from selfspec.config import DraftConfig, GenerateConfig, ModelConfig, PipelineConfig
from selfspec.demo import add_parser as add_demo
from selfspec.engine import validate_request
from selfspec.errors import SelfSpecError
from selfspec.progress import announce
from selfspec.server.cli import add_parser as add_serve
from selfspec.train.answers import add_parser as add_answer_prompts
from selfspec.train.cli import add_parsers as add_train_and_eval_draft
from selfspec.train.deep import add_parser as add_train_deep
from selfspec.train.features import add_parser as add_collect_features
from selfspec.train.make_prompts import add_parser as add_make_prompts
from selfspec.train.nested import add_parser as add_train_nested
from selfspec.train.predictors import add_parser as add_train_predictors
from selfspec.train.recipe import add_parser as add_train_recipe
from selfspec.train.store import add_parser as add_build_store
from selfspec.train.sweep import add_parser as add_sweep_exit
from selfspec.tuning import cache_path, format_tuning


def _read_prompt(args: argparse.Namespace, chat: bool) -> Any:
    """The prompt argument (or stdin), as one user chat message if ``chat`` else as plain text."""
    text = args.prompt if args.prompt not in (None, "-") else sys.stdin.read()
    if chat:
        return [{"role": "user", "content": text}]
    return text


def cmd_generate(args: argparse.Namespace) -> int:
    gen = config_from_args(args, GenerateConfig)
    validate_request(1, gen, sys.maxsize)  # bad settings fail before the model loads; the prompt's checks come later
    ss = SelfSpec.load(config_from_args(args, ModelConfig), config_from_args(args, DraftConfig))
    if not args.quiet:
        announce(ss.describe())
    chat = args.chat and ss.has_chat_template
    if args.chat and not chat:
        print(f"selfspec: note: '{ss.model_id}' has no chat template, sending the prompt as plain text",
              file=sys.stderr)
    if gen.method == "specee":
        print("selfspec: note: method 'specee' is LOSSY (SpecEE as published): the text may differ from the "
              "model's own; 'specee-verified' is the lossless mode", file=sys.stderr)
    if args.pipeline:
        ss.use_pipeline(PipelineConfig(mode=args.pipeline, transport=args.pipeline_transport),
                        config_from_args(args, ModelConfig))
    result = None
    try:
        for ev in ss.stream(_read_prompt(args, chat), gen):
            sys.stdout.write(ev.text)
            sys.stdout.flush()
            result = ev.result
    finally:
        ss.use_pipeline(None)  # stops the pipeline's deep stage, if any
    sys.stdout.write("\n")
    if result is not None and not args.quiet:
        d = ss.draft_config
        where = f"exit layer {d.exit_layer}, head {ss.head.kind}, gamma {d.gamma}, policy {d.policy}"
        if gen.method.startswith("specee") and ss.engine.specee is not None:
            where += f", exit threshold {ss.engine.specee.settings.threshold[gen.method]}"
        if args.pipeline and gen.method == "selfspec":
            where += f", pipeline {args.pipeline} over a {args.pipeline_transport}"
        print(f"[{gen.method}: {where}] {result.stats.summary()}", file=sys.stderr)
    return 0


def add_generate(sub: Any) -> None:
    g = sub.add_parser("generate", help="Generate text (streams to stdout, stats to stderr).")
    g.add_argument("prompt", nargs="?", default=None, help="The prompt; '-' or nothing reads stdin.")
    g.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="Wrap the prompt as a user message in the model's chat template "
                        "(plain text if the model has none).")
    g.add_argument("--quiet", action="store_true", help="Do not print stats.")
    g.add_argument("--pipeline", choices=["ppsd", "mirror"], default=None,
                   help="Draft and verify at the same time (docs/PIPELINE.md): PPSD or Mirror-SD, the deep stage in a "
                        "second process (see --pipeline-transport).")
    g.add_argument("--pipeline-transport", choices=["process", "thread"], default="process",
                   help="Where the pipeline's deep stage runs: a second process, or a thread (one device).")
    add_config_args(g, ModelConfig)
    add_config_args(g, DraftConfig)
    add_config_args(g, GenerateConfig)
    g.set_defaults(func=cmd_generate)


def cmd_tune(args: argparse.Namespace) -> int:
    draft = DraftConfig(head=args.head, exit_layer=args.exit_layer, tune="refresh" if args.refresh else "auto")
    ss = SelfSpec.load(config_from_args(args, ModelConfig), draft)
    announce(ss.describe())
    t = ss.tuning_result
    print(json.dumps(t.to_dict(), indent=1) if args.json else format_tuning(t))
    print(f"\ncache: {cache_path(t.key)}")
    return 0


def add_tune(sub: Any) -> None:
    p = sub.add_parser("tune", help="Show (or make) the self-tuning calibration of a model + exit head on this "
                       "machine: costs, acceptance per depth and tree width, the chosen draft shape.")
    p.add_argument("--head", default="auto", help="Exit head: 'auto' (the bundled one), 'nested', 'lm' or a directory.")
    p.add_argument("--exit-layer", type=int, default=None, help="Exit layer of an 'lm' head (default L // 4).")
    p.add_argument("--refresh", action="store_true", help="Calibrate again even when a cached result exists.")
    p.add_argument("--json", action="store_true", help="Print the cached JSON instead of tables.")
    add_config_args(p, ModelConfig)
    p.set_defaults(func=cmd_tune)


# The subcommands, in the order ``selfspec --help`` lists them: each entry registers its command(s) on the
# subparsers. A command lives beside the code it runs (generate and tune, thin front ends of SelfSpec,
# live here); nothing imports this module but selfspec.__main__.
COMMANDS: tuple[Callable[[Any], None], ...] = (
    add_generate,  # generate (above)
    add_demo,  # demo (selfspec/demo.py)
    add_bench_quick,  # bench-quick (selfspec/bench/quick.py)
    add_bench_forward,  # bench-forward (selfspec/bench/forward.py)
    add_bench_rounds,  # bench-rounds (selfspec/bench/rounds.py)
    add_bench,  # bench, bench report (selfspec/bench/specbench.py)
    add_bench_batch,  # bench-batch (selfspec/bench/batching.py)
    add_bench_pipeline,  # bench-pipeline (selfspec/bench/pipeline.py)
    add_train_and_eval_draft,  # train, eval-draft (selfspec/train/cli.py)
    add_sweep_exit,  # sweep-exit (selfspec/train/sweep.py)
    add_make_prompts,  # make-prompts: prompts of Spec-Bench's kinds from ShareGPT (selfspec/train/make_prompts.py)
    add_answer_prompts,  # answer-prompts (selfspec/train/answers.py)
    add_build_store,  # build-store: a token store for lookup drafts (selfspec/train/store.py)
    add_collect_features,  # collect-features (selfspec/train/features.py)
    add_train_deep,  # train-deep (selfspec/train/deep.py)
    add_train_recipe,  # train-recipe: data to bundled-ready head in one command (selfspec/train/recipe.py)
    add_train_nested,  # train-nested (selfspec/train/nested.py)
    add_train_predictors,  # train-predictors (selfspec/train/predictors.py)
    add_tune,  # tune (above)
    add_serve,  # serve (selfspec/server/cli.py)
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="selfspec", description=__doc__)
    p.add_argument("--version", action="version", version=f"selfspec {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    for add in COMMANDS:
        add(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except SelfSpecError as e:
        print(f"selfspec: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
