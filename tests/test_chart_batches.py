"""The chart's Batch API (batches.*), without a cluster: the claim the batches' state lives on,
mounted in the sidecar alone, `batches.dir` written as its mount path, an existing claim, the
feature off, the layouts refused (several pods, a surging rollout, a `batches.dir` of one's own),
that the feeder's target (the connect address of `listen.http`) is the pod's Envoy listener, and
a batch run through the rendered pod on this machine.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import uuid
from typing import Any

import pytest
import yaml

import chart_tools as ct

from llamaswap.config import HostPort, parse_config  # noqa: E402

MOUNT = "/var/lib/llamaswap/batches"
# The chart's default quota on the claim's files (batches.maxStoredBytes), below its 1Gi.
QUOTA = "768MiB"


def on(values: dict[str, Any] | None = None) -> dict[str, Any]:
    """``values`` with the Batch API on (it is off by default)."""
    return ct.merge_values({"batches": {"enabled": True}}, values or {})


def _config(rendered: ct.Rendered) -> dict[str, Any]:
    return yaml.safe_load(rendered.sidecar_config)


def _claims(rendered: ct.Rendered) -> dict[str, dict[str, Any]]:
    return {m["metadata"]["name"]: m for m in rendered.all("PersistentVolumeClaim")}


def _volumes(rendered: ct.Rendered) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in rendered.pod_spec["volumes"]}


def _mounts(container: dict[str, Any]) -> dict[str, str]:
    return {m["name"]: m["mountPath"] for m in container.get("volumeMounts", [])}


def test_the_claim_renders_the_sidecar_mounts_it_and_the_config_names_it() -> None:
    rendered = ct.render(on())
    claim = _claims(rendered)["llm-llamaswap-batches"]
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "1Gi"
    assert "storageClassName" not in claim["spec"]  # the cluster's default class
    assert claim["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    assert claim["metadata"]["labels"]["app.kubernetes.io/component"] == "batches"
    assert ct.validate_manifest(claim) is None
    assert _volumes(rendered)["batches"] == {"name": "batches", "persistentVolumeClaim": {
        "claimName": "llm-llamaswap-batches"}}
    assert _mounts(rendered.container("sidecar"))["batches"] == MOUNT
    # The sidecar alone writes it: no other container or init container mounts it.
    others = [c for c in rendered.pod_spec["containers"] + rendered.pod_spec["initContainers"]
              if c["name"] != "sidecar"]
    assert all("batches" not in _mounts(c) for c in others)
    config = _config(rendered)
    assert config["batches"] == {"dir": MOUNT, "maxStoredBytes": QUOTA}
    assert parse_config(config).batches.dir == MOUNT


def test_the_claims_size_class_and_keep_are_the_values() -> None:
    rendered = ct.render(on({"batches": {"mountPath": "/data/batches", "persistence": {
        "size": "20Gi", "storageClassName": "fast-ssd", "keep": False, "accessModes": ["ReadWriteOncePod"]}}}))
    claim = _claims(rendered)["llm-llamaswap-batches"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "20Gi"
    assert claim["spec"]["storageClassName"] == "fast-ssd"
    assert claim["spec"]["accessModes"] == ["ReadWriteOncePod"]
    assert "annotations" not in claim["metadata"]
    assert _mounts(rendered.container("sidecar"))["batches"] == "/data/batches"
    assert _config(rendered)["batches"]["dir"] == "/data/batches"


def test_an_existing_claim_is_used_and_none_is_created() -> None:
    rendered = ct.render(on({"batches": {"persistence": {"existingClaim": "my-batches"}}}))
    assert "llm-llamaswap-batches" not in _claims(rendered)
    assert _volumes(rendered)["batches"]["persistentVolumeClaim"] == {"claimName": "my-batches"}
    assert _config(rendered)["batches"]["dir"] == MOUNT


def test_the_batch_settings_of_config_pass_through_beside_the_dir() -> None:
    rendered = ct.render(on({"config": {"batches": {"maxRequests": 1000, "inFlight": 2}}}))
    assert _config(rendered)["batches"] == {"maxRequests": 1000, "inFlight": 2, "dir": MOUNT, "maxStoredBytes": QUOTA}
    # A quota of config's own wins over the chart's; an empty chart quota writes none.
    rendered = ct.render(on({"config": {"batches": {"maxStoredBytes": "5GiB"}}}))
    assert _config(rendered)["batches"] == {"maxStoredBytes": "5GiB", "dir": MOUNT}
    rendered = ct.render(on({"batches": {"maxStoredBytes": ""}}))
    assert _config(rendered)["batches"] == {"dir": MOUNT}


def test_off_by_default_and_the_notes_say_how_to_turn_it_on() -> None:
    rendered = ct.render()
    assert "llm-llamaswap-batches" not in _claims(rendered) and "batches" not in _config(rendered)
    assert "batches.enabled=true" in rendered.notes and "config.batches.apiKeys" in rendered.notes


def test_the_notes_warn_when_nothing_tells_callers_apart() -> None:
    """On with no key, no caller header and no upstream key, anyone who reaches the Service
    reads every caller's files: the NOTES say so plainly; any of the three silences it."""
    warning = "WARNING: the Batch API is open to every caller who reaches the Service"
    assert warning in ct.render(on()).notes
    for values in ({"config": {"batches": {"apiKeys": [{"name": "team-a", "key": "env:TEAM_A_KEY"}]}}},
                   {"config": {"batches": {"callerHeader": "x-user"}}},
                   {"llamaServer": {"apiKey": {"existingSecret": "llama-key"}}}):
        notes = ct.render(on(values)).notes
        assert "WARNING" not in notes, values
        assert "other callers get 404" in notes


