"""A run's ``manifest.json``: the machine, the versions, the model and every config, and one entry per invocation
of ``selfspec bench`` (a resumed run must be the same experiment)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

import selfspec
from selfspec.api import SelfSpec
from selfspec.bench.config import BenchConfig
from selfspec.bench.methods import Method
from selfspec.config import GenerateConfig, ModelConfig
from selfspec.errors import InvalidConfigError
from selfspec.kernels.build import matrix_unit
from selfspec.machine import cpu_info

FORMAT = "selfspec-specbench/1"


def machine_info() -> dict[str, Any]:
    import transformers  # lazy: a heavy import, loaded anyway once a model is (selfspec.models.loading)

    cpu = cpu_info().name
    try:
        commit = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
                                cwd=Path(__file__).parent, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {"platform": platform.platform(), "python": platform.python_version(), "cpu": cpu,
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
            "versions": {"selfspec": selfspec.__version__, "torch": torch.__version__,
                         "transformers": transformers.__version__},
            "git": commit}


def write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)


def open_manifest(run: Path, cfg: BenchConfig, model_cfg: ModelConfig | None, ss: SelfSpec,
                  methods: list[Method]) -> dict[str, Any]:
    """Create the manifest, or check a resumed run is the same experiment and record this resumption."""
    path = run / "manifest.json"
    now = time.strftime("%Y-%m-%d %H:%M:%S")
    settings = {m.name: m.settings() for m in methods}
    gen = GenerateConfig(max_new_tokens=cfg.max_new_tokens, ignore_eos=False)
    model = {"model_id": ss.model_id, "num_layers": ss.split.num_layers, "vocab_size": ss.split.vocab_size,
             "dtype": str(ss.split.dtype).removeprefix("torch."), "parameters": sum(p.numel() for p in ss.model.parameters()),
             "kernel": ss.split.kernel, "numerics": ss.split.numerics.name,
             "matrix_unit": matrix_unit()}
    if path.is_file():
        m = json.loads(path.read_text())
        problems = []
        if m["model"]["model_id"] != ss.model_id:
            problems.append(f"model {m['model']['model_id']} vs {ss.model_id}")
        if m["generate"]["max_new_tokens"] != cfg.max_new_tokens:
            problems.append(f"max_new_tokens {m['generate']['max_new_tokens']} vs {cfg.max_new_tokens}")
        for name, s in settings.items():
            old = m["methods"].get(name)
            if old is not None and json.loads(json.dumps(old)) != json.loads(json.dumps(s)):
                problems.append(f"method {name}: {old} vs {s}")
        if problems:
            raise InvalidConfigError(f"'{run}' holds a different run ({'; '.join(problems)}): use another --out")
        m["methods"].update(settings)
        m["method_order"] += [n for n in settings if n not in m["method_order"]]
    else:
        run.mkdir(parents=True, exist_ok=True)
        m = {"format": FORMAT, "created": now, "model": model, "model_config": asdict(model_cfg) if model_cfg else None,
             "generate": asdict(gen), "baseline": cfg.baseline, "methods": settings, "method_order": list(settings),
             "sessions": []}
    m["sessions"].append({"started": now, "finished": None, "bench": asdict(cfg), "machine": machine_info(),
                          "methods": list(settings)})
    write_json(path, m)
    return m
