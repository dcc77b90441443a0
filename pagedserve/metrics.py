"""Prometheus metrics, named after vLLM's (``vllm:`` becomes ``pagedserve:``).

Each server app owns one :class:`EngineMetrics` with its own ``CollectorRegistry``, so two
apps in one process (tests) do not collide. The engine thread of
:class:`pagedserve.engine.async_llm.AsyncLLM` feeds it from its output thread:

* ``observe_stats(stats)`` after every step: gauges (running / waiting requests, KV cache
  usage) and counters that follow the engine's running totals (prompt tokens, preemptions,
  prefix cache queries / hits in tokens, KV-transfer tokens sent / received and failures by
  reason), and the step's KV-load times.
* ``observe_output(output)`` for every ``RequestOutput``: generation tokens returned, time to
  first token, inter-token latency, and per completion as it ends ``request_success
  {finished_reason}``, end-to-end latency and the phase and size histograms.
* ``observe_abort(request_id, n)`` when a live request is aborted with ``n`` completions running
  (``finished_reason="abort"`` each).

Counters are exposed with the ``_total`` suffix, as prometheus-client (and vLLM) do:
``pagedserve:prompt_tokens_total``, ``pagedserve:request_success_total{finished_reason="stop"}``.

Every series carries an ``engine`` label, as vLLM's (the data-parallel rank; "0" with one
engine): with ``--data-parallel-size N`` the front serves each replica's series side by side
(``for_engine(i)`` gives replica i's view, over the same metric families), so a sum over
``engine`` is the server's. ``pagedserve:engine_replica_up{engine}`` is 1 while a replica is in
rotation.

With LoRA (``--enable-lora``), ``pagedserve:lora_requests_info`` is vLLM's ``vllm:lora_requests_info``
(see :class:`LoRARequestsInfo`): one series whose labels ``running_lora_adapters`` and
``waiting_lora_adapters`` list the adapters of the live requests (comma-joined, sorted) and
``max_lora`` is ``--max-loras``; its value is the Unix time of the last change, as vLLM's is the
time of its update. Like vLLM's it carries only those three labels (no ``model_name``, no
``engine``): it describes the whole server.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any, Callable, Optional

import prometheus_client
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from pagedserve.core.outputs import SchedulerStats
from pagedserve.outputs import RequestOutput

PREFIX = "pagedserve:"

# Buckets as vLLM's (seconds).
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]

# Request sizes in tokens (vLLM's 1-2-5 series), and tokens per engine step.
TOKEN_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000]
ITERATION_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]

CONTENT_TYPE = CONTENT_TYPE_LATEST

# Each registry's metric families by name: the EngineMetrics of several engines share them.
_FAMILIES: "weakref.WeakKeyDictionary[CollectorRegistry, dict[str, Any]]" = weakref.WeakKeyDictionary()


def _shared(cls: type, registry: CollectorRegistry) -> Callable[..., Any]:
    """``cls(name, ...)`` that returns the family already registered under ``name`` in
    ``registry`` instead of registering a second one."""
    families = _FAMILIES.setdefault(registry, {})

    def make(name: str, *args: Any, **kwargs: Any) -> Any:
        if name not in families:
            families[name] = cls(name, *args, **kwargs)
        return families[name]

    return make


class EngineMetrics:
    """The server's Prometheus metrics of one engine, labelled by ``model_name`` and ``engine``."""

    def __init__(self, model_name: str, registry: Optional[CollectorRegistry] = None, engine: int = 0) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        self.engine = str(engine)
        self._engines: dict[int, EngineMetrics] = {engine: self}
        r, L = self.registry, ["model_name", "engine"]
        Counter, Gauge, Histogram = (_shared(c, r) for c in (prometheus_client.Counter, prometheus_client.Gauge, prometheus_client.Histogram))

        def lab(metric):
            return metric.labels(model_name=model_name, engine=self.engine)

        self.num_requests_running = lab(Gauge(PREFIX + "num_requests_running", "Number of requests in model execution batches.", L, registry=r))
        self.num_requests_waiting = lab(Gauge(PREFIX + "num_requests_waiting", "Number of requests waiting to be processed.", L, registry=r))
        self.kv_cache_usage_perc = lab(Gauge(PREFIX + "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", L, registry=r))
        self.prefix_cache_queries = lab(
            Counter(PREFIX + "prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.", L, registry=r)
        )
        self.prefix_cache_hits = lab(Counter(PREFIX + "prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", L, registry=r))
        self.num_preemptions = lab(Counter(PREFIX + "num_preemptions", "Cumulative number of preemptions from the engine.", L, registry=r))
        self.prompt_tokens = lab(Counter(PREFIX + "prompt_tokens", "Number of prefill tokens processed.", L, registry=r))
        self.generation_tokens = lab(Counter(PREFIX + "generation_tokens", "Number of generation tokens processed.", L, registry=r))
        self.time_to_first_token = lab(
            Histogram(PREFIX + "time_to_first_token_seconds", "Histogram of time to first token in seconds.", L, registry=r, buckets=TTFT_BUCKETS)
        )
        self.inter_token_latency = lab(
            Histogram(PREFIX + "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", L, registry=r, buckets=ITL_BUCKETS)
        )
        self.e2e_request_latency = lab(
            Histogram(PREFIX + "e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", L, registry=r, buckets=E2E_BUCKETS)
        )
        phase = lambda name, what: lab(Histogram(PREFIX + name, f"Histogram of time spent in {what} in seconds.", L, registry=r, buckets=E2E_BUCKETS))  # noqa: E731
        self.request_queue_time = phase("request_queue_time_seconds", "WAITING phase for request")
        self.request_prefill_time = phase("request_prefill_time_seconds", "PREFILL phase for request")
        self.request_decode_time = phase("request_decode_time_seconds", "DECODE phase for request")
        self.request_inference_time = phase("request_inference_time_seconds", "RUNNING phase for request")
        self.request_prompt_tokens = lab(
            Histogram(PREFIX + "request_prompt_tokens", "Number of prefill tokens processed.", L, registry=r, buckets=TOKEN_BUCKETS)
        )
        self.request_generation_tokens = lab(
            Histogram(PREFIX + "request_generation_tokens", "Number of generation tokens processed.", L, registry=r, buckets=TOKEN_BUCKETS)
        )
        self.iteration_tokens = lab(
            Histogram(PREFIX + "iteration_tokens_total", "Histogram of number of tokens per engine_step.", L, registry=r, buckets=ITERATION_BUCKETS)
        )
        self._request_success = Counter(
            PREFIX + "request_success", "Count of successfully processed requests.", ["model_name", "engine", "finished_reason"], registry=r
        )
        for reason in ("stop", "length", "abort", "timeout", "error"):
            self._request_success.labels(model_name=model_name, engine=self.engine, finished_reason=reason)
        self.replica_up = lab(Gauge(PREFIX + "engine_replica_up", "1 while the engine replica is in rotation.", L, registry=r))
        self.replica_up.set(1)
        self._weight_bytes = Gauge(
            PREFIX + "model_weight_bytes",
            "Bytes the model's weights take in memory, by weights type.",
            ["model_name", "engine", "weights_type"],
            registry=r,
        )
        # Prefill/decode disaggregation (zero on an instance without a KV connector).
        self.kv_transfer_sent_tokens = lab(
            Counter(PREFIX + "kv_transfer_sent_tokens", "Tokens whose KV this instance sent to a decode instance.", L, registry=r)
        )
        self.kv_transfer_received_tokens = lab(
            Counter(PREFIX + "kv_transfer_received_tokens", "Tokens whose KV this instance loaded from a prefill instance.", L, registry=r)
        )
        self.kv_transfer_time = lab(
            Histogram(
                PREFIX + "kv_transfer_time_seconds",
                "Histogram of the wall time of KV loads from a prefill instance in seconds.",
                L,
                registry=r,
                buckets=TTFT_BUCKETS,
            )
        )
        self._kv_transfer_failures = Counter(
            PREFIX + "kv_transfer_failures", "KV transfers that failed, by reason.", ["model_name", "engine", "reason"], registry=r
        )
        # Speculative decoding (zero without --speculative-config), vLLM's names.
        self.spec_decode_num_drafts = lab(Counter(PREFIX + "spec_decode_num_drafts", "Number of spec decoding drafts.", L, registry=r))
        self.spec_decode_num_draft_tokens = lab(Counter(PREFIX + "spec_decode_num_draft_tokens", "Number of draft tokens.", L, registry=r))
        self.spec_decode_num_accepted_tokens = lab(Counter(PREFIX + "spec_decode_num_accepted_tokens", "Number of accepted tokens.", L, registry=r))
        self._spec_decode_per_pos = Counter(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            ["model_name", "engine", "position"],
            registry=r,
        )
        self.lora_usage: Optional[LoRARequestsInfo] = None  # enable_lora_info
        self._lock = threading.Lock()
        self._totals: dict[str, int] = {}
        self._last_token_time: dict[str, float] = {}
        self._generated: dict[str, dict[int, int]] = {}  # request id -> completion index -> tokens
        self._finish_counted: dict[str, set[int]] = {}  # completions whose request_success is counted

    def enable_lora_info(self, max_loras: int) -> "LoRARequestsInfo":
        """Register ``pagedserve:lora_requests_info`` (a server with ``--enable-lora``); the
        front reports its LoRA requests to the returned :attr:`lora_usage`."""
        if self.lora_usage is None:
            gauge = _shared(prometheus_client.Gauge, self.registry)(
                PREFIX + "lora_requests_info", "Running stats on lora requests.", list(LoRARequestsInfo.LABELS), registry=self.registry
            )
            self.lora_usage = LoRARequestsInfo(gauge, max_loras)
        return self.lora_usage

    # -- fed by the engine thread ----------------------------------------------------------
    def set_weights(self, weights_type: str, nbytes: int) -> None:
        """The model's weights: type (``bfloat16``, ``Q4_1+Q8_0``) and bytes in memory."""
        if weights_type:
            self._weight_bytes.labels(model_name=self.model_name, engine=self.engine, weights_type=weights_type).set(nbytes)

    def observe_stats(self, stats: SchedulerStats) -> None:
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_cache_usage_perc.set(stats.kv_cache_usage)
        with self._lock:
            for key, counter in (
                ("prefix_cache_queries", self.prefix_cache_queries),
                ("prefix_cache_hits", self.prefix_cache_hits),
                ("num_preemptions", self.num_preemptions),
                ("num_prompt_tokens", self.prompt_tokens),
                ("kv_transfer_sent_tokens", self.kv_transfer_sent_tokens),
                ("kv_transfer_received_tokens", self.kv_transfer_received_tokens),
                ("spec_decode_num_drafts", self.spec_decode_num_drafts),
                ("spec_decode_num_draft_tokens", self.spec_decode_num_draft_tokens),
                ("spec_decode_num_accepted_tokens", self.spec_decode_num_accepted_tokens),
            ):
                value = getattr(stats, key)
                delta = value - self._totals.get(key, 0)
                if delta > 0:
                    counter.inc(delta)
                self._totals[key] = value
            for family, label, counts in (
                (self._kv_transfer_failures, "reason", stats.kv_transfer_failures),
                (self._spec_decode_per_pos, "position", stats.spec_decode_num_accepted_tokens_per_pos),
            ):
                for value_of_label, value in counts.items():
                    key = f"{label}:{value_of_label}"
                    delta = value - self._totals.get(key, 0)
                    if delta > 0:
                        family.labels(model_name=self.model_name, engine=self.engine, **{label: value_of_label}).inc(delta)
                    self._totals[key] = value
        for seconds in stats.kv_transfer_seconds:
            self.kv_transfer_time.observe(seconds)

    def observe_output(self, out: RequestOutput) -> None:
        """Count one ``RequestOutput`` (final-only with its ``n`` completions, or a delta holding
        those that changed). As vLLM records each child of an ``n > 1`` request, every
        per-request series counts completions: TTFT when a completion first returns tokens, and
        ``request_success`` and the end-of-request histograms (with that completion's own token
        count) when its finish reason first appears, so a completion that ends before its
        siblings is counted even if the request is aborted later. The times are the request's
        (its completions run together); a completion that ends apart from the others ends now.
        ``generation_tokens`` counts the tokens returned (as vLLM, which drops what the engine
        sampled after a stop string ended the sequence)."""
        m = out.metrics
        if m is None:
            return
        rid = out.request_id
        with self._lock:
            # Outputs may be deltas: count each completion's tokens over all of them.
            generated = self._generated.setdefault(rid, {})
            first = [c for c in out.outputs if c.token_ids and not generated.get(c.index)]  # its first tokens
            for c in out.outputs:
                generated[c.index] = generated.get(c.index, 0) + len(c.token_ids)
            done = self._finish_counted.setdefault(rid, set())
            ended = [(c, generated[c.index]) for c in out.outputs if c.finish_reason and c.index not in done]
            done.update(c.index for c, _ in ended)
            # The request's finish time is this output's when completion 0 ends in it.
            together = out.finished and any(c.index == 0 for c, _ in ended)
            if out.finished:
                self._generated.pop(rid)
                self._finish_counted.pop(rid)
            prev = self._last_token_time.get(rid)
            if m.last_token_time is not None:
                if prev is not None and m.last_token_time > prev:
                    self.inter_token_latency.observe(m.last_token_time - prev)
                self._last_token_time[rid] = m.last_token_time
            if out.finished:
                self._last_token_time.pop(rid, None)
        returned = sum(len(c.token_ids) for c in out.outputs)
        if returned:
            self.generation_tokens.inc(returned)
        if m.first_token_time is not None:
            for _ in first:
                self.time_to_first_token.observe(max(0.0, m.first_token_time - m.arrival_time))
        if ended:
            end = (m.finished_time or m.last_token_time) if together else time.monotonic()
            for c, count in ended:
                self._request_success.labels(model_name=self.model_name, engine=self.engine, finished_reason=c.finish_reason).inc()
                if end is not None:
                    self.e2e_request_latency.observe(max(0.0, end - m.arrival_time))
                self._observe_phases(out, count)

    def _observe_phases(self, out: RequestOutput, generated: int) -> None:
        """vLLM's per-request phase times (queue, prefill, decode, running) and sizes."""
        m = out.metrics
        if m.first_scheduled_time is not None:
            self.request_queue_time.observe(max(0.0, m.first_scheduled_time - m.arrival_time))
            if m.first_token_time is not None:
                self.request_prefill_time.observe(max(0.0, m.first_token_time - m.first_scheduled_time))
            if m.last_token_time is not None:
                self.request_inference_time.observe(max(0.0, m.last_token_time - m.first_scheduled_time))
        if m.first_token_time is not None and m.last_token_time is not None:
            self.request_decode_time.observe(max(0.0, m.last_token_time - m.first_token_time))
        self.request_prompt_tokens.observe(len(out.prompt_token_ids))
        self.request_generation_tokens.observe(generated)

    def observe_step(self, num_scheduled_tokens: int) -> None:
        if num_scheduled_tokens > 0:
            self.iteration_tokens.observe(num_scheduled_tokens)

    def observe_abort(self, request_id: str, num_completions: int = 1) -> None:
        """A live request was aborted with ``num_completions`` completions still running: one
        ``finished_reason="abort"`` each (its finished ones were counted as they ended)."""
        with self._lock:
            self._last_token_time.pop(request_id, None)
            self._generated.pop(request_id, None)
            self._finish_counted.pop(request_id, None)
        if num_completions > 0:
            self._request_success.labels(model_name=self.model_name, engine=self.engine, finished_reason="abort").inc(num_completions)

    def for_engine(self, engine: int) -> "EngineMetrics":
        """Engine ``engine``'s metrics (created on first use), in this registry."""
        m = self._engines.get(engine)
        if m is None:
            m = self._engines[engine] = EngineMetrics(self.model_name, self.registry, engine)
        return m

    # -- exposition --------------------------------------------------------------------------
    def render(self) -> bytes:
        return generate_latest(self.registry)


