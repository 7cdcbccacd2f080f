"""Loading a GGUF file natively: the model keeps its block-quantized weights (no float32 copy).

The model's structure comes from the GGUF's metadata (on the meta device: nothing is allocated): the lean tree
(``selfspec.models.lean``: transformers' names and shapes without its model code) for the architectures it
covers, else transformers' own model; transformers' name map (``get_gguf_hf_weights_map``) and tensor processors
(the Llama q/k row permutation, Gemma's norm offset) place every tensor, exactly as its dequantizing loader
would. Then:

- each quantized Linear weight becomes a ``QuantLinear`` (``selfspec.quant``), packed for the kernels;
- the quantized token embedding becomes a ``QuantEmbedding`` (rows dequantized as they are looked up);
  a tied LM head shares its packed weight;
- float tensors (norms, biases; F32, F16 and BF16 matrices) are loaded as float32 parameters.

The dequantized values of every quantized weight are gguf-py's bit for bit (``selfspec.quant.formats``),
so the target model is the same as the float32 conversion's (``dtype='float32'``). The tokenizer, built
from the GGUF's vocabulary by transformers, is cached beside the converted models.
"""

from __future__ import annotations

import fcntl
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from selfspec.errors import ModelNotFoundError, SelfSpecError
from selfspec.models.architectures import check_supported
from selfspec.models.lean import meta_model
from selfspec.paths import atomic_dir, atomic_write_text
from selfspec.progress import announce, progress, quiet_transformers
from selfspec.quant.formats import FLOAT_TYPES, check_type
from selfspec.quant.store import assemble, load_packed, save_packed
from selfspec.quant.weight import QuantWeight


def _reader(path: Path) -> Any:
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except Exception as e:  # gguf-py raises ValueError / IndexError / struct errors on truncated or corrupt files
        raise ModelNotFoundError(f"'{path}' is not a readable GGUF file (truncated or corrupt?): {e}") from e


def _row_permutation(processor: Any, name: str, n: int) -> np.ndarray | None:
    """The rows transformers' tensor processor reorders (Llama's q/k), found by processing row indices."""
    idx = np.arange(n, dtype=np.int64).reshape(n, 1)
    out = processor.process(weights=idx, name=name, tensor_key_mapping={}, parsed_parameters={})
    perm = np.asarray(out.weights).reshape(-1)
    if out.weights.shape != (n, 1) or not np.array_equal(np.sort(perm), idx[:, 0]):
        raise SelfSpecError(f"transformers transforms GGUF tensor {name} beyond a row permutation; "
                            "load this model with dtype='float32'")
    return None if np.array_equal(perm, idx[:, 0]) else perm


def _read_gguf(path: Path, config: Any, model: nn.Module) -> tuple[dict[str, QuantWeight], dict[str, torch.Tensor]]:
    """Every tensor of ``path`` placed by transformers' name map: (module name -> packed QuantWeight,
    parameter name -> float32 tensor)."""
    from gguf import dequantize
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
        read_field,
    )

    reader = _reader(path)
    arch = read_field(reader, "general.architecture")[0]
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict())
    names = get_gguf_hf_weights_map(model, processor)
    params = dict(model.named_parameters(remove_duplicate=False))
    tensors = [(names[t.name], t) for t in reader.tensors if t.name in names]
    quant: dict[str, QuantWeight] = {}
    floats: dict[str, torch.Tensor] = {}
    announce(f"packing {path.name}'s weights into selfspec's cache (once per file)")
    with progress(total=len(tensors), desc=f"packing {path.name}", unit="tensor", inner=True) as bar:
        for hf_name, t in tensors:
            type_name = t.tensor_type.name
            check_type(type_name, t.name)
            module_name, _, kind = hf_name.rpartition(".")
            module = model.get_submodule(module_name)
            if type_name in FLOAT_TYPES or not isinstance(module, (nn.Linear, nn.Embedding)) or kind != "weight":
                w = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(params[hf_name].shape)
                w = processor.process(weights=w, name=t.name, tensor_key_mapping={}, parsed_parameters={}).weights
                floats[hf_name] = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))
            else:
                raw = t.data  # [N, row_bytes] uint8, memory-mapped
                perm = _row_permutation(processor, t.name, raw.shape[0])
                if perm is not None:
                    raw = raw[perm]
                quant[module_name] = QuantWeight.from_gguf(raw, type_name, params[hf_name].shape[1])
            bar.update()
    return quant, floats


def load_gguf_model(path: Path, cache: Path | None = None, mmap: bool = False) -> nn.Module:
    """A transformers CausalLM with ``path``'s weights, quantized ones kept quantized. ``cache``: a directory
    where config, packed and float tensors are kept after the first load; later loads map them instead of
    parsing the GGUF (its metadata and name map alone take seconds) and decoding its blocks again (``mmap``:
    mapped from the file, else read into 2 MB pages, ``load_packed``)."""
    hit = load_packed(cache, mmap=mmap) if cache is not None else None
    if hit is not None:
        config, quant, floats = hit
    else:
        # (imported only here: the auto classes' modules are 4.8 MB resident)
        from transformers import AutoConfig

        try:
            with quiet_transformers():
                config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        except Exception as e:
            raise ModelNotFoundError(f"'{path}' is not a readable GGUF file (truncated or corrupt?): {e}") from e
    check_supported(config.model_type)  # before any weights are read
    model = meta_model(config)
    if hit is None:
        quant, floats = _read_gguf(path, config, model)
        if cache is not None:
            save_packed(cache, config, quant, floats)
            mapped = load_packed(cache, mmap=mmap)  # as every later load: from the file, the decoded arrays freed
            if mapped is not None:
                _, quant, floats = mapped
    return assemble(model, quant, floats, str(path))


