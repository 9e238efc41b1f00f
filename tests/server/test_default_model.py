"""`loramux serve` with no arguments serves the built-in default model (models/default) as "default", with its
adapters registered by name: through the official openai client, each of them answers a greedy text
completion with exactly the tokens and text Hugging Face produced (tests/fixtures/default_model.json, written
by tools/train_default.py), and the adapters' answers differ from the base model's."""
import json
import os

import pytest

from serve_helpers import ROOT, Server

FIXTURE = os.path.join(ROOT, "tests", "fixtures", "default_model.json")
EXPECTED = json.load(open(FIXTURE, encoding="utf-8"))


@pytest.fixture(scope="module")
def server():
    s = Server()  # no --model: the built-in default
    yield s
    s.stop()


def expected_for(prompt_index, adapter):
    return next(r for r in EXPECTED["results"] if r["prompt"] == prompt_index and r["adapter"] == adapter)


def greedy_completion(server, model, prompt):
    r = server.client().completions.create(model=model, prompt=prompt, max_tokens=EXPECTED["max_new_tokens"],
                                           temperature=0)
    c = r.choices[0]
    return c.text, c.to_dict()["token_ids"], c.finish_reason


def test_models_lists_default_and_every_adapter(server):
    ids = {m.id for m in server.client().models.list().data}
    assert {"default", *EXPECTED["adapters"]} <= ids, ids


@pytest.mark.parametrize("adapter", [None] + EXPECTED["adapters"])
def test_completion_matches_transformers(server, adapter):
    for index, prompt in enumerate(EXPECTED["prompts"]):
        ref = expected_for(index, adapter)
        # Greedy steps closer than the generator's margin may legitimately flip (NUMERICS.md): compare up to one.
        clear = 0
        while clear < len(ref["greedy"]) and ref["greedy_margins"][clear] >= EXPECTED["min_greedy_margin"]:
            clear += 1
        # The server stops at EOS (id 0) and lists it among the token ids; its text ends before it.
        want = ref["greedy"][:ref["greedy"].index(0) + 1] if ref["stops_at_eos"] else ref["greedy"]
        clear = min(clear, len(want))
        text, token_ids, finish = greedy_completion(server, adapter or "default", prompt["text"])
        what = f"adapter {adapter or 'default'} prompt {prompt['text']!r}"
        assert token_ids[:clear] == want[:clear], what
        if clear == len(want):
            assert token_ids == want, what
            assert finish == ("stop" if ref["stops_at_eos"] else "length"), what
            assert text == ref["text"], what


def test_adapters_change_the_continuation(server):
    prompt = EXPECTED["prompts"][0]["text"]
    base = greedy_completion(server, "default", prompt)[0]
    for adapter in EXPECTED["adapters"]:
        assert greedy_completion(server, adapter, prompt)[0] != base, f"{adapter} answers {prompt!r} like the base"
