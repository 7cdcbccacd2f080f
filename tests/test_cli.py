"""The command line's parser: the command table, list options (comma-separated and/or repeated), and
config <-> option mapping and the text -> field value converter (selfspec.cli_options). Nothing is run."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest

from selfspec.bench.batching import BatchBenchConfig
from selfspec.bench.config import BenchConfig
from selfspec.bench.forward import ForwardBenchConfig
from selfspec.bench.methods import split_specs
from selfspec.bench.quick import QuickBenchConfig
from selfspec.bench.specbench import run_parser
from selfspec.cli import COMMANDS, build_parser
from selfspec.cli_options import add_config_args, config_from_args, parse_field
from selfspec.config import DraftConfig, GenerateConfig, ModelConfig, opt
from selfspec.errors import InvalidConfigError
from selfspec.train.sweep import SweepConfig

COMMAND_NAMES = ["generate", "demo", "bench-quick", "bench-forward", "bench-rounds", "bench", "bench-batch",
                 "bench-pipeline",
                 "train", "eval-draft", "sweep-exit", "make-prompts", "answer-prompts", "build-store", "collect-features", "train-deep",
                 "train-recipe",
                 "train-nested", "train-predictors", "tune", "serve"]


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def test_every_command_in_order() -> None:
    assert list(subparsers(build_parser())) == COMMAND_NAMES
    assert len(COMMANDS) == len(COMMAND_NAMES) - 1  # train and eval-draft: one entry (selfspec/train/cli.py)


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


@pytest.mark.parametrize("argv, cls, field, expected", [
    (["bench-forward", "--block-sizes", "1,2,4,8,16"], ForwardBenchConfig, "block_sizes", [1, 2, 4, 8, 16]),
    (["bench-forward", "--block-sizes", "1", "--block-sizes", "2"], ForwardBenchConfig, "block_sizes", [1, 2]),
    (["bench-forward", "--block-sizes", "1,2", "--block-sizes", "4"], ForwardBenchConfig, "block_sizes", [1, 2, 4]),
    (["bench-forward", "--block-sizes", " 1, 2 ,"], ForwardBenchConfig, "block_sizes", [1, 2]),
    (["bench-forward", "--backends", "fast,reference"], ForwardBenchConfig, "backends", ["fast", "reference"]),
    (["bench-forward", "--backends", "fast"], ForwardBenchConfig, "backends", ["fast"]),
    (["bench-forward"], ForwardBenchConfig, "block_sizes", [1, 2, 4, 8, 16]),  # the default
    (["bench-quick", "--exit-layers", "6,12"], QuickBenchConfig, "exit_layers", [6, 12]),
    (["bench-batch", "--batch-sizes", "1,2", "--methods", "plain,exspec"], BatchBenchConfig, "methods",
     ["plain", "exspec"]),
    (["bench-batch", "--batch-sizes", "1,2"], BatchBenchConfig, "batch_sizes", [1, 2]),
    (["sweep-exit", "--layers", "2,4", "--layers", "6"], SweepConfig, "layers", [2, 4, 6]),
    (["generate", "x", "--eos-token-ids", "2,7"], GenerateConfig, "eos_token_ids", [2, 7]),
])
def test_list_options_take_commas_and_repeats(argv, cls, field, expected) -> None:
    assert getattr(config_from_args(parse(*argv), cls), field) == expected


def test_every_list_option_takes_commas_and_repeats() -> None:
    """Every list option of every command: "1,2" then "3" is three values (or, for the options whose values
    may hold commas, two)."""
    checked = 0
    for name, sub in subparsers(build_parser()).items():
        for action in sub._actions:
            if not isinstance(action, (argparse._ExtendAction, argparse._AppendAction)):
                continue
            flag = action.option_strings[0]
            pre = ["x"] if name == "generate" else []
            values = getattr(sub.parse_args([*pre, flag, "1,2", flag, "3"]), action.dest)
            if isinstance(action, argparse._ExtendAction):
                assert [str(v) for v in values] == ["1", "2", "3"], (name, flag)
            else:
                assert (name, flag) == ("generate", "--stop")  # stop strings keep their commas
                assert values == ["1,2", "3"]
            checked += 1
    assert checked >= 10


def test_a_bad_list_value_is_a_usage_error(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        parse("bench-forward", "--block-sizes", "1,x")
    assert e.value.code == 2
    assert "argument --block-sizes: invalid int value: '1,x'" in capsys.readouterr().err


def test_stop_strings_keep_their_commas() -> None:
    gen = config_from_args(parse("generate", "x", "--stop", "a, b", "--stop", ","), GenerateConfig)
    assert gen.stop == ["a, b", ","]


def test_bench_categories_and_method_specs() -> None:
    """bench's --categories splits like any list; a --methods spec keeps its KEY=VALUE commas."""
    a = run_parser().parse_args(["q.jsonl", "--categories", "qa,rag", "--categories", "mt_bench",
                                 "--methods", "hf,selfspec:gamma=2,policy=fixed", "--methods", "plain"])
    cfg = config_from_args(a, BenchConfig, questions=a.questions)
    assert cfg.categories == ["qa", "rag", "mt_bench"]
    assert split_specs(cfg.methods) == ["hf", "selfspec:gamma=2,policy=fixed", "plain"]