def test_disabled_renders_no_claim_no_mount_and_no_dir() -> None:
    rendered = ct.render({"batches": {"enabled": False}})
    assert "llm-llamaswap-batches" not in _claims(rendered)
    assert "batches" not in _volumes(rendered)
    assert "batches" not in _mounts(rendered.container("sidecar"))
    assert "batches" not in _config(rendered)
    assert parse_config(_config(rendered)).batches.dir is None  # the Batch API answers 404
    # Its other settings still reach the sidecar (they apply once a directory is given).
    kept = ct.render({"batches": {"enabled": False}, "config": {"batches": {"maxRequests": 10}}})
    assert _config(kept)["batches"] == {"maxRequests": 10}


@pytest.mark.parametrize("values, words", [
    ({"config": {"batches": {"dir": "/tmp/b"}}}, "config.batches.dir is written by the chart"),
    ({"batches": {"enabled": False}, "config": {"batches": {"dir": "/tmp/b"}}},
     "config.batches.dir is written by the chart"),
    (on({"replicas": 2}), "batches.enabled with replicas: 2"),
    (on({"strategy": {"type": "RollingUpdate"}}), "a RollingUpdate that may surge (maxSurge 25%)"),
    (on({"strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}}),
     "a RollingUpdate that may surge (maxSurge 1)"),
], ids=["dir", "dir while off", "replicas", "rolling default", "rolling surge"])
def test_layouts_that_would_share_or_lose_a_batch_are_refused(values: dict[str, Any], words: str) -> None:
    helm = ct.helm()
    with pytest.raises(helm.HelmError) as refused:
        ct.render(values)
    assert words in str(refused.value), str(refused.value)


def test_what_is_refused_with_batches_renders_without_them() -> None:
    assert ct.render({"replicas": 2, "batches": {"enabled": False}}).deployment["spec"]["replicas"] == 2
    for surge in (0, "0%"):
        rendered = ct.render(on({"strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": surge,
                                                                                         "maxUnavailable": 1}}}))
        assert _mounts(rendered.container("sidecar"))["batches"] == MOUNT


@pytest.mark.parametrize("batches", [{"mountPath": "relative/path"}, {"persistence": {"size": "lots"}},
                                     {"persistence": {"accessModes": ["ReadOnlyMany"]}}, {"enable": True},
                                     {"maxStoredBytes": "lots of it"}, {"maxStoredBytes": 0}],
                         ids=["relative mount", "size", "read-only", "unknown key", "quota words", "quota 0"])
def test_the_schema_refuses_bad_batch_values(batches: dict[str, Any]) -> None:
    helm = ct.helm()
    with pytest.raises(helm.HelmValuesError):
        ct.render({"batches": batches})


