"""Envoy ext_proc: the stream that lives from a request's arrival to the end of its exchange.

On request headers we open a ticket and stamp its token on the request (overwriting any
client copy, so it cannot be forged); on response headers we add the x-llamaswap-* headers;
when Envoy ends the stream (response complete, client gone, upstream failure), the ticket
is closed and the GPU goes to the next request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc

from llamaswap._proto.envoy.config.core.v3 import base_pb2
from llamaswap._proto.envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc_pb2
from llamaswap._proto.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from llamaswap.runtime.coordinator import TICKET_HEADER, Coordinator
from llamaswap.transport.trace_metadata import trace_metadata

_log = logging.getLogger(__name__)

_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def header_value(header: base_pb2.HeaderValue) -> str:
    return header.raw_value.decode("latin-1") if header.raw_value else header.value


def _set_headers(pairs: list[tuple[str, str]]) -> ext_proc_pb2.HeaderMutation:
    return ext_proc_pb2.HeaderMutation(set_headers=[
        base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=key, raw_value=value.encode("latin-1")),
                                   append_action=_OVERWRITE)
        for key, value in pairs
    ])


class ExternalProcessor(ext_proc_grpc.ExternalProcessorServicer):
    def __init__(self, coordinator: Coordinator) -> None:
        self._coordinator = coordinator

    async def Process(  # noqa: N802 - the gRPC method name
        self, request_iterator: AsyncIterator[ext_proc_pb2.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ext_proc_pb2.ProcessingResponse]:
        coordinator = self._coordinator
        token: str | None = None
        try:
            async for message in request_iterator:
                kind = message.WhichOneof("request")
                if kind == "request_headers":
                    request_id = ""
                    for header in message.request_headers.headers.headers:
                        if header.key == "x-request-id":
                            request_id = header_value(header)
                            break
                    ticket = coordinator.open(request_id)
                    token = ticket.token
                    ticket.trace_context["ext_proc_metadata"] = trace_metadata(context)
                    yield ext_proc_pb2.ProcessingResponse(request_headers=ext_proc_pb2.HeadersResponse(
                        response=ext_proc_pb2.CommonResponse(header_mutation=_set_headers([(TICKET_HEADER, token)]))))
                elif kind == "response_headers":
                    mutation = None
                    if token is not None:
                        status = 0
                        for header in message.response_headers.headers.headers:
                            if header.key == ":status":
                                status = int(header_value(header) or 0)
                                break
                        coordinator.record_response(token, status)
                        ticket = coordinator.ticket(token)
                        if ticket is not None and ticket.decision is not None:
                            mutation = _set_headers(ticket.response_headers())
                    yield ext_proc_pb2.ProcessingResponse(response_headers=ext_proc_pb2.HeadersResponse(
                        response=ext_proc_pb2.CommonResponse(header_mutation=mutation)))
                elif kind == "response_trailers":
                    yield ext_proc_pb2.ProcessingResponse(response_trailers=ext_proc_pb2.TrailersResponse())
                elif kind == "request_trailers":
                    yield ext_proc_pb2.ProcessingResponse(request_trailers=ext_proc_pb2.TrailersResponse())
                elif kind == "request_body":
                    yield ext_proc_pb2.ProcessingResponse(request_body=ext_proc_pb2.BodyResponse())
                elif kind == "response_body":
                    yield ext_proc_pb2.ProcessingResponse(response_body=ext_proc_pb2.BodyResponse())
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - one bad stream must not take the sidecar down
            _log.exception("ext_proc stream failed")
        finally:
            if token is not None:
                coordinator.close(token)
