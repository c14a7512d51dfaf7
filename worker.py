import copy
from dataclasses import fields, is_dataclass
from typing import Any, Mapping

def chattts_config(overrides: Mapping[str, Any] | None = None):
    from ChatTTS.config import Config
    return _fresh(Config(), overrides or {}, "config")

def _fresh(obj, overrides, where):
    names = {f.name for f in fields(obj)}
    unknown = set(overrides) - names
    if unknown:
        raise ValueError(f"unknown ChatTTS config keys at {where}: {sorted(unknown)}")
    kwargs = {}
    for f in fields(obj):
        value = getattr(obj, f.name)
        if is_dataclass(value):
            kwargs[f.name] = _fresh(value, overrides.get(f.name, {}), f"{where}.{f.name}")
        else:
            new = overrides.get(f.name, value)
            if isinstance(value, tuple) and isinstance(new, list):
                new = tuple(new)
            kwargs[f.name] = copy.deepcopy(new)
    return type(obj)(**kwargs)
