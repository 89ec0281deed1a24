"""The one codec of deepinfer's inter-process messages: pickle, restricted on decoding to deepinfer's own
types, plain Python containers and torch dtypes, and checked to be one of a closed set of message types:
``messages.MESSAGES`` (engine <-> ranks) by default, ``server.core_messages.MESSAGES`` (server <-> engine
core process) where that channel passes its own set."""

from __future__ import annotations

import io
import pickle

import torch

from deepinfer.executor.messages import MESSAGES

_BUILTINS = {"tuple", "list", "dict", "set", "frozenset", "int", "float", "str", "bytes", "bool", "complex", "slice"}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module == "deepinfer" or module.startswith("deepinfer."):
            return super().find_class(module, name)
        if module == "builtins" and name in _BUILTINS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == "collections" and name in ("OrderedDict", "deque"):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"message codec: {module}.{name} is not a message type")


def encode(message, kinds: tuple[type, ...] = MESSAGES) -> bytes:
    if not isinstance(message, kinds):
        raise TypeError(f"message codec: {type(message).__name__} is not a message type")
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes, kinds: tuple[type, ...] = MESSAGES):
    message = _Unpickler(io.BytesIO(data)).load()
    if not isinstance(message, kinds):
        raise TypeError(f"message codec: decoded a {type(message).__name__}, not a message")
    return message
