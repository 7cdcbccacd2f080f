"""How the two pipeline stages talk: messages of tensors over torch.distributed or between two threads.

A message is a kind and a list of tensors. Both transports carry the same messages, so the stages'
code does not know which one it runs on:

- ``ProcessChannel``: two processes (or two devices) over a torch.distributed group; gloo on CPU, where
  each tensor goes as a small meta tensor (dtype, shape) and then its data; NCCL would carry the same.
- ``ThreadChannel``: the one-device variant, both stages in one process; a pair of queues.

A peer that dies or raises is a ``PipelineError`` on the other side at once (its connection closes, or
its thread sends the error), never a hang.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from selfspec.errors import PipelineError

STOP, PREFILL, BLOCK, SIGNAL, VERDICT, ERROR = range(6)
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.float64, torch.uint8]
_META = 8  # long: dtype code, ndim, shape (up to 6 dims)


@dataclass
class Message:
    kind: int
    tensors: list[torch.Tensor] = field(default_factory=list)


def error_message(text: str) -> Message:
    return Message(ERROR, [torch.tensor(list(text.encode()[:4000]), dtype=torch.uint8)])


def error_text(msg: Message) -> str:
    return bytes(msg.tensors[0].tolist()).decode(errors="replace") if msg.tensors else "unknown error"


class ProcessChannel:
    """One end of a two-rank torch.distributed group (this rank talks to the other one)."""

    def __init__(self, rank: int) -> None:
        self.peer = 1 - rank

    def send(self, msg: Message) -> None:
        try:
            dist.send(torch.tensor([msg.kind, len(msg.tensors)], dtype=torch.long), dst=self.peer)
            for t in msg.tensors:
                meta = torch.zeros(_META, dtype=torch.long)
                meta[0], meta[1] = _DTYPES.index(t.dtype), t.dim()
                meta[2 : 2 + t.dim()] = torch.tensor(t.shape, dtype=torch.long)
                dist.send(meta, dst=self.peer)
                if t.numel():
                    dist.send(t.contiguous(), dst=self.peer)
        except RuntimeError as e:
            raise PipelineError(f"the other stage is gone: {e}") from e

    def recv(self) -> Message:
        """Blocking (gloo's receive cannot be polled): a dead peer fails it at once, a stuck one runs into
        the group's timeout."""
        try:
            head = torch.zeros(2, dtype=torch.long)
            dist.recv(head, src=self.peer)
            tensors = []
            for _ in range(int(head[1])):
                meta = torch.zeros(_META, dtype=torch.long)
                dist.recv(meta, src=self.peer)
                shape = meta[2 : 2 + int(meta[1])].tolist()
                t = torch.empty(shape, dtype=_DTYPES[int(meta[0])])
                if t.numel():
                    dist.recv(t, src=self.peer)
                tensors.append(t)
        except RuntimeError as e:
            raise PipelineError(f"the other stage stopped answering: {e}") from e
        return Message(int(head[0]), tensors)

    def poll(self) -> Message | None:
        """Never a message without waiting: gloo's receive cannot be polled."""
        return None


class ThreadChannel:
    """One end of a queue pair between two threads of this process (the one-device pipeline)."""

    def __init__(self, inbox: queue.Queue, outbox: queue.Queue, timeout: float) -> None:
        self.inbox, self.outbox, self.timeout = inbox, outbox, timeout
        self.peer_thread: threading.Thread | None = None

    @classmethod
    def pair(cls, timeout: float) -> tuple[ThreadChannel, ThreadChannel]:
        a: queue.Queue[Message] = queue.Queue()
        b: queue.Queue[Message] = queue.Queue()
        return cls(a, b, timeout), cls(b, a, timeout)

    def send(self, msg: Message) -> None:
        self.outbox.put(msg)

    def recv(self) -> Message:
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                return self.inbox.get(timeout=0.05)
            except queue.Empty:
                if self.peer_thread is not None and not self.peer_thread.is_alive():
                    raise PipelineError("the other stage's thread has stopped") from None
                if time.monotonic() > deadline:
                    raise PipelineError(f"the other stage did not answer within {self.timeout:.0f} s") from None

    def poll(self) -> Message | None:
        """A message if one is waiting (threads can look without blocking; gloo cannot)."""
        try:
            return self.inbox.get_nowait()
        except queue.Empty:
            return None