# tokenizer_config.json entries that describe the saved directory, not the tokenizer's settings
_DIRECTORY_KEYS = ("tokenizer_class", "backend", "is_local", "local_files_only", "auto_map", "added_tokens_decoder")
FAST_OPEN_MARK = "selfspec_fast_open.json"  # {"same": bool}: whether open_tokenizer_dir matched AutoTokenizer here
_PROBE_TEXTS = ("Hello there!", "  spaces\n\n\ttabs  ", "Übersetze: 'Guten Morgen' — 日本語 🙂", "def f(x):\n    return x**2",
                "3.14159, 1,000,000 and https://example.com/a?b=c")
_PROBE_CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."},
               {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another?"}]


def same_tokenizer(a: Any, b: Any) -> bool:
    """Whether tokenizers ``a`` and ``b`` agree on probe texts (ids with and without special tokens, decodes), the
    chat template's text and ids, and the special token ids."""
    try:
        for text in _PROBE_TEXTS:
            for special in (True, False):
                ids = a(text, add_special_tokens=special)["input_ids"]
                if ids != b(text, add_special_tokens=special)["input_ids"]:
                    return False
                if any(a.decode(ids, skip_special_tokens=k) != b.decode(ids, skip_special_tokens=k) for k in (True, False)):
                    return False
        if a.chat_template != b.chat_template:
            return False
        if b.chat_template:
            for gen in (True, False):
                if (a.apply_chat_template(_PROBE_CHAT, add_generation_prompt=gen, tokenize=False)
                        != b.apply_chat_template(_PROBE_CHAT, add_generation_prompt=gen, tokenize=False)):
                    return False
        return all(getattr(a, n) == getattr(b, n) for n in ("eos_token_id", "pad_token_id", "bos_token_id",
                                                            "all_special_ids")) and len(a) == len(b)
    except Exception:  # a template or setting one of them cannot handle: not the same
        return False


def open_tokenizer_dir(cache_dir: Path) -> Any:
    """A tokenizer directory this module saved, opened as transformers' fast tokenizer straight from its
    tokenizer.json (the tokenizers library parses it) with its tokenizer_config.json settings and chat template.
    ``AutoTokenizer`` builds the architecture's own class, which parses the whole vocabulary and merges in Python
    first (slower to open, and more memory resident). The first open of a directory
    also builds ``AutoTokenizer``'s and compares the two (``same_tokenizer``); the verdict is kept in the directory
    (FAST_OPEN_MARK), and where they differ (an architecture class that adds what the generic one does not)
    ``AutoTokenizer`` opens it, now and later. Without a tokenizer.json, ``AutoTokenizer``."""
    import json

    from transformers import PreTrainedTokenizerFast

    def auto_tokenizer() -> Any:  # (imported only when needed: the auto classes' modules are 4.8 MB resident)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(cache_dir))

    mark = cache_dir / FAST_OPEN_MARK
    try:
        verdict = json.loads(mark.read_text()).get("same") if mark.is_file() else None
    except (OSError, ValueError):
        verdict = None
    if not (cache_dir / "tokenizer.json").is_file() or verdict is False:
        return auto_tokenizer()
    settings = json.loads((cache_dir / "tokenizer_config.json").read_text())
    kw = {k: v for k, v in settings.items() if k not in _DIRECTORY_KEYS}
    template = cache_dir / "chat_template.jinja"
    if template.is_file():
        kw["chat_template"] = template.read_text()
    fast = PreTrainedTokenizerFast(tokenizer_file=str(cache_dir / "tokenizer.json"), **kw)
    if verdict is None:  # first open: compare with AutoTokenizer's once
        ref = auto_tokenizer()
        same = same_tokenizer(fast, ref)
        try:
            atomic_write_text(mark, json.dumps({"same": same}))
        except OSError:
            pass  # a read-only cache: compared again next time
        return fast if same else ref
    return fast


def load_gguf_tokenizer(path: Path, cache_dir: Path) -> Any:
    """The GGUF's tokenizer, built once by transformers and cached as a tokenizer directory (``open_tokenizer_dir``
    opens it on later loads)."""
    if (cache_dir / "tokenizer_config.json").is_file():
        return open_tokenizer_dir(cache_dir)
    from transformers import AutoTokenizer

    with quiet_transformers():
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    cache_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(cache_dir.parent / f".{cache_dir.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (cache_dir / "tokenizer_config.json").is_file():
            with atomic_dir(cache_dir) as tmp:
                tok.save_pretrained(tmp)
    return tok
