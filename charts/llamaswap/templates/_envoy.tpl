{{/* ---------------------------------------------------------------------------------
Envoy's bootstrap. It mirrors llamaswap.envoy.build_bootstrap() for the same settings
(tests/test_chart.py compares the two): ext_proc stamps a ticket and stays open until the
exchange ends (response trailers SEND), ext_authz's Check is held until the scheduler grants
the GPU, then the router. Keep the two in step when either changes.
--------------------------------------------------------------------------------- */}}

{{/* One cluster. (dict "name" "host" "port" "http2" "bufferBytes" "maxRequests") */}}
{{- define "llamaswap.envoyCluster" -}}
- name: {{ .name }}
  type: {{ if include "llamaswap.isIP" .host }}STATIC{{ else }}STRICT_DNS{{ end }}
  connect_timeout: 5s
  load_assignment:
    cluster_name: {{ .name }}
    endpoints:
    - lb_endpoints:
      - endpoint:
          address:
            socket_address:
              address: {{ .host | quote }}
              port_value: {{ .port }}
  {{- if not (include "llamaswap.isIP" .host) }}
  dns_lookup_family: V4_PREFERRED
  {{- end }}
  {{- if .http2 }}
  typed_extension_protocol_options:
    envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
      '@type': type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
      explicit_http_config:
        http2_protocol_options:
          initial_stream_window_size: 16777216
          initial_connection_window_size: 67108864
  {{- end }}
  {{- if .bufferBytes }}
  per_connection_buffer_limit_bytes: {{ .bufferBytes }}
  {{- end }}
  {{- if .maxRequests }}
  circuit_breakers:
    thresholds:
    - priority: DEFAULT
      max_connections: {{ .maxRequests }}
      max_pending_requests: {{ .maxRequests }}
      max_requests: {{ .maxRequests }}
      max_retries: 3
  {{- end }}
{{- end }}

{{/* typed_per_filter_config that turns both llamaswap filters off (bypass routes). */}}
{{- define "llamaswap.envoyBypass" -}}
typed_per_filter_config:
  envoy.filters.http.ext_proc:
    '@type': type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute
    disabled: true
  envoy.filters.http.ext_authz:
    '@type': type.googleapis.com/envoy.extensions.filters.http.ext_authz.v3.ExtAuthzPerRoute
    disabled: true
{{- end }}

{{- define "llamaswap.envoyBootstrap" -}}
{{- $v := .Values }}
{{- $e := $v.envoy }}
{{- $maxBytes := int64 $e.maxRequestBytes }}
{{- $maxWait := float64 $v.routing.scheduler.maxWaitSeconds }}
{{- /* The sidecar answers a held Check at maxWaitSeconds; Envoy's timer is a backstop.
       Waiting forever: 100 days (ext_authz has no one-hour cap). */}}
{{- $hold := 8640000.0 }}
{{- if gt $maxWait 0.0 }}{{ $hold = addf $maxWait 60 }}{{ end }}
{{- $otlp := include "llamaswap.otlpEndpoint" . -}}
admin:
  address:
    socket_address:
      address: {{ include "llamaswap.host" $e.admin | quote }}
      port_value: {{ include "llamaswap.port" $e.admin }}
