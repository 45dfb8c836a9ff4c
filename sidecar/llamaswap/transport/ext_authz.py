"""Envoy ext_authz: the Check call that is answered only when the request gets the GPU.

ext_authz has no one-hour cap on a held call (unlike ext_proc messages), so the wait can
last as long as the queue needs. A cancelled Check means the client left while waiting.
"""

from __future__ import annotations

import logging

import grpc
from google.rpc import code_pb2, status_pb2

from llamaswap._proto.envoy.config.core.v3 import base_pb2
from llamaswap.core import Outcome
from llamaswap._proto.envoy.service.auth.v3 import external_auth_pb2 as authz_pb2
from llamaswap._proto.envoy.service.auth.v3 import external_auth_pb2_grpc as authz_grpc
from llamaswap._proto.envoy.type.v3 import http_status_pb2
from llamaswap.runtime.coordinator import TICKET_HEADER, Coordinator, Rejected
from llamaswap.transport.errors import openai_error_body
from llamaswap.transport.trace_metadata import trace_metadata

_log = logging.getLogger(__name__)


def _header(key: str, value: str) -> base_pb2.HeaderValueOption:
    # ext_authz reads `value`, not `raw_value` (facts/envoy.md).
    return base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=key, value=value),
                                      append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)


def denied(rejected: Rejected, extra_headers: list[tuple[str, str]] = ()) -> authz_pb2.CheckResponse:  # type: ignore[assignment]
    headers = [_header("content-type", "application/json")]
    if rejected.retry_after_s is not None:
        headers.append(_header("retry-after", str(rejected.retry_after_s)))
    headers.append(_header("x-llamaswap-outcome", rejected.outcome.value))
    headers.extend(_header(k, v) for k, v in extra_headers)
    body = openai_error_body(rejected.message, rejected.error_type, rejected.code)
    return authz_pb2.CheckResponse(
        status=status_pb2.Status(code=code_pb2.PERMISSION_DENIED, message=rejected.code),
        denied_response=authz_pb2.DeniedHttpResponse(
            status=http_status_pb2.HttpStatus(code=rejected.http_status), headers=headers, body=body.decode()),
    )


_GRANTED = authz_pb2.CheckResponse(
    status=status_pb2.Status(code=code_pb2.OK),
    ok_response=authz_pb2.OkHttpResponse(headers_to_remove=[TICKET_HEADER]),
)


class Authorization(authz_grpc.AuthorizationServicer):
    def __init__(self, coordinator: Coordinator) -> None:
        self._coordinator = coordinator

    async def Check(  # noqa: N802 - the gRPC method name
        self, request: authz_pb2.CheckRequest, context: grpc.aio.ServicerContext
    ) -> authz_pb2.CheckResponse:
        http = request.attributes.request.http
        token = http.headers.get(TICKET_HEADER, "")
        ticket = self._coordinator.ticket(token)
        if ticket is not None:
            ticket.trace_context["check_metadata"] = trace_metadata(context)
        try:
            admission = await self._coordinator.prepare(token, http.headers, http.raw_body or http.body.encode())
            # The wait can last hours: from here on nothing keeps the request or its body.
            del request, http
            if admission is None:
                admission = await self._coordinator.wait(token)
        except Exception:  # noqa: BLE001 - answer the client rather than hang it
            _log.exception("admission failed")
            self._coordinator.close(token)
            return denied(Rejected(Outcome.UPSTREAM_ERROR, 500, "llamaswap could not schedule the request",
                                   "server_error", "scheduler_error"))
        if admission.decision is not None:
            return _GRANTED
        assert admission.rejected is not None
        return denied(admission.rejected)

