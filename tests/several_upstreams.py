"""A parsed configuration seen with several upstreams, for the data path's tests.

The bootstrap reads `Config.upstream_entries`; this stands in for the configuration's own
`upstreams:` key where a test wants the bootstrap alone (or the real Envoy with a stub sidecar).
"""

from __future__ import annotations

import dataclasses
from typing import Any
from urllib.parse import urlsplit


@dataclasses.dataclass(frozen=True)
class Entry:
    name: str
    url: str

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or ""

    @property
    def tls(self) -> bool:
        return urlsplit(self.url).scheme == "https"

    @property
    def port(self) -> int:
        return urlsplit(self.url).port or (443 if self.tls else 80)


class SeveralUpstreams:
    """`config` with these upstreams (name -> url, the first one first); everything else its own."""

    def __init__(self, config: Any, urls: dict[str, str]) -> None:
        self._config = config
        self.upstream_entries = tuple(Entry(name, url) for name, url in urls.items())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)
