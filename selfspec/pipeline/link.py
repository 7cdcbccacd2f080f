"""The shallow stage's link to the deep stage: started in a thread or a child process (torch.distributed
over loopback), messages both ways, and a stage that dies or raises turned into a ``PipelineError`` at
once (no hang). ``selfspec.pipeline.ppsd`` drives the rounds over it; ``selfspec.pipeline.deep`` answers."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from selfspec.config import ModelConfig, PipelineConfig
from selfspec.errors import InvalidConfigError
from selfspec.models.loading import load_model
from selfspec.models.split import SplitModel
from selfspec.pipeline.deep import DeepStage
from selfspec.pipeline.transport import (
    ERROR,
    STOP,
    Message,
    PipelineError,
    ProcessChannel,
    ThreadChannel,
    error_text,
)
from selfspec.ports import free_port


@dataclass
class ModelSource:
    """How a stage process gets the model: a ModelConfig to load, or (config, state_dict) to rebuild (tests)."""

    model_config: Any = None
    hf_config: Any = None
    state_dict: dict | None = None

    @classmethod
    def of(cls, model: Any) -> ModelSource:
        if isinstance(model, ModelConfig):
            return cls(model_config=model)
        return cls(hf_config=model.config, state_dict={k: v.clone() for k, v in model.state_dict().items()})

    def load(self) -> Any:
        if self.model_config is not None:
            return load_model(self.model_config)[0]
        from transformers import AutoModelForCausalLM  # lazy: only a deep stage of a float model needs it

        model = AutoModelForCausalLM.from_config(self.hf_config, attn_implementation="sdpa", dtype=torch.float32)
        model.load_state_dict(self.state_dict)
        return model.eval().requires_grad_(False)


def _deep_process(source: ModelSource, exit_layer: int, port: int, threads: int, backend: str, timeout: float) -> None:
    """Rank 1: the deep stage in its own process."""
    torch.set_num_threads(threads)
    split = SplitModel(source.load(), backend)  # first: a model that does not load ends the start at once
    store = dist.TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=timeout))
    store.set("ready", "1")
    dist.init_process_group("gloo", store=store, rank=1, world_size=2, timeout=timedelta(seconds=timeout))
    try:
        DeepStage(split, exit_layer).serve(ProcessChannel(1))
    finally:
        dist.destroy_process_group()


class DeepLink:
    """The deep stage of ``split`` past layer ``k``, started now (``cfg.transport``); its model from ``source``
    (default: a copy of ``split``'s weights) when it is a process."""

    def __init__(self, split: SplitModel, k: int, cfg: PipelineConfig, source: ModelSource | None = None) -> None:
        self.closed = False
        self.stash: Message | None = None  # a message read early (Mirror-SD's poll), handed out by the next recv
        self.wait_time = 0.0  # seconds spent waiting for the deep stage
        self.channel: Any
        self.worker: Any
        threads = cfg.threads or (torch.get_num_threads() if cfg.transport == "thread" else 1)
        torch.set_num_threads(threads)
        if cfg.transport == "thread":
            self.channel, deep_end = ThreadChannel.pair(cfg.timeout)
            self.worker = threading.Thread(target=DeepStage(split, k).serve, args=(deep_end, False), daemon=True,
                                           name="selfspec-deep-stage")
            self.channel.peer_thread = self.worker
            self.worker.start()
            return
        if dist.is_initialized():
            raise InvalidConfigError("a torch.distributed group is already running in this process")
        if source is None:
            source = ModelSource.of(split.model)
        port = free_port()
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback: both stages on this machine
        self.worker = mp.get_context("spawn").Process(
            target=_deep_process, args=(source, k, port, cfg.deep_threads or threads, split.backend, cfg.timeout),
            daemon=True)
        self.worker.start()
        self._join_group(port, cfg.timeout)
        self.channel = ProcessChannel(0)

    def _join_group(self, port: int, timeout: float) -> None:
        """Rank 0 hosts the group's store and waits for the deep process to say it is ready (its model loaded),
        watching it meanwhile: one that dies while starting is a PipelineError now, not a wait for the
        group's timeout."""
        store = dist.TCPStore("127.0.0.1", port, 2, True, timedelta(seconds=timeout), wait_for_workers=False)
        deadline = time.monotonic() + timeout
        while not store.check(["ready"]):
            if not self.worker.is_alive():
                self.closed = True
                raise PipelineError(f"the deep stage exited while starting (exit code {self.worker.exitcode})")
            if time.monotonic() > deadline:
                self.worker.kill()
                self.closed = True
                raise PipelineError(f"the deep stage did not start within {timeout:.0f} s")
            time.sleep(0.05)
        dist.init_process_group("gloo", store=store, rank=0, world_size=2, timeout=timedelta(seconds=timeout))

    def poll(self) -> Message | None:
        """A message already there, if the transport can look without waiting (threads); kept for ``recv``."""
        msg = self.channel.poll()  # only the thread channel can look
        if msg is not None:
            self.stash = msg
        return msg

    def send(self, msg: Message) -> None:
        self.check_alive()
        try:
            self.channel.send(msg)
        except PipelineError as e:
            self.fail(e)

    def recv(self, kind: int) -> Message:
        t0 = time.perf_counter()
        msg, self.stash = self.stash, None
        try:
            msg = msg or self.channel.recv()
        except PipelineError as e:
            self.fail(e)
        self.wait_time += time.perf_counter() - t0
        if msg.kind == ERROR:
            self.fail(PipelineError(error_text(msg)))
        if msg.kind != kind:
            self.fail(PipelineError(f"the deep stage answered {msg.kind}, expected {kind}"))
        return msg

    def alive(self) -> bool:
        return self.worker.is_alive()

    def check_alive(self) -> None:
        if self.closed or not self.alive():
            code = getattr(self.worker, "exitcode", None)
            raise PipelineError(f"the deep stage is not running{'' if code is None else f' (exit code {code})'}")

    def fail(self, e: PipelineError) -> NoReturn:
        """A stage is gone: close this link (a new pipeline is needed) and raise."""
        if not isinstance(self.worker, threading.Thread):
            self.worker.join(1)
            code = self.worker.exitcode
            e = PipelineError(f"the deep stage failed{'' if code is None else f' (exit code {code})'}: {e}")
        self.close(stop=False)
        raise e

    def close(self, stop: bool = True) -> None:
        """Stop the deep stage (and leave the process group)."""
        if self.closed:
            return
        self.closed = True
        if stop and self.alive():
            try:
                self.channel.send(Message(STOP))
            except PipelineError:
                pass
        if isinstance(self.worker, threading.Thread):
            self.worker.join(10)
            return
        self.worker.join(10)
        if self.worker.is_alive():
            self.worker.kill()
            self.worker.join(5)
        if dist.is_initialized():
            dist.destroy_process_group()