static_resources:
  listeners:
  - name: ingress
    address:
      socket_address:
        address: {{ include "llamaswap.host" $v.listen.http | quote }}
        port_value: {{ include "llamaswap.port" $v.listen.http }}
    per_connection_buffer_limit_bytes: {{ add $maxBytes 1048576 }}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          '@type': type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: ingress
          codec_type: AUTO
          stream_idle_timeout: {{ printf "%.3fs" (float64 $e.streamIdleTimeoutSeconds) }}
          route_config:
            name: llamaswap
            virtual_hosts:
            - name: llm
              domains:
              - '*'
              routes:
              # Paths that never reach the GPU: answered at once, outside the queue.
              - match:
                  path: /metrics
                route:
                  cluster: llamaswap_admin
                  timeout: 10s
                {{- include "llamaswap.envoyBypass" . | nindent 16 }}
              {{- range list "/health" "/v1/models" "/props" }}
              - match:
                  path: {{ . }}
                route:
                  cluster: llm_upstream
                  timeout: 30s
                {{- include "llamaswap.envoyBypass" . | nindent 16 }}
              {{- end }}
              - match:
                  path: /models
                  headers:
                  - name: :method
                    string_match:
                      exact: GET
                route:
                  cluster: llm_upstream
                  timeout: 30s
                {{- include "llamaswap.envoyBypass" . | nindent 16 }}
              # Everything else waits for the GPU: no route timeout or idle timer (the
              # scheduler bounds the wait with maxWaitSeconds, a generation with maxRunSeconds).
              - match:
                  prefix: /
                route:
                  cluster: llm_upstream
                  timeout: 0s
                  idle_timeout: 0s
          http_filters:
          # The whole body is read before the request is seen at all: a clear 413 above the
          # limit, and a slow sender never holds a place in the queue while it sends.
          - name: envoy.filters.http.buffer
            typed_config:
              '@type': type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer
              max_request_bytes: {{ $maxBytes }}
          - name: envoy.filters.http.ext_proc
            typed_config:
              '@type': type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
              grpc_service:
                envoy_grpc:
                  cluster_name: llamaswap_grpc
              failure_mode_allow: {{ $e.failOpen }}
              status_on_error:
                code: ServiceUnavailable
              message_timeout: {{ printf "%.3fs" (divf (int64 $e.extProcMessageTimeoutMs) 1000) }}
              processing_mode:
                request_header_mode: SEND
                response_header_mode: SEND
                request_body_mode: NONE
                response_body_mode: NONE
                request_trailer_mode: SKIP
                # Keeps the stream open until the exchange ends: the release signal.
                response_trailer_mode: SEND
          - name: envoy.filters.http.ext_authz
            typed_config:
              '@type': type.googleapis.com/envoy.extensions.filters.http.ext_authz.v3.ExtAuthz
              grpc_service:
                envoy_grpc:
                  cluster_name: llamaswap_grpc
                timeout: {{ printf "%.3fs" $hold }}
              transport_api_version: V3
              failure_mode_allow: {{ $e.failOpen }}
              status_on_error:
                code: ServiceUnavailable
              with_request_body:
                max_request_bytes: {{ $maxBytes }}
                allow_partial_message: false
                pack_as_bytes: true
          - name: envoy.filters.http.router
            typed_config:
              '@type': type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
          # Envoy's own 503s (the sidecar unreachable, for one) tell clients when to come back.
          local_reply_config:
            mappers:
            - filter:
                status_code_filter:
                  comparison:
                    op: EQ
                    value:
                      default_value: 503
                      runtime_key: llamaswap.local_503
              headers_to_add:
              - header:
                  key: retry-after
                  value: '5'
                append_action: ADD_IF_ABSENT
          common_http_protocol_options:
            headers_with_underscores_action: ALLOW
          request_id_extension:
            typed_config:
              '@type': type.googleapis.com/envoy.extensions.request_id.uuid.v3.UuidRequestIdConfig
              use_request_id_for_trace_sampling: false
          http2_protocol_options:
            max_concurrent_streams: 100000
          {{- if $otlp }}
          tracing:
            random_sampling:
              value: 100
            spawn_upstream_span: true
            provider:
              name: envoy.tracers.opentelemetry
              typed_config:
                '@type': type.googleapis.com/envoy.config.trace.v3.OpenTelemetryConfig
                grpc_service:
                  envoy_grpc:
                    cluster_name: otlp_collector
                  timeout: 2s
                service_name: {{ $e.serviceName | quote }}
          {{- end }}
  clusters:
  {{- include "llamaswap.envoyCluster" (dict "name" "llm_upstream" "host" "127.0.0.1" "port" (int $v.llamaServer.port) "bufferBytes" $maxBytes "maxRequests" 1024) | nindent 2 }}
  {{- include "llamaswap.envoyCluster" (dict "name" "llamaswap_grpc" "host" (include "llamaswap.connectHost" $v.listen.grpc) "port" (include "llamaswap.port" $v.listen.grpc) "http2" true "bufferBytes" (add $maxBytes 1048576) "maxRequests" (int64 $e.maxSidecarStreams)) | nindent 2 }}
  {{- include "llamaswap.envoyCluster" (dict "name" "llamaswap_admin" "host" (include "llamaswap.connectHost" $v.listen.admin) "port" (include "llamaswap.port" $v.listen.admin)) | nindent 2 }}
  {{- if $otlp }}
  {{- $hostPort := regexReplaceAll "/.*$" (regexReplaceAll "^[a-zA-Z][a-zA-Z0-9+.-]*://" $otlp "") "" }}
  {{- $otlpHost := lower (include "llamaswap.host" $hostPort) }}
  {{- $otlpPort := "4317" }}
  {{- if regexMatch ":[0-9]+$" $hostPort }}{{ $otlpPort = include "llamaswap.port" $hostPort }}{{ end }}
  {{- include "llamaswap.envoyCluster" (dict "name" "otlp_collector" "host" $otlpHost "port" $otlpPort "http2" true) | nindent 2 }}
  {{- end }}
{{- end }}
