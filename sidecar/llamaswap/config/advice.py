"""Settings that are valid but do not do what they seem to: warnings (key path and fix) that
`llamaswap check-config`, `up` and the sidecar's start-up log print. A configuration with
advice still runs; one with problems (`ConfigError`) does not."""

from __future__ import annotations

from llamaswap.config.problems import Problem
from llamaswap.config.sections import Config
from llamaswap.core.priority import INTERACTIVE_FLOOR, Band, PriorityMode, band_of


def advice(config: Config) -> list[Problem]:
    """What in ``config`` cannot apply or undoes its purpose, each with its fix."""
    return [*_clamp_reaches_interactive(config)]


def _clamp_reaches_interactive(config: Config) -> list[Problem]:
    # A clamp keeps callers out of bands; one whose max is in the interactive band (nearest
    # anchor 100) lets every caller that reaches Envoy's listener take that band and its
    # reserved slots. "Public" is what the file can tell: listen.http off the loopback (the Helm
    # chart's 0.0.0.0, behind its Service and Ingress).
    security = config.security.priority
    listen = config.listen.http
    if security.mode is not PriorityMode.CLAMP or band_of(security.max) is not Band.INTERACTIVE or listen.is_loopback:
        return []
    return [Problem("security.priority.max",
                    f"{security.max} is in the interactive band (>= {INTERACTIVE_FLOOR}) and listen.http {listen} "
                    f"is reachable from other machines (an Ingress, a Service): any caller asking for "
                    f"interactive gets {security.max}, ahead of normal traffic and into the reserved slots. "
                    f"Set max: 0 to keep callers at normal or below (and security.priority.trustedHeader for "
                    f"the callers you trust)")]
