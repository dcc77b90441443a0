"""EngineMetrics counts every completion of an n > 1 request once in every per-request series
(as vLLM records each child request), whether the outputs are deltas or one final output."""
import time

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.metrics import EngineMetrics
from pagedserve.outputs import CompletionOutput, RequestMetrics, RequestOutput

PROMPT = [5, 6, 7, 8]


def _samples(m: EngineMetrics) -> dict:
    out = {}
    for fam in text_string_to_metric_families(generate_latest(m.registry).decode()):
        for s in fam.samples:
            key = s.name + (f"[{s.labels['finished_reason']}]" if "finished_reason" in s.labels else "")
            out[key] = s.value
    return out


def _out(outputs: list, finished: bool, t: float) -> RequestOutput:
    return RequestOutput("r1", None, PROMPT, outputs, finished,
                         metrics=RequestMetrics(arrival_time=0.0, first_scheduled_time=0.1, first_token_time=0.5,
                                                last_token_time=t, finished_time=t if finished else None))


def _c(index: int, tokens: list, reason=None) -> CompletionOutput:
    return CompletionOutput(index=index, text="x" * len(tokens), token_ids=tokens, cumulative_logprob=None, logprobs=None,
                            finish_reason=reason)


def _check(m: EngineMetrics, e2e_sum: float) -> None:
    s = _samples(m)
    assert s["pagedserve:request_success_total[length]"] == 2
    assert s["pagedserve:request_success_total[stop]"] == 1
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prompt_tokens", "request_generation_tokens"):
        assert s[f"pagedserve:{name}_count"] == 3, name
    assert s["pagedserve:request_prompt_tokens_sum"] == 3 * len(PROMPT)
    assert s["pagedserve:request_generation_tokens_sum"] == 3 + 2 + 3
    assert abs(s["pagedserve:e2e_request_latency_seconds_sum"] - e2e_sum) < 1.0
    assert not m._generated and not m._finish_counted  # nothing kept once the request ends


def test_n3_delta_outputs_count_each_completion_once():
    m = EngineMetrics("m")
    m.observe_output(_out([_c(0, [1]), _c(1, [1]), _c(2, [1])], False, 0.5))
    m.observe_output(_out([_c(0, [2]), _c(1, [2], "stop"), _c(2, [2])], False, 1.0))  # 1 ends here, reported once
    t0 = time.monotonic()  # completion 1 ends apart from the others: at the time it is seen
    m.observe_output(_out([_c(0, [3], "length"), _c(2, [3], "length")], True, 1.5))
    _check(m, 2 * 1.5 + t0)


def test_n3_final_output_counts_the_same():
    m = EngineMetrics("m")
    m.observe_output(_out([_c(0, [1, 2, 3], "length"), _c(1, [1, 2], "stop"), _c(2, [1, 2, 3], "length")], True, 1.5))
    _check(m, 3 * 1.5)


def test_generation_tokens_are_the_tokens_returned():
    m = EngineMetrics("m")
    m.observe_output(_out([_c(0, [1]), _c(1, [1]), _c(2, [1])], False, 0.5))
    m.observe_output(_out([_c(0, [2, 3], "length"), _c(1, [2], "stop"), _c(2, [2, 3], "length")], True, 1.5))
    assert _samples(m)["pagedserve:generation_tokens_total"] == 3 + 5


def test_abort_counts_each_running_completion_and_keeps_those_that_ended():
    m = EngineMetrics("m")
    m.observe_output(_out([_c(0, [1]), _c(1, [1]), _c(2, [1])], False, 0.5))
    m.observe_output(_out([_c(0, [2]), _c(1, [2], "stop"), _c(2, [2])], False, 1.0))
    m.observe_abort("r1", 2)  # 0 and 2 were still running
    s = _samples(m)
    assert s["pagedserve:request_success_total[stop]"] == 1 and s["pagedserve:request_success_total[abort]"] == 2
    assert s["pagedserve:e2e_request_latency_seconds_count"] == 1 and s["pagedserve:request_generation_tokens_sum"] == 2
    assert not m._generated and not m._finish_counted
