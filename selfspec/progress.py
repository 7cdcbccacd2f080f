"""Progress bars: one tqdm bar per long task, shown only where someone is watching.

Every bar in selfspec goes through ``progress``: it is drawn on stderr only when stderr is a
terminal, so logs, CI output and pipes get no bar debris. ``SELFSPEC_PROGRESS=1`` forces bars on,
``SELFSPEC_PROGRESS=0`` forces them off, ``SELFSPEC_PROGRESS=log`` writes each bar as a plain line
at most every 30 s (for long runs logged to a file: ``tail -f`` shows where they are). Bars for a step of a larger task (``inner=True``) vanish
when done, leaving the outer task's bar. ``quiet_transformers`` silences transformers' own bars
("Loading weights", GGUF dequantization) so a model load shows nothing but selfspec's bar.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

from tqdm import tqdm

ENV = "SELFSPEC_PROGRESS"


class _LineFile:
    """stderr for log mode: tqdm's carriage-return redraws become one line each."""

    def write(self, text: str) -> None:
        text = text.replace("\r", "").strip()
        if text:
            sys.stderr.write(text + "\n")
            sys.stderr.flush()

    def flush(self) -> None:
        sys.stderr.flush()


def progress_enabled() -> bool:
    """Whether bars are drawn: ``SELFSPEC_PROGRESS`` if set (1 / 0), else whether stderr is a TTY."""
    env = os.environ.get(ENV, "").strip().lower()
    if env:
        return env not in ("0", "false", "no", "off")
    try:
        return sys.stderr is not None and sys.stderr.isatty()
    except (AttributeError, ValueError):  # a replaced or closed stderr
        return False


def announce(message: str) -> None:
    """One line on stderr for a one-time stage (a kernel build, a model's packing, a calibration), printed
    whether or not stderr is a terminal, so a first run that is busy for minutes says why; bars stay for
    terminals. ``SELFSPEC_PROGRESS=0`` silences it too."""
    if os.environ.get(ENV, "").strip().lower() in ("0", "false", "no", "off"):
        return
    try:
        print(f"selfspec: {message}", file=sys.stderr, flush=True)
    except (AttributeError, ValueError, OSError):  # no stderr, or a closed one
        pass


def progress(iterable: Iterable[Any] | None = None, *, inner: bool = False, **kw: Any) -> tqdm:
    """A tqdm bar on stderr, disabled unless ``progress_enabled()``; ``inner``: a step of a larger
    task, its bar is cleared when done (``leave=False``). Other keywords go to tqdm."""
    if os.environ.get(ENV, "").strip().lower() == "log":
        kw.update(file=_LineFile(), mininterval=30.0, ascii=True, dynamic_ncols=False, ncols=100)
    kw.setdefault("disable", not progress_enabled())
    if inner:
        kw["leave"] = False
    return tqdm(iterable, **kw)


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silence transformers' progress bars (weights loading, GGUF dequantization) inside the block."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:  # the GGUF loader uses tqdm.auto directly, outside transformers' switch
        gguf_utils: Any = importlib.import_module("transformers.modeling_gguf_pytorch_utils")
    except ImportError:  # no gguf support installed: nothing to silence there
        gguf_utils = None
    gguf_tqdm = getattr(gguf_utils, "tqdm", None)
    if gguf_tqdm is not None:
        gguf_utils.tqdm = partial(gguf_tqdm, disable=True)
    try:
        yield
    finally:
        if gguf_tqdm is not None:
            gguf_utils.tqdm = gguf_tqdm
        if was_enabled:
            hf_logging.enable_progress_bar()
