"""vLLM's ``bad_words`` and ``allowed_token_ids``: the worker's per-row bans
(``pagedserve.worker.token_bans``), the frontend's tokenization and refusals, and SmolLM2
end to end."""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from conftest import assert_engine_idle
from pagedserve import SamplingParams
from pagedserve.engine.input_processor import RequestError
from pagedserve.worker.input_batch import CachedRequestState, InputBatch


def _batch_with(bad_words_ids, prompt, allowed=None, V=20):
    batch = InputBatch(2, 16, 1, V, torch.device("cpu"))
    sp = SamplingParams(temperature=0.0, allowed_token_ids=allowed)
    sp._bad_words_token_ids = bad_words_ids
    row = batch.add_request(CachedRequestState("r", sp, [], None), prompt, [], [0], 0)
    return batch, row


def _banned(batch, row):
    md = batch.sampling_metadata(np.array([row], dtype=np.int64))
    return set() if md.banned_mask is None else set(torch.nonzero(md.banned_mask[0]).flatten().tolist())


def test_a_bad_word_bans_its_last_token_after_its_prefix_in_the_output_only():
    batch, row = _batch_with([[3], [5, 6], [7, 8, 9]], prompt=[1, 5])  # the prompt ends with 5: does not count
    assert _banned(batch, row) == {3}
    for out, want in (([5], {3, 6}), ([8], {3}), ([7, 8], {3, 9}), ([8], {3}), ([5], {3, 6}), ([7], {3})):
        batch.append_token_ids(row, out)
        assert _banned(batch, row) == want, (out, batch.token_ids[row, : batch.num_tokens[row]])


def test_bad_words_and_allowed_token_ids_add_up_and_leave_with_the_row():
    batch, row = _batch_with([[4], [2, 6]], prompt=[1], allowed=[4, 6, 9])
    assert _banned(batch, row) == set(range(20)) - {6, 9}
    batch.append_token_ids(row, [2])
    assert _banned(batch, row) == set(range(20)) - {9}
    batch.remove_request("r")
    assert not batch.token_bans
    plain = batch.add_request(CachedRequestState("s", SamplingParams(temperature=0.0), [], None), [2], [], [0], 0)
    assert _banned(batch, plain) == set()


def test_frontend_tokenizes_both_spellings_and_refuses_what_leaves_nothing(smollm2_llm):
    ip = smollm2_llm.llm_engine.input_processor
    tok = smollm2_llm.get_tokenizer()
    spellings = ip.bad_words_token_ids(["  Paris"])
    assert spellings == [tok("Paris", add_special_tokens=False)["input_ids"], tok(" Paris", add_special_tokens=False)["input_ids"]]
    params = SamplingParams(bad_words=["Paris"], allowed_token_ids=[s[-1] for s in spellings])
    with pytest.raises(RequestError, match="bad_words can ban every token"):
        ip.check_params(params)
    two = ip.bad_words_token_ids(["omt"])[0]  # two tokens: its last is banned only after the first,
    assert len(two) == 2  # which is not allowed here, so the request can always sample
    ip.check_params(SamplingParams(bad_words=["omt"], allowed_token_ids=[two[-1]]))
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=["   "])
    with pytest.raises(ValueError, match="at most 64"):
        SamplingParams(bad_words=["x"] * 65)


def test_smollm2_never_generates_a_bad_word(smollm2_llm):
    """Ban a word the model writes greedily (taken from its own answer, whatever it says on this
    host): neither spelling's tokens appear under the ban, greedy or sampled."""
    prompt = "The capital of France is"
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    first = smollm2_llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0]
    ids = list(first.token_ids)

    def contains(ids, w):
        return any(ids[i:i + len(w)] == w for i in range(len(ids)))

    ip = smollm2_llm.llm_engine.input_processor
    # The first whole word (3+ letters) whose tokens, as either spelling, are in the greedy answer's ids.
    candidates = [(m.group(), ip.bad_words_token_ids([m.group()])) for m in re.finditer(r"\b[A-Za-z]{3,}\b", first.text)]
    word, spellings = next(((w, sp) for w, sp in candidates if any(contains(ids, s) for s in sp)), (None, None))
    assert word is not None, (first.text, ids)  # the word the test bans is in the unbanned answer
    for params in (SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, bad_words=[word]),
                   SamplingParams(temperature=1.0, seed=3, max_tokens=10, ignore_eos=True, bad_words=[word], n=2)):
        for out in smollm2_llm.generate(prompt, params, use_tqdm=False)[0].outputs:
            for w in spellings:
                assert not contains(list(out.token_ids), w), (word, w, out.text)
    assert_engine_idle(smollm2_llm)


def test_n_copies_share_the_ban_lists():
    params = SamplingParams(allowed_token_ids=list(range(1000)), bad_words=["Paris"], n=4)
    params._bad_words_token_ids = [[5, 6]]
    child = params.clone()
    assert child.allowed_token_ids is params.allowed_token_ids and child._bad_words_token_ids is params._bad_words_token_ids
    assert child.stop is not params.stop  # other lists are still copies
