"""``selfspec serve``: the server's command line. One process (selfspec.server.app) or, with --replicas
or --ray-address, replicas on Ray Serve (selfspec.server.ray_serve). See docs/SERVER.md."""

from __future__ import annotations

import argparse
from typing import Any

from selfspec.api import SelfSpec
from selfspec.batch.scheduler import BatchConfig
from selfspec.cli_options import add_command, config_from_args
from selfspec.config import DraftConfig, ModelConfig, PipelineConfig
from selfspec.progress import announce
from selfspec.server.config import ServeConfig


def cmd_serve(args: argparse.Namespace) -> int:
    # FastAPI, uvicorn and Ray are imported here, not with the command line: imports no other command needs
    from selfspec.server.app import serve
    from selfspec.server.ray_serve import serve_ray

    cfg = config_from_args(args, ServeConfig)
    if cfg.replicas > 1 or cfg.ray_address:
        serve_ray(config_from_args(args, ModelConfig), config_from_args(args, DraftConfig), cfg,
                  config_from_args(args, BatchConfig))
        return 0
    model_cfg = config_from_args(args, ModelConfig)
    ss = SelfSpec.load(model_cfg, config_from_args(args, DraftConfig))
    announce(ss.describe())
    if cfg.pipeline:
        ss.use_pipeline(PipelineConfig(mode=cfg.pipeline, transport=cfg.pipeline_transport), model_cfg)
    try:
        serve(ss, cfg, config_from_args(args, BatchConfig))
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it handled, once the graceful shutdown is done
        pass
    finally:
        ss.use_pipeline(None)
    return 0


def add_parser(sub: Any) -> None:
    """Register ``selfspec serve`` on the CLI's subparsers."""
    add_command(sub, "serve", (ModelConfig, DraftConfig, ServeConfig, BatchConfig), cmd_serve,
                "OpenAI-compatible HTTP server (completions, chat, streaming, metrics).")
