"""An embedding checkpoint's own pooling: the PoolingParams `Engine.embed` uses when asked for none.

A sentence-transformers checkpoint (Qwen3-Embedding, and most embedders on the Hub) says it in
`modules.json`: its Pooling module's `config.json` names the mode (pooling_mode_lasttoken,
pooling_mode_mean_tokens or pooling_mode_cls_token) and a Normalize module, where present, makes
the vectors unit length. A GGUF file says it in `<arch>.pooling_type`, llama.cpp's enum (0 none,
1 mean, 2 cls, 3 last, 4 rank), and llama.cpp normalises what it pools. A checkpoint that says
nothing, or whose type pools nothing nanoserve serves (none, rank), gets "last", normalised: the
default of vLLM's and llama.cpp's embedding servers.
"""

from __future__ import annotations

from pathlib import Path

from nanoserve.params import PoolingParams

DEFAULT_POOLING = PoolingParams("last", normalize=True)

# sentence-transformers' Pooling config flags -> nanoserve's pooling types
_ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
_ST_UNSERVED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")
# llama.cpp's enum llama_pooling_type; None: nothing nanoserve pools
_GGUF_TYPES = {0: None, 1: "mean", 2: "cls", 3: "last", 4: None}


def checkpoint_pooling(source: Path, is_gguf: bool) -> PoolingParams:
    """The pooling a checkpoint (a model.weights.checkpoint_source) declares; DEFAULT_POOLING where
    it declares none.

    Raises:
        ValueError: a sentence-transformers Pooling config with no served mode or with several (naming
            them), or a GGUF pooling_type outside llama.cpp's enum.
    """
    found = gguf_pooling(source) if is_gguf else sentence_transformers_pooling(source)
    return found or DEFAULT_POOLING


def sentence_transformers_pooling(directory: Path) -> PoolingParams | None:
    """The pooling of a sentence-transformers checkpoint directory (modules.json); None without one.

    Raises:
        ValueError: a modules.json or Pooling config.json that is not JSON of the shape
            sentence-transformers writes (a list of module objects; a Pooling path inside the
            directory; an object of flags), naming the file.
    """
    from nanoserve.model.weights import read_json

    modules_file = directory / "modules.json"
    if not modules_file.is_file():
        return None
    modules = read_json(modules_file)
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ValueError(f"{modules_file}: sentence-transformers' modules.json is a list of module objects")
    types = [str(m.get("type", "")) for m in modules]
    pooling = next((m for m in modules if str(m.get("type", "")).endswith(".Pooling")), None)
    if pooling is None:
        return None
    path = pooling.get("path", "")
    if not isinstance(path, str) or Path(path).is_absolute() or ".." in Path(path).parts:
        raise ValueError(f"{modules_file}: the Pooling module's path {path!r} must name a folder inside {directory}")
    config_file = directory / path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{config_file} not found: modules.json names a Pooling module there")
    config = read_json(config_file)
    if not isinstance(config, dict):
        raise ValueError(f"{config_file}: a Pooling config is a JSON object of flags")
    modes = [mode for flag, mode in _ST_MODES.items() if config.get(flag)]
    unserved = [flag for flag in _ST_UNSERVED if config.get(flag)]
    if unserved or len(modes) != 1:
        set_flags = [flag for flag in (*_ST_MODES, *_ST_UNSERVED) if config.get(flag)]
        raise ValueError(f"{config_file} sets {set_flags or 'no pooling mode'}: exactly one of "
                         f"{list(_ST_MODES)} must be set")
    return PoolingParams(modes[0], normalize=any(t.endswith(".Normalize") for t in types))


def gguf_pooling(file: Path) -> PoolingParams | None:
    """The pooling of a GGUF file (`<arch>.pooling_type`); None where it has none or pools nothing
    nanoserve serves."""
    from nanoserve.model.gguf import read_gguf_file

    metadata = read_gguf_file(file).metadata  # the header checked as untrusted input (ValueError) first
    value = metadata.get(f"{metadata.get('general.architecture')}.pooling_type")
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value not in _GGUF_TYPES:
        raise ValueError(f"{file}: pooling_type={value} is outside llama.cpp's enum {sorted(_GGUF_TYPES)}")
    mode = _GGUF_TYPES[value]
    return None if mode is None else PoolingParams(mode, normalize=True)
