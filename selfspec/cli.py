"""Command line: ``selfspec generate | bench-quick | ...``. Options are built from the dataclass
configs (selfspec.config), so names match the Python API: ``max_new_tokens`` <-> ``--max-new-tokens``."""

from __future__ import annotations

import argparse
import sys
from dataclasses import MISSING, fields
from typing import Any

from selfspec.config import DraftConfig, GenerateConfig, ModelConfig
from selfspec.errors import SelfSpecError


def _type_of(f: Any) -> tuple[Any, bool]:
    """(argparse type, is_list) from a dataclass field's annotation string."""
    t = str(f.type)
    if t.startswith("list[str]"):
        return str, True
    if t.startswith("list[int]"):
        return int, True
    for name, typ in (("int", int), ("float", float), ("bool", bool)):
        if t.startswith(name):
            return typ, False
    return str, False


def add_config_args(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    group = parser.add_argument_group(cls.__name__, cls.__doc__)
    for f in fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        typ, is_list = _type_of(f)
        default = f.default if f.default is not MISSING else None
        kw: dict[str, Any] = {"dest": f"{cls.__name__}.{f.name}", "help": f.metadata.get("help", "")}
        if typ is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, **kw)
            continue
        if "choices" in f.metadata:
            kw["choices"] = f.metadata["choices"]
        if is_list:
            group.add_argument(flag, type=typ, action="append", default=None, **kw)
        else:
            group.add_argument(flag, type=typ, default=default, **kw)


def config_from_args(args: argparse.Namespace, cls: type, **extra: Any) -> Any:
    kw = {}
    for f in fields(cls):
        key = f"{cls.__name__}.{f.name}"
        if hasattr(args, key) and getattr(args, key) is not None:
            kw[f.name] = getattr(args, key)
    kw.update(extra)
    return cls(**kw)


def _read_prompt(args: argparse.Namespace, chat: bool) -> Any:
    """The prompt argument (or stdin), as one user chat message if ``chat`` else as plain text."""
    text = args.prompt if args.prompt not in (None, "-") else sys.stdin.read()
    if chat:
        return [{"role": "user", "content": text}]
    return text


def cmd_generate(args: argparse.Namespace) -> int:
    from selfspec.api import SelfSpec

    ss = SelfSpec.load(config_from_args(args, ModelConfig), config_from_args(args, DraftConfig))
    gen = config_from_args(args, GenerateConfig)
    chat = args.chat and ss.has_chat_template
    if args.chat and not chat:
        print(f"selfspec: note: '{ss.model_id}' has no chat template, sending the prompt as plain text",
              file=sys.stderr)
    if gen.method == "specee":
        print("selfspec: note: method 'specee' is LOSSY (SpecEE as published): the text may differ from the "
              "model's own; 'specee-verified' is the lossless mode", file=sys.stderr)
    if args.pipeline:
        from selfspec.config import PipelineConfig

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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="selfspec", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

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

    from selfspec.bench.forward import add_parser as add_forward
    from selfspec.demo import add_parser as add_demo

    add_demo(sub)
    from selfspec.bench.quick import add_parser as add_quick
    from selfspec.bench.specbench import add_parser as add_bench

    add_quick(sub)
    add_forward(sub)
    add_bench(sub)
    from selfspec.bench.batching import add_parser as add_bench_batch

    add_bench_batch(sub)
    from selfspec.bench.pipeline import add_parser as add_bench_pipeline

    add_bench_pipeline(sub)
    from selfspec.train.answers import add_parser as add_answers
    from selfspec.train.cli import add_parsers as add_train
    from selfspec.train.deep import add_parser as add_train_deep
    from selfspec.train.features import add_parser as add_features
    from selfspec.train.nested import add_parser as add_train_nested
    from selfspec.train.predictors import add_parser as add_predictors

    add_train(sub)
    add_answers(sub)
    add_features(sub)
    add_train_deep(sub)
    add_train_nested(sub)
    add_predictors(sub)
    from selfspec.server.app import add_parser as add_serve
    from selfspec.tuning import add_parser as add_tune

    add_tune(sub)

    add_serve(sub)
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
