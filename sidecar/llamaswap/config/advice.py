"""Settings that are valid but do not do what they seem to: warnings (key path and fix) that
`llamaswap check-config`, `up` and the sidecar's start-up log print. A configuration with
advice still runs; one with problems (`ConfigError`) does not."""

from __future__ import annotations

from pydantic import BaseModel

from llamaswap.config.idle import idle_advice, idle_keys
from llamaswap.config.problems import Problem
from llamaswap.config.residency import residency_advice
from llamaswap.config.sections import Config
from llamaswap.core.priority import INTERACTIVE_FLOOR, PriorityMode, band_of
from llamaswap.core.scheduler import PolicyName


def advice(config: Config) -> list[Problem]:
    """What in ``config`` cannot apply or undoes its purpose, each with its fix."""
    return [*_clamp_reaches_interactive(config), *_unused_settings(config), *_stripped_batches(config),
            *residency_advice(config), *idle_advice(config.gpu_entries, idle_keys(config), config.models)]


def _stripped_batches(config: Config) -> list[Problem]:
    # The feeder sends a batch's lines through Envoy like any caller's: with strip and no
    # trusted header to send them in, their priority is stripped to normal like any claim.
    security = config.security.priority
    if config.batches.dir is None or security.mode is not PriorityMode.STRIP or security.trusted_header:
        return []
    return [Problem("security.priority.mode",
                    "strip drops every caller's priority, and the Batch API (batches.dir) sends its lines as a "
                    "caller: they run at normal (0), not batch. Set security.priority.trustedHeader (the feeder "
                    "then sends each line's priority in it), or use clamp")]


def _clamp_reaches_interactive(config: Config) -> list[Problem]:
    # A clamp keeps callers out of bands; one whose max is in the interactive band (nearest
    # anchor 100) lets every caller that reaches Envoy's listener take that band and its
    # reserved slots. "Public" is what the file can tell: listen.http off the loopback (the Helm
    # chart's 0.0.0.0, behind its Service and Ingress).
    security = config.security.priority
    listen = config.listen.http
    if security.mode is not PriorityMode.CLAMP or not band_of(security.max).interactive or listen.is_loopback:
        return []
    return [Problem("security.priority.max",
                    f"{security.max} is in the interactive band (>= {INTERACTIVE_FLOOR}) and listen.http {listen} "
                    f"is reachable from other machines (an Ingress, a Service): any caller asking for "
                    f"interactive gets {security.max}, ahead of normal traffic and into the reserved slots. "
                    f"Set max: 0 to keep callers at normal or below (and security.priority.trustedHeader for "
                    f"the callers you trust)")]


def _set_keys(section: BaseModel) -> list[str]:
    """The keys a file set in this section (camelCase, as written), in the section's order."""
    fields = section.model_fields_set
    return [info.alias or name for name, info in type(section).model_fields.items() if name in fields]


def _unused_settings(config: Config) -> list[Problem]:
    """Keys the file sets that the rest of it keeps from applying."""
    problems = []
    use = config.routing.scheduler.use
    other = PolicyName.FIFO if use is PolicyName.SERIAL else PolicyName.SERIAL
    settings = getattr(config.routing.scheduler.settings, other.value)
    for key in _set_keys(settings):
        problems.append(Problem(f"routing.scheduler.settings.{other}.{key}",
                                f"applies to the {other} scheduler only, and routing.scheduler.use is {use}: "
                                f"remove it, or set use: {other}"))
    if use is PolicyName.SERIAL:
        for model_id, model in config.models.items():
            if model.priority != 0:
                problems.append(Problem(f"models.{model_id}.priority",
                                        "applies to the fifo scheduler only (serial orders by the caller's priority, "
                                        "swap affinity and aging): remove it, or set routing.scheduler.use: fifo"))
    security = config.security.priority
    if security.mode is not PriorityMode.CLAMP:
        for key in ("min", "max"):
            if key in security.model_fields_set:
                problems.append(Problem(f"security.priority.{key}",
                                        f"applies with mode: clamp only, and the mode is {security.mode}: remove it, "
                                        f"or set security.priority.mode: clamp"))
    return problems
