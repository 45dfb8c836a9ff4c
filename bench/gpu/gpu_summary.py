"""The GPU benchmark's results (results.json) as the text summary printed and kept beside them."""

from __future__ import annotations

from typing import Any


def _f(value: Any, digits: int = 2) -> str:
    return f"{value:.{digits}f}" if isinstance(value, (int, float)) else str(value)


def _cpu(per_request: dict[str, float]) -> str:
    return f"CPU per request: sidecar {_f(per_request['sidecar'])} ms, Envoy {_f(per_request['envoy'])} ms"


def _load(lines: list[str], figures: dict[str, Any]) -> None:
    lines.append("model load (router, --models-max 1): first token of the loading request minus a loaded one's")
    for model, entry in figures.items():
        if not isinstance(entry, dict) or "load_s" not in entry:
            continue
        cold = entry["cold_first_token_s"]
        lines.append(f"  {model}: load {_f(entry['load_s'])} s (cold first tokens {', '.join(_f(c) for c in cold)} s; "
                     f"warm median {_f(sorted(entry['warm_first_token_s'])[len(entry['warm_first_token_s']) // 2], 3)}"
                     f" s); unload {', '.join(_f(u) for u in entry['unload_s'])} s; device memory with it "
                     f"{_f(entry.get('gpu_memory_mib'), 0)} MiB")
        lines.append(f"      through llamaswap: the estimator learns {_f(entry['estimator_swap_s'])} s (cold "
                     f"{', '.join(_f(c) for c in entry['llamaswap_cold_first_token_s'])} s)")


def _slots(lines: list[str], name: str, figures: dict[str, Any]) -> None:
    per_s = figures["tokens_per_s"]
    lines.append(f"{name}: {_f(per_s['direct'], 0)} tokens/s direct, {_f(per_s['llamaswap'], 0)} through llamaswap "
                 f"({_f(figures['ratio'], 3)}x)")
    if "overhead" in figures:
        o = figures["overhead"]
        lines.append(f"  {o['tokens']}-token requests one at a time ({o['requests_each']} each): direct p50 "
                     f"{_f(o['direct']['p50_ms'])} p99 {_f(o['direct']['p99_ms'])} ms; llamaswap p50 "
                     f"{_f(o['llamaswap']['p50_ms'])} p99 {_f(o['llamaswap']['p99_ms'])} ms; added p50 "
                     f"{_f(o['added_p50_ms'])} ms ({_f(100 * o['added_share_p50'], 1)} % of a request), p99 "
                     f"{_f(o['added_p99_ms'])} ms; {_cpu(o['cpu_ms_per_request'])}")


def _resident(lines: list[str], figures: dict[str, Any]) -> None:
    lines.append("two models resident (router, --models-max 2), tokens/s with 4 clients each:")
    for key, value in figures.items():
        if key.endswith(" kept"):
            model = key[: -len(" kept")]
            lines.append(f"  {model}: alone {_f(figures[model + ' alone'], 0)}, beside the other "
                         f"{_f(figures[model + ' beside the other'], 0)} ({_f(100 * value, 0)} % kept)")
    lines.append(f"  device memory MiB: {figures.get('gpu_memory_mib')}; both loaded at the end: "
                 f"{figures.get('both_loaded')}")


def _short(lines: list[str], figures: dict[str, Any]) -> None:
    per_s = figures["requests_per_s"]
    lines.append(f"short requests ({figures['tokens']} tokens) from {figures['slots']} clients at {figures['slots']} "
                 f"slots: {_f(per_s['direct'], 0)} requests/s direct, {_f(per_s['llamaswap'], 0)} through llamaswap "
                 f"({_f(figures['ratio'], 3)}x); {_cpu(figures['cpu_ms_per_request'])}; cores busy: sidecar "
                 f"{_f(figures['cores_busy']['sidecar'])}, Envoy {_f(figures['cores_busy']['envoy'])}")


def _beside(lines: list[str], figures: dict[str, Any]) -> None:
    lines.append("a load beside generation (router, --models-max 2):")
    for key, value in figures.items():
        if key != "seconds":
            lines.append(f"  {key}: {_f(value)}")


def render(results: dict[str, Any]) -> str:
    env = results.get("environment", {})
    where = "CPU trial" if results.get("cpu_trial") else "GPU"
    lines = [f"llamaswap GPU benchmark, {results.get('started')} ({where})",
             f"device: {env.get('gpu')}; llama-server: {str(env.get('llama_server', '')).splitlines()[-2:]}",
             f"models: {env.get('models')}", ""]
    for name, figures in results.get("sections", {}).items():
        if "error" in figures or "skipped" in figures:
            lines.append(f"{name}: {figures.get('error') or 'skipped: ' + figures['skipped']}")
        elif name == "load":
            _load(lines, figures)
        elif name.startswith("slots"):
            _slots(lines, name, figures)
        elif name == "resident":
            _resident(lines, figures)
        elif name == "short":
            _short(lines, figures)
        elif name == "beside":
            _beside(lines, figures)
        elif name == "preempt":
            lines.append("stopping batch lines for a person (bench/preempt.py, issue 46):")
            lines.extend(f"  {line}" for line in figures["report"])
        if "seconds" in figures:
            lines.append(f"  ({figures['seconds']} s)")
    return "\n".join(lines) + "\n"
