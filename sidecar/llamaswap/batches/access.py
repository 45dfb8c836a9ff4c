"""Who calls the Batch API, and what each caller may see: pure decisions over a request's headers.

A caller is named by its key (batches.apiKeys; else upstream.apiKey as one caller who sees all)
or by the header the operator's authenticating proxy sets (batches.callerHeader). A file or batch
belongs to its creator; an admin sees every one. With neither keys nor header nothing tells
callers apart: the API is open, and every caller sees everything (as an admin).
"""

from __future__ import annotations

import dataclasses
import hmac
from collections.abc import Mapping

from llamaswap.config.batches import KnownKey

# The longest caller name the header may give (a name is kept with each file and batch).
MAX_CALLER_NAME = 256


@dataclasses.dataclass(frozen=True, slots=True)
class Caller:
    """Who made a request: ``name`` owns what it creates (None: the open API, nobody told apart)."""

    name: str | None
    admin: bool

    def sees(self, owner: str | None) -> bool:
        """Whether this caller may see and manage what ``owner`` created."""
        return self.admin or (owner is not None and owner == self.name)

    @property
    def only(self) -> str | None:
        """The owner whose records this caller lists (None: every owner's)."""
        return None if self.admin else self.name


OPEN = Caller(None, True)


class Unidentified(Exception):
    """The request shows no key or caller header that the Batch API accepts."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


@dataclasses.dataclass(frozen=True, slots=True)
class Access:
    """How callers are told apart (from batches.* and upstream.apiKey, read at start)."""

    keys: tuple[KnownKey, ...] = ()
    caller_header: str | None = None
    admin_callers: frozenset[str] = frozenset()

    @property
    def open(self) -> bool:
        return not self.keys and self.caller_header is None

    def identify(self, headers: Mapping[str, str]) -> Caller:
        """The caller of a request with these headers (names lower-case or a case-insensitive
        mapping); Unidentified when it shows no accepted key, or no caller header where only the
        header names callers. A caller header that is sent names the caller (and its role, from
        adminCallers) even beside a key: the key then only admits the request."""
        shown: KnownKey | None = None
        if self.keys:
            authorization = headers.get("authorization", "").encode()
            for known in self.keys:  # every key compared: the time does not say which one is close
                if hmac.compare_digest(authorization, f"Bearer {known.key}".encode()) and shown is None:
                    shown = known
            if shown is None:
                raise Unidentified("the Batch API wants a key as Authorization: Bearer KEY (batches.apiKeys, or "
                                   "upstream.apiKey where batches.apiKeys is empty)", "invalid_api_key")
        if self.caller_header is not None:
            named = headers.get(self.caller_header, "").strip()
            if named:
                if len(named) > MAX_CALLER_NAME:
                    raise Unidentified(f"the caller header {self.caller_header} is longer than {MAX_CALLER_NAME} "
                                       "characters", "invalid_caller")
                return Caller(named, named in self.admin_callers)
            if shown is None:
                raise Unidentified(f"the Batch API names its callers by the header {self.caller_header}, which your "
                                   "authenticating proxy sets; this request has none", "missing_caller")
        if shown is not None:
            return Caller(shown.name, shown.admin)
        return OPEN
