"""Request bodies for the OpenAI endpoints (hypothesis strategies): hostile and well-formed.

``CHAT``/``COMPLETION``: mostly-valid bodies with fields swapped for junk, what a buggy
or hostile client sends. ``VALID_CHAT``/``VALID_COMPLETION``: well-formed bodies combining
the options a client may use. Generation is always bounded (``max_tokens`` is always
present and small when valid), so an accepted request finishes quickly on 2 cores; a junk
bound is a client error the server must answer with a 4xx.
"""

from __future__ import annotations

from hypothesis import strategies as st

MODEL = "SmolLM2-135M-Instruct"
VOCAB = 49152  # SmolLM2's; ids beyond it must be a 4xx, not a crash

HOSTILE_INTS = st.sampled_from([-(2**63), -1, 0, 2**31, 2**63, 10**30])
JUNK = st.one_of(
    st.none(),
    st.booleans(),
    HOSTILE_INTS,
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.lists(st.integers(-5, 5), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(-5, 5), max_size=2),
)


def mostly(valid: st.SearchStrategy) -> st.SearchStrategy:
    """The valid value two times in three, junk otherwise."""
    return st.one_of(valid, valid, JUNK)


TEXT = st.text(max_size=200)
CONTENT = st.one_of(
    TEXT,
    st.lists(
        st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "input_audio", "bogus"]), "text": TEXT}),
        max_size=2,
    ),
    JUNK,
)
MESSAGE = st.fixed_dictionaries(
    {"role": mostly(st.sampled_from(["system", "user", "assistant", "tool", "developer"])), "content": CONTENT},
    optional={"name": st.text(max_size=10), "tool_calls": JUNK, "tool_call_id": JUNK},
)
PROMPT = st.one_of(
    TEXT,
    st.lists(st.integers(-2, VOCAB + 2), max_size=20),
    st.lists(TEXT, max_size=3),
    st.lists(st.lists(st.integers(0, VOCAB - 1), max_size=5), max_size=2),
)

# Shared by both endpoints. The bound is always there: null or a numeric string would
# mean "up to the context length", minutes on 2 cores.
BOUND_JUNK = st.one_of(
    HOSTILE_INTS, st.floats(allow_nan=True, allow_infinity=True).filter(lambda f: not 0 <= f <= 64),
    st.text(alphabet="abcxyz -", max_size=8), st.lists(st.integers(-5, 5), max_size=3), st.dictionaries(st.text(max_size=3), st.booleans(), max_size=1),
)
COMMON_REQUIRED = {"max_tokens": st.one_of(st.integers(-2, 6), st.integers(-2, 6), BOUND_JUNK)}
COMMON_OPTIONAL = {
    "model": mostly(st.just(MODEL)),
    "temperature": mostly(st.floats(-1, 3)),
    "top_p": mostly(st.floats(-0.5, 1.5)),
    "top_k": mostly(st.integers(-2, 100)),
    "n": mostly(st.integers(-1, 3)),
    "stream": mostly(st.booleans()),
    "stream_options": JUNK,
    "stop": mostly(st.one_of(st.text(max_size=5), st.lists(st.text(max_size=5), max_size=3))),
    "seed": mostly(st.integers(-(2**70), 2**70)),
    "presence_penalty": mostly(st.floats(-3, 3)),
    "frequency_penalty": mostly(st.floats(-3, 3)),
    "logit_bias": st.one_of(JUNK, st.dictionaries(st.text(max_size=6), st.floats(-200, 200), max_size=2)),
    "min_tokens": mostly(st.integers(-1, 10)),
    "ignore_eos": mostly(st.booleans()),
    "user": mostly(st.text(max_size=20)),
    "conversation_id": mostly(st.text(max_size=140)),
    "kv_transfer_params": JUNK,
    "response_format": JUNK,
}

CHAT = st.fixed_dictionaries(
    {"messages": mostly(st.lists(MESSAGE, max_size=4)), **COMMON_REQUIRED},
    optional={
        **COMMON_OPTIONAL,
        "logprobs": mostly(st.booleans()),
        "top_logprobs": mostly(st.integers(-1, 30)),
        "max_completion_tokens": st.one_of(st.integers(-2, 6), BOUND_JUNK),
        "tools": JUNK,
        "tool_choice": JUNK,
        "chat_template": JUNK,
        "add_generation_prompt": JUNK,
    },
)
COMPLETION = st.fixed_dictionaries(
    {"prompt": mostly(PROMPT), **COMMON_REQUIRED},
    optional={
        **COMMON_OPTIONAL,
        "logprobs": mostly(st.integers(-1, 30)),
        "echo": mostly(st.booleans()),
        "suffix": JUNK,
        "best_of": mostly(st.integers(-1, 3)),
        "prompt_logprobs": mostly(st.integers(-1, 30)),
    },
)
# Not even an object.
NOT_AN_OBJECT = st.one_of(st.lists(st.integers(), max_size=3), st.text(max_size=10), st.integers(), st.none())

# Well-formed bodies with the options a client may combine (n, stop, logprobs, seeds,
# streaming, conversations): each must be answered, none may crash a leg.
_VALID_OPTIONAL = {
    "model": st.just(MODEL),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.05, 1),
    "n": st.integers(1, 3),
    "stream": st.booleans(),
    "stop": st.lists(st.text(min_size=1, max_size=4), max_size=2),
    "seed": st.integers(0, 2**31),
    "min_tokens": st.integers(0, 2),
    "ignore_eos": st.booleans(),
    "conversation_id": st.from_regex(r"[A-Za-z0-9._:@-]{1,20}", fullmatch=True),
}
VALID_CHAT = st.fixed_dictionaries(
    {
        "messages": st.lists(
            st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": st.text(max_size=120)}),
            min_size=1, max_size=3,
        ).map(lambda ms: [*ms[:-1], {"role": "user", "content": ms[-1]["content"]}]),
        "max_tokens": st.integers(1, 6),
    },
    optional={**_VALID_OPTIONAL, "logprobs": st.booleans(), "top_logprobs": st.integers(0, 3)},
)
VALID_COMPLETION = st.fixed_dictionaries(
    {
        "prompt": st.one_of(st.text(min_size=1, max_size=200), st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20)),
        "max_tokens": st.integers(1, 6),
    },
    optional={**_VALID_OPTIONAL, "logprobs": st.integers(0, 3), "echo": st.booleans()},
)