@pytest.mark.parametrize("listen", [None, "0.0.0.0:18080"], ids=["default", "moved"])
def test_the_feeder_sends_lines_to_the_pods_envoy_listener(listen: str | None, tmp_path: pathlib.Path) -> None:
    """The feeder sends each line to the connect address of listen.http (commands/serve.py):
    in the pod that is the loopback and the port of Envoy's listener, the one the bootstrap binds
    and the container exposes."""
    rendered = ct.render(on({"config": {"listen": {"http": listen}}} if listen else {}))
    config = parse_config(_config(rendered))
    listener = config.listen.http
    target = HostPort(listener.connect_host, listener.port)
    assert target.host == "127.0.0.1"  # the pod's shared localhost
    envoy = rendered.container("envoy")
    [port] = [p["containerPort"] for p in envoy["ports"] if p["name"] == "http"]
    assert target.port == port == (18080 if listen else 8080)
    bootstrap, _ = ct.pod_bootstrap(rendered, tmp_path)
    [public] = [item for item in bootstrap["static_resources"]["listeners"]
                if item["address"]["socket_address"]["port_value"] == target.port]
    assert public["address"]["socket_address"]["address"] in ("0.0.0.0", "127.0.0.1")


def _multipart(fields: dict[str, tuple[str | None, bytes]]) -> tuple[bytes, str]:
    boundary = uuid.uuid4().hex
    body = b""
    for name, (filename, data) in fields.items():
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        body += f"--{boundary}\r\nContent-Disposition: {disposition}\r\n\r\n".encode() + data + b"\r\n"
    return body + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


def test_a_batch_runs_through_the_rendered_pod(tmp_path: pathlib.Path) -> None:
    """The rendered pod on this machine (the init container's bootstrap, Envoy, the sidecar with
    its batches volume, a stand-in llama-server): a batch uploaded and created through Envoy's
    listener sends its lines back through the same listener at the batch priority, and its
    state is in the volume's directory."""
    from harness import http_get, wait_for
    from test_chart import DEFAULT_PORTS, PodUpstream, _http, _pod_values, _start_pod

    ports = ct.pod_ports(DEFAULT_PORTS)
    values = _pod_values(ports, 0)
    values["collector"] = {"enabled": False, "endpoint": ""}
    rendered = ct.render(on(values))
    upstream = PodUpstream(ports["llama"])
    processes: list[Any] = []
    try:
        volumes, sidecar, envoy = _start_pod(rendered, tmp_path)
        processes += [sidecar, envoy]
        wait_for(lambda: http_get(f"http://127.0.0.1:{ports['admin']}/readyz")[0] == 200, what="sidecar /readyz")
        wait_for(lambda: http_get(f"http://127.0.0.1:{ports['envoy_admin']}/ready")[0] == 200, what="Envoy /ready")
        base = f"http://127.0.0.1:{ports['http']}"
        lines = [{"custom_id": f"line-{n}", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"model": "model-a", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}}
                 for n in range(3)]
        body, content_type = _multipart({"purpose": (None, b"batch"), "file": (
            "input.jsonl", b"".join(json.dumps(line).encode() + b"\n" for line in lines))})
        status, _, answer = _http(f"{base}/v1/files", body=body, headers={"Content-Type": content_type})
        assert status == 200, answer
        file_id = json.loads(answer)["id"]
        status, _, answer = _http(f"{base}/v1/batches", body=json.dumps({
            "input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}).encode(),
            headers={"Content-Type": "application/json"})
        assert status == 200, answer
        batch_id = json.loads(answer)["id"]

        def ended() -> dict[str, Any] | None:
            document = json.loads(_http(f"{base}/v1/batches/{batch_id}")[2])
            return document if document["status"] in ("completed", "failed", "expired", "cancelled") else None

        batch = wait_for(ended, timeout=60, what="the batch to end")
        assert batch["status"] == "completed", batch
        assert batch["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
        status, _, output = _http(f"{base}/v1/files/{batch['output_file_id']}/content")
        assert status == 200
        records = [json.loads(line) for line in output.decode().splitlines()]
        assert [record["custom_id"] for record in records] == ["line-0", "line-1", "line-2"]
        assert all(record["response"]["status_code"] == 200 for record in records)
        # Each line reached llama-server through Envoy, at the batch priority, with its own id.
        lines_seen = [hit for hit in upstream.hits if hit.get("x-request-id", "").startswith(batch_id)]
        assert sorted(hit["x-request-id"] for hit in lines_seen) == [f"{batch_id}:line-{n}" for n in range(3)]
        assert {hit["x-llamaswap-priority"] for hit in lines_seen} == {"-100"}
        # The state is on the batches volume (in the pod: the claim).
        assert (volumes.dirs["batches"] / "batches.sqlite3").exists()
        assert (volumes.dirs["batches"] / "files" / file_id).exists()
    except BaseException:
        for process in processes:
            process.dump()
        raise
    finally:
        for process in processes:
            with contextlib.suppress(Exception):
                process.stop()
        upstream.close()
