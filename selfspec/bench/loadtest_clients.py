"""The load test's clients: the request kinds each sends in a fixed mix (KINDS), the prompts, the malformed bodies
with the status each must get, and the reference answers every good request must equal."""

from __future__ import annotations

import time
from typing import Any

import httpx

from selfspec.bench.loadtest_config import LoadTestConfig

PROMPTS = [
    "Name three colors of the rainbow.",
    "What is the capital of France?",
    "Give me one tip for writing clear code.",
    "Write one sentence about the sea.",
]
KINDS = ["chat", "completion_stream", "malformed", "chat_stream", "completion", "disconnect", "unauthorized",
         "chat_stream"]
MALFORMED: list[tuple[str, int]] = [  # (body, expected status)
    ('{"model": "MODEL", "messages": [{"role": "user", "content": "hi"}', 400),  # invalid JSON
    ('{"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}', 404),
    ('{"model": "MODEL", "messages": [{"role": "user", "content": "hi"}], "temperature": -1}', 400),
    ('{"model": "MODEL", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1000000}', 400),
    ('{"model": "MODEL", "messages": []}', 400),
    ('{"model": "MODEL", "prompt": ["a", "b"]}', 400),
]


class Clients:
    """The request kinds; each returns a record {kind, ok, latency, tokens, detail}."""

    def __init__(self, url: str, cfg: LoadTestConfig, model: str) -> None:
        import openai  # lazy: an optional dependency (the dev extra), needed only by the clients

        self.url, self.cfg, self.model = url, cfg, model
        self.openai = openai
        self.good = openai.OpenAI(base_url=url + "/v1", api_key=cfg.api_key, max_retries=0,
                                  timeout=cfg.request_timeout)
        self.reference: dict[tuple[str, int], str] = {}

    def _chat(self, p: int, stream: bool) -> tuple[str, int]:
        kw: dict[str, Any] = dict(model=self.model, messages=[{"role": "user", "content": PROMPTS[p]}],
                                  max_tokens=self.cfg.max_tokens, temperature=0)
        if not stream:
            r = self.good.chat.completions.create(**kw)
            return r.choices[0].message.content, r.usage.completion_tokens
        text, tokens = "", 0
        for ch in self.good.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
            text += "".join(c.delta.content or "" for c in ch.choices)
            tokens = ch.usage.completion_tokens if ch.usage else tokens
        return text, tokens

    def _completion(self, p: int, stream: bool) -> tuple[str, int]:
        kw: dict[str, Any] = dict(model=self.model, prompt=PROMPTS[p], max_tokens=self.cfg.max_tokens, temperature=0)
        if not stream:
            r = self.good.completions.create(**kw)
            return r.choices[0].text, r.usage.completion_tokens
        text, tokens = "", 0
        for ch in self.good.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
            text += "".join(c.text for c in ch.choices)
            tokens = ch.usage.completion_tokens if ch.usage else tokens
        return text, tokens

    def make_references(self) -> None:
        for p in range(self.cfg.num_prompts):
            self.reference[("chat", p)] = self._chat(p, False)[0]
            self.reference[("completion", p)] = self._completion(p, False)[0]

    def run(self, kind: str, i: int) -> dict[str, Any]:
        p = i % self.cfg.num_prompts
        t0 = time.perf_counter()
        rec: dict[str, Any] = {"kind": kind, "ok": False, "tokens": 0, "detail": ""}
        try:
            if kind in ("chat", "chat_stream", "completion", "completion_stream"):
                endpoint = kind.split("_")[0]
                fn = self._chat if endpoint == "chat" else self._completion
                text, rec["tokens"] = fn(p, kind.endswith("_stream"))
                rec["ok"] = text == self.reference[(endpoint, p)]
                rec["detail"] = "" if rec["ok"] else f"got {text!r}, expected {self.reference[(endpoint, p)]!r}"
            elif kind == "malformed":
                body, want = MALFORMED[i % len(MALFORMED)]
                r = httpx.post(self.url + "/v1/chat/completions", content=body.replace("MODEL", self.model),
                               headers={"Authorization": f"Bearer {self.cfg.api_key}",
                                        "Content-Type": "application/json"}, timeout=self.cfg.request_timeout)
                err = r.json().get("error", {})
                rec["ok"] = r.status_code == want and bool(err.get("message")) and "type" in err
                rec["detail"] = f"{r.status_code} {r.text[:200]}"
            elif kind == "unauthorized":
                bad = self.openai.OpenAI(base_url=self.url + "/v1", api_key="wrong-key", max_retries=0)
                try:
                    bad.models.list()
                except self.openai.AuthenticationError:
                    rec["ok"] = True
            elif kind == "disconnect":  # read one chunk of a long answer, then hang up
                stream = self.good.chat.completions.create(
                    model=self.model, messages=[{"role": "user", "content": "Tell me a long story."}],
                    max_tokens=512, temperature=0, stream=True, extra_body={"ignore_eos": True})
                next(iter(stream))
                stream.close()
                rec["ok"] = True
        except Exception as e:  # noqa: BLE001 - every failure is recorded, none stops the test
            rec["detail"] = f"{type(e).__name__}: {e}"
        rec["latency"] = time.perf_counter() - t0
        return rec
