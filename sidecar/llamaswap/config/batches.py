"""The `batches:` section: the OpenAI Batch API on the public port (`llamaswap.batches`)."""

from __future__ import annotations

from typing import Annotated

from pydantic import BeforeValidator, Field

from llamaswap.config.problems import Meaning
from llamaswap.config.section import Section
from llamaswap.config.types import StrictInt, optional_path

# The OpenAI Batch API's own limits (facts: models-and-batches.md).
MAX_REQUESTS_DEFAULT = 50_000
MAX_FILE_BYTES_DEFAULT = 200 * 1024 * 1024
# `llamaswap up` keeps batches here, under the directory it runs in, unless batches.dir is set.
UP_DIR_DEFAULT = "llamaswap-batches"


class BatchesConfig(Section):
    """The OpenAI Batch API (POST /v1/files, /v1/batches on Envoy's listener): its files and state."""

    dir: Annotated[str | None, BeforeValidator(optional_path)] = Field(
        default=None,
        description="Where batches keep their state (SQLite) and files; null turns the Batch API off "
                    f"(`llamaswap up` uses ./{UP_DIR_DEFAULT} unless set). Put it on a persistent volume: "
                    "a batch resumes from here after a restart.")
    max_requests: StrictInt = Field(
        default=MAX_REQUESTS_DEFAULT, ge=1, description="The most lines one batch's input file may have.")
    max_file_bytes: StrictInt = Field(
        default=MAX_FILE_BYTES_DEFAULT, ge=1, description="The largest file POST /v1/files accepts, in bytes.")
    in_flight: Annotated[StrictInt | None, Meaning("null = the node's slots")] = Field(
        default=None, ge=1,
        description="The most lines of one batch waiting or running at once; null: the node's slots (the "
                    "sum of every upstream's), so a batch never floods the queue.")