@dataclass
class Toy:
    """A config with every kind of field."""

    count: int = opt(3, "An int.")
    ratio: float | None = opt(None, "A float or None.")
    flag: bool = opt(False, "A bool.")
    mode: str = opt("a", "A choice.", choices=["a", "b"])
    sizes: list[int] = opt([1], "Ints.")
    kinds: list[str] = opt([], "Choices.", choices=["x", "y"])
    skipped: str = opt("s", "Not an option.")


def toy(*argv: str) -> Toy:
    p = argparse.ArgumentParser()
    add_config_args(p, Toy, skip=("skipped",))
    return config_from_args(p.parse_args(list(argv)), Toy, skipped="given")


def test_config_round_trip() -> None:
    assert toy() == Toy(skipped="given")
    t = toy("--count", "5", "--ratio", "0.5", "--flag", "--mode", "b", "--sizes", "2,3", "--kinds", "y,x")
    assert t == Toy(5, 0.5, True, "b", [2, 3], ["y", "x"], "given")
    assert toy("--no-flag").flag is False


@pytest.mark.parametrize("argv", [["--mode", "c"], ["--kinds", "x,z"], ["--skipped", "t"], ["--count", "1.5"]])
def test_config_options_refuse_bad_values(argv, capsys) -> None:
    with pytest.raises(SystemExit):
        toy(*argv)
    err = capsys.readouterr().err
    assert "invalid" in err or "unrecognized" in err


def test_every_command_prints_its_help() -> None:
    """Every command's --help renders: argparse %-formats help texts, so a bare '%' in an option's docstring
    (say '5-10% faster') broke --help of every command taking that config."""
    for name, sub in subparsers(build_parser()).items():
        assert sub.format_help().startswith("usage:"), name


@pytest.mark.parametrize("name, text, expected", [
    ("count", "5", 5), ("count", " 7 ", 7), ("ratio", "0.25", 0.25), ("ratio", "none", None), ("ratio", "NULL", None),
    ("flag", "true", True), ("flag", "off", False), ("flag", "1", True), ("flag", "no", False),
    ("mode", "b", "b"), ("sizes", "1, 2,4", [1, 2, 4]), ("kinds", "y,x", ["y", "x"]), ("skipped", "none", "none"),
])
def test_parse_field_converts_by_the_fields_type(name, text, expected) -> None:
    assert parse_field(Toy, name, text) == expected


@pytest.mark.parametrize("name, text, message", [
    ("count", "1.5", "Toy.count: invalid int value: '1.5'"),
    ("count", "none", "Toy.count: invalid int value: 'none'"),  # an int field that may not be None
    ("ratio", "half", "Toy.ratio: invalid float value: 'half'"),
    ("flag", "maybe", "Toy.flag: invalid bool value: 'maybe' (true/false, yes/no, on/off, 1/0)"),
    ("mode", "c", "Toy.mode: invalid choice: 'c' (choose from a, b)"),
    ("sizes", "1,x", "Toy.sizes: invalid int value: '1,x'"),
    ("kinds", "x,z", "Toy.kinds: invalid choice: 'z' (choose from x, y)"),
    ("nope", "1", "unknown Toy field 'nope' (known: count, ratio, flag, mode, sizes, kinds, skipped)"),
])
def test_parse_field_names_the_problem(name, text, message) -> None:
    with pytest.raises(InvalidConfigError) as e:
        parse_field(Toy, name, text)
    assert str(e.value) == message


def test_parse_field_reads_the_real_configs() -> None:
    """The configs' own fields, through their classmethod (what `selfspec bench --methods selfspec:K=V` uses)."""
    assert DraftConfig.parse_field("gamma", "none") is None and DraftConfig.parse_field("gamma", "3") == 3
    assert DraftConfig.parse_field("depth_policy", "none") is None
    assert DraftConfig.parse_field("threshold", "0.6") == 0.6 and DraftConfig.parse_field("explore", "yes") is True
    assert GenerateConfig.parse_field("eos_token_ids", "2,7") == [2, 7]
    assert GenerateConfig.parse_field("stop", "a, b") == ["a, b"]  # stop strings keep their commas
    with pytest.raises(InvalidConfigError, match="invalid choice: 'x'"):
        DraftConfig.parse_field("policy", "x")


def test_none_on_the_command_line() -> None:
    """A field that may be None takes "none", also where its default is not None; a value not given keeps the
    default."""
    gen = config_from_args(parse("generate", "x", "--seed", "none"), GenerateConfig)
    assert gen.seed is None
    draft = config_from_args(parse("generate", "x", "--head-context", "none", "--gamma", "2"), DraftConfig)
    assert draft.head_context is None and draft.gamma == 2
    assert config_from_args(parse("generate", "x"), DraftConfig) == DraftConfig()
    assert config_from_args(parse("generate", "x", "--quantize", "none"), ModelConfig).quantize is None
    assert toy("--ratio", "none").ratio is None
