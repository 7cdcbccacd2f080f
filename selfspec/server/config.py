"""Settings of ``selfspec serve`` (the model and draft come from ModelConfig and DraftConfig)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from selfspec.config import opt


@dataclass
class ServeConfig:
    """Where and how the OpenAI-compatible server listens."""

    host: str = opt("127.0.0.1", "Interface to bind (127.0.0.1: this machine only; 0.0.0.0: every interface).")
    port: int = opt(8000, "TCP port to listen on.")
    api_key: str | None = opt(
        None,
        "Require 'Authorization: Bearer <key>' on every endpoint but /health (None: read the "
        "SELFSPEC_API_KEY environment variable; unset or empty: no key needed).",
    )
    model_name: str | None = opt(None, "Model name clients must send (None: the model's id, e.g. SmolLM2-135M-Instruct).")
    max_queue: int = opt(64, "Most requests waiting or running at once; more are refused with 429.")
    graceful_timeout: float = opt(
        10.0,
        "On shutdown (Ctrl-C / SIGTERM), seconds in-flight and queued requests get to finish before "
        "they are cancelled (their clients get an OpenAI-style error).",
    )
    method: str = opt(
        "selfspec",
        "Decoding method of requests that name none (a request may send 'method' in extra_body): "
        "'selfspec', 'plain', 'specee-verified', or 'specee' (LOSSY SpecEE, outputs may differ from the model's).",
        choices=["selfspec", "plain", "specee-verified", "specee"],
    )
    pipeline: str | None = opt(
        None, "Decode 'selfspec' requests with the pipeline, one at a time (docs/PIPELINE.md): 'ppsd' or 'mirror' "
        "(Mirror-SD). Its deep stage runs in a second process; if it dies, that request fails with 503 and the next "
        "one starts a new pipeline.", choices=["ppsd", "mirror"])
    pipeline_transport: str = opt(
        "process", "Where the pipeline's deep stage runs: 'process' (torch.distributed) or 'thread' (one device).",
        choices=["process", "thread"])
    replicas: int = opt(
        1, "Engine replicas. 1: this process serves (uvicorn); more, or --ray-address: a Ray Serve deployment "
        "of that many replicas behind the same API (pip install 'selfspec[ray]').")
    ray_address: str | None = opt(
        None, "Serve on an existing Ray cluster ('auto', or ray://HEAD:10001) instead of a local Ray instance.")
    log_level: str = opt("info", "uvicorn log level.", choices=["critical", "error", "warning", "info", "debug"])

    def to_dict(self) -> dict:
        return asdict(self)
