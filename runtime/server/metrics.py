"""Prometheus metrics, written by hand in the text exposition format (no extra dependency).

Request counts come from an ASGI middleware (endpoint x status); token totals, queue depths and KV blocks are
read from the engine when /metrics is scraped; TTFT and TPOT histograms are observed by the generation code.
"""

from __future__ import annotations

import bisect
import time
from collections import Counter
from collections.abc import Iterable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from envex.runtime.server.async_engine import AsyncEngine

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    return repr(float(value)) if isinstance(value, float) else str(value)


class Histogram:
    def __init__(self, buckets: Iterable[float]) -> None:
        self.bounds = tuple(sorted(buckets))
        self.counts = [0] * (len(self.bounds) + 1)  # the last slot is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def lines(self, name: str) -> list[str]:
        out, cumulative = [], 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            cumulative += count
            le = "+Inf" if bound == float("inf") else repr(bound)
            out.append(f'{name}_bucket{{le="{le}"}} {cumulative}')
        out += [f"{name}_sum {_number(self.sum)}", f"{name}_count {cumulative}"]
        return out


class Metrics:
    """The server's counters; one per app. Only touched from the event loop, so no lock is needed."""

    def __init__(self, known_paths: Iterable[str] = ()) -> None:
        self.known_paths = set(known_paths)
        self.requests: Counter[tuple[str, str]] = Counter()
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.started = time.time()

    def count_request(self, path: str, status: int) -> None:
        # Unknown paths share one label so a scanner cannot grow the label set without bound.
        endpoint = path if path in self.known_paths else "other"
        self.requests[(endpoint, str(status))] += 1

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_tpot(self, seconds: float) -> None:
        self.tpot.observe(seconds)

    def render(self, async_engine: AsyncEngine) -> str:
        stats = async_engine.stats()
        lines: list[str] = []

        def metric(name: str, kind: str, help_text: str, samples: list[str]) -> None:
            lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *samples])

        metric("envex_requests_total", "counter", "HTTP requests by endpoint and status code.",
               [f'envex_requests_total{{endpoint="{_escape(e)}",status="{s}"}} {n}'
                for (e, s), n in sorted(self.requests.items())])
        states = getattr(getattr(async_engine.engine, "runner", None), "states", None)  # a hybrid's state slots
        for name, kind, help_text, value in (
            ("envex_prompt_tokens_total", "counter", "Prompt tokens prefilled.", stats.prompt_tokens_total),
            ("envex_generation_tokens_total", "counter", "Tokens generated.", stats.generation_tokens_total),
            ("envex_prefix_cache_hit_tokens_total", "counter", "Prompt tokens found in the prefix cache.",
             stats.prefix_cache_hit_tokens_total),
            ("envex_preemptions_total", "counter", "Sequences preempted for lack of KV blocks.",
             stats.preemptions_total),
            ("envex_accepted_draft_tokens_total", "counter", "Speculative draft tokens accepted.",
             stats.accepted_draft_tokens_total),
            ("envex_spec_draft_tokens_total", "counter", "Speculative draft tokens proposed to verify steps.",
             stats.spec_draft_tokens_total),
            ("envex_spec_verify_steps_total", "counter", "Speculative verify steps.", stats.spec_verify_steps_total),
            ("envex_spec_tokens_per_step", "gauge",
             "Tokens a sequence gained per verify step (1 + accepted drafts), since start.",
             stats.spec_tokens_per_step),
            ("envex_spec_depth", "gauge", "Draft depth k of the last verify step.", stats.spec_depth),
            ("envex_num_requests_running", "gauge", "Sequences in the running batch.", stats.num_running),
            ("envex_num_requests_waiting", "gauge", "Sequences waiting to be scheduled.", stats.num_waiting),
            ("envex_requests_in_flight", "gauge", "Engine requests admitted by the server and not finished.",
             async_engine.in_flight),
            ("envex_kv_blocks_used", "gauge", "KV-cache blocks in use.", stats.kv_blocks_used),
            ("envex_kv_blocks_total", "gauge", "KV-cache blocks in the pool.", stats.kv_blocks_total),
            ("envex_engine_up", "gauge", "1 while the engine thread is alive.", int(async_engine.is_running)),
            ("envex_state_bytes_per_sequence", "gauge",
             "Recurrent state one sequence holds over the model's linear-attention layers (0: none).",
             states.bytes_per_slot if states is not None else 0),
            ("envex_state_slots_total", "gauge",
             "Recurrent-state slots allocated: one live a sequence, prefix snapshots, scratch and verify slots.",
             states.total_slots if states is not None else 0),
        ):
            metric(name, kind, help_text, [f"{name} {value}"])
        metric("envex_speculative_info", "gauge", "Speculative decoding: the drafter and the most drafts per step.",
               [f'envex_speculative_info{{drafter="{_escape(stats.speculative_drafter or "off")}",'
                f'max_k="{stats.speculative_max_k}"}} 1'])
        config = async_engine.engine.config  # resolved: what this server actually runs
        # Tokens the KV pool holds in its format (fp8 / int4 packed: more blocks in the same memory), all layers.
        metric("envex_kv_cache_capacity_tokens", "gauge", "Tokens the KV-cache pool holds, in its kv_cache_dtype.",
               [f'envex_kv_cache_capacity_tokens{{kv_cache_dtype="{_escape(config.kv_cache_dtype)}"}} '
                f"{stats.kv_blocks_total * config.block_size}"])
        settings = ",".join(f'{key}="{_escape(str(value).lower() if isinstance(value, bool) else str(value))}"'
                            for key, value in (("backend", config.backend), ("dtype", config.dtype),
                                               ("deterministic", config.deterministic),
                                               ("max_model_len", config.max_model_len),
                                               ("tensor_parallel", config.tensor_parallel),
                                               ("max_num_seqs", config.max_num_seqs),
                                               ("weights", config.weights or "as stored")))  # fmt: skip
        metric("envex_engine_info", "gauge", "The engine's resolved settings.", [f"envex_engine_info{{{settings}}} 1"])
        metric("envex_time_to_first_token_seconds", "histogram",
               "Time from request arrival to each choice's first token.", self.ttft.lines(
                   "envex_time_to_first_token_seconds"))
        metric("envex_time_per_output_token_seconds", "histogram",
               "Mean time between tokens after the first, per finished choice.", self.tpot.lines(
                   "envex_time_per_output_token_seconds"))
        return "\n".join(lines) + "\n"


class MetricsMiddleware:
    """Counts every HTTP request by path and the status it was answered with (499: client left first)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_and_record(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        finally:
            self.metrics.count_request(scope.get("path", ""), status)
