"""llama-server's command line (``upstream.command``, ``upstreams[i].command``, the built-in one),
the one place that knows its flags: where a router's models are (``--models-dir``), how many it
keeps loaded (``--models-max``), the context and KV cache it runs them with, its port, threads
and slots. A flag's value is read (`flag_value`: ``--flag VALUE``, ``--flag=VALUE``, or the
variable a command sets as ``env NAME=VALUE llama-server ...``) and set (`with_flag_value`). The
configuration reads commands through it (model sizes, residency advice); `llamaswap up` writes
them through it (``--max-loaded``, ``--gpus``, the built-in llama-server).
"""

from __future__ import annotations

import pathlib
from collections.abc import Collection, Sequence

# Router mode: the directory of its models, and how many it keeps loaded (0: no limit; without
# the flag, ROUTER_MODELS_MAX_DEFAULT).
MODELS_DIR_FLAG = "--models-dir"
MODELS_DIR_ENV = "LLAMA_ARG_MODELS_DIR"
MODELS_MAX_FLAG = "--models-max"
MODELS_MAX_ENV = "LLAMA_ARG_MODELS_MAX"
ROUTER_MODELS_MAX_DEFAULT = 4
# The context and the KV cache's element types (K and V) its models run with.
CONTEXT_FLAGS = ("-c", "--ctx-size")
CONTEXT_ENV = "LLAMA_ARG_CTX_SIZE"
CACHE_TYPE_FLAGS = {"K": ("-ctk", "--cache-type-k"), "V": ("-ctv", "--cache-type-v")}
CACHE_TYPE_ENV = {"K": "LLAMA_ARG_CACHE_TYPE_K", "V": "LLAMA_ARG_CACHE_TYPE_V"}
DEFAULT_CACHE_TYPE = "f16"
PORT_FLAG = "--port"
THREADS_FLAGS = ("-t", "--threads")
# llama-server reads its thread count from this variable when no -t/--threads is given.
THREADS_ENV = "LLAMA_ARG_THREADS"
PARALLEL_FLAGS = ("--parallel", "-np")


def flag_value(command: Sequence[str], flags: Collection[str], env: str | None = None) -> str | None:
    """The value of the last of ``flags`` on a command line (``--flag VALUE`` or ``--flag=VALUE``),
    else of the variable ``env`` that the command sets (``env NAME=VALUE llama-server ...``)."""
    found = None
    for index, argument in enumerate(command):
        for flag in flags:
            if argument == flag and index + 1 < len(command):
                found = command[index + 1]
            elif argument.startswith(f"{flag}="):
                found = argument.split("=", 1)[1]
    if found is None and env is not None:
        for argument in command:
            if argument.startswith(f"{env}="):
                found = argument.split("=", 1)[1]
    return found


def with_flag_value(argv: Sequence[str], flags: Collection[str], value: str) -> tuple[list[str], bool]:
    """``argv`` with the value of each of ``flags`` (``--flag V`` or ``--flag=V``) set to
    ``value``, and whether any was there (a trailing flag without its value gets it)."""
    result: list[str] = []
    found = False
    skip = False
    prefixes = tuple(f"{flag}=" for flag in flags)
    for argument in argv:
        if skip:
            result.append(value)
            skip = False
        elif argument in flags:
            result.append(argument)
            skip = found = True
        elif argument.startswith(prefixes):
            result.append(f"{argument.split('=', 1)[0]}={value}")
            found = True
        else:
            result.append(argument)
    if skip:
        result.append(value)
    return result, found


def models_dir(command: Sequence[str]) -> pathlib.Path | None:
    """The models directory of a llama-server command (router mode's ``--models-dir``), if any."""
    value = flag_value(command, (MODELS_DIR_FLAG,), MODELS_DIR_ENV)
    return pathlib.Path(value) if value else None


def router_models_max(command: Sequence[str]) -> int | None:
    """The models a llama-server router started by ``command`` keeps loaded (``--models-max``,
    else its default where the command is a router, ``--models-dir``); None: not a router command,
    or no limit (``--models-max 0``)."""
    value = flag_value(command, (MODELS_MAX_FLAG,), MODELS_MAX_ENV)
    if value is not None:
        try:
            return int(value) or None
        except ValueError:
            return None
    return ROUTER_MODELS_MAX_DEFAULT if models_dir(command) is not None else None


def with_models_max(argv: Sequence[str], models_max: int) -> list[str] | None:
    """``argv`` keeping ``models_max`` models loaded where it starts llama-server's router: its
    ``--models-max`` replaced, or added to a router command (``--models-dir``); None where it
    starts no router."""
    result, found = with_flag_value(argv, (MODELS_MAX_FLAG,), str(models_max))
    if found:
        return result
    if models_dir(argv) is not None:
        return [*result, MODELS_MAX_FLAG, str(models_max)]
    return None


def context_of(command: Sequence[str]) -> int:
    """The context a command runs its models with (``-c``/``--ctx-size``); 0, the model's own
    trained context, without one or where it is not a number (the larger estimate: the safe side)."""
    value = flag_value(command, CONTEXT_FLAGS, CONTEXT_ENV)
    try:
        return max(0, int(value)) if value is not None else 0
    except ValueError:
        return 0


def cache_types(command: Sequence[str]) -> tuple[str, ...]:
    """The KV cache's element types, K's then V's (``--cache-type-k/-v``, f16 by default), lower case."""
    return tuple((flag_value(command, flags, CACHE_TYPE_ENV[which]) or DEFAULT_CACHE_TYPE).lower()
                 for which, flags in CACHE_TYPE_FLAGS.items())


def parallel_of(command: Sequence[str]) -> str | None:
    """The slots a command gives llama-server (``--parallel``/``-np``), if any."""
    return flag_value(command, PARALLEL_FLAGS)