class LoRARequestsInfo:
    """``pagedserve:lora_requests_info``: which LoRA adapters the live requests use, as the front
    sees them (vLLM reads its scheduler's queues; the front's view has the same meaning).

    A request is *waiting* from the moment the front hands it to the engine until its first
    output (queued, in prefill, or waiting for a free adapter slot: what
    ``AsyncLLM.num_waiting_to_start`` counts), then *running* until it ends (a request preempted
    after its first output stays running). An adapter is listed in ``running_lora_adapters`` when
    at least one of its requests runs, and in ``waiting_lora_adapters`` when at least one waits
    (it may be in both). Base-model requests are not listed.

    One series at a time: when the lists change, the old series is removed and the new one set
    to the current Unix time (vLLM keeps every past series; a reader that takes the series with
    the largest value reads both the same way).
    """

    LABELS = ("max_lora", "waiting_lora_adapters", "running_lora_adapters")

    def __init__(self, gauge: Any, max_loras: int) -> None:
        self._gauge = gauge
        self.max_lora = str(max_loras)
        self._lock = threading.Lock()
        self._requests: dict[str, list] = {}  # request id -> [adapter name, running]
        self._labels: Optional[tuple[str, str, str]] = None
        with self._lock:
            self._publish()

    def add(self, request_id: str, lora_name: str) -> None:
        """A request of adapter ``lora_name`` was handed to the engine (waiting)."""
        with self._lock:
            self._requests[request_id] = [lora_name, False]
            self._publish()

    def update(self, request_id: str, finished: bool) -> None:
        """The request returned an output: it runs (or, ``finished``, it is gone)."""
        with self._lock:
            entry = self._requests.get(request_id)
            if entry is None or (entry[1] and not finished):
                return
            if finished:
                del self._requests[request_id]
            else:
                entry[1] = True
            self._publish()

    def discard(self, request_id: str) -> None:
        """The request ended (finished, aborted, failed); unknown ids are ignored."""
        with self._lock:
            if self._requests.pop(request_id, None) is not None:
                self._publish()

    def adapters(self) -> tuple[list[str], list[str]]:
        """(running, waiting) adapter names, sorted."""
        with self._lock:
            return self._lists()

    def _lists(self) -> tuple[list[str], list[str]]:
        running = sorted({name for name, started in self._requests.values() if started})
        waiting = sorted({name for name, started in self._requests.values() if not started})
        return running, waiting

    def _publish(self) -> None:  # under the lock
        running, waiting = self._lists()
        labels = (self.max_lora, ",".join(waiting), ",".join(running))
        if labels == self._labels:
            return
        if self._labels is not None:
            self._gauge.remove(*self._labels)
        self._gauge.labels(*labels).set(time.time())
        self._labels = labels
